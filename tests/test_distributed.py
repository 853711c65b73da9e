"""Start-up choices that differ between a GPU machine and this one, shown with mocks."""

import sys
import time

import pytest
import torch
import torch.distributed as dist

from mp_offload.runtime import cpu_threads
from mp_offload.runtime import distributed as d


@pytest.fixture
def fake_gpus(monkeypatch):
    """A machine with ``n`` visible GPUs, as far as pick_device can tell."""

    def make(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    monkeypatch.delenv(d.DEVICE_ENV, raising=False)
    return make


def test_more_ranks_than_gpus_names_local_rank_and_count(fake_gpus, monkeypatch):
    fake_gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(
        d.DeviceError,
        match=r"LOCAL_RANK 1 has no GPU: 1 visible "
        r"\(CUDA_VISIBLE_DEVICES=3\).*--device cpu",
    ):
        d.pick_device()
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert d.pick_device() == torch.device("cuda", 0)


def test_cpu_can_be_forced_by_flag_or_environment(fake_gpus, monkeypatch):
    fake_gpus(8)
    monkeypatch.setenv("LOCAL_RANK", "12")  # would be refused on the GPUs
    assert d.pick_device("cpu") == torch.device("cpu")
    monkeypatch.setenv(d.DEVICE_ENV, "cpu")
    assert d.pick_device() == torch.device("cpu")
    monkeypatch.setenv(d.DEVICE_ENV, "gpu")
    with pytest.raises(d.DeviceError, match="must be auto, cuda or cpu"):
        d.pick_device()


def test_cuda_requested_without_gpu_is_refused(fake_gpus):
    fake_gpus(0)
    assert d.pick_device() == torch.device("cpu")
    with pytest.raises(d.DeviceError, match="no CUDA device"):
        d.pick_device("cuda")


def test_threads_per_rank_shares_cores_and_ignores_torchrun_omp(monkeypatch, tmp_path):
    # torchrun with 4 workers on a 16-core node sets OMP_NUM_THREADS=1 for each.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(cpu_threads, "CGROUP", str(tmp_path))  # no quota
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert d.threads_per_rank() == 4
    assert d.threads_per_rank(gpu=True) == 3  # a core for the launching threads
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert d.threads_per_rank() == 1
    assert d.threads_per_rank(6) == 6
    with pytest.raises(d.DeviceError, match="--cpu-threads-per-rank"):
        d.threads_per_rank(0)


def test_apply_cpu_threads_reaches_the_cpu_adam_despite_omp_num_threads(monkeypatch):
    from mp_offload.ops import cpu_adam

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = (torch.get_num_threads(), cpu_adam.get_num_threads())
    try:
        report = d.apply_cpu_threads(2)
        assert cpu_adam.get_num_threads() == 2 and torch.get_num_threads() == 2
        assert report.startswith(f"host threads 2; CPU Adam {cpu_adam.simd_level()}; OpenMP")
    finally:
        torch.set_num_threads(before[0])
        cpu_adam.set_num_threads(before[1])


def test_missing_extension_is_said_loudly(monkeypatch):
    monkeypatch.setitem(sys.modules, "mp_offload.ops.cpu_adam", None)  # import fails
    before = torch.get_num_threads()
    try:
        assert "WARNING: the C++ CPU Adam is not built" in d.apply_cpu_threads(1)
    finally:
        torch.set_num_threads(before)


def _waiting_worker(rank, world):
    t = torch.ones(4)
    dist.all_reduce(t)  # both ranks are up
    if rank == 1:
        time.sleep(2.0)
        dist.all_reduce(t)
        return
    cpu = time.process_time()  # every thread of the process (gloo's included)
    dist.all_reduce(t)
    spent = time.process_time() - cpu
    assert spent < 0.5, f"waiting 2 s in an all-reduce took {spent:.2f} s of CPU (spinning)"


@pytest.mark.slow
def test_a_rank_waiting_in_a_gloo_collective_sleeps():
    """On a busy host a spinning wait would take the core its late peer needs."""
    from dist_helpers import run_distributed

    run_distributed(_waiting_worker, 2)
