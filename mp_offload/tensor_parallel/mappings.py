"""Autograd communication primitives for tensor parallelism.

They come in conjugate pairs: what one does in forward, its partner does in backward.
  copy_to_tp_region      fwd identity        bwd all-reduce
  reduce_from_tp_region  fwd all-reduce      bwd identity
  scatter_to_tp_region   fwd split last dim  bwd all-gather last dim
  gather_from_tp_region  fwd all-gather      bwd split last dim
Every function takes the TP group explicitly as a ``ParallelGroup``; for a group of one
process they are all identities.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel_state import ParallelGroup


def _all_reduce(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    if group.size == 1:
        return x
    # Clone: the input may be saved by autograd elsewhere; never reduce it in place.
    out = x.clone()
    dist.all_reduce(out, group=group.torch_group())
    return out


def _split_last_dim(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    if group.size == 1:
        return x
    if x.shape[-1] % group.size != 0:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the TP size "
                         f"{group.size}")
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


def _gather_last_dim(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    if group.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x, group=group.torch_group())
    return torch.cat(parts, dim=-1)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    return _ScatterToTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    return _GatherFromTP.apply(x, group)
