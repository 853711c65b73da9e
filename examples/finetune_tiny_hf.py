#!/usr/bin/env python
"""Fine-tune a tiny random Hugging Face model with tools/finetune_hf.py, then load the
export back in transformers and ask it a question (CPU, under a minute).

    python examples/finetune_tiny_hf.py [--arch qwen2] [--nproc 2] [--iters 30] [--dir DIR]

It writes into DIR (default: a new temporary directory) a model directory (a config of
``--arch`` and a small byte-level BPE tokenizer with a chat template, trained here:
nothing is downloaded) and a prompt/completion JSONL of sums ("3 plus 4 is" -> " 7."),
runs ``torchrun --nproc-per-node N tools/finetune_hf.py --from-config ...`` and greedy-
decodes one prompt from the exported model. For a real model, point ``--hf-model`` at its
directory instead.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="qwen2", help="gpt2, llama, qwen2, mistral, gpt_neox")
    p.add_argument("--nproc", type=int, default=2, help="data-parallel ranks (torchrun)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--dir", help="work directory (default: a new temporary one)")
    args = p.parse_args()
    work = args.dir or tempfile.mkdtemp(prefix="finetune_tiny_hf_")
    os.makedirs(work, exist_ok=True)

    from mp_offload.hf_finetune.tiny_models import arithmetic_pairs, write_model_dir

    records = arithmetic_pairs(256)
    texts = [r["prompt"] + r["completion"] for r in records]
    model_dir = write_model_dir(os.path.join(work, "model"), args.arch, texts, weights=False)
    data = os.path.join(work, "train.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    out = os.path.join(work, "out")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", os.path.join(ROOT, "tools", "finetune_hf.py"),
           "--from-config", model_dir, "--data", data, "--train-iters", str(args.iters),
           "--micro-batch-size", "8", "--global-batch-size", str(8 * args.nproc),
           "--seq-length", "32", "--lr", "1e-2", "--lr-warmup-iters", "10", "--weight-decay",
           "0.0", "--log-interval", str(max(1, args.iters // 10)),
           "--save", os.path.join(work, "ckpt"), "--hf-out", out]  # fmt: skip
    print("$", " ".join(cmd[2:]), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    subprocess.run(cmd, check=True, env=env)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    prompt = records[0]["prompt"]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    print(f"exported model in {out}: {prompt!r} -> {tokenizer.decode(gen[0, ids.shape[1] :])!r}")


if __name__ == "__main__":
    main()
