"""The one CPU-thread rule of a rank (C++ Adam, host gradient sums, torch intra-op).

Threads = the cores this process may use, shared among the ranks of the node
(LOCAL_WORLD_SIZE; a rank bound to its GPU's NUMA node, ``numa.py``: that node's cores
among the ranks bound there), less one per rank on a GPU, kept for the threads that launch
kernels and run autograd (with DPU and host accumulation the C++ teams would otherwise take
every core and the launches would queue behind them); at least one. The cores are the affinity
mask, capped by a cgroup CPU quota (a container limited to 4 CPUs on a 64-core host sees
all 64 in its mask). ``OMP_NUM_THREADS`` is ignored on purpose: torchrun sets it to 1 for
every multi-process job, which would leave the CPU Adam on one core per rank.
``--cpu-threads-per-rank`` overrides the rule. Nothing here runs at import.
"""

from __future__ import annotations

import math
import os

CGROUP = "/sys/fs/cgroup"


def cgroup_cpu_limit(root: str | None = None) -> int | None:
    """Whole CPUs a cgroup quota allows (v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``), or
    None without a quota. A fraction rounds down (at least 1): a thread per partial CPU
    would be throttled. ``root``: the cgroup file system (``CGROUP``)."""
    root = root or CGROUP
    v2 = os.path.join(root, "cpu.max")
    try:
        with open(v2) as f:
            quota, period = (f.read().split() + ["100000"])[:2]
        return None if quota == "max" else max(1, math.floor(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    for sub in ("cpu", "cpu,cpuacct"):
        try:
            with open(os.path.join(root, sub, "cpu.cfs_quota_us")) as f:
                quota = int(f.read())
            with open(os.path.join(root, sub, "cpu.cfs_period_us")) as f:
                period = int(f.read())
        except (OSError, ValueError):
            continue
        return None if quota <= 0 or period <= 0 else max(1, quota // period)
    return None


def available_cores(root: str | None = None) -> int:
    """The affinity mask's cores, capped by the cgroup quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    return cores if limit is None else min(cores, limit)


def default_threads_per_rank(gpu: bool, root: str | None = None, ranks: int | None = None) -> int:
    """The rule above, for a rank on a GPU (``gpu``) or on the CPU. ``ranks``: the ranks
    sharing this process's mask (a NUMA-bound rank: those on its node); else the node's."""
    if ranks is None:
        try:
            ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        except ValueError:
            ranks = 1
    return max(1, available_cores(root) // max(1, ranks) - (1 if gpu else 0))
