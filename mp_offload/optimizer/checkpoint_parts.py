"""The optimizer's state as checkpoints and reports see it, read from the sides' faces.

A checkpoint holds each state key as the sides' parts in slice order (one tensor when
the slice is unsplit), in fp32: a side's live tensor where its stored form is fp32 (no
copy), else a temporary (the master joined from its remainders, 8-bit moments decoded).
A load at any split (offload fraction, stored form) copies the saved parts piece by
overlapping piece into each side's ``target`` and ``commit``s it.
"""

from __future__ import annotations

import torch

from .host_state import nbytes


def state_parts(sides, key: str):
    parts = [s.parts(key) for s in sides]
    return parts[0] if len(parts) == 1 else parts


def copy_parts(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Copy the concatenation of 1-D ``src`` into that of ``dst`` (same total length), piece
    by overlapping piece: a slice saved at one split loads at another without a whole copy."""
    if sum(t.numel() for t in dst) != sum(t.numel() for t in src):
        raise ValueError("copy_parts: the source and destination slices differ in length")
    i = j = a = b = 0  # part indices and offsets inside them
    while i < len(dst) and j < len(src):
        n = min(dst[i].numel() - a, src[j].numel() - b)
        dst[i][a : a + n].copy_(src[j][b : b + n])
        a, b = a + n, b + n
        if a == dst[i].numel():
            i, a = i + 1, 0
        if b == src[j].numel():
            j, b = j + 1, 0


def memory_bytes(opt) -> dict:
    """Bytes ``opt`` (a ZeroOptimizer) holds by place and report category: every category
    the placement lists, filled from the real buffers (the sides' ``buffers()``, the flat
    parameters and the reducer's bucket buffers)."""
    place = opt.placement
    out: dict[str, dict[str, int]] = {"device": {}, "host": {}}
    for b in place.buffers:
        out[b.side].setdefault(b.category, 0)
    out["device"]["params"] = nbytes(opt.flat)
    out["device"].update(opt.reducer.buffer_bytes())
    for side in opt.sides:
        for name, t in side.buffers():
            buf = place.buffer(name)
            out[buf.side][buf.category] += nbytes(t)
    return out
