"""The host's gradient sums at k > 1 micro-batches: how long the training thread waits.

With offload and k > 1 micro-batches summed on the host, each reduced chunk is added into
the fp32 gradient by a worker thread as its copy lands. This runs the project's optimizer
(``--cpu-offload``, one rank, a small GPT in fp32: bf16 GEMMs on a CPU without bf16
units are ~50x slower, which would bury the host's work; one row of 32 tokens per
micro-batch, so the sums weigh against backward about as on a GPU) with that worker on, as
on a GPU: the streams are the CPU's (copies are done when they return), but marked
asynchronous, so the sums run on the worker while the training thread goes on, exactly
the code path a GPU runs. Per k it prints the medians over the steps of: the whole step,
forward + backward (``training.train_step``'s phase; it holds every wait of the training
thread for the sums between micro-batches), and the time in the wait phase
("wait for the host's gradient sums", where the code has it), with the CPU model.

Run it at two commits to compare them (the figures in docs/PERFORMANCE.md):

  python bench/bench_host_sums.py [--micro-batches 1,4,8] [--steps 7] [--layers 6]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import mp_offload.runtime.cpu_threads  # noqa: E402, F401, I001  (idle OpenMP threads sleep: before torch)
import torch  # noqa: E402

from mp_offload import parallel_state as ps  # noqa: E402
from mp_offload.model.gpt import GPTConfig, GPTModel  # noqa: E402
from mp_offload.optimizer.options import OptimizerOptions  # noqa: E402
from mp_offload.optimizer.streams import HostStreams  # noqa: E402
from mp_offload.optimizer.zero import ZeroOptimizer  # noqa: E402
from mp_offload.training import train_step  # noqa: E402
from phase_sections import Sections  # noqa: E402

HP = dict(lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=1.0)
WAIT = "wait for the host's gradient sums"


class WorkerStreams(HostStreams):
    """The CPU's streams with the host worker on (what ``asynchronous`` turns on)."""

    asynchronous = True


def run(k: int, args) -> tuple[float, float, float | None]:
    """(step ms, forward + backward ms, wait ms or None) medians at ``k`` micro-batches."""
    single = ps.ParallelGroup.single()
    torch.manual_seed(0)
    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                    seq_length=args.seq, vocab_size=4096, hidden_dropout=0.0,
                    attention_dropout=0.0)  # fmt: skip
    model = GPTModel(cfg, tp_group=single)
    options = OptimizerOptions(dtype=torch.float32, micro_batches=k)
    opt = ZeroOptimizer(model, **HP, dp=single, tp=single, device="cpu", options=options,
                        streams=WorkerStreams())  # fmt: skip
    phases = Sections()
    opt.set_phase_timer(phases.section)
    g = torch.Generator().manual_seed(1)
    step_ms, fb_ms, wait_ms = [], [], []
    for step in range(args.steps + 1):  # the first warms up
        batches = iter(torch.randint(0, 4096, (k, 1, args.seq + 1), generator=g))
        phases.take()
        t0 = time.perf_counter()
        out = train_step(model, opt, batches, k, HP["lr"], single, torch.device("cpu"))
        if step:
            step_ms.append((time.perf_counter() - t0) * 1e3)
            fb_ms.append(out.phases["phase_forward_backward_ms"])
            wait = phases.take().get(WAIT)
            wait_ms.append(None if wait is None else wait * 1e3)
    waits = [w for w in wait_ms if w is not None]
    med = statistics.median
    return med(step_ms), med(fb_ms), med(waits) if waits else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", default="1,4,8")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args()
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip
    print(f"{'k':>3} {'step ms':>9} {'fwd+bwd ms':>11} {'wait ms':>8}")
    for k in (int(x) for x in args.micro_batches.split(",")):
        step, fb, wait = run(k, args)
        shown = "-" if wait is None else f"{wait:8.1f}"
        print(f"{k:>3} {step:9.1f} {fb:11.1f} {shown:>8}")


if __name__ == "__main__":
    main()
