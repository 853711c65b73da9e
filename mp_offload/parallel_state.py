"""Process groups for tensor parallelism (TP) and data parallelism (DP).

Rank layout (DESIGN.md §1): ``rank = dp_rank * tp + tp_rank`` — TP innermost, so a
TP group is a block of consecutive ranks and stays inside one node.
  TP group i: ranks [i*tp, (i+1)*tp)      DP group j: ranks j, j+tp, j+2tp, ...

A group of ``None`` (or ``SINGLE_PROCESS``, which layers take to mean "unsplit even
though parallel state is initialised") is a group of size 1, so layers and the
optimizer run unchanged without torch.distributed.
Pipeline parallelism would add a third axis between TP and DP; the code keeps the
groups in one place so that it could.
"""
from __future__ import annotations

import torch.distributed as dist

_TP_GROUP = None
_DP_GROUP = None
_TP_SIZE = 1
_DP_SIZE = 1
_TP_RANK = 0
_DP_RANK = 0
_INITIALIZED = False


SINGLE_PROCESS = "single-process"


class ParallelConfigError(ValueError):
    """An invalid parallel layout; the message names the flag and the numbers."""


def validate_parallel_sizes(world_size: int, tp: int, *, num_attention_heads: int | None = None,
                            hidden_size: int | None = None) -> None:
    """Reject layouts that cannot be split evenly, naming the flag at fault."""
    if tp < 1:
        raise ParallelConfigError(f"--tensor-model-parallel-size must be >= 1, got {tp}")
    if world_size % tp != 0:
        raise ParallelConfigError(
            f"--tensor-model-parallel-size {tp} does not divide the world size {world_size} "
            f"(number of processes)")
    if num_attention_heads is not None and num_attention_heads % tp != 0:
        raise ParallelConfigError(
            f"--num-attention-heads {num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}")
    if hidden_size is not None and hidden_size % tp != 0:
        raise ParallelConfigError(
            f"--hidden-size {hidden_size} is not divisible by --tensor-model-parallel-size {tp}")


def rank_layout(world_size: int, tp: int) -> tuple[list[list[int]], list[list[int]]]:
    """The TP groups and DP groups as lists of global ranks."""
    dp = world_size // tp
    tp_groups = [list(range(i * tp, (i + 1) * tp)) for i in range(dp)]
    dp_groups = [list(range(j, world_size, tp)) for j in range(tp)]
    return tp_groups, dp_groups


def initialize_model_parallel(tensor_model_parallel_size: int = 1) -> None:
    """Create the TP and DP groups of the running job (torch.distributed must be up)."""
    global _TP_GROUP, _DP_GROUP, _TP_SIZE, _DP_SIZE, _TP_RANK, _DP_RANK, _INITIALIZED
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel: torch.distributed is not initialized")
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = tensor_model_parallel_size
    validate_parallel_sizes(world, tp)
    tp_groups, dp_groups = rank_layout(world, tp)
    # Every rank must take part in creating every group (torch.distributed rule).
    for ranks in tp_groups:
        g = dist.new_group(ranks)
        if rank in ranks:
            _TP_GROUP = g
    for ranks in dp_groups:
        g = dist.new_group(ranks)
        if rank in ranks:
            _DP_GROUP = g
    _TP_SIZE, _DP_SIZE = tp, world // tp
    _TP_RANK, _DP_RANK = rank % tp, rank // tp
    _INITIALIZED = True


def destroy_model_parallel() -> None:
    global _TP_GROUP, _DP_GROUP, _TP_SIZE, _DP_SIZE, _TP_RANK, _DP_RANK, _INITIALIZED
    _TP_GROUP = _DP_GROUP = None
    _TP_SIZE = _DP_SIZE = 1
    _TP_RANK = _DP_RANK = 0
    _INITIALIZED = False


def model_parallel_is_initialized() -> bool:
    return _INITIALIZED


def get_tensor_model_parallel_group():
    return _TP_GROUP


def get_data_parallel_group():
    return _DP_GROUP


def get_tensor_model_parallel_world_size() -> int:
    return _TP_SIZE


def get_tensor_model_parallel_rank() -> int:
    return _TP_RANK


def get_data_parallel_world_size() -> int:
    return _DP_SIZE


def get_data_parallel_rank() -> int:
    return _DP_RANK


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group (the one that reads data)."""
    return (dist.get_rank() // _TP_SIZE) * _TP_SIZE if dist.is_initialized() else 0


def comm_device():
    """Where small control tensors must live to take part in collectives.

    NCCL only reduces CUDA tensors; gloo takes CPU ones.
    """
    import torch
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_size(group) -> int:
    """Size of ``group``; ``None`` stands for a single process."""
    return 1 if group is None or group is SINGLE_PROCESS else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None or group is SINGLE_PROCESS else dist.get_rank(group)
