"""The profiler's device timeline, reduced to what the CUDA checks judge (pure functions).

``test_cuda.py`` feeds them the events of ``torch.profiler``; ``test_kernel_timeline.py``
feeds them synthetic ones on the CPU, so the checks themselves are proven before a GPU
minute is spent.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the caching *host* allocator's key in torch.cuda.host_memory_stats() (the device
#: allocator's is "allocated_bytes.all.current": a different dictionary)
HOST_ALLOCATED = "allocated_bytes.current"


@dataclass(frozen=True)
class Span:
    """One device activity: its name, stream and [start, end) in microseconds."""

    name: str
    stream: int
    start: float
    end: float


def is_transfer(name: str) -> bool:
    """A memcpy or memset (the profiler names them "Memcpy DtoH (...)", "Memset (...)")."""
    low = name.lower()
    return low.startswith("memcpy") or low.startswith("memset")


def is_d2h(name: str) -> bool:
    return name.lower().startswith("memcpy") and "dtoh" in name.lower()


def is_compute(name: str) -> bool:
    """Every kernel that is not a copy or a fill: GEMMs whatever their library calls them
    (cuBLAS on Hopper names them nvjet_*), elementwise, reductions, attention."""
    return not is_transfer(name)


def spans(events) -> list[Span]:
    """Device spans of ``torch.profiler`` events (``prof.events()``)."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    return [
        Span(e.name, e.device_resource_id, e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == cuda
    ]


def host_allocated_bytes(stats: dict) -> int:
    """Bytes the caching host allocator holds (``torch.cuda.host_memory_stats()``)."""
    return int(stats.get(HOST_ALLOCATED, 0))


def _merged(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, z in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], z)
        else:
            out.append([a, z])
    return [(a, z) for a, z in out]


def _covered(a: float, z: float, merged) -> float:
    return sum(max(0.0, min(z, hi) - max(a, lo)) for lo, hi in merged)


def d2h_overlap_share(timeline: list[Span]) -> float:
    """The share of device->host copy time during which a compute kernel runs on another
    stream (0 without copies): overlap in time, from the spans' start and end."""
    total = covered = 0.0
    for c in (s for s in timeline if is_d2h(s.name)):
        others = _merged(
            (k.start, k.end) for k in timeline if is_compute(k.name) and k.stream != c.stream
        )
        total += c.end - c.start
        covered += _covered(c.start, c.end, others)
    return covered / total if total > 0 else 0.0


def streams_of(timeline: list[Span], pick) -> set[int]:
    return {s.stream for s in timeline if pick(s.name)}
