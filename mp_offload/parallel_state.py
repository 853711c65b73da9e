"""Process groups for tensor parallelism (TP) and data parallelism (DP).

Rank layout (docs/DESIGN.md §1): ``rank = dp_rank * tp + tp_rank`` — TP innermost, so
a TP group is a block of consecutive ranks and stays inside one node.
  TP group i: ranks [i*tp, (i+1)*tp)      DP group j: ranks j, j+tp, j+2tp, ...

Layers, primitives and the optimizer take a ``ParallelGroup`` handle (size, rank,
process group) rather than a bare process group, so "one process" is a value
(``ParallelGroup.single()``) and not a ``None`` that could also mean "the default
group". The getters below hand out the handles of the initialised job and raise
before ``initialize_model_parallel``: a script that forgets it fails loudly instead
of silently training an unsplit model.
Pipeline parallelism would add a third axis between TP and DP; the code keeps the
groups in one place so that it could.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# The flag checks need no torch: pretrain_gpt.py runs them before importing it.
from .parallel_sizes import ParallelConfigError, validate_parallel_sizes

# The tensor collectives, named once: torch >= 2.13 renamed them (``*_single``); the
# older names keep older releases working.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["ParallelConfigError", "validate_parallel_sizes"]  # and the module's own names


class ParallelStateError(RuntimeError):
    """Parallel state used before ``initialize_model_parallel`` (or after destroying it)."""


@dataclass(frozen=True)
class ParallelGroup:
    """One rank's view of a group: its size, its rank in it, and the process group.

    ``group`` is None for a single process and for a *planned* group (a meta-device
    build for the planner), which knows its size and rank but can run no collective.
    """

    size: int
    rank: int
    group: object | None = None

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of {self.size}")

    @classmethod
    def single(cls) -> ParallelGroup:
        return cls(1, 0, None)

    @classmethod
    def planned(cls, size: int, rank: int = 0) -> ParallelGroup:
        """Rank ``rank`` of a group of ``size`` that exists only on paper (meta builds)."""
        return cls(size, rank, None)

    @classmethod
    def of(cls, group) -> ParallelGroup:
        """The handle of a live torch.distributed group, from this rank's point of view."""
        return cls(dist.get_world_size(group), dist.get_rank(group), group)

    def torch_group(self):
        """The process group to pass to a collective (only when ``size > 1``)."""
        if self.group is None and self.size > 1:
            raise ParallelStateError(
                f"a planned group of {self.size} ranks cannot communicate "
                f"(it was built for the meta device)"
            )
        return self.group


_TP: ParallelGroup | None = None
_DP: ParallelGroup | None = None


def rank_layout(world_size: int, tp: int) -> tuple[list[list[int]], list[list[int]]]:
    """The TP groups and DP groups as lists of global ranks."""
    dp = world_size // tp
    tp_groups = [list(range(i * tp, (i + 1) * tp)) for i in range(dp)]
    dp_groups = [list(range(j, world_size, tp)) for j in range(tp)]
    return tp_groups, dp_groups


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1, timeout: timedelta | None = None
) -> None:
    """Create the TP and DP groups of the running job (torch.distributed must be up).

    ``timeout`` bounds every collective of the groups (``--distributed-timeout-minutes``):
    a new group does not inherit the default group's, it would keep the backend's 30
    minutes and a stalled rank would hang the job. None: torch's default.
    """
    global _TP, _DP
    if not dist.is_initialized():
        raise ParallelStateError("initialize_model_parallel: torch.distributed is not initialized")
    if _TP is not None or _DP is not None:
        raise ParallelStateError(
            f"initialize_model_parallel called twice (the groups exist: TP={_TP.size}, "
            f"DP={_DP.size}): call destroy_model_parallel() first"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = tensor_model_parallel_size
    validate_parallel_sizes(world, tp)
    tp_groups, dp_groups = rank_layout(world, tp)
    # Every rank must take part in creating every group (torch.distributed rule).
    for ranks in tp_groups:
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            _TP = ParallelGroup(tp, rank % tp, g)
    for ranks in dp_groups:
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            _DP = ParallelGroup(world // tp, rank // tp, g)


def destroy_model_parallel() -> None:
    global _TP, _DP
    _TP = _DP = None


def _need(handle: ParallelGroup | None, what: str) -> ParallelGroup:
    if handle is None:
        raise ParallelStateError(
            f"the {what} group is not initialised: call "
            f"mp_offload.parallel_state.initialize_model_parallel() first, or pass "
            f"tp_group=ParallelGroup.single() to build an unsplit model"
        )
    return handle


def get_tensor_model_parallel_group() -> ParallelGroup:
    return _need(_TP, "tensor-parallel")


def get_data_parallel_group() -> ParallelGroup:
    return _need(_DP, "data-parallel")


def get_tensor_model_parallel_world_size() -> int:
    return get_tensor_model_parallel_group().size


def get_tensor_model_parallel_rank() -> int:
    return get_tensor_model_parallel_group().rank


def get_data_parallel_world_size() -> int:
    return get_data_parallel_group().size


def get_data_parallel_rank() -> int:
    return get_data_parallel_group().rank


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group (the one that reads data)."""
    tp = get_tensor_model_parallel_group()
    return dist.get_rank() - tp.rank if dist.is_initialized() else 0


def comm_device() -> torch.device:
    """Where small control tensors must live to take part in collectives.

    NCCL only reduces CUDA tensors; gloo takes CPU ones.
    """
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
