"""The host Adam stage (issue 21): ``bench/bench_cpu_adam.py --rows`` with the remainder
and 8-bit moment rows, each timed round-robin with the ceiling patterns for its own
bytes, on every usable core of this host; each row's paired "of ceiling" is a check.

On a many-core GPU host DRAM bounds these rows, and they must reach GOAL of their
ceiling. In the rehearsal they are only recorded: a 2-core development host is bound
by the cores' compute, not by DRAM, for the 18 B and 8-bit rows (docs/PERFORMANCE.md
1b), so its figures judge nothing (as the practicality stage treats CPU figures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .calibrate import usable_cores
from .checks import Check, at_least, finite

ROWS = ("ours_rem", "ours_rem_bf16mom", "ours_q8mom", "ours_rem_q8mom")
GOAL = 0.90
# elements, repeats: 50M is 0.7-1.3 GB per class (beyond any host's L3); the four
# classes with their 6-7 patterns take ~10 s on 16 cores (well inside the stage's 30 s)
SIZE = {False: ("5e7", 7), True: ("2e4", 2)}
TIMEOUT_S = {False: 25, True: 100}
BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "bench_cpu_adam.py")


def run_bench(out: str, rehearsal: bool) -> tuple[dict | None, str]:
    """The bench's JSON for this stage's rows (None and why when it did not run)."""
    size, repeats = SIZE[rehearsal]
    path = os.path.join(out, "host_adam.json")
    cmd = [sys.executable, os.path.normpath(BENCH), "--sizes", size, "--repeats", str(repeats)]
    cmd += ["--rows", ",".join(ROWS), "--threads", str(usable_cores()), "--no-deepspeed"]
    cmd += ["--json", path]
    print(f"device_proof: {' '.join(cmd[1:])}", flush=True)
    try:
        with open(os.path.join(out, "host_adam.out"), "w") as f:
            res = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, timeout=TIMEOUT_S[rehearsal]
            )
    except subprocess.TimeoutExpired:
        return None, f"ran past {TIMEOUT_S[rehearsal]} s (host_adam.out)"
    if res.returncode != 0:
        return None, f"exit {res.returncode} (host_adam.out)"
    with open(path) as f:
        return json.load(f), ""


def of_ceiling(report: dict) -> dict[str, float | None]:
    """Row key -> its paired "of ceiling" (the one size the stage runs)."""
    (size,) = report["sizes"].values()
    got = {r["key"]: r.get("frac_ceiling") for r in size["rows"]}
    return {key: got.get(key) for key in ROWS}


def host_adam_checks(out: str, rehearsal: bool) -> list[Check]:
    report, why = run_bench(out, rehearsal)
    if report is None:
        return [Check("host_adam.bench", False, why, "bench_cpu_adam.py --rows runs")]
    checks = []
    for key, frac in of_ceiling(report).items():
        name = f"host_adam.{key}.of_ceiling"
        print(f"device_proof: {key}: {frac} of the ceiling for its own bytes", flush=True)
        if rehearsal:
            why = f"rehearsal: measured only; >= {GOAL:g} judged on the GPU host"
            checks.append(Check(name, finite(frac) and frac > 0, frac, f"> 0 ({why})"))
        else:
            checks.append(at_least(name, frac, GOAL, " (paired: its ceiling / its step)"))
    return checks
