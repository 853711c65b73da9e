"""The one CPU-thread rule (mp_offload/runtime/cpu_threads.py): affinity and cgroup quota per
rank, one core kept for launching on a GPU, OMP_NUM_THREADS ignored, nothing at import."""

import os
import subprocess
import sys

import pytest

from mp_offload.runtime import cpu_threads as ct
from mp_offload.runtime import distributed as d


def _cgroup(tmp_path, files: dict) -> str:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


@pytest.mark.parametrize(
    "files,cpus",
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "400000 100000\n"}, 4),
        ({"cpu.max": "250000 100000\n"}, 2),  # 2.5 CPUs: two whole ones
        ({"cpu.max": "50000 100000\n"}, 1),  # never below one
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
        (
            {"cpu,cpuacct/cpu.cfs_quota_us": "600000", "cpu,cpuacct/cpu.cfs_period_us": "100000"},
            6,
        ),
        ({}, None),
    ],
)
def test_cgroup_quota_v1_and_v2(tmp_path, files, cpus):
    assert ct.cgroup_cpu_limit(_cgroup(tmp_path, files)) == cpus


def test_threads_per_rank_honours_the_quota_keeps_a_launch_core_and_ignores_omp(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(ct.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(ct, "CGROUP", str(tmp_path))  # no quota files there
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's: ignored
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    root = _cgroup(tmp_path / "q", {"cpu.max": "1600000 100000"})
    assert ct.default_threads_per_rank(gpu=False) == 16
    assert ct.default_threads_per_rank(gpu=True) == 15  # one core for the launch threads
    assert ct.default_threads_per_rank(gpu=False, root=root) == 4  # 16 CPUs / 4 ranks
    assert ct.default_threads_per_rank(gpu=True, root=root) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "128")
    assert ct.default_threads_per_rank(gpu=True) == 1  # never below one
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert d.threads_per_rank(gpu=True) == 15 and d.threads_per_rank(6, gpu=True) == 6
    with pytest.raises(d.DeviceError, match="--cpu-threads-per-rank must be >= 1, got 0"):
        d.threads_per_rank(0)


def test_the_cpu_adam_sets_nothing_at_import_and_uses_the_rule_at_first_use():
    code = (
        "import mp_offload.ops.cpu_adam as ca, mp_offload.runtime.cpu_threads as ct\n"
        "assert not ca._threads_chosen\n"
        "ct.available_cores = lambda root=None: 12\n"
        "print(ca.get_num_threads(), ca._threads_chosen)\n"
    )
    env = {"OMP_NUM_THREADS": "5", "LOCAL_WORLD_SIZE": "3"}
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["4", "True"]  # 12 cores / 3 ranks; OMP_NUM_THREADS=5 ignored


@pytest.mark.parametrize(
    "first_call",
    [
        "ca.split_fp32(torch.ones(8))",
        "ca.join_fp32(*ca.split_fp32(torch.ones(8)))",
        "ca.adam_step_remainder(*ca.split_fp32(torch.ones(8)), torch.ones(8), torch.zeros(8),"
        " torch.zeros(8), step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)",
    ],
)
def test_every_threaded_entry_point_applies_the_rule_first(first_call):
    """The remainder and split/join kernels run threaded too: whichever is called first
    must apply the thread rule, not run with the module's built-in count."""
    code = (
        "import torch, mp_offload.ops.cpu_adam as ca, mp_offload.runtime.cpu_threads as ct\n"
        "ct.available_cores = lambda root=None: 12\n"
        f"{first_call}\n"
        "print(ca._threads_chosen, ca._C.get_num_threads())\n"
    )
    env = {"LOCAL_WORLD_SIZE": "3", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True", "4"]


def _fresh(code: str, **env) -> list[str]:
    """``code``'s printed words in a new interpreter whose environment is ``env`` only."""
    env = {**env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.split()


def test_importing_mp_offload_makes_idle_openmp_threads_sleep_before_torch_loads():
    show = "import os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('KMP_BLOCKTIME'))"
    assert _fresh(f"import mp_offload; {show}") == ["PASSIVE", "0"]
    assert _fresh(f"import mp_offload; {show}", OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", "0"]
    report = "import mp_offload.runtime.cpu_threads as ct; print(ct.openmp_wait())"
    assert _fresh(f"import mp_offload; {report}") == ["OpenMP", "waits", "passive"]
    # torch first, without a policy: its runtime spins, and the start-up line says so
    assert "spinning" in _fresh(f"import torch, mp_offload; {report}")
    assert _fresh(f"import torch, mp_offload; {report}", OMP_WAIT_POLICY="PASSIVE")[-1] == (
        "passive"
    )


def test_other_runnable_counts_the_kernels_runnable_tasks_less_the_reader(tmp_path, monkeypatch):
    monkeypatch.setattr(ct.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(ct.os, "cpu_count", lambda: 2)
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("3.10 2.00 1.50 3/412 9876\n")
    assert ct.other_runnable(0.0, 3, str(loadavg)) == 2.0
    monkeypatch.setattr(ct.os, "cpu_count", lambda: 8)  # the others spread over 8 CPUs
    assert ct.other_runnable(0.0, 3, str(loadavg)) == 0.5
    assert ct.other_runnable(0.0, 3, str(tmp_path / "absent")) == 0.0


@pytest.mark.parametrize(
    "ranks,threads,cores,others,busy",
    [
        (4, 1, 2, 0.0, False),  # the CPU demo on a quiet 2-core machine: oversubscribed by design
        (4, 1, 2, 0.5, False),  # less than a core's worth of other work
        (4, 1, 2, 2.0, True),  # two CPU-bound jobs beside the demo
        (1, 2, 2, 1.0, True),
        (2, 4, 16, 3.0, False),  # fits beside them
        (2, 8, 16, 3.0, True),
    ],
)
def test_busy_machine_warns_when_the_job_does_not_fit_beside_other_work(
    ranks, threads, cores, others, busy, monkeypatch
):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(ct, "spinning_runtime", False)
    taken, line = ct.busy_machine(ranks, threads, cores, others, load=7.25)
    assert (line is not None) == busy and taken == threads  # sleeping threads: all kept
    if busy:
        assert "\n" not in line and line.startswith("warning: this machine is busy: ")
        assert f"{others:g} runnable tasks of other jobs (load average 7.2)" in line
        assert f"{ranks} rank(s) x {threads} host thread(s) > {cores} usable core(s)" in line
        assert f"keeping {threads} host thread(s) per rank" in line and "NPROC=1 TP=1" in line


@pytest.mark.parametrize("spins", ["active", "torch first"])
def test_a_busy_machine_takes_one_host_thread_per_rank_where_idle_threads_spin(spins, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE" if spins == "active" else "PASSIVE")
    monkeypatch.setattr(ct, "spinning_runtime", spins == "torch first")
    taken, line = ct.busy_machine(2, 8, 16, 3.0, load=3.0)
    assert taken == 1 and "taking 1 host thread per rank" in line
    assert ct.busy_machine(2, 8, 16, 3.0, load=3.0, requested=True)[0] == 8  # the flag's
    assert ct.busy_machine(2, 4, 16, 3.0, load=3.0) == (4, None)  # not busy: all kept


def test_host_threads_counts_the_other_jobs_and_keeps_the_flags_choice(monkeypatch):
    monkeypatch.setattr(ct.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(ct, "cgroup_cpu_limit", lambda root=None: None)
    monkeypatch.setattr(ct, "spinning_runtime", True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(d, "other_runnable", lambda: 0.0)
    assert d.host_threads() == (4, None)
    monkeypatch.setattr(d, "other_runnable", lambda: 6.0)
    threads, line = d.host_threads()
    assert threads == 1 and "6 runnable tasks of other jobs" in line
    threads, line = d.host_threads(3)
    assert threads == 3 and "keeping --cpu-threads-per-rank 3" in line
