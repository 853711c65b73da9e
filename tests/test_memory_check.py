"""The memory preflight: a run the planner says does not fit this machine's free memory
ends before it allocates, in one line naming both numbers and what would fit;
--skip-memory-check starts it anyway."""

import os
import re

import pytest
from pretrain_runs import TINY, assert_one_line, run_pretrain

from mp_offload.config import parse_args, resolve
from mp_offload.memory_check import GiB, cgroup_room, host_available, memory_problem, rank_needs


def _meminfo(tmp_path, available_kb: int) -> str:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: 99999999 kB\nMemFree: 1 kB\nMemAvailable: {available_kb} kB\n")
    return str(path)


def test_the_cgroup_limit_less_its_unreclaimable_usage_is_the_room(tmp_path):
    for proc, base, files in (
        ("0::/job\n", tmp_path / "job", ("memory.max", "memory.current", "inactive_file")),
        (
            "4:memory:/job\n0::/\n",
            tmp_path / "memory" / "job",
            ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
        ),
    ):
        os.makedirs(base)
        (base / files[0]).write_text("1000000\n")
        (base / files[1]).write_text("600000\n")
        (base / "memory.stat").write_text(f"anon 5\n{files[2]} 100000\n")
        (tmp_path / "cgroup").write_text(proc)
        assert cgroup_room(str(tmp_path), str(tmp_path / "cgroup")) == 500_000
        (base / files[0]).write_text("max\n")  # no limit
        assert cgroup_room(str(tmp_path), str(tmp_path / "cgroup")) is None
        os.rename(base, tmp_path / "moved")
        os.rename(tmp_path / "moved", base.with_name("other"))


def test_the_smallest_change_that_fits_is_offered(monkeypatch, tmp_path):
    """A 1.3B-like GPT on a CPU "device": the planner's own sums decide; with a little
    too little memory one flag is enough, with much too little only more nodes are."""
    import torch

    argv = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16"]
    argv += ["--seq-length", "1024", "--micro-batch-size", "1", "--train-iters", "10"]
    args = resolve(parse_args([*argv, "--mock-data", "--bf16", "--cpu-offload"]), 1)
    need = rank_needs(args, 1, cuda=False).host_total
    cpu = torch.device("cpu")
    monkeypatch.setenv("MP_OFFLOAD_MEMINFO", _meminfo(tmp_path, need // 1024 + 1))
    assert memory_problem(args, 1, 1, cpu) is None
    monkeypatch.setenv("MP_OFFLOAD_MEMINFO", _meminfo(tmp_path, need * 19 // 20 // 1024))
    line = memory_problem(args, 1, 1, cpu)
    assert f"need {need / GiB:.1f} GiB of host memory" not in line  # one rank: "needs"
    assert f"1 rank needs {need / GiB:.1f} GiB of host memory" in line, line
    assert "it would fit with --store-param-remainders (or --skip-memory-check" in line, line
    monkeypatch.setenv("MP_OFFLOAD_MEMINFO", _meminfo(tmp_path, need // 4 // 1024))
    line = memory_problem(args, 1, 1, cpu)
    assert "would not be enough; it would fit on " in line and "torchrun --nnodes" in line


def test_skip_memory_check_gets_past_the_check(tmp_path):
    """MemAvailable faked at 1 kB: the tiny run is refused in one line (exit 2); with
    --skip-memory-check the same run trains."""
    run = [*TINY, "--mock-data", "--train-iters", "2"]
    res = run_pretrain(*run, MP_OFFLOAD_MEMINFO=_meminfo(tmp_path, 1))
    line = assert_one_line(res, "of host memory (1 x ", code=2)
    assert "but 0.0 MiB is available (MemAvailable)" in line, line
    assert line.endswith("(or --skip-memory-check to start anyway)"), line
    res = run_pretrain(*run, "--skip-memory-check", MP_OFFLOAD_MEMINFO=_meminfo(tmp_path, 1))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "memory check skipped (--skip-memory-check)" in res.stdout + res.stderr


@pytest.mark.slow
def test_a_model_ten_times_too_big_for_this_host_is_refused_in_one_line():
    """A GPT sized at ten times this machine's free host memory (by its parameters' 16
    bytes of fp32 master, moments and gradient alone) is refused before it allocates,
    naming both numbers."""
    free, source = host_available()
    hidden = 4096
    layers = max(1, round(10 * free / (12 * hidden * hidden * 16)))
    res = run_pretrain(
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads",
        "32", "--seq-length", "1024", "--micro-batch-size", "1", "--train-iters", "10",
        "--mock-data", "--bf16", "--cpu-offload", timeout=300,
    )  # fmt: skip
    line = assert_one_line(res, "of host memory (1 x ", code=2)
    need, have = (
        float(x)
        for x in re.search(
            r"needs ([\d.]+) GiB of host .* but ([\d.]+) GiB is available", line
        ).groups()
    )
    assert need > 8 * have and f"GiB is available ({source})" in line, line


def test_a_gpu_short_of_memory_is_named_with_the_flag_that_fits(monkeypatch, tmp_path):
    """The device side (no GPU needed: its free memory is given): a 1.3B-like GPT without
    offload needs more than the GPU has free; --cpu-offload is offered."""
    import torch

    from mp_offload import memory_check

    argv = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16"]
    argv += ["--seq-length", "1024", "--micro-batch-size", "1", "--train-iters", "10"]
    args = resolve(parse_args([*argv, "--mock-data", "--bf16"]), 1)
    need = rank_needs(args, 1, cuda=True)
    monkeypatch.setenv("MP_OFFLOAD_MEMINFO", _meminfo(tmp_path, 10**12 // 1024))
    monkeypatch.setattr(memory_check, "device_available", lambda d: need.device_total - 1)
    line = memory_problem(args, 1, 1, torch.device("cuda", 0))
    assert line.startswith(
        f"not enough memory: each rank needs {need.device_total / GiB:.1f} GiB on its GPU"
    ), line
    assert "of cuda:0 is free; it would fit with --cpu-offload (or --skip" in line, line
    monkeypatch.setattr(memory_check, "device_available", lambda d: need.device_total)
    assert memory_problem(args, 1, 1, torch.device("cuda", 0)) is None
