"""End to end under torchrun: a user's JSONL corpus, and a restart after a killed worker."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, tiny_model_flags

pytestmark = pytest.mark.slow  # every test here runs torchrun

MODEL = tiny_model_flags(
    hidden_size=64, seq_length=32, vocab_size=None, make_vocab_size_divisible_by=None
) + [
    "--micro-batch-size",
    "2",
    "--lr",
    "3e-3",
    "--log-interval",
    "1",
    "--cpu-offload",
]


def _run(cmd, env_extra=None, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env_extra or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _torchrun(nproc, *args, extra_launcher=(), **kw):
    return _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            *extra_launcher,
            os.path.join(ROOT, "pretrain_gpt.py"),
            *args,
        ],
        **kw,
    )


def test_user_jsonl_corpus_tp2_dp2(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    with open(corpus, "w") as f:
        for i in range(300):
            text = " ".join(words[(i * 7 + k * 3) % 8] for k in range(60))
            f.write(json.dumps({"text": f"document {i}: {text}"}) + "\n")
    tok = tmp_path / "tok"
    res = _run(
        [
            sys.executable,
            "tools/train_tokenizer.py",
            "--input",
            str(corpus),
            "--model-prefix",
            str(tok),
            "--vocab-size",
            "300",
        ]
    )
    assert res.returncode == 0, res.stderr[-2000:]
    prefix = tmp_path / "data" / "corpus"
    res = _run(
        [
            sys.executable,
            "tools/preprocess_data.py",
            "--input",
            str(corpus),
            "--output-prefix",
            str(prefix),
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            f"{tok}.model",
            "--workers",
            "2",
            "--append-eod",
        ]
    )
    assert res.returncode == 0, res.stderr[-2000:]
    log = tmp_path / "log.jsonl"
    res = _torchrun(
        4,
        *MODEL,
        "--tensor-model-parallel-size",
        "2",
        "--data-path",
        f"{prefix}_text_document",
        "--tokenizer-model",
        f"{tok}.model",
        "--train-iters",
        "12",
        "--eval-interval",
        "6",
        "--eval-iters",
        "2",
        "--split",
        "90,8,2",
        "--data-cache-dir",
        str(tmp_path / "cache"),
        "--log-json",
        str(log),
        "--save",
        str(tmp_path / "ckpt"),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    recs = [json.loads(line) for line in open(log)]
    train = [r["loss"] for r in recs if "loss" in r]
    valid = [r["valid_loss"] for r in recs if "valid_loss" in r]
    assert len(train) == 12 and train[-1] < train[0]
    assert len(valid) >= 3 and valid[-1] < valid[0]
    assert any("test_loss" in r for r in recs)
    _hf_export_round_trips_text(tmp_path, f"{tok}.model")


def _hf_export_round_trips_text(tmp_path, sp_model):
    """AutoTokenizer + AutoModelForCausalLM on the export: the project's ids, its logits."""
    import torch
    import transformers

    from mp_offload.checkpoint import resolve_checkpoint
    from mp_offload.checkpoint.convert import main as convert
    from mp_offload.data.tokenizer import build_tokenizer
    from mp_offload.generation import load_model

    hf = str(tmp_path / "hf")
    ours = build_tokenizer("SentencePieceTokenizer", sp_model)
    # The checkpoint keeps its own copy of the tokenizer: move the original away.
    os.rename(sp_model, sp_model + ".moved")
    assert convert(["--load", str(tmp_path / "ckpt"), "--hf-out", hf]) == 0
    from mp_offload.generation import main as generate

    out = generate(
        [
            "--load",
            str(tmp_path / "ckpt"),
            "--prompt",
            "alpha beta",
            "--max-new-tokens",
            "4",
            "--greedy",
        ]
    )
    assert out["prompt_ids"] == ours.tokenize("alpha beta")
    theirs = transformers.AutoTokenizer.from_pretrained(hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
    for text in ("document 7: alpha beta  gamma", "zeta\n\teta  theta délta 42"):
        ids = ours.tokenize(text)
        assert theirs(text)["input_ids"] == ids, text
        tokens = torch.tensor([ids])
        with torch.no_grad():
            got = model(tokens).logits
            want = load_model(resolve_checkpoint(str(tmp_path / "ckpt")))(tokens)
        torch.testing.assert_close(got, want[..., : got.shape[-1]], atol=2e-5, rtol=1e-5)


def test_torchrun_restart_resumes_from_latest_checkpoint(tmp_path):
    ck, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    marker = tmp_path / "killed-once"
    res = _torchrun(
        2,
        *MODEL,
        "--mock-data",
        "--vocab-size",
        "128",
        "--train-iters",
        "8",
        "--eval-interval",
        "1000",
        "--save",
        str(ck),
        "--load",
        str(ck),
        "--save-interval",
        "3",
        "--log-json",
        str(log),
        extra_launcher=["--max-restarts=1"],
        env_extra={"MP_OFFLOAD_FAULT_ONCE": f"{marker}:5"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert marker.exists(), "the fault was never injected"
    its = [json.loads(line)["iteration"] for line in open(log) if '"loss"' in line]
    # first attempt: 1..5 (killed after 5, last save at 3); restart resumes at 4
    assert its == [1, 2, 3, 4, 5, 4, 5, 6, 7, 8], its
    assert "loaded checkpoint" in res.stdout + res.stderr


def test_sigterm_finishes_the_step_and_saves(tmp_path):
    import signal
    import time

    from mp_offload.checkpoint import read_latest

    ck, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            os.path.join(ROOT, "pretrain_gpt.py"),
            *MODEL,
            "--mock-data",
            "--vocab-size",
            "128",
            "--train-iters",
            "100000",
            "--eval-interval",
            "100000",
            "--save",
            str(ck),
            "--log-json",
            str(log),
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and (not log.exists() or sum(1 for _ in open(log)) < 4):
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)  # what a scheduler sends before it kills a job
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    last = [json.loads(line)["iteration"] for line in open(log) if '"loss"' in line][-1]
    assert "stop requested: exiting after iteration" in out, out[-2000:]
    assert read_latest(str(ck)) == last, "the finished step must be saved"
