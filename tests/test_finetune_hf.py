"""tools/finetune_hf.py on tiny random Hugging Face models (Qwen2, an architecture the
project has no class for, GPT-2 and Llama), built from their configs here; nothing is
downloaded. DP=2 runs go through torchrun with gloo."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, load_tool

from mp_offload.hf_finetune.jsonl_data import (
    IGNORE,
    GlobalBatches,
    collate,
    read_jsonl,
    tokenize,
)
from mp_offload.hf_finetune.tiny_models import arithmetic_pairs, write_model_dir

TOOL = os.path.join(ROOT, "tools", "finetune_hf.py")
# A step: 2 ranks x 2 micro-batches of 2 (the optimizer accumulates two backward calls).
TRAIN = ["--micro-batch-size", "2", "--global-batch-size", "8", "--seq-length", "32",
         "--lr", "3e-3", "--weight-decay", "0.01", "--clip-grad", "1.0"]  # fmt: skip


@pytest.fixture(scope="module")
def records():
    return arithmetic_pairs(64)


@pytest.fixture(scope="module")
def data(tmp_path_factory, records):
    """The same pairs as prompt/completion, chat and text JSONL files."""
    d = tmp_path_factory.mktemp("data")
    forms = {
        "prompt": records,
        "messages": [
            dict(
                messages=[
                    dict(role="user", content=r["prompt"]),
                    dict(role="assistant", content=r["completion"]),
                ]
            )
            for r in records
        ],  # fmt: skip
        "text": [dict(text=r["prompt"] + r["completion"]) for r in records],
    }
    for kind, recs in forms.items():
        with open(d / f"{kind}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
    return {kind: str(d / f"{kind}.jsonl") for kind in forms}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, records):
    """A tiny random model directory per architecture (GPT-2 keeps its dropout of 0.1, so
    the resume must restore the random state too)."""
    texts = [r["prompt"] + r["completion"] for r in records]
    root = tmp_path_factory.mktemp("models")
    return {
        arch: write_model_dir(str(root / arch), arch, texts, seed=1)
        for arch in ("qwen2", "gpt2", "llama")
    }


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=ROOT)


def _torchrun(*args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           TOOL, *map(str, args)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(), cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout


def _dataset_loss(model, tokenizer, path) -> float:
    """Mean cross-entropy over every target token of the file (eval mode, one batch)."""
    _, examples, _ = tokenize(path, tokenizer, 32)
    batch = collate(examples, tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE
    ).item()


def _weights(out_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(out_dir, "model.safetensors"))


# ------------------------------------------------------------------------ data formats
def test_only_completions_and_assistant_turns_are_targets(data, model_dirs, records):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs["qwen2"])
    targets = lambda e: tok.decode([t for t in e.labels if t != IGNORE])  # noqa: E731
    _, pairs, dropped = tokenize(data["prompt"], tok, 32)
    assert dropped == 0 and len(pairs) == len(records)
    assert [targets(e) for e in pairs] == [r["completion"] + "<|endoftext|>" for r in records]
    assert tok.decode(pairs[0].input_ids) == records[0]["prompt"] + targets(pairs[0])
    _, chats, _ = tokenize(data["messages"], tok, 64)
    assert [targets(e) for e in chats] == [r["completion"] + "<|im_end|>\n" for r in records]
    assert tok.decode(chats[0].input_ids).startswith(f"<|im_start|>user\n{records[0]['prompt']}")
    _, blocks, _ = tokenize(data["text"], tok, 32)
    stream = [t for e in blocks for t in e.input_ids]
    assert (
        all(len(e.input_ids) == 32 for e in blocks[:-1]) and blocks[0].labels == blocks[0].input_ids
    )
    assert tok.decode(stream) == "".join(
        r["prompt"] + r["completion"] + "<|endoftext|>" for r in records
    )


def test_each_rank_takes_its_share_of_every_global_batch():
    one = GlobalBatches(10, 8, 2, world=1, rank=0, seed=3)
    ranks = [GlobalBatches(10, 8, 2, world=2, rank=r, seed=3) for r in range(2)]
    for consumed in (0, 8, 16):  # the second batch crosses into epoch 1
        whole = one.global_batch_at(consumed)
        shares = [m for r in ranks for m in r.micro_batches_at(consumed)]
        assert [i for m in shares for i in m] == whole and all(len(m) == 2 for m in shares)
    first_epoch = one.global_batch_at(0) + one.global_batch_at(8)[:2]
    assert sorted(first_epoch) == list(range(10))  # each example once an epoch
    assert GlobalBatches(10, 8, 2, 1, 0, seed=4).global_batch_at(0) != one.global_batch_at(0)


def test_a_bad_line_names_its_file_and_line(tmp_path):
    from mp_offload.hf_finetune import BadInput

    path = tmp_path / "d.jsonl"
    for body, says in [
        ('{"prompt": "a", "completion": "b"}\n{"prompt": "a"\n', "d.jsonl:2: not JSON"),
        ('{"prompt": "a", "completion": "b"}\n\n{"prompt": "a"}\n', 'd.jsonl:3: no "completion"'),
        ('{"messages": [{"role": "user"}]}\n', 'd.jsonl:1: "messages" must be a list'),
        ('[1, 2]\n', "d.jsonl:1: a line must be a JSON object"),
    ]:  # fmt: skip
        path.write_text(body)
        with pytest.raises(BadInput, match=says.replace("[", r"\[")):
            read_jsonl(str(path))


# ---------------------------------------------------------------- the tool, in-process
@pytest.mark.parametrize(
    "arch,form,precision",
    [
        ("qwen2", "prompt", []),
        ("gpt2", "messages", ["--bf16"]),
        ("llama", "prompt", ["--bf16", "--store-param-remainders"]),
        ("llama", "text", []),
    ],
)
def test_export_loads_and_gives_the_trained_models_logits(
    tmp_path, model_dirs, data, arch, form, precision
):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    argv = ["--hf-model", model_dirs[arch], "--data", data[form], "--train-iters", "3",
            "--micro-batch-size", "4", "--global-batch-size", "8", "--seq-length", "64",
            "--lr", "1e-2", "--hf-out", str(out), *precision]  # fmt: skip
    trained = load_tool("finetune_hf").main(argv).eval()
    exported, info = AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True, dtype="auto"
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert exported.dtype == (torch.bfloat16 if precision else torch.float32)
    before = AutoModelForCausalLM.from_pretrained(model_dirs[arch])
    x = torch.randint(
        0, exported.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        ours, theirs = trained(input_ids=x).logits, exported.eval()(input_ids=x).logits
        untrained = before.eval()(input_ids=x).logits
    assert torch.equal(ours, theirs)
    # every weight bit for bit (a rounding other than the optimizer's differs in a few)
    mine = dict(trained.named_parameters())
    assert all(torch.equal(mine[n], p) for n, p in exported.named_parameters())
    assert not torch.allclose(ours.float(), untrained, atol=1e-3)  # it did train


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--hf-model", "/no/such/dir", "--data", "D", "--train-iters", "2"],
         "--hf-model /no/such/dir: no such directory"),
        (["--hf-model", "M", "--data", "BAD", "--train-iters", "2"], "bad.jsonl:2: not JSON"),
        (["--hf-model", "M", "--data", "D", "--train-iters", "2", "--save-intervall", "1"],
         "unrecognized argument --save-intervall: did you mean --save-interval?"),
        (["--hf-model", "M", "--data", "D", "--train-iters", "2", "--store-param-remainders"],
         "--store-param-remainders needs --bf16"),
        (["--hf-model", "M", "--data", "D", "--train-iters", "2", "--load", "/no/ckpt"],
         "--load /no/ckpt: no such directory"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_status_2(tmp_path, model_dirs, data, capsys, argv, says):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": \n')
    subst = {"M": model_dirs["qwen2"], "D": data["prompt"], "BAD": str(bad)}
    with pytest.raises(SystemExit) as e:
        load_tool("finetune_hf").main([subst.get(a, a) for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("finetune_hf.py: error: ") and says in err[0]


@pytest.mark.slow
def test_a_signal_saves_and_exits(tmp_path, model_dirs, data):
    """SIGINT mid-run: the step finishes, a checkpoint of that iteration is written, exit 0."""
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, TOOL, "--hf-model", model_dirs["llama"], "--data", data["prompt"],
           "--train-iters", "100000", "--save", str(ckpt), *TRAIN]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=ROOT)  # fmt: skip
    try:
        for line in proc.stdout:
            if line.startswith("iteration 2/"):
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    stopped = int(out.split("stopped at iteration ")[1].split()[0])
    assert (
        stopped >= 2 and (ckpt / "latest_checkpointed_iteration.txt").read_text() == f"{stopped}\n"
    )
    assert (ckpt / f"iter_{stopped:07d}" / "optimizer.pt").is_file()


# ------------------------------------------------------------------- DP=2 under torchrun
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "gpt2", "llama"])
def test_dp2_lowers_the_loss_exports_and_resumes_bitwise(tmp_path, model_dirs, data, arch):
    """Six steps straight (a checkpoint at 3) against three from that checkpoint: the same
    exported weights and optimizer state, bit for bit; the export is the master."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = ["--hf-model", model_dirs[arch], "--data", data["prompt"], "--train-iters", 6, *TRAIN]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _torchrun(*common, "--save", straight, "--save-interval", 3, "--hf-out", straight / "hf")
    _torchrun(*common, "--load", straight / "iter_0000003", "--save", resumed,
              "--hf-out", resumed / "hf")  # fmt: skip
    a, b = _weights(straight / "hf"), _weights(resumed / "hf")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = (torch.load(d / "iter_0000006" / "optimizer.pt") for d in (straight, resumed))
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(sa["state"][key][n], sb["state"][key][n]) for n in sa["state"][key])
    exported, info = AutoModelForCausalLM.from_pretrained(straight / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    params = dict(exported.named_parameters())
    assert all(torch.equal(params[n], w) for n, w in sa["state"]["master"].items())
    tok = AutoTokenizer.from_pretrained(straight / "hf")
    initial = AutoModelForCausalLM.from_pretrained(model_dirs[arch]).eval()
    before, after = (_dataset_loss(m, tok, data["prompt"]) for m in (initial, exported.eval()))
    assert after < 0.9 * before, (before, after)


@pytest.mark.slow
def test_bad_input_under_torchrun_is_one_line(tmp_path, model_dirs):
    """Both ranks find the bad line before any process group exists; rank 0 says it once
    (torchrun's own report filtered by scripts/torchrun_quiet.py, as the scripts run it)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"prompt": "b", "completion": "c"}\n')
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "torchrun_quiet.py"), "--standalone",
           "--nproc-per-node=2", TOOL, "--hf-model", model_dirs["qwen2"], "--data", str(bad),
           "--train-iters", "2"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert res.returncode != 0
    says = f"--data {bad}:2: no \"text\" (the file's first line is 'text' format)"
    assert res.stderr.strip().splitlines() == [f"finetune_hf.py: error: {says}"]
