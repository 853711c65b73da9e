"""``python -m mp_offload.device_proof STAGE --out DIR [--rehearsal]``: run one stage and
write its checks (``summary`` merges them into summary.json and sets the exit status)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .checks import STAGES as STAGE_NAMES
from .checks import Check, merge, table, write_stage


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mp_offload.device_proof", allow_abbrev=False)
    p.add_argument("stage", choices=[*STAGE_NAMES, "summary"])
    p.add_argument("--out", required=True)
    p.add_argument("--rehearsal", action="store_true", help="the CPU as the device, tiny sizes")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.stage == "summary":
        summary = merge(a.out, a.rehearsal)
        with open(os.path.join(a.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
        print(table(summary))
        n = len(summary["checks"])
        ok = sum(c["passed"] for c in summary["checks"])
        print(
            f"device_proof: {ok}/{n} checks passed; summary {os.path.join(a.out, 'summary.json')}"
        )
        return 0 if summary["passed"] else 1
    from .stages import STAGES

    try:
        checks = STAGES[a.stage](a.out, a.rehearsal)
    except Exception as e:  # the stage's own failure is a failed check, not a lost summary
        checks = [Check(f"{a.stage}.error", False, f"{type(e).__name__}: {e}", "no exception")]
        print(f"device_proof: stage {a.stage} raised {type(e).__name__}: {e}", file=sys.stderr)
    return 0 if write_stage(a.out, a.stage, checks) else 1


if __name__ == "__main__":
    sys.exit(main())
