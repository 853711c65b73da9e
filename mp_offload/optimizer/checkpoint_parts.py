"""The optimizer's state as checkpoints and reports see it, read from the sides' faces.

A checkpoint holds each state key as the sides' parts in slice order (one tensor when
the slice is unsplit), in fp32: a side's live tensor where its stored form is fp32 (no
copy), else a temporary (the master joined from its remainders, 8-bit moments decoded,
a device share's copy); a save streams those a chunk at a time instead (``Streamed``).
A load at any split (offload fraction, stored form) copies the saved parts piece by
overlapping piece into each side's ``target`` and ``commit``s it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .host_state import nbytes

KEYS = ("master", "exp_avg", "exp_avg_sq")
# Elements a save converts at once (4 MiB in fp32): a checkpoint of the compact forms
# holds one chunk beside the state, not an fp32 copy of it (12 B/param at 7B: 84 GB).
SAVE_CHUNK = 1 << 20


@dataclass(frozen=True)
class Streamed:
    """A state key a save writes one chunk at a time (``checkpoint.on_disk.write_raw``):
    ``chunks()`` yields its fp32 values in slice order, ``numel`` in all."""

    numel: int
    chunks: Callable[[], Iterator[torch.Tensor]]


def save_transient_bytes(place, cuda: bool, weights_bytes: int = 0) -> int:
    """Host bytes a rank's save holds beside its state, at the peak: the larger of one
    parameter's host copy (``weights_bytes``: DP rank 0 on a GPU, where torch.save copies
    the weights down one at a time; on the CPU they are written from themselves) and one
    streamed fp32 chunk, where any key streams (a converted form, or state on a GPU)."""
    state = [b for b in place.buffers if b.category in KEYS and b.copies]
    streams = any(b.dtype in (torch.int16, torch.uint8) for b in state)
    streams = streams or (cuda and any(b.side == "device" for b in state))
    return max(weights_bytes, SAVE_CHUNK * 4 if streams else 0)


def state_parts(sides, key: str):
    parts = [s.parts(key) for s in sides]
    return parts[0] if len(parts) == 1 else parts


def _streamed(sides, key: str) -> Streamed:
    def chunks():
        for side in sides:
            yield from side.saved_chunks(key, SAVE_CHUNK)

    return Streamed(sum(s.numel for s in sides), chunks)


def slice_state(opt, streamed: bool = False) -> dict:
    """``opt``'s (a ZeroOptimizer) slice: each state key as the sides' parts in slice order
    (one tensor when unsplit), the live buffers where the stored form is fp32 on the host
    (no copy); a converted or device-held key is a temporary, or with ``streamed`` a
    ``Streamed`` for a save."""
    opt.flush()
    out = {}
    for key in KEYS:
        stream = streamed and any(s.converts(key) for s in opt.sides)
        out[key] = _streamed(opt.sides, key) if stream else state_parts(opt.sides, key)
    steps = {s.name: n for s, n in zip(opt.layout.slots, opt.slot_steps)}
    return dict(out, step=opt.step_count, scaler=opt.scaler.state_dict(),
                layout=opt.layout.describe(), param_steps=steps)  # fmt: skip


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


def _install_key(sides, key: str, saved) -> None:
    """One key into the sides; a converting form's fp32 target is freed on return, before
    the next key's is made."""
    targets = [s.target(key) for s in sides]
    copy_parts(targets, list(saved) if isinstance(saved, (list, tuple)) else [saved])
    for side, t in zip(sides, targets):
        side.commit(key, t)


def install_slice(opt, state: dict) -> None:
    """A (re-partitioned) slice into ``opt``'s sides: ``master`` and optionally the moments,
    ``step``, ``param_steps`` (default: every parameter at ``step``) and ``scaler``."""
    keys = ["master"] + (["exp_avg", "exp_avg_sq"] if state.get("exp_avg") is not None else [])
    for key in keys:
        _install_key(opt.sides, key, state[key])
    opt.step_count = state.get("step", 0)
    steps = state.get("param_steps") or {}
    opt.slot_steps = [steps.get(s.name, opt.step_count) for s in opt.layout.slots]
    if state.get("scaler"):
        opt.scaler.load_state_dict(state["scaler"])


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


def stats(opt) -> dict:
    """The iteration log's figures: host<->device bytes per owned element and step, the
    pinned bytes, and the schedule's own (the overlap's)."""
    host = opt.host_side
    moved = 0 if host is None else host.bytes_down + host.bytes_up
    per = moved / max(opt.step_calls, 1) / max(opt.layout.slice_numel, 1)
    out = dict(host_device_bytes_per_param=per, pinned_host_bytes=opt.pinned_bytes())
    return dict(out, **opt.schedule.stats())


def memory_line(opt) -> str:
    """One line: what ``opt`` holds where, and the device share of a partial offload."""
    rep, place, asked = opt.memory_bytes(), opt.placement, opt.options.offload_fraction
    fmt = lambda d: ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in d.items())  # noqa
    split = ""
    if place.device_buckets and place.offloaded:
        split = (f"; offload fraction {place.actual_offload_fraction:.3f} (asked {asked:g}): "
                 f"the device updates {place.share_numel} of them")  # fmt: skip
    return (
        f"rank memory: device [{fmt(rep['device'])}] host [{fmt(rep['host'])}] "
        f"(owned {opt.layout.slice_numel} of {opt.layout.numel} elements{split})"
    )
