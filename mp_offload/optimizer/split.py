"""Where the slice is cut between the device and the host (``--optimizer-offload-fraction``).

Pure functions of the per-rank bucket chunk sizes, shared with the planner, so the plan
splits exactly as the optimizer does. The device keeps whole buckets, the ones whose
gradients arrive last in backward (the end of the slice): their host step could not hide
behind the rest of backward, while the first-arriving buckets' host step can.
"""

from __future__ import annotations

from collections.abc import Sequence


def split_buckets(chunks: Sequence[int], fraction: float) -> int:
    """How many buckets (this rank's chunk sizes ``chunks``, in slice order) stay on the
    device at offload fraction ``fraction``, counted from the end of the slice (the last
    gradients of backward): the boundary nearest (1 - F) of the slice, a tie going to
    the host. F = 1 gives 0, F = 0 every bucket."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--optimizer-offload-fraction must be >= 0 and <= 1, got {fraction}")
    want = (1.0 - fraction) * sum(chunks)
    best, best_err, acc = 0, want, 0
    for j, c in enumerate(reversed(chunks), 1):
        acc += c
        if abs(acc - want) < best_err:
            best, best_err = j, abs(acc - want)
    return best


def actual_fraction(chunks: Sequence[int], device_buckets: int) -> float:
    """The offload fraction a split really gives: host elements / slice elements."""
    total = sum(chunks)
    return 1.0 - sum(chunks[len(chunks) - device_buckets :]) / total if total else 1.0


def host_buckets(chunks: Sequence[int], device_buckets: int) -> int:
    """How many buckets, from the start of the slice, the host steps."""
    return len(chunks) - device_buckets
