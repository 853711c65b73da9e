"""Where the ranks of a save wait for each other, and for how long.

Each rank writes, fsyncs and hashes its files (reading them back) before the gather of
their manifest entries; a rank that finished waits there for the slowest, and the ranks
wait once more for rank 0's commit. On network storage a large save takes longer than
``--distributed-timeout-minutes``, the bound of every training collective, so those two
waits use a gloo group of their own whose timeout follows the save's size: the run's
timeout plus the largest rank's bytes written and read back at ``FLOOR_BYTES_PER_S``.
The ranks agree on that size in a gather before the slow part, where all of them are
already waiting for rank 0 to open the save.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from .. import parallel_state as ps
from ..runtime.distributed import collective_timeout_minutes

# The slowest storage a save is expected to reach: a shared network file system under
# every rank of a node at once (e.g. 8 ranks on a 2.5 Gb/s link); written, then read back.
FLOOR_BYTES_PER_S = 25e6
STATE_BYTES = 12  # per parameter of the slice: the fp32 master and two moments, as saved
_GROUP: list = [None, None, None]  # default group, timeout s, the save group


def planned_bytes(model, optimizer, dp_rank: int) -> int:
    """About what this rank writes: its TP shard of the weights (DP rank 0), and the
    optimizer state, partitioned over DP for a "zero" checkpoint."""
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params) if dp_rank == 0 else 0
    share = ps.get_data_parallel_world_size() if optimizer.checkpoint_kind == "zero" else 1
    return weights + STATE_BYTES * sum(p.numel() for p in params) // share


def save_timeout_s(largest: int) -> float:
    """The run's collective timeout plus the largest rank's save at the floor rate, in
    whole minutes (so a run's saves of one size share one group)."""
    seconds = collective_timeout_minutes() * 60 + 2 * largest / FLOOR_BYTES_PER_S
    return 60.0 * -(-seconds // 60)


def save_group(nbytes: int):
    """Collective, before the slow part: every rank's ``nbytes`` (``planned_bytes``), and
    the gloo group whose timeout covers the largest (made once per run and size)."""
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, nbytes)
    seconds = save_timeout_s(max(sizes))
    world = dist.group.WORLD
    if _GROUP[0] is not world or _GROUP[1] != seconds:  # every rank decides alike
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
        _GROUP[:] = [world, seconds, group]
    return _GROUP[2]
