"""Start-up choices that differ between a GPU machine and this one, shown with mocks."""

import sys

import pytest
import torch

from mp_offload import cpu_threads
from mp_offload import distributed as d


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
        assert report == f"host threads 2; CPU Adam {cpu_adam.simd_level()}"
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
