"""Stage 3's practicality (issue 22): at k micro-batches, the no-offload step time over the
offload step time, synchronous and with ``--overlap-cpu-optimizer``; and that the overlapped
run is the synchronous one (bitwise the same losses, every speculation committed)."""

from __future__ import annotations

from .checks import Check, at_least, equal, finite
from .run_checks import steady_median
from .runs import PRACTICALITY, Size

GOAL = 0.9  # the overlapped run's practicality, judged on the first GPU
OVERLAP, SYNC = "offload-k8-device-overlap", "offload-k8-device"


def practicality(runs: dict[str, list[dict]], mode: str) -> float | None:
    """Median no-offload iteration time / median ``mode`` iteration time (steady)."""
    base = steady_median(runs.get(PRACTICALITY[mode], []), "elapsed_ms")
    own = steady_median(runs.get(mode, []), "elapsed_ms")
    return base / own if finite(base) and finite(own) and own > 0 else None


def practicality_checks(runs: dict[str, list[dict]], cuda: bool) -> list[Check]:
    """On a GPU the overlapped run must reach the goal; the synchronous one is reported
    beside it. In the rehearsal (a tiny model on a shared CPU) both are only measured."""
    out = []
    for mode, base in PRACTICALITY.items():
        p = practicality(runs, mode)
        print(f"device_proof: {mode}: practicality {p} ({base} step / its step)", flush=True)
        if cuda and mode == OVERLAP:
            out.append(at_least(f"{mode}.practicality", p, GOAL, f" ({base} step / this step)"))
        else:
            why = "rehearsal: measured only" if not cuda else f"reported; the goal is {OVERLAP}'s"
            out.append(Check(f"{mode}.practicality", finite(p) and p > 0, p, f"> 0 ({why})"))
    return out


def overlap_checks(runs: dict[str, list[dict]], size: Size) -> list[Check]:
    """The overlapped run's losses are the synchronous run's, bit for bit, and with no
    clipping every one of its steps committed (none replayed)."""
    sync, ovl = runs.get(SYNC, []), runs.get(OVERLAP, [])
    losses = [r["loss"] for r in ovl]
    same = bool(ovl) and losses == [r["loss"] for r in sync]
    out = [Check(f"{OVERLAP}.losses", same, losses, f"== {SYNC}'s losses, bitwise")]
    last = ovl[-1] if ovl else {}
    out.append(equal(f"{OVERLAP}.overlap_steps", last.get("overlap_steps"), size.iters))
    out.append(
        equal(f"{OVERLAP}.replays", last.get("overlap_replays"), 0, " (no clipping: all commit)")
    )
    for key in ("host_hidden_ms", "host_exposed_ms"):
        print(f"device_proof: {OVERLAP}: median {key} {steady_median(ovl, key)}", flush=True)
    return out
