"""Stage 3's seven training runs through the public CLI (``pretrain_gpt.py --log-json``)
and the plans they are held to (``python -m mp_offload.plan --json``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass

DPU_WARMUP = 2


@dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    micro: int
    iters: int
    k: int  # micro-batches per step of the accumulation run
    device: str
    timeout_s: int  # one run

    def model_args(self) -> list[str]:
        return [
            *("--num-layers", str(self.layers), "--hidden-size", str(self.hidden)),
            *("--num-attention-heads", str(self.heads), "--seq-length", str(self.seq)),
            *("--max-position-embeddings", str(self.seq), "--vocab-size", str(self.vocab)),
            *("--micro-batch-size", str(self.micro), "--bf16"),
            *("--hidden-dropout", "0.0", "--attention-dropout", "0.0"),
        ]


GPU = Size(24, 2048, 16, 2048, 50257, 4, 8, 8, "cuda", 42)  # GPT 1.3B; 7 runs < 5 min
TINY = Size(2, 64, 4, 64, 256, 2, 8, 8, "cpu", 90)

_OFFLOAD = ["--cpu-offload", "--optimizer-offload-fraction", "1"]  # F=1 said, not planned
# The practicality trio (no offload, sync offload, overlapped offload; k micro-batches):
# no clipping, so the overlapped step commits every speculation (a replay costs one more
# CPU Adam pass: tests/test_overlap.py proves it bitwise; here the schedule is timed).
_K8 = ["--clip-grad", "0"]
_K8_OFFLOAD = [*_K8, *_OFFLOAD, "--accumulate-grads-on-device"]
MODES = {
    "no-offload": [],
    "offload": _OFFLOAD,
    "offload-dpu": [*_OFFLOAD, "--dpu-warmup-steps", str(DPU_WARMUP)],
    "offload-k8-device-dpu": [
        *_OFFLOAD,
        *("--dpu-warmup-steps", str(DPU_WARMUP), "--accumulate-grads-on-device"),
    ],
    "no-offload-k8": _K8,
    "offload-k8-device": _K8_OFFLOAD,
    "offload-k8-device-overlap": [*_K8_OFFLOAD, "--overlap-cpu-optimizer"],
}
# practicality = the no-offload step time / this offload run's (k micro-batches each)
PRACTICALITY = {"offload-k8-device": "no-offload-k8", "offload-k8-device-overlap": "no-offload-k8"}


def micro_batches(mode: str, size: Size) -> int:
    return size.k if "-k8" in mode else 1


def mode_args(mode: str, size: Size) -> list[str]:
    gb = size.micro * micro_batches(mode, size)
    return [*size.model_args(), "--global-batch-size", str(gb), *MODES[mode]]


def train_command(py: str, mode: str, size: Size, log: str) -> list[str]:
    run = [
        *("--mock-data", "--tokenizer-type", "NullTokenizer", "--train-iters", str(size.iters)),
        *("--lr", "1e-4", "--log-interval", "1", "--eval-interval", "100000"),
        *("--eval-iters", "1", "--device", size.device, "--log-json", log),
    ]
    launch = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    return [*launch, "pretrain_gpt.py", *mode_args(mode, size), *run]


def plan_command(py: str, mode: str, size: Size, device_gb: float, host_gb: float) -> list[str]:
    hw = ["--device-memory-gb", f"{device_gb:g}", "--host-memory-gb", f"{host_gb:g}"]
    return [
        py,
        "-m",
        "mp_offload.plan",
        *mode_args(mode, size),
        "--json",
        *hw,
        "--devices-per-node",
        "1",
    ]


def read_log(path: str) -> list[dict]:
    """The iteration records of a ``--log-json`` file (evaluations and samples left out)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [r for r in recs if "loss" in r and "elapsed_ms" in r]


def run_all(py: str, size: Size, out: str, device_gb: float, host_gb: float, say) -> tuple:
    """Every mode's records and plan; a failed run has no records (its output is in
    ``out``) and says so. The plans are made meanwhile, in their own processes."""
    planning = {
        mode: subprocess.Popen(
            plan_command(py, mode, size, device_gb, host_gb),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for mode in MODES
    }
    records = {mode: _train(py, mode, size, out, say) for mode in MODES}
    plans = {}
    for mode, proc in planning.items():
        stdout, stderr = proc.communicate()
        try:
            plans[mode] = json.loads(stdout)
        except ValueError:
            say(f"plan {mode} failed: {stderr.strip()[-300:]}")
            plans[mode] = {}
    return records, plans


def _train(py: str, mode: str, size: Size, out: str, say) -> list[dict]:
    log, text = os.path.join(out, f"run_{mode}.jsonl"), os.path.join(out, f"run_{mode}.out")
    if os.path.exists(log):
        os.remove(log)
    say(f"run {mode}: {size.iters} iterations, k={micro_batches(mode, size)}")
    with open(text, "w") as f:
        # its own process group: on a timeout torchrun's workers go too (and free the GPU)
        cmd = train_command(py, mode, size, log)
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=size.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = f"ran past {size.timeout_s} s"
    if rc != 0:
        say(f"run {mode} failed ({rc}); see {text}")
    return read_log(log)
