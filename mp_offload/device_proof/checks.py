"""Named checks ``{name, passed, value, expected}``: how they are judged, and how the
stages' checks become one summary (a stage that died or timed out is a failed check)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

STAGES = ("preflight", "pytest", "runs", "profile", "host_adam")
# What one GPU cannot prove: said in every summary.
NOT_COVERED = [
    "multi-GPU NCCL paths (reduce-scatter, all-gather, all-reduce across ranks)",
    "tensor parallelism (TP > 1) on devices",
    "CUDA contexts and worker threads on GPUs other than device 0",
    "reduce-scatter precision across ranks (bf16 vs fp32 reduction of many ranks' gradients)",
]


@dataclass
class Check:
    name: str
    passed: bool
    value: object
    expected: str


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def at_least(name: str, value, low: float, why: str = "") -> Check:
    return Check(name, finite(value) and value >= low, value, f">= {low:g}{why}")


def at_most(name: str, value, high: float, why: str = "") -> Check:
    return Check(name, finite(value) and value <= high, value, f"<= {high:g}{why}")


def within(name: str, value, ref, rel: float, why: str = "") -> Check:
    """|value - ref| <= rel * |ref| (``value`` recorded as given; ``ref`` in expected)."""
    ok = finite(value) and finite(ref) and abs(value - ref) <= rel * abs(ref)
    return Check(name, ok, value, f"within {rel:g} relative of {ref!r}{why}")


def equal(name: str, value, ref, why: str = "") -> Check:
    return Check(name, value == ref, value, f"== {ref!r}{why}")


def stage_path(out: str, stage: str) -> str:
    return os.path.join(out, f"stage_{stage}.json")


def write_stage(out: str, stage: str, checks: list[Check]) -> bool:
    """The stage's checks into ``out``; True when all passed (and there is at least one)."""
    with open(stage_path(out, stage), "w") as f:
        json.dump([asdict(c) for c in checks], f, indent=1, default=str)
    return bool(checks) and all(c.passed for c in checks)


def merge(out: str, rehearsal: bool, stages=STAGES) -> dict:
    """Every stage's checks in one summary; a stage without its file failed to finish."""
    checks = []
    for stage in stages:
        path = stage_path(out, stage)
        try:
            with open(path) as f:
                checks += json.load(f)
        except (OSError, ValueError) as e:
            why = "no stage file" if isinstance(e, OSError) else f"unreadable: {e}"
            checks.append(
                asdict(Check(f"{stage}.finished", False, why, "the stage writes its checks"))
            )
    return dict(
        rehearsal=rehearsal,
        passed=bool(checks) and all(c["passed"] for c in checks),
        checks=checks,
        not_covered=NOT_COVERED,
    )


def table(summary: dict) -> str:
    """The summary as lines: one per check."""
    rows = [
        f"{'PASS' if c['passed'] else 'FAIL'}  {c['name']:<34} {_fmt(c['value']):>14}  "
        f"(expected {c['expected']})"
        for c in summary["checks"]
    ]
    rows.append("not covered on one GPU: " + "; ".join(summary["not_covered"]))
    return "\n".join(rows)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
