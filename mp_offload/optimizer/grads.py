"""Gradient reductions shared by every optimizer: DP averaging and the global norm.

The global norm reads the metadata contract (docs/DESIGN.md §2, reader 1): a parameter
counts if it is TP-sharded or this is TP rank 0, so replicated parameters are
counted once; squares are summed over the DP group, then over the TP group.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..parallel_state import ParallelGroup, comm_device
from ..tensor_parallel.utils import is_duplicate_across_tp


def allreduce_gradients(params, dp: ParallelGroup) -> None:
    """Average ``.grad`` over the DP group with one flat all-reduce (non-ZeRO path)."""
    grads = [p.grad for p in params if p.grad is not None]
    if dp.size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=dp.torch_group())
    flat.div_(dp.size)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def reduce_norm_squared(local_sq: torch.Tensor, *groups: ParallelGroup) -> float:
    """Sum a local squared norm over each of ``groups`` (DP if the grads are partitioned
    over it, then TP)."""
    total = local_sq.detach().double().reshape(1).to(comm_device(), copy=True)
    for g in groups:
        if g.size > 1:
            dist.all_reduce(total, group=g.torch_group())
    return float(total.item())


def params_grad_norm(params, tp: ParallelGroup) -> float:
    """Global L2 norm of replicated-over-DP ``.grad``s (after DP averaging)."""
    # Summed where the gradients are: one device->host transfer, not one per parameter.
    squares = [
        p.grad.detach().double().pow(2).sum()
        for p in params
        if p.grad is not None and not is_duplicate_across_tp(p, tp.rank)
    ]
    sq = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
    return math.sqrt(reduce_norm_squared(sq, tp))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Factor to multiply grads by (1.0 when clipping is off or not needed)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
