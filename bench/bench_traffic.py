"""Host<->device bytes per parameter per iteration, as counted by our ZeRO-Offload optimizer.

Each row is a short ``pretrain()`` run (mock data, a small GPT, ``--cpu-offload``); the
optimizer object is captured and its own counters are read afterwards:
``bytes_down`` (each reduced gradient chunk copied to the host, counted once per
micro-batch) and ``bytes_up`` (the new parameter slice copied back, once per step),
divided by the parameters this rank owns (``layout.slice_numel``) and by the
iterations run. DP=1 rows run in this process; DP>1 rows under ``torchrun``
(every rank's counters are read; they agree).

What our code does: every micro-batch's reduced gradient chunk goes down and is added
into the fp32 host gradient, so with k micro-batches per step it moves
k x (compute-dtype bytes) down + 1 x (compute-dtype bytes) up per parameter:
2k+2 B in fp16/bf16, 4k+4 B in fp32. Reference points (not measured here): the
ZeRO-Offload paper's minimum, 4 B/param per step (2 B fp16 grads down, 2 B fp16
params up, once per step), and DeepSpeed's documented ~8 B/param (fp32 grads down,
fp32 params up). On a CPU-only machine the "device" is the CPU: the copies are the
same logical copies, counted the same way.

  python bench/bench_traffic.py [--precisions bf16,fp16,fp32] [--micro 1,4] [--dp 1,2]
                                [--iters 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRECISION_FLAGS = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16"]}
ELEM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
PAPER_MIN = 4.0  # ZeRO-Offload paper: 2 B fp16 grad down + 2 B fp16 param up, per step
DEEPSPEED_DOC = 8.0  # DeepSpeed stage-1/2 offload, documented: fp32 grads down + fp32 params up

NOTES = """\
expected   = k x (compute-dtype bytes) down + 1 x up: 2k+2 B in fp16/bf16, 4k+4 B in fp32.
paper min  = ZeRO-Offload's 4 B/param/step (fp16 grads down + fp16 params up, once per step);
             * fp32 rows: the same two copies at 4 B each are 8 B.
DeepSpeed  = its documented ~8 B/param (fp32 grads down, fp32 params up) for one micro-batch
             per step; not measured here (no GPU).
step_stats = the optimizer's own host_device_bytes_per_param (divides by non-skipped steps).
fp16 ovf   = a loss scale of 2^40: every step overflows and is skipped, so no parameters go up."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(pretrain_argv) -> dict:
    """Run pretrain(argv) in this process and read the captured optimizer's counters."""
    import mp_offload.training as training

    captured = []
    orig = training.build_optimizer

    def build_and_keep(*args, **kwargs):
        opt = orig(*args, **kwargs)
        captured.append(opt)
        return opt

    training.build_optimizer = build_and_keep
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            summary = training.pretrain(pretrain_argv)
    finally:
        training.build_optimizer = orig
        for s, h in handlers.items():  # pretrain() installs its own stop handlers
            signal.signal(s, h)
    opt = captured[0]
    return dict(
        bytes_down=0 if opt.host_side is None else opt.host_side.bytes_down,
        bytes_up=0 if opt.host_side is None else opt.host_side.bytes_up,
        steps=opt.step_count,
        iterations=summary["iteration"],
        owned=opt.layout.slice_numel,
        total_params=opt.layout.numel,
        step_stats=opt.stats()["host_device_bytes_per_param"],
        skipped=summary.get("skipped_iterations", 0),
    )


def measure_in_process(pretrain_argv) -> list[dict]:
    env = dict(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return [measure(pretrain_argv)]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure_torchrun(pretrain_argv, nproc: int, threads: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bench_traffic_") as work:
        prefix = os.path.join(work, "counters")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            os.path.abspath(__file__),
            "--worker",
            prefix,
            "--",
            *pretrain_argv,
        ]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"torchrun failed (rc {res.returncode}):\n{res.stderr[-3000:]}")
        recs = []
        for r in range(nproc):
            with open(f"{prefix}.rank{r}.json") as f:
                recs.append(json.load(f))
        return recs


def _parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--precisions", default="bf16,fp16,fp32")
    ap.add_argument("--micro", default="1,4", help="micro-batches per step (gradient accumulation)")
    ap.add_argument("--dp", default="1,2", help="data-parallel sizes (>1 runs under torchrun)")
    ap.add_argument("--dpu", action="store_true", help="add a bf16, k=1 row with DPU on")
    ap.add_argument(
        "--no-overflow-row",
        dest="overflow_row",
        action="store_false",
        help="skip the fp16 row whose every step overflows (and is skipped)",
    )
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument(
        "--bucket-size",
        type=int,
        default=50_000,
        help="--reduce-bucket-size: several buckets even on the small model",
    )
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    a.precisions = [p.strip() for p in a.precisions.split(",") if p.strip()]
    for p in a.precisions:
        if p not in PRECISION_FLAGS:
            ap.error(f"unknown precision {p!r} (bf16, fp16, fp32)")
    a.micro = [int(x) for x in a.micro.split(",") if x.strip()]
    a.dp = [int(x) for x in a.dp.split(",") if x.strip()]
    return a


def pretrain_argv(a, precision: str, k: int, dp: int, dpu: bool, extra=()) -> list[str]:
    mb = 2
    flags = [
        "--num-layers",
        a.layers,
        "--hidden-size",
        a.hidden,
        "--num-attention-heads",
        4,
        "--seq-length",
        32,
        "--vocab-size",
        128,
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--micro-batch-size",
        mb,
        "--global-batch-size",
        mb * k * dp,
        "--train-iters",
        a.iters,
        "--lr",
        "1e-4",
        "--log-interval",
        10**6,
        "--eval-interval",
        10**6,
        "--eval-iters",
        1,
        "--optimizer",
        "adam",
        "--cpu-offload",
        "--reduce-bucket-size",
        a.bucket_size,
        *PRECISION_FLAGS[precision],
    ]
    if dpu:
        flags += ["--dpu-warmup-steps", 1]
    return [str(f) for f in [*flags, *extra]]


def row(a, precision, k, dp, dpu=False, overflow=False) -> dict:
    # overflow: a loss scale so large that every fp16 step overflows and is skipped
    extra = ["--initial-loss-scale", 2.0**40, "--hysteresis", 1] if overflow else []
    argv = pretrain_argv(a, precision, k, dp, dpu, extra)
    recs = measure_in_process(argv) if dp == 1 else measure_torchrun(argv, dp, a.threads)
    r0 = recs[0]
    per = lambda b: b / r0["iterations"] / r0["owned"]  # noqa: E731
    e = ELEM_BYTES[precision]
    down, up = per(r0["bytes_down"]), per(r0["bytes_up"])
    ranks_agree = all(
        abs(per(r["bytes_down"]) + per(r["bytes_up"]) - down - up) < 1e-9 for r in recs
    )
    # k gradient copies per iteration; a parameter copy only for the steps not skipped
    expected = e * k + e * r0["steps"] / r0["iterations"]
    return dict(
        precision=precision,
        micro_batches=k,
        dp=dp,
        dpu=dpu,
        overflow=overflow,
        down=down,
        up=up,
        total=down + up,
        step_stats=r0["step_stats"],
        expected=expected,
        paper_min=PAPER_MIN if e == 2 else 2 * PAPER_MIN,
        deepspeed_doc=DEEPSPEED_DOC,
        steps=r0["steps"],
        iterations=r0["iterations"],
        skipped=r0["skipped"],
        owned=r0["owned"],
        total_params=r0["total_params"],
        ranks_agree=ranks_agree,
    )


def print_table(rows):
    print(
        "\n=== host<->device bytes per parameter per iteration (counted by ZeroOptimizer; "
        "per owned parameter) ==="
    )
    hdr = (
        f"{'precision':9s} {'micro':>5s} {'DP':>3s} {'down':>6s} {'up':>6s} {'total':>6s} "
        f"{'expected':>9s} {'step_stats':>10s} {'paper min':>9s} {'DeepSpeed':>9s} "
        f"{'steps/iters':>11s}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        name = r["precision"] + (" DPU" if r["dpu"] else "") + (" ovf" if r["overflow"] else "")
        exp = f"{r['expected']:.3g} B"
        pm = f"{r['paper_min']:g}" + ("" if r["precision"] != "fp32" else "*")
        print(
            f"{name:9s} {r['micro_batches']:5d} {r['dp']:3d} {r['down']:6.2f} {r['up']:6.2f} "
            f"{r['total']:6.2f} {exp:>9s} {r['step_stats']:10.2f} {pm:>9s} "
            f"{'~' + format(r['deepspeed_doc'], 'g'):>9s} {r['steps']:>5d}/{r['iterations']:<5d}"
        )
    print(NOTES)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # one rank under torchrun: write this rank's counters
        prefix, rest = argv[1], argv[argv.index("--") + 1 :]
        rank = int(os.environ.get("RANK", 0))
        rec = measure(rest)
        with open(f"{prefix}.rank{rank}.json", "w") as f:
            json.dump(rec, f)
        return None
    a = _parse_args(argv)
    rows = []
    for precision in a.precisions:
        for k in a.micro:
            for dp in a.dp:
                rows.append(row(a, precision, k, dp))
                print(
                    f"  {precision} k={k} DP={dp}: {rows[-1]['total']:.2f} B/param/iteration",
                    flush=True,
                )
    if a.dpu and "bf16" in a.precisions:
        rows.append(row(a, "bf16", 1, 1, dpu=True))
    if a.overflow_row and "fp16" in a.precisions:
        rows.append(row(a, "fp16", 1, 1, overflow=True))
    print_table(rows)
    for r in rows:
        if abs(r["total"] - r["expected"]) > 1e-6:
            print(
                f"NOTE: {r['precision']} k={r['micro_batches']} DP={r['dp']}: counted "
                f"{r['total']:.3f} B/param, expected {r['expected']:g}"
            )
        if abs(r["step_stats"] - r["total"]) > 1e-6:
            print(
                f"NOTE: {r['precision']}{' ovf' if r['overflow'] else ''} "
                f"k={r['micro_batches']}: the optimizer's step_stats() says "
                f"{r['step_stats']:.2f} B/param but {r['total']:.2f} moved per iteration "
                f"({r['skipped']} of {r['iterations']} steps skipped: bytes_down counts every "
                f"backward, the divisor only the steps taken)"
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(argv=argv, rows=rows), f, indent=2)
        print(f"wrote {a.json}")
    return rows


if __name__ == "__main__":
    main()
