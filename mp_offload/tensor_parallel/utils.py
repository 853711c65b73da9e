"""The parameter-metadata contract (docs/DESIGN.md §2) and the split/merge it implies.

Every parameter carries ``tensor_model_parallel``, ``partition_dim`` and
``partition_stride``. ``split_for_rank`` and ``merge_partitions`` are exact inverses
and are the only place that knows how a strided partition is laid out: the full
tensor is cut into ``stride`` blocks along ``partition_dim``, each block into ``tp``
pieces, and rank r keeps piece r of every block (so a fused [q; k; v] weight gives
each rank its own [q_r; k_r; v_r]).
"""

from __future__ import annotations

import torch

from ..model.gpt_config import pad_vocab_size  # noqa: F401 - defined without torch, re-exported

TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def set_tensor_model_parallel_attributes(
    param: torch.Tensor, is_parallel: bool, partition_dim: int, stride: int = 1
) -> None:
    param.tensor_model_parallel = is_parallel
    param.partition_dim = partition_dim
    param.partition_stride = stride


def set_defaults_if_not_set(param: torch.Tensor) -> None:
    """Replicated parameters (LayerNorm, row-parallel bias, positions) get explicit metadata;
    ``sequence_parallel`` (gradient summed over TP, reader 4 of DESIGN.md §2) is False
    unless a layer said otherwise."""
    if not hasattr(param, "tensor_model_parallel"):
        set_tensor_model_parallel_attributes(param, False, -1, 1)
    if not hasattr(param, "sequence_parallel"):
        param.sequence_parallel = False


def is_duplicate_across_tp(param: torch.Tensor, tp_rank: int) -> bool:
    """Reader 1 of the contract: replicated params count only on TP rank 0."""
    return not getattr(param, "tensor_model_parallel", False) and tp_rank != 0


def split_for_rank(
    full: torch.Tensor, dim: int, world: int, rank: int, stride: int = 1
) -> torch.Tensor:
    if world == 1:
        return full
    size = full.shape[dim]
    if size % (world * stride) != 0:
        raise ValueError(
            f"dimension {dim} of size {size} does not split into {world} ranks x stride {stride}"
        )
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(world, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def merge_partitions(parts: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of ``split_for_rank`` over all ranks' pieces."""
    if len(parts) == 1:
        return parts[0]
    per_rank = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([per_rank[r][s] for s in range(stride) for r in range(len(parts))], dim=dim)


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} {numerator} is not divisible by {denominator}")
    return numerator // denominator
