"""The sides of one rank's slice, made from the placement, and writing into them piece by
piece (the model's weights at start-up, a whole-model state at load)."""

from __future__ import annotations

from .device_side import DeviceSide
from .host_side import HostSide


def make_sides(layout, place, device, streams, flat, dp_rank: int):
    """(device side or None, host side or None, both in slice order). Without offload the
    device side holds every bucket ("master", ...); with partial offload its buffers are
    the placement's "share." ones."""
    first, end = place.device_range
    prefix = "share." if place.offloaded else ""
    dev = DeviceSide(layout, place, device, streams, prefix) if end > first else None
    host = HostSide(layout, place, streams, flat, dp_rank) if place.offloaded else None
    return dev, host, sorted((s for s in (dev, host) if s is not None), key=lambda s: s.offset)


def fill(sides, layout, key: str, source) -> None:
    """Each side's ``key`` from ``source(slot, start in the param, length)`` (a 1-D tensor)
    for every piece this rank owns, then committed to the side's stored form."""
    targets = [s.target(key) for s in sides]
    for slot, p_off, offset, length in layout.owned_pieces():
        i = next(i for i, s in enumerate(sides) if s.owns(offset))
        targets[i][offset - sides[i].offset :][:length].copy_(source(slot, p_off, length))
    for side, t in zip(sides, targets):
        side.commit(key, t)
