"""Binding each GPU rank to its GPU's NUMA node, on a fake sysfs tree (no GPU needed)."""

import os

import pytest
import torch

from mp_offload.runtime import cpu_threads, distributed
from mp_offload.runtime import numa as nm

BUS = ["0000:1b:00.0", "0000:3d:00.0", "0000:9a:00.0", "0000:ba:00.0"]  # GPUs 0-3


def _sysfs(root, gpu_nodes, cpulists):
    for bus, node in zip(BUS, gpu_nodes):
        d = root / "bus/pci/devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    for node, text in enumerate(cpulists):
        d = root / f"devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(text + "\n")
    return str(root)


def test_cpulists_parse_and_print():
    assert nm.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert nm.parse_cpulist("") == set()
    assert nm.format_cpulist({11, 0, 1, 2, 3, 8, 10}) == "0-3,8,10-11"


def test_the_gpu_node_is_read_from_its_pci_device(tmp_path):
    root = _sysfs(tmp_path, [0, 1, -1, 1], ["0-3", "4-7"])
    assert [nm.gpu_numa_node(b, root) for b in BUS] == [0, 1, None, 1]
    assert nm.gpu_numa_node(BUS[1].upper(), root) == 1  # sysfs names are lower case
    assert nm.gpu_numa_node("0000:ff:00.0", root) is None and nm.gpu_numa_node(None, root) is None
    assert nm.node_cpus(1, root) == {4, 5, 6, 7} and nm.node_cpus(5, root) == set()


def test_each_rank_takes_its_nodes_cores_in_its_mask(tmp_path):
    root = _sysfs(tmp_path, [0, 0, 1, 1], ["0-3,8-11", "4-7,12-15"])
    everything = set(range(16))
    b = nm.plan_binding([0, 0, 1, 1], 2, everything, root)
    assert (b.node, sorted(b.cpus), b.ranks, b.bound) == (1, [4, 5, 6, 7, 12, 13, 14, 15], 2, True)
    assert "NUMA node 1, CPUs 4-7,12-15 (8)" in b.describe(2, torch.device("cuda", 2))
    # a launcher's numactl chose other cores: kept, and said
    b = nm.plan_binding([0, 0, 1, 1], 0, {4, 5}, root)
    assert not b.bound and "no CPU of NUMA node 0" in b.describe(0, torch.device("cuda", 0))
    b = nm.plan_binding([None, None], 1, everything, root)
    assert not b.bound and b.ranks is None and "unknown" in b.why


def test_binding_sets_the_mask_before_anything_allocates(tmp_path, monkeypatch):
    root = _sysfs(tmp_path, [0, 1], ["0-1", "2-3"])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(nm, "pci_bus_id", lambda i: BUS[i])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    calls = []
    b = nm.bind_to_gpu(torch.device("cuda", 1), root, lambda pid, cpus: calls.append(set(cpus)))
    assert calls == [{2, 3}] and b.node == 1 and b.ranks == 1
    calls.clear()  # on the CPU nothing is read or set
    assert not nm.bind_to_gpu(torch.device("cpu"), root, calls.append).bound and calls == []


def test_the_pci_bus_id_comes_from_the_device_properties(monkeypatch):
    class Props:
        pci_domain_id, pci_bus_id, pci_device_id = 0, 0x1B, 0

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    assert nm.pci_bus_id(0) == "0000:1b:00.0"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: object())
    assert nm.pci_bus_id(0) is None  # an older torch without the fields: not bound


@pytest.mark.parametrize("ranks", [None, 2])
def test_a_bound_rank_shares_its_nodes_cores_with_the_ranks_there(monkeypatch, ranks):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(cpu_threads, "available_cores", lambda root=None: 8)
    # 8 cores of one node, 2 ranks bound there: 4 each, one kept for the launches
    assert cpu_threads.default_threads_per_rank(True, ranks=2) == 3
    assert cpu_threads.default_threads_per_rank(True) == 1  # the node's 4 ranks
    monkeypatch.setattr(distributed, "_BINDING", nm.Binding(0, frozenset({0}), ranks, ""))
    assert distributed.threads_per_rank(gpu=False) == 8 // (ranks or 4)


def test_the_report_line_says_where_each_rank_is_bound(monkeypatch):
    monkeypatch.setattr(distributed, "_BINDING", nm.Binding(1, frozenset({4, 5}), 2, ""))
    line = distributed.numa_report(torch.device("cuda", 0))
    assert line == "CPU binding: rank 0 (cuda:0): NUMA node 1, CPUs 4-5 (2)"
