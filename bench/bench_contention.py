"""The main job on a busy machine: its iteration time beside CPU-bound processes, divided by
its quiet iteration time, paired in one run.

Each run is ``scripts/pretrain_gpt_tiny_cpu.sh`` as a user starts it (4 ranks, TP=2 x DP=2,
bf16, ZeRO-Offload, the default corpus; ``NPROC``/``TP`` from ``--nproc``/``--tp``), for
``--iters`` iterations in a fresh run directory, with ``SKIP_SETUP=1`` and the evaluations,
checkpoints and samples pushed past the end. The runs alternate, quiet then loaded (then
loaded then quiet, ...), so a change of the machine's own load hits both. For a loaded run
``--hogs`` CPU-bound processes (pure-Python arithmetic, each ended by this script and by
its own deadline) start first and stop when the run ends; with ``--hog-session own`` they
run in a session of their own (another user's jobs: Linux's autogroup then splits the CPU
between the two sessions), by default in this one (as a second job from the same shell).

The iteration times are the runs' own (``elapsed_ms`` of ``log.jsonl``), less the first
``--warmup`` of each run. The table gives each kind's median and the last line
``contention ratio (loaded / quiet): R``, the loaded median over the quiet one.

  python bench/bench_contention.py [--iters 10] [--warmup 2] [--hogs 2] [--pairs 1]
                                   [--nproc 4] [--tp 2] [--hog-session same|own]
                                   [--json FILE] [-- PRETRAIN_FLAGS...]

Flags after ``--`` go to the job (e.g. ``-- --cpu-threads-per-rank 2``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "pretrain_gpt_tiny_cpu.sh")

# A CPU-bound process that never outlives its deadline (argv[1] seconds) even if this
# script is killed before it can stop it.
HOG = (
    "import sys, time\n"
    "end = time.monotonic() + float(sys.argv[1])\n"
    "x = 0\n"
    "while time.monotonic() < end:\n"
    "    for i in range(20000):\n"
    "        x += i * i\n"
)


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=10, help="iterations of each run")
    ap.add_argument("--warmup", type=int, default=2, help="iterations of each run not counted")
    ap.add_argument("--hogs", type=int, default=2, help="CPU-bound processes of a loaded run")
    ap.add_argument("--pairs", type=int, default=1, help="quiet + loaded runs")
    ap.add_argument("--nproc", type=int, default=4, help="ranks of the job (NPROC)")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (TP)")
    ap.add_argument("--hog-session", choices=("same", "own"), default="same")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
    ap.add_argument("--json", default=None, help="also write the figures here")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.job_flags = argv[cut + 1 :]
    for name in ("iters", "pairs", "nproc", "tp"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.warmup < args.iters:
        ap.error(f"--warmup must be in 0..{args.iters - 1} (below --iters), got {args.warmup}")
    if args.hogs < 1:
        ap.error(f"--hogs must be >= 1, got {args.hogs}")
    return args


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_job(args, run_dir: str) -> list[float]:
    """One run of the main job; its iteration times (s), warm-up dropped."""
    env = dict(
        os.environ,
        SKIP_SETUP="1",
        RUN_DIR=run_dir,
        TRAIN_ITERS=str(args.iters),
        NPROC=str(args.nproc),
        TP=str(args.tp),
        PYTHON=sys.executable,
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )
    later = str(args.iters + 1)  # no evaluation, checkpoint or sample inside the timed loop
    flags = ["--log-interval", "1", "--eval-interval", later, "--save-interval", later]
    flags += ["--eval-iters", "1", "--sample-prompt", "", *args.job_flags]
    res = subprocess.run(
        ["bash", SCRIPT, *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    if res.returncode != 0:
        sys.exit(f"bench_contention: the job failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    with open(os.path.join(run_dir, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    times = [r["elapsed_ms"] / 1e3 for r in records if "elapsed_ms" in r]
    return times[args.warmup :]


def start_hogs(args) -> list[subprocess.Popen]:
    own = args.hog_session == "own"
    return [
        subprocess.Popen(
            [sys.executable, "-c", HOG, str(args.timeout)],
            start_new_session=own,
        )
        for _ in range(args.hogs)
    ]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for p in hogs:
        p.kill()
    for p in hogs:
        p.wait()


def main() -> None:
    args = _args()
    runs: dict[str, list[float]] = {"quiet": [], "loaded": []}
    order = []
    with tempfile.TemporaryDirectory(prefix="bench_contention_") as tmp:
        for pair in range(args.pairs):
            kinds = ("quiet", "loaded") if pair % 2 == 0 else ("loaded", "quiet")
            for kind in kinds:
                hogs = start_hogs(args) if kind == "loaded" else []
                load = os.getloadavg()[0]
                t0 = time.perf_counter()
                try:
                    times = run_job(args, os.path.join(tmp, f"{kind}_{pair}"))
                finally:
                    stop_hogs(hogs)
                runs[kind] += times
                order.append((kind, load, time.perf_counter() - t0, statistics.median(times)))
    quiet, loaded = statistics.median(runs["quiet"]), statistics.median(runs["loaded"])
    ratio = loaded / quiet
    extra = " " + " ".join(args.job_flags) if args.job_flags else ""
    print(
        f"CPU: {cpu_model()}, {os.cpu_count()} cores; job: NPROC={args.nproc} TP={args.tp}{extra}"
    )
    print(f"loaded: {args.hogs} CPU-bound processes in the {args.hog_session} session")
    print(f"{'run':8s} {'load1 at start':>14s} {'wall s':>8s} {'median s/iter':>14s}")
    for kind, load, wall, med in order:
        print(f"{kind:8s} {load:14.2f} {wall:8.1f} {med:14.3f}")
    print(f"{'kind':8s} {'iterations':>10s} {'median s/iter':>14s}")
    for kind in ("quiet", "loaded"):
        print(f"{kind:8s} {len(runs[kind]):10d} {statistics.median(runs[kind]):14.3f}")
    print(f"contention ratio (loaded / quiet): {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "cpu": cpu_model(),
                    "cores": os.cpu_count(),
                    "args": vars(args),
                    "runs": [dict(zip(("kind", "load1", "wall_s", "median_s"), r)) for r in order],
                    "quiet_median_s": quiet,
                    "loaded_median_s": loaded,
                    "ratio": ratio,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
