#!/usr/bin/env python
"""Wall time of ``python -m mp_offload.plan`` questions, this checkout beside another.

    python bench/bench_planner_cli.py --before /path/to/other/checkout [--repeats 5]
    python bench/bench_planner_cli.py --repeats 3 --only dgx2      # this checkout alone

Each question is one process (the torch import included: it is what a user waits for),
run --repeats times, the checkouts alternating question by question so that the load of
a shared machine falls on both alike. Prints the median seconds of each and their ratio.
The other checkout runs with its own code (its directory first on the module path) and
this checkout's built extensions are not needed there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = {
    "no flags (largest model)": [],
    "dgx2 llama2-70b": ["--machine", "dgx2", "--model", "llama2-70b"],
    "hgx-h100 llama2-70b 1e10 tokens": [
        *("--machine", "hgx-h100", "--model", "llama2-70b", "--train-tokens", "1e10")
    ],
    "one H200, 7B, global batch 4": [
        *("--model", "llama2-7b", "--global-batch-size", "4", "--devices-per-node", "1"),
        *("--device-memory-gb", "139.8", "--host-memory-gb", "128"),
    ],
    "paper table": ["--paper-table"],
}


def seconds(tree: str, argv: list[str]) -> float:
    """One planner process in ``tree``: its wall seconds (it must succeed)."""
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "mp_offload.plan", *argv],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    took = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{tree}: plan {' '.join(argv)} failed:\n{res.stderr[-2000:]}")
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", help="another checkout to compare with")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", help="the questions whose name holds this text")
    a = p.parse_args()
    trees = {"this": ROOT, **({"before": os.path.abspath(a.before)} if a.before else {})}
    asked = {k: v for k, v in QUESTIONS.items() if not a.only or a.only in k}
    times = {(q, t): [] for q in asked for t in trees}
    for _ in range(a.repeats):
        for q, argv in asked.items():
            for name, tree in trees.items():
                times[q, name].append(seconds(tree, argv))
    head = f"{'question':<34}{'this s':>9}"
    head += f"{'before s':>10}{'this/before':>13}" if a.before else ""
    print(f"median wall seconds of {a.repeats} processes each (torch import included)")
    print(head)
    for q in asked:
        this = statistics.median(times[q, "this"])
        line = f"{q:<34}{this:9.2f}"
        if a.before:
            before = statistics.median(times[q, "before"])
            line += f"{before:10.2f}{this / before:13.2f}"
        print(line)


if __name__ == "__main__":
    main()
