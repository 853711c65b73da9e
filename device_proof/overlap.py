"""How much of the device->host copy time runs while kernels run on other streams: pure
interval arithmetic over (start, end, stream) events, so it is tested without a GPU."""

from __future__ import annotations

from bisect import bisect_right

Event = tuple[float, float, object]  # start, end, stream (any hashable id)


def merge(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint union of [start, end) intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for a, z in sorted((a, z) for a, z in intervals if z > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], z)
        else:
            out.append([a, z])
    return [(a, z) for a, z in out]


def covered(a: float, z: float, union: list[tuple[float, float]]) -> float:
    """Length of [a, z) covered by ``union`` (sorted and disjoint)."""
    total = 0.0
    i = max(0, bisect_right(union, (a, float("inf"))) - 1)
    for s, e in union[i:]:
        if s >= z:
            break
        total += max(0.0, min(e, z) - max(s, a))
    return total


def copy_overlap_share(copies: list[Event], kernels: list[Event]) -> float | None:
    """The share of the copies' time covered by kernels on streams other than the copy's
    own (a kernel on the copy's stream cannot overlap it); None without copy time."""
    by_stream: dict = {}
    for s in {stream for _, _, stream in copies}:
        by_stream[s] = merge((a, z) for a, z, k in kernels if k != s)
    total = sum(max(0.0, z - a) for a, z, _ in copies)
    if total <= 0:
        return None
    # overlapping copies on one stream are counted once each: they are serial in practice
    return sum(covered(a, z, by_stream[s]) for a, z, s in copies) / total
