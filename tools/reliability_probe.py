#!/usr/bin/env python
"""Run the reliability cases of docs/RELIABILITY.md and print their table and counts.

    python tools/reliability_probe.py                 # every case, one at a time
    python tools/reliability_probe.py --only fp16 --markdown out.md --jobs 2

Each case is a real command (pretrain_gpt.py alone or under torchrun, or a tool) run
on tiny inputs built in a temporary directory, with a timeout. Its outcome is one of:

  named      the expected one-line error: the right exit code, the line holding the
             expected words, printed once, first on stderr, no traceback
  ok         a run that must succeed did, with what it must print or save
  traceback  a traceback from the project's processes (torchrun's own summary aside)
  hang       the timeout passed
  silent     exit 0, or a wrong result without an error, where an error was due
  data lost  a checkpoint or dataset that should exist (or survive) does not
  other      an error, but not as promised (unnamed, repeated, buried, wrong code)

Targets: 0 traceback, 0 hang, 0 silent, 0 data lost, 0 other. Needs a few minutes on 2
cores; no GPU (MP_OFFLOAD_DEVICE=cpu).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reliability_cases import all_cases  # noqa: E402 (tools/ is not a package)
from reliability_runs import DATA, MODEL, ROOT, TINY, Case, build_fixtures, run_command  # noqa: E402

TRACEBACK = re.compile(r'File "[^"]*(pretrain_gpt\.py|/mp_offload/|/tools/)')
ROOT_CAUSE = re.compile(r"Root Cause[\s\S]*?exitcode\s*:\s*(-?\d+)")


def judge(case: Case, d: str, rc, out: str, err: str, problem) -> str:
    if problem == "hang" or rc is None:
        return "hang"
    if TRACEBACK.search(out + err):
        return "traceback"
    if problem:
        return problem.split(":")[0]
    if case.check:
        found = case.check(d, rc, out, err)
        if found:
            return found.split(":")[0]
    needle = case.needle.replace("$D", d)
    errors = [ln for ln in err.splitlines() if ln.startswith(case.prefix)]
    if case.expect == "ok":
        return "ok" if rc == 0 and not errors and needle in out + err else "other"
    if rc == 0:
        return "silent"
    root = ROOT_CAUSE.search(err)
    code = int(root.group(1)) if root else rc
    if not errors or needle not in "\n".join(errors) or len(errors) != case.lines:
        return "other"
    shown = [
        ln
        for ln in err.splitlines()
        if not ln.startswith(("pretrain_gpt.py: waiting", "usage:", "   "))
    ]
    if code != case.code or (case.first and shown[0] != errors[0]):
        return "other"
    return "named"


def run_case(case: Case, d: str) -> tuple:
    t0 = time.time()
    runner = case.runner or (lambda c, dd: run_command(c.cmd, dd, c.env, c.timeout))
    rc, out, err, problem = runner(case, d)
    outcome = judge(case, d, rc, out, err, problem)
    if case.expect == "ok":  # the line that shows it ran as it should
        needle = case.needle.replace("$D", d)
        shown = next((ln for ln in (out + err).splitlines() if needle in ln), "")
    else:
        errors = [ln for ln in err.splitlines() if ln.startswith(case.prefix)]
        shown = errors[0] if errors else (err.strip().splitlines() or [""])[-1]
    return outcome, shown.strip().replace(d, "$D"), time.time() - t0


# ----------------------------------------------------------------------- output
def _command(case: Case) -> str:
    text = " ".join(case.cmd).replace(sys.executable, "python").replace(ROOT + "/", "")
    text = text.replace("-m torch.distributed.run --standalone", "-m torchrun")
    for name, flags in (("$TINY", TINY), ("$DATA", DATA), ("$MODEL", MODEL)):
        text = text.replace(" ".join(flags), name)
    env = " ".join(f"{k}={v}" for k, v in case.env.items())
    return f"{env} {text}".strip()


def table(cases, results) -> str:
    rows = [
        "| # | area | case | command | expected | outcome | first line printed |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (case, (outcome, shown, _)) in enumerate(zip(cases, results), 1):
        want = "runs" if case.expect == "ok" else f"exit {case.code}, one line"
        cells = [
            str(i),
            case.area,
            case.name,
            f"`{_command(case)}`",
            want,
            outcome,
            f"`{shown[:160]}`" if shown else "",
        ]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def counts(cases, results) -> str:
    total = collections.Counter(outcome for outcome, _, _ in results)
    by_area = collections.defaultdict(collections.Counter)
    for case, (outcome, _, _) in zip(cases, results):
        by_area[case.area][outcome] += 1
    kinds = ["named", "ok", "traceback", "hang", "silent", "data lost", "other"]
    rows = ["| area | cases | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 2) + "|"]
    for area, ctr in list(by_area.items()) + [("all", total)]:
        rows.append(
            f"| {area} | {sum(ctr.values())} | " + " | ".join(str(ctr[k]) for k in kinds) + " |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="run the cases whose name or area holds this text")
    p.add_argument("--jobs", type=int, default=1, help="cases run at once (default 1)")
    p.add_argument("--markdown", help="also write the table and counts here")
    a = p.parse_args(argv)
    cases = [c for c in all_cases() if not a.only or a.only in c.name or a.only == c.area]
    d = tempfile.mkdtemp(prefix="mp_offload_probe_")
    try:
        build_fixtures(d)
        with ThreadPoolExecutor(max(1, a.jobs)) as pool:
            futures = [pool.submit(run_case, c, d) for c in cases]
            results = []
            for i, (case, fut) in enumerate(zip(cases, futures), 1):
                results.append(fut.result())
                print(
                    f"[{i}/{len(cases)}] {results[-1][0]:9s} {case.area}: {case.name} "
                    f"({results[-1][2]:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        shutil.rmtree(d, ignore_errors=True)
    report = f"{table(cases, results)}\n\n{counts(cases, results)}\n"
    print(report)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(report)
    bad = sum(1 for outcome, _, _ in results if outcome not in ("named", "ok"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
