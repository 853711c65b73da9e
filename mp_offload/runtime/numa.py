"""Each rank's CPU threads and host memory on its GPU's socket (NUMA node).

On a two-socket GPU host, a rank whose CPU Adam runs on the far socket reads its host
state across the socket link, and its pinned staging crosses it again on every copy. So a
GPU rank restricts its CPU affinity to the cores of its GPU's NUMA node (the mask it was
given, intersected with that node's cores) *before* it allocates: threads started later
inherit the mask, and Linux places a page on the node of the core that first touches it
(the default "local" policy), so the host state and the staging land there too.

The GPU's node comes from sysfs (``/sys/bus/pci/devices/<bus id>/numa_node``), the bus id
from ``torch.cuda.get_device_properties``. Nothing happens on a CPU run, on a one-node
host (numa_node -1), where torch does not report the bus id, or where the given mask has
no core on the GPU's node (a launcher's own ``numactl`` choice is kept); the start-up
line says which.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

SYSFS = "/sys"


def parse_cpulist(text: str) -> set[int]:
    """``0-3,8,10-11`` (the kernel's cpulist format) as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpulist(cpus) -> str:
    """The inverse of ``parse_cpulist``: sorted runs, ``0-3,8``."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def pci_bus_id(index: int) -> str | None:
    """``0000:1b:00.0`` for CUDA device ``index``, or None where torch does not say."""
    props = torch.cuda.get_device_properties(index)
    fields = [getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(not isinstance(f, int) for f in fields):
        return None
    domain, bus, dev = fields
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def gpu_numa_node(bus_id: str | None, sysfs: str = SYSFS) -> int | None:
    """The NUMA node of the PCI device ``bus_id``; None when unknown or one node (-1)."""
    if bus_id is None:
        return None
    try:
        with open(os.path.join(sysfs, "bus/pci/devices", bus_id.lower(), "numa_node")) as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_cpus(node: int, sysfs: str = SYSFS) -> set[int]:
    """The CPUs of NUMA node ``node`` (empty when sysfs does not list it)."""
    try:
        with open(os.path.join(sysfs, f"devices/system/node/node{node}/cpulist")) as f:
            return parse_cpulist(f.read())
    except (OSError, ValueError):
        return set()


@dataclass(frozen=True)
class Binding:
    """Where one rank's CPU work runs: ``cpus`` on ``node`` when bound (else ``why`` not);
    ``ranks``: the node's ranks sharing those cores (the thread rule divides by it)."""

    node: int | None = None
    cpus: frozenset[int] = frozenset()
    ranks: int | None = None
    why: str = "not a GPU rank"

    @property
    def bound(self) -> bool:
        return bool(self.cpus)

    def describe(self, rank: int, device: torch.device) -> str:
        if not self.bound:
            return f"rank {rank} ({device}): not bound ({self.why})"
        cpus = format_cpulist(self.cpus)
        return f"rank {rank} ({device}): NUMA node {self.node}, CPUs {cpus} ({len(self.cpus)})"


def plan_binding(nodes: list[int | None], local_rank: int, allowed: set[int], sysfs: str):
    """The binding of local rank ``local_rank`` given every local rank's GPU node
    (``nodes``, local rank i on GPU i) and the affinity mask it was started with."""
    node = nodes[local_rank] if local_rank < len(nodes) else None
    if node is None:
        return Binding(why="the GPU's NUMA node is unknown or the host has one node")
    cpus = node_cpus(node, sysfs) & allowed
    if not cpus:
        return Binding(node, why=f"no CPU of NUMA node {node} in this process's affinity mask")
    return Binding(node, frozenset(cpus), sum(n == node for n in nodes), "")


def bind_to_gpu(device: torch.device, sysfs: str = SYSFS, setaffinity=None) -> Binding:
    """Restrict this process to its GPU's NUMA node (``device``: the rank's device, with
    its index); a no-op off the GPU. Call it before allocating host memory."""
    if device.type != "cuda":
        return Binding()
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    count = min(max(local, device.index + 1), torch.cuda.device_count())
    nodes = [gpu_numa_node(pci_bus_id(i), sysfs) for i in range(count)]
    binding = plan_binding(nodes, device.index, os.sched_getaffinity(0), sysfs)
    if binding.bound:
        (setaffinity or os.sched_setaffinity)(0, binding.cpus)
    return binding
