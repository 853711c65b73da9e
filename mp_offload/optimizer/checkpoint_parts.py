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


def install_slice(opt, state: dict) -> None:
    """A (re-partitioned) slice into ``opt``'s sides: ``master`` and optionally the moments,
    ``step``, ``param_steps`` (default: every parameter at ``step``) and ``scaler``."""
    keys = ["master"] + (["exp_avg", "exp_avg_sq"] if state.get("exp_avg") is not None else [])
    for key in keys:
        targets = [s.target(key) for s in opt.sides]
        saved = state[key]
        copy_parts(targets, list(saved) if isinstance(saved, (list, tuple)) else [saved])
        for side, t in zip(opt.sides, targets):
            side.commit(key, t)
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
