"""The whole model's optimizer state by parameter name: what ``OffloadAdamW.state_dict``
saves and loads, and the full fp32 weights for ``torch.save`` or ``save_pretrained``.

Each DP rank owns a slice of every bucket (``FlatLayout``); here the slices are
all-gathered bucket by bucket into the flat layout and cut per parameter, so a state
saved at one DP size loads at any other (each rank copies back its own pieces). Only DP
rank 0 keeps what it gathers (``everywhere``: every rank): the whole state of a large
model on every rank of a node would not fit its host memory (12 B a parameter per rank).
"""

from __future__ import annotations

import torch

from ..parallel_state import all_gather_tensor, comm_device
from .sides import fill

KEYS = ("master", "exp_avg", "exp_avg_sq")


def _slice(opt, key: str) -> torch.Tensor:
    """This rank's slice of ``key`` in fp32 on the CPU (the sides' parts in slice order)."""
    parts = [s.parts(key).detach() for s in opt.sides]
    if len(parts) == 1:  # a copy, never the live buffer: the state must not move with training
        return parts[0].to("cpu", torch.float32, copy=True)
    return torch.cat([p.float().cpu() for p in parts])


def _flat(opt, key: str, keep: bool) -> torch.Tensor | None:
    """``key`` over the whole flat layout (every rank's chunks), on the CPU; None where not
    ``keep`` (the rank still takes part in each bucket's gather)."""
    layout, mine = opt.layout, _slice(opt, key)
    if opt.dp_group.size == 1:
        return mine
    out = torch.zeros(layout.numel) if keep else None
    dev = comm_device()
    for b in layout.buckets:
        chunk = mine[b.slice_offset : b.slice_offset + b.chunk].to(dev)
        whole = torch.empty(b.numel, device=dev)
        all_gather_tensor(whole, chunk, group=opt.dp_group.torch_group())
        if keep:
            out[b.start : b.end] = whole.cpu()
    return out


def gather(opt, keys=KEYS, everywhere: bool = False) -> dict[str, dict[str, torch.Tensor]] | None:
    """{key: {parameter name: fp32 tensor of its shape}} on DP rank 0 (``everywhere``: on
    every rank), None on the others (collective). Each parameter's tensor is a view of
    its key's one flat tensor (no second copy; ``torch.save`` writes the storage once)."""
    opt.flush()
    keep = everywhere or opt.dp_group.rank == 0
    out = {}
    for key in keys:
        flat = _flat(opt, key, keep)
        if keep:
            out[key] = {
                s.name: flat[s.start : s.start + s.numel].view(s.param.shape)
                for s in opt.layout.slots
            }
    return out if keep else None


def install(opt, state: dict[str, dict[str, torch.Tensor]]) -> None:
    """Copy each parameter's saved tensors into this rank's pieces of the slice."""
    missing = {s.name for s in opt.layout.slots} - set(state["master"])
    if missing:
        raise KeyError(f"the saved optimizer state has no entry for {sorted(missing)[:3]}")
    for key in (k for k in KEYS if k in state):
        fill(
            opt.sides, opt.layout, key, lambda s, a, n, t=state[key]: t[s.name].view(-1)[a : a + n]
        )
