"""Autograd communication primitives for tensor parallelism.

They come in conjugate pairs: what one does in forward, its partner does in backward.
  copy_to_tp_region      fwd identity        bwd all-reduce
  reduce_from_tp_region  fwd all-reduce      bwd identity
  scatter_to_tp_region   fwd split last dim  bwd all-gather last dim
  gather_from_tp_region  fwd all-gather      bwd split last dim
and, along the sequence dimension of [batch, sequence, hidden] activations (sequence
parallelism, Korthikanti et al. 2022):
  scatter_to_sequence_region         fwd split sequence   bwd all-gather sequence
  gather_from_sequence_region        fwd all-gather seq.  bwd split sequence
  reduce_scatter_from_tp_region      fwd reduce-scatter   bwd all-gather sequence
  gather_sequence_to_tp_region       fwd all-gather seq.  bwd reduce-scatter
The last two are what reduce_from_tp_region and copy_to_tp_region become when the
replicated activations between the parallel layers are kept as sequence shards: a
row-parallel output is summed *and* split, a column-parallel input is gathered and its
gradient summed and split, so each rank ends with 1/T of the tokens.
Every function takes the TP group explicitly as a ``ParallelGroup``; for a group of one
process they are all identities.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel_state import ParallelGroup, all_gather_tensor, reduce_scatter_tensor

SEQUENCE_DIM = 1  # activations are [batch, sequence, hidden]


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
        raise ValueError(
            f"last dimension {x.shape[-1]} is not divisible by the TP size {group.size}"
        )
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


def _gather_last_dim(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    if group.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x, group=group.torch_group())
    return torch.cat(parts, dim=-1)


def _check_sequence(x: torch.Tensor, group: ParallelGroup) -> None:
    if x.shape[SEQUENCE_DIM] % group.size != 0:
        raise ValueError(
            f"sequence of {x.shape[SEQUENCE_DIM]} tokens is not divisible by the "
            f"TP size {group.size} (--sequence-parallel)"
        )


def split_sequence(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """This rank's contiguous 1/T of the sequence."""
    if group.size == 1:
        return x
    _check_sequence(x, group)
    return x.chunk(group.size, dim=SEQUENCE_DIM)[group.rank].contiguous()


def gather_sequence(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """All ranks' shards, in rank order along the sequence."""
    if group.size == 1:
        return x
    # The collective fills one buffer along dim 0: move the sequence there and back.
    shard = x.movedim(SEQUENCE_DIM, 0).contiguous()
    out = shard.new_empty((group.size * shard.shape[0], *shard.shape[1:]))
    all_gather_tensor(out, shard, group=group.torch_group())
    return out.movedim(0, SEQUENCE_DIM).contiguous()


def reduce_scatter_sequence(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """Sum over the ranks, keep this rank's 1/T of the sequence."""
    if group.size == 1:
        return x
    _check_sequence(x, group)
    full = x.movedim(SEQUENCE_DIM, 0).contiguous()
    out = full.new_empty((full.shape[0] // group.size, *full.shape[1:]))
    reduce_scatter_tensor(out, full, group=group.torch_group())
    return out.movedim(0, SEQUENCE_DIM).contiguous()


def _identity(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    return x


def _conjugate(name: str, forward_op, backward_op) -> type[torch.autograd.Function]:
    """An autograd Function doing ``forward_op`` in forward and ``backward_op`` on the
    gradient (both ``(tensor, group) -> tensor``)."""

    def forward(ctx, x, group):
        ctx.group = group
        return forward_op(x, group)

    def backward(ctx, grad):
        return backward_op(grad, ctx.group), None

    return type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )


_CopyToTP = _conjugate("_CopyToTP", _identity, _all_reduce)
_ReduceFromTP = _conjugate("_ReduceFromTP", _all_reduce, _identity)
_ScatterToTP = _conjugate("_ScatterToTP", _split_last_dim, _gather_last_dim)
_GatherFromTP = _conjugate("_GatherFromTP", _gather_last_dim, _split_last_dim)
_ScatterToSequence = _conjugate("_ScatterToSequence", split_sequence, gather_sequence)
_GatherFromSequence = _conjugate("_GatherFromSequence", gather_sequence, split_sequence)
_ReduceScatterFromTP = _conjugate("_ReduceScatterFromTP", reduce_scatter_sequence, gather_sequence)
_GatherSequenceToTP = _conjugate("_GatherSequenceToTP", gather_sequence, reduce_scatter_sequence)


def copy_to_tp_region(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    return _ScatterToTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    return _GatherFromTP.apply(x, group)


def scatter_to_sequence_region(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """Replicated full sequence -> this rank's shard (the gradient is gathered back)."""
    return _ScatterToSequence.apply(x, group)


def gather_from_sequence_region(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """Shards -> the full sequence, consumed identically on every rank (the gradient,
    replicated, is split again)."""
    return _GatherFromSequence.apply(x, group)


def reduce_scatter_from_tp_region(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """Partial sums over the full sequence -> this rank's shard of their sum."""
    return _ReduceScatterFromTP.apply(x, group)


def gather_sequence_to_tp_region(x: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """Shards -> the full sequence, consumed by a TP-split layer (each rank's gradient is
    partial: summed and split on the way back)."""
    return _GatherSequenceToTP.apply(x, group)
