"""The one CPU-thread rule of a rank (C++ Adam, host gradient sums, torch intra-op).

Threads = the cores this process may use, shared among the ranks of the node
(LOCAL_WORLD_SIZE; a rank bound to its GPU's NUMA node, ``numa.py``: that node's cores
among the ranks bound there), less one per rank on a GPU, kept for the threads that launch
kernels and run autograd (with DPU and host accumulation the C++ teams would otherwise take
every core and the launches would queue behind them); at least one. The cores are the affinity
mask, capped by a cgroup CPU quota (a container limited to 4 CPUs on a 64-core host sees
all 64 in its mask). ``OMP_NUM_THREADS`` is ignored on purpose: torchrun sets it to 1 for
every multi-process job, which would leave the CPU Adam on one core per rank.
``--cpu-threads-per-rank`` overrides the rule.

Idle OpenMP threads sleep (``wait_passively``, called when ``mp_offload`` is imported, the
only thing done at import): by default a team's threads spin for milliseconds after each
parallel region, and on a busy or oversubscribed host that spin takes the core their own
rank's training thread, or a peer rank, needs (one rank with 2 threads on a loaded 2-core
host: 9.7 s per iteration spinning, 0.76 s passive). When the machine is busy anyway
(``busy_machine``: other runnable tasks besides the job) the run says so in one line, and
takes one thread per rank where the threads would spin.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

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


# The runtimes read their wait policy once, when they load (libgomp, which torch and the C++
# extensions share; Intel's libiomp reads KMP_BLOCKTIME).
PASSIVE_WAIT = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
# Set by wait_passively: whether torch's OpenMP runtime loaded before the policy was set.
spinning_runtime = False


def wait_passively() -> None:
    """Make idle OpenMP threads sleep: set ``PASSIVE_WAIT`` in the environment, keeping
    what the user set (``OMP_WAIT_POLICY=ACTIVE`` on a dedicated host stays). It must run
    before torch is imported; if torch came first without a policy, ``spinning_runtime``
    records it for the start-up line."""
    global spinning_runtime
    spinning_runtime = "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ
    for name, value in PASSIVE_WAIT.items():
        os.environ.setdefault(name, value)


def openmp_wait() -> str:
    """How this process's idle OpenMP threads wait, for the start-up line."""
    if spinning_runtime:
        return "OpenMP waits spinning (torch was imported first: set OMP_WAIT_POLICY=PASSIVE)"
    return f"OpenMP waits {os.environ.get('OMP_WAIT_POLICY', 'PASSIVE').lower()}"


def other_runnable(window_s: float = 0.1, samples: int = 11, path: str = "/proc/loadavg") -> float:
    """Tasks of other jobs that want a CPU now: the median over ``window_s`` of the
    kernel's count of runnable tasks (/proc/loadavg), less this reading process. The
    job's own ranks must be idle meanwhile (they all sample at once, sleeping between
    reads). Scaled to the share of the machine's CPUs this process may use (the others
    spread over all of them). 0.0 where the count cannot be read."""
    counts = []
    for i in range(samples):
        try:
            with open(path) as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)
        except (OSError, ValueError, IndexError):
            return 0.0
        if i + 1 < samples:
            time.sleep(window_s / (samples - 1))
    try:
        share = len(os.sched_getaffinity(0)) / (os.cpu_count() or 1)
    except AttributeError:  # not Linux
        share = 1.0
    return round(max(0.0, statistics.median(counts) * min(1.0, share)), 1)


def openmp_spins() -> bool:
    """Whether this process's idle OpenMP threads spin (torch loaded before the policy, or
    ``OMP_WAIT_POLICY=ACTIVE``)."""
    return spinning_runtime or os.environ.get("OMP_WAIT_POLICY", "").upper() == "ACTIVE"


def busy_machine(
    ranks: int, threads: int, cores: int, others: float, load: float, requested: bool = False
) -> tuple[int, str | None]:
    """The host threads of a rank and a warning, when other jobs take at least a core and
    the job's ``ranks`` x ``threads`` do not fit beside them on its ``cores``; else
    (``threads``, None): the CPU demo's 4 ranks on 2 quiet cores are oversubscribed by
    design and run at their quiet speed. A busy machine takes one thread per rank only
    where idle OpenMP threads spin: sleeping ones cost nothing, and fewer threads would
    only shrink the job's share of the CPU (one rank beside two CPU-bound processes on 2
    cores: 1.6 s per iteration with 2 threads, 2.8 s with 1). ``requested``: the thread
    count came from --cpu-threads-per-rank, and stays."""
    if others < 1 or others + ranks * threads <= cores:
        return threads, None
    taken = threads if requested or not openmp_spins() else 1
    if requested:
        action = f"keeping --cpu-threads-per-rank {threads}"
    elif taken < threads:
        action = "taking 1 host thread per rank (idle OpenMP threads spin in this process)"
    else:
        action = f"keeping {taken} host thread(s) per rank (idle OpenMP threads sleep)"
    return taken, (
        f"warning: this machine is busy: {others:g} runnable tasks of other jobs (load "
        f"average {load:.1f}) + {ranks} rank(s) x {threads} host thread(s) > {cores} usable "
        f"core(s); {action}; steps will be slower than on a quiet machine. Fewer ranks "
        f"compete less: the CPU demo on one rank is NPROC=1 TP=1 bash "
        f"scripts/pretrain_gpt_tiny_cpu.sh, another job takes a smaller torchrun "
        f"--nproc-per-node"
    )
