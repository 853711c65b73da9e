"""The host phase of one ZeRO-Offload step against the CPU Adam alone, side by side.

With offload, what the host does per step is the step's cost on a modern GPU. This times,
on the project's own optimizer (bf16, offload, one rank), everything the host does per
step — the fp32 accumulation of each micro-batch's chunks when k > 1 (the first overwrites,
the last also sums the squares for the norm in the same pass), the optimizer step (norm
all-reduce, CPU Adam over the whole slice, publish) — and the C++ ``adam_step`` alone on
the same number of elements and dtypes, interleaved round by round, and prints medians and
the ratio (of the medians, and "paired": the median of each round's ratio, which a load
change between rounds moves less). Targets: <= 1.15 at k = 1, <= 1.30 at k = 4. A row
"4d" is k = 4 with ``--accumulate-grads-on-device``: the micro-batches are summed on the
device and Adam reads the one copy that comes down, as at k = 1. The row "1r" is k = 1
with ``--store-param-remainders`` (the master as the bf16 staging + an int16 remainder),
timed round by round against k = 1 without it; it prints the paired ratio to today's
(target <= 0.95 at 70M elements, the default model).

What a GPU would do (the reduced chunk's sum of squares, its copy into the staging, the
device-side accumulation) runs inside backward's hooks on the CPU here; it is not timed as
host work. On this CPU "device" Adam writes the new bf16 params straight into the model's
flat buffer, so the publish copies nothing; on CUDA it is an asynchronous DMA from pinned
memory, which costs the host no time either.

  python bench/bench_host_phase.py [--layers 3] [--hidden 1024] [--repeats 7] [--threads N]
                                   [--micro-batches 1,4,4d,1r] [--ceiling]

--ceiling adds the bound: GB/s of our accumulate and of the Adam against the best access
pattern of bench/bench_host_ceiling.py for the same traffic (the accumulate's two streams
reach less bandwidth per byte than Adam's five on some machines).
"""

import argparse
import contextlib
import os
import platform
import statistics
import time


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument(
        "--micro-batches",
        default="1,4,4d,1r",
        help="comma-separated k values; a 'd' suffix accumulates on the device; '1r': k = 1 "
        "with --store-param-remainders, paired with k = 1 without",
    )
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument(
        "--ceiling",
        action="store_true",
        help="also: our accumulate and Adam against bench_host_ceiling's best pattern",
    )
    args = ap.parse_args()
    for row in args.micro_batches.split(","):
        if row == "1r":
            continue
        if not row.rstrip("d").isdigit() or int(row.rstrip("d")) < 1:
            ap.error(f"--micro-batches: {row!r} is not k >= 1 with an optional 'd' suffix")
    return args


ARGS = _args()
os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)

import torch  # noqa: E402

from mp_offload import parallel_state as ps  # noqa: E402
from mp_offload.model.gpt import GPTConfig, GPTModel  # noqa: E402
from mp_offload.ops import cpu_adam, host_ops  # noqa: E402
from mp_offload.optimizer.options import OptimizerOptions  # noqa: E402
from mp_offload.optimizer.zero import ZeroOptimizer  # noqa: E402

HP = dict(lr=1e-4, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8, clip_grad=1.0)


_NULL = contextlib.nullcontext()


class Timer:
    def __init__(self):
        self.total = 0.0

    @contextlib.contextmanager
    def section(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.total += time.perf_counter() - t0

    def wrap(self, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total += time.perf_counter() - t0

        return timed


def build(k: int, on_device: bool, remainders: bool = False):
    single = ps.ParallelGroup.single()
    cfg = GPTConfig(
        num_layers=ARGS.layers,
        hidden_size=ARGS.hidden,
        num_attention_heads=max(1, ARGS.hidden // 64),
        seq_length=64,
        vocab_size=32000,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model = GPTModel(cfg, tp_group=single)
    opt = ZeroOptimizer(
        model,
        **HP,
        dp=single,
        tp=single,
        device="cpu",
        options=OptimizerOptions(
            dtype=torch.bfloat16,
            cpu_offload=True,
            micro_batches=k,
            accumulate_on_device=on_device,
            store_param_remainders=remainders,
        ),
    )
    params = list(model.parameters())
    consts = [torch.randn(p.shape).mul_(1e-3).to(torch.bfloat16) for p in params]
    return opt, params, consts


def one_step(opt, params, consts, k: int) -> None:
    """k backward passes whose gradients are constants (autograd cost ~ one multiply)."""
    opt.zero_grad()
    for _ in range(k):
        loss = sum((p * c).sum() for p, c in zip(params, consts))
        loss.backward()
        opt.reducer.finish()
    opt.step(HP["lr"])


def bench_row(row: str) -> int:
    """One table row ("4" or "4d"); returns the slice's element count."""
    k, on_device = int(row.rstrip("d")), row.endswith("d")
    host_acc, step_t = Timer(), Timer()
    opt, params, consts = build(k, on_device)
    opt.set_phase_timer(lambda name: host_acc.section() if name.startswith("copy down") else _NULL)
    opt.step = step_t.wrap(opt.step)
    n = opt.layout.slice_numel
    grad_dtype = torch.bfloat16 if opt.placement.adam_reads_staging else torch.float32
    p, m, v = (torch.rand(n) for _ in range(3))
    g = torch.randn(n).to(grad_dtype)
    out = torch.empty(n, dtype=torch.bfloat16)
    host, alone, acc_ms, step_ms = [], [], [], []
    one_step(opt, params, consts, k)  # warm-up: buffers, pages
    for step in range(1, ARGS.repeats + 1):
        host_acc.total = step_t.total = 0.0
        one_step(opt, params, consts, k)
        host.append((host_acc.total + step_t.total) * 1e3)
        acc_ms.append(host_acc.total * 1e3)
        step_ms.append(step_t.total * 1e3)
        t0 = time.perf_counter()
        cpu_adam.adam_step(
            p,
            g,
            m,
            v,
            step=step,
            lr=1e-4,
            beta1=0.9,
            beta2=0.95,
            eps=1e-8,
            weight_decay=0.01,
            param_out=out,
        )
        alone.append((time.perf_counter() - t0) * 1e3)
    med = statistics.median
    paired = med([h / a for h, a in zip(host, alone)])  # same round: robust to drift
    print(
        f"{row:>2} {n:11,d} {med(host):13.1f} {med(alone):13.1f} "
        f"{med(host) / med(alone):6.2f} {paired:6.2f} {med(acc_ms):14.1f} "
        f"{med(step_ms):8.1f}"
    )
    return n


def bench_remainders() -> None:
    """k = 1 with and without --store-param-remainders, one step of each per round."""
    runs = {name: (*build(1, False, rem), Timer()) for name, rem in (("1", False), ("1r", True))}
    ms = {name: [] for name in runs}
    for opt, params, consts, timer in runs.values():
        opt.step = timer.wrap(opt.step)
        one_step(opt, params, consts, 1)  # warm-up: buffers, pages
    for _ in range(ARGS.repeats):
        for name, (opt, params, consts, timer) in runs.items():
            timer.total = 0.0
            one_step(opt, params, consts, 1)
            ms[name].append(timer.total * 1e3)
    med = statistics.median
    paired = med([r / t for r, t in zip(ms["1r"], ms["1"])])
    n = runs["1"][0].layout.slice_numel
    print(
        f"1r {n:11,d} host phase with remainders {med(ms['1r']):.1f} ms, without "
        f"{med(ms['1']):.1f} ms: ratio {med(ms['1r']) / med(ms['1']):.2f}, paired {paired:.2f}"
    )


def ceiling(n: int) -> None:
    """GB/s of our accumulate (bf16 add) and Adam (fp32 grad, bf16 copy) against the best
    access pattern of bench_host_ceiling.py for the same traffic, round-robin."""
    import bench_host_ceiling as hc  # beside this file

    lib, why = hc.build_library()
    if lib is None:
        print(f"ceiling: {why}")
        return
    # the accumulate's traffic: read 2 B, read and write 4 B per element (this process only)
    hc.TRAFFIC.setdefault(
        "accumulate", (10, [("param", "float32", hc.READ_WRITE), ("grad", "bfloat16", hc.READ)])
    )
    dst, src = torch.randn(n), torch.randn(n).to(torch.bfloat16)
    p, m, v, g = (torch.rand(n) for _ in range(4))
    out = torch.empty(n, dtype=torch.bfloat16)
    ours = {
        "accumulate": lambda: host_ops.accumulate_(dst, src, overwrite=False),
        "fp32+bf16out": lambda: cpu_adam.adam_step(
            p,
            g,
            m,
            v,
            step=1,
            lr=1e-4,
            beta1=0.9,
            beta2=0.95,
            eps=1e-8,
            weight_decay=0.01,
            param_out=out,
        ),
    }
    print(f"{'traffic':>13} {'B/elem':>6} {'ours GB/s':>9} {'ceiling GB/s':>12}  pattern")
    for traffic, fn in ours.items():
        nbytes = hc.TRAFFIC[traffic][0] * n
        pats = [("ours", fn)] + hc.HostCeiling(lib, torch, n, ARGS.threads, traffic).patterns()
        times = {name: [] for name, _ in pats}
        for _ in range(ARGS.repeats):
            for name, f in pats:
                t0 = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t0)
        best, secs = hc.best_of({k: v for k, v in times.items() if k != "ours"})
        print(
            f"{traffic:>13} {hc.TRAFFIC[traffic][0]:6d} "
            f"{nbytes / statistics.median(times['ours']) / 1e9:9.1f} "
            f"{nbytes / secs / 1e9:12.1f}  {best}"
        )


def main() -> None:
    torch.set_num_threads(ARGS.threads)
    cpu_adam.set_num_threads(ARGS.threads)
    host_ops.set_num_threads(ARGS.threads)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    # (host_ops.simd_level is new: the script also runs on older trees, for before/after)
    ops = host_ops.simd_level() if hasattr(host_ops, "simd_level") else "?"
    print(
        f"CPU: {cpu}; {ARGS.threads} thread(s); CPU Adam {cpu_adam.simd_level()}; "
        f"host ops {ops}; torch {torch.__version__}; "
        f"load avg {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'k':>2} {'elements':>11} {'host phase ms':>13} {'adam alone ms':>13} {'ratio':>6} "
        f"{'paired':>6} {'(accumulate ms':>14} {'step ms)':>8}"
    )
    n = 0
    for row in ARGS.micro_batches.split(","):
        if row == "1r":
            bench_remainders()
        else:
            n = bench_row(row)
    if ARGS.ceiling:
        ceiling(n)
    print(f"load avg at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
