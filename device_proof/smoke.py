"""The last check: one short training run through the public command, ``torchrun
pretrain_gpt.py`` (one process, ZeRO-Offload with the overlapped CPU Adam), as a user
starts it. It passes when the run exits 0 and logs every iteration with a finite loss."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERS = 4


def command(device: str, log: str) -> list[str]:
    model = [
        *("--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4"),
        *("--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "512"),
        *("--micro-batch-size", "2", "--global-batch-size", "4", "--bf16"),
    ]
    run = [
        *("--mock-data", "--tokenizer-type", "NullTokenizer", "--train-iters", str(ITERS)),
        *("--lr", "1e-4", "--log-interval", "1", "--eval-interval", "100000"),
        *("--eval-iters", "1", "--device", device, "--log-json", log),
        *("--cpu-offload", "--overlap-cpu-optimizer"),
    ]
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
    ]
    return [*launch, os.path.join(ROOT, "pretrain_gpt.py"), *model, *run]


def records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [r for r in recs if "loss" in r and "iteration" in r]


def smoke(device: str, work: str, timeout_s: float):
    log, text = os.path.join(work, "smoke.jsonl"), os.path.join(work, "smoke.out")
    with open(text, "w") as f:
        # its own process group: on a timeout torchrun's workers go too (and free the GPU)
        proc = subprocess.Popen(
            command(device, log), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = f"ran past {timeout_s:.0f} s"
    recs = records(log)
    losses = [r["loss"] for r in recs]
    ok = rc == 0 and len(recs) == ITERS and all(math.isfinite(x) for x in losses)
    value = f"exit {rc}, {len(recs)} iterations, losses {[round(x, 4) for x in losses]}"
    yield ("PASS" if ok else "FAIL", "smoke.torchrun", value, f"exit 0, {ITERS} finite losses")
