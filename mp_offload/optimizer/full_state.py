"""The whole model's optimizer state by parameter name: what ``OffloadAdamW.state_dict``
saves and loads, and the full fp32 weights for ``torch.save`` or ``save_pretrained``.

Each DP rank owns a slice of every bucket (``FlatLayout``); here the slices are
all-gathered bucket by bucket into the flat layout and cut per parameter, so a state
saved at one DP size loads at any other (each rank copies back its own pieces).
"""

from __future__ import annotations

import torch

from ..parallel_state import all_gather_tensor, comm_device
from .sides import fill

KEYS = ("master", "exp_avg", "exp_avg_sq")


def _slice(opt, key: str) -> torch.Tensor:
    """This rank's slice of ``key`` in fp32 on the CPU (the sides' parts in slice order)."""
    parts = [s.parts(key).detach().float().cpu() for s in opt.sides]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _flat(opt, key: str) -> torch.Tensor:
    """``key`` over the whole flat layout (every rank's chunks), on the CPU."""
    layout, mine = opt.layout, _slice(opt, key)
    if opt.dp_group.size == 1:
        return mine
    out = torch.zeros(layout.numel)
    dev = comm_device()
    for b in layout.buckets:
        chunk = mine[b.slice_offset : b.slice_offset + b.chunk].to(dev)
        whole = torch.empty(b.numel, device=dev)
        all_gather_tensor(whole, chunk, group=opt.dp_group.torch_group())
        out[b.start : b.end] = whole.cpu()
    return out


def gather(opt, keys=KEYS) -> dict[str, dict[str, torch.Tensor]]:
    """{key: {parameter name: fp32 tensor of its shape}} on every rank (collective)."""
    opt.flush()
    out = {}
    for key in keys:
        flat = _flat(opt, key)
        out[key] = {
            s.name: flat[s.start : s.start + s.numel].view(s.param.shape).clone()
            for s in opt.layout.slots
        }
    return out


def install(opt, state: dict[str, dict[str, torch.Tensor]]) -> None:
    """Copy each parameter's saved tensors into this rank's pieces of the slice."""
    missing = {s.name for s in opt.layout.slots} - set(state["master"])
    if missing:
        raise KeyError(f"the saved optimizer state has no entry for {sorted(missing)[:3]}")
    for key in (k for k in KEYS if k in state):
        fill(
            opt.sides, opt.layout, key, lambda s, a, n, t=state[key]: t[s.name].view(-1)[a : a + n]
        )
