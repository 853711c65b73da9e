"""The device proof's own logic (scripts/device_check.sh, mp_offload/device_proof): the
interval arithmetic, the parsing and judging, and (slow) the whole CPU rehearsal."""

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

from mp_offload.device_proof import checks as ck
from mp_offload.device_proof import run_checks as rc
from mp_offload.device_proof.calibrate import host_memory_bytes, usable_cores
from mp_offload.device_proof.dpu_timing import dpu_interleaved
from mp_offload.device_proof.junit import junit_counts
from mp_offload.device_proof.overlap import copy_overlap_share, covered, merge
from mp_offload.device_proof.runs import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ overlap
def test_merge_and_covered():
    assert merge([(5, 7), (0, 2), (1, 3), (4, 4)]) == [(0, 3), (5, 7)]
    u = merge([(0, 3), (5, 7)])
    assert covered(2, 6, u) == 2  # [2,3) and [5,6)
    assert covered(3, 5, u) == 0 and covered(-1, 10, u) == 5


def test_copy_overlap_share_counts_other_streams_only():
    copies = [(10, 20, "copy"), (30, 40, "copy")]
    kernels = [(0, 15, "compute"), (35, 50, "compute"), (10, 40, "copy")]
    # 5 of the first copy and 5 of the second lie under compute kernels; the kernel on the
    # copy's own stream does not count
    assert copy_overlap_share(copies, kernels) == 0.5
    assert copy_overlap_share(copies, [(0, 100, "copy")]) == 0.0
    assert copy_overlap_share(copies, [(0, 100, 7)]) == 1.0
    assert copy_overlap_share([], kernels) is None


# ------------------------------------------------------------------ parsing and judging
def test_junit_counts():
    xml = """<testsuites><testsuite>
      <testcase classname="tests.test_cuda_proof" name="test_a[cuda]"/>
      <testcase classname="tests.test_cuda" name="test_b"><failure message="x"/></testcase>
      <testcase classname="tests.test_cuda" name="test_c"><skipped/></testcase>
      <testcase classname="tests.test_cuda" name="test_d"><error message="y"/></testcase>
    </testsuite></testsuites>"""
    c = junit_counts(xml)
    assert (c["tests"], c["passed"], c["failed"], c["skipped"]) == (4, 1, 2, 1)
    assert c["passed_names"] == ["tests.test_cuda_proof.test_a[cuda]"]


def test_judges_fail_on_missing_or_nonfinite_values():
    assert ck.within("x", 1.05, 1.0, 0.1).passed and not ck.within("x", 1.2, 1.0, 0.1).passed
    for bad in (None, float("nan"), True):
        assert not ck.within("x", bad, 1.0, 0.1).passed
        assert not ck.at_least("x", bad, 0).passed and not ck.at_most("x", bad, 1).passed
    assert ck.equal("x", [1, 2], [1, 2]).passed and not ck.equal("x", 3, 4).passed


def test_a_stage_without_its_file_is_a_failed_check(tmp_path):
    out = str(tmp_path)
    assert ck.write_stage(out, "preflight", [ck.Check("a", True, 1, "1")])
    assert not ck.write_stage(out, "pytest", [])  # no checks: not a pass
    s = ck.merge(out, rehearsal=True, stages=("preflight", "runs"))
    assert not s["passed"] and s["not_covered"] == ck.NOT_COVERED
    assert [c["name"] for c in s["checks"]] == ["a", "runs.finished"]
    assert "FAIL  runs.finished" in ck.table(s)


def _recs(losses, mode, **extra):
    return [
        dict(
            iteration=i + 1,
            loss=loss,
            elapsed_ms=10.0,
            optimizer_ms=1.0,
            host_device_bytes_per_param=rc.expected_bytes_per_param(mode, i + 1),
            pinned_host_bytes=0,
            host_allocator_bytes=0,
            peak_device_reserved_gb=0.0,
            tflops_per_device=0.01,
            phase_zero_grad_ms=0.5,
            phase_forward_backward_ms=7.0,
            phase_optimizer_ms=1.0,
        )
        | extra
        for i, loss in enumerate(losses)
    ]


def _runs(n=TINY.iters):
    base = [5.0 - 0.01 * i for i in range(n)]
    k8 = [x * 1.002 for x in base]
    return {
        "no-offload": _recs(base, "no-offload"),
        "offload": _recs(base, "offload"),
        "offload-dpu": _recs(base[:3] + [x + 1e-3 for x in base[3:]], "offload-dpu"),
        "offload-k8-device-dpu": _recs([x * 1.001 for x in base], "offload-k8-device-dpu"),
        "no-offload-k8": _recs(k8, "no-offload-k8", elapsed_ms=9.0),
        "offload-k8-device": _recs(k8, "offload-k8-device", elapsed_ms=12.0),
        "offload-k8-device-overlap": _recs(
            k8, "offload-k8-device-overlap", elapsed_ms=9.5, overlap_steps=n, overlap_replays=0
        ),
    }


def test_expected_bytes_per_param():
    assert rc.expected_bytes_per_param("no-offload", 5) == 0
    assert rc.expected_bytes_per_param("offload", 5) == 4
    assert rc.expected_bytes_per_param("offload-dpu", rc.DPU_WARMUP) == 4
    assert rc.expected_bytes_per_param("offload-dpu", 8) == 4 - 2 / 8
    # the device sum comes down once, in fp32 (the host path's precision): 4 + 2 B
    assert rc.expected_bytes_per_param("offload-k8-device-dpu", rc.DPU_WARMUP) == 6
    assert rc.expected_bytes_per_param("offload-k8-device-dpu", 8) == 6 - 2 / 8


def test_run_checks_pass_on_good_records_and_fail_on_each_fault():
    runs = _runs()
    good = rc.loss_checks(runs, TINY) + rc.traffic_checks(runs, {}, cuda=False)
    assert all(c.passed for c in good), [c for c in good if not c.passed]
    faults = {
        "offload.loss@1": lambda r: r["offload"][0].update(loss=5.0000001),
        "offload-dpu.warmup_losses": lambda r: r["offload-dpu"][1].update(loss=4.0),
        "offload.bytes_per_param_error": lambda r: r["offload"][3].update(
            host_device_bytes_per_param=3.75
        ),
        "offload-k8-device-dpu.loss@8": lambda r: r["offload-k8-device-dpu"][-1].update(loss=9.0),
        "offload.iterations": lambda r: r["offload"].pop(),
        "offload.host_allocator_bytes": lambda r: r["offload"][-1].update(host_allocator_bytes=2),
        "offload-k8-device.loss@1": lambda r: r["offload-k8-device"][0].update(loss=5.1),
        "offload-k8-device-overlap.bytes_per_param_error": lambda r: r["offload-k8-device-overlap"][
            2
        ].update(host_device_bytes_per_param=4.0),
    }
    for name, fault in faults.items():
        runs = _runs()
        fault(runs)
        got = {c.name: c for c in rc.loss_checks(runs, TINY) + rc.traffic_checks(runs, {}, False)}
        assert not got[name].passed, name


def test_memory_and_dpu_and_tflops_checks():
    runs = _runs()
    plans = {m: {"device_total": 2e9, "host": {"staging": 100}} for m in runs}
    assert all(c.passed for c in rc.memory_checks(runs, plans, cuda=False))
    for r in runs["offload"]:
        r["peak_device_reserved_gb"] = 2.1
    assert rc.memory_checks(runs, plans, cuda=True)[1].passed  # 5% over the plan
    runs["offload"][0]["peak_device_reserved_gb"] = 2.3
    assert not rc.memory_checks(runs, plans, cuda=True)[1].passed
    # Adam over 0.3 s: DPU must be faster; below, only not much slower
    for r in runs["offload"]:
        r["optimizer_ms"] = 400.0
    assert not rc.dpu_check(runs).passed  # equal ms: not faster
    for r in runs["offload-dpu"]:
        r["elapsed_ms"] = 9.0
    assert rc.dpu_check(runs).passed
    for r in runs["offload"]:
        r["optimizer_ms"] = 1.0
    runs["offload-dpu"][4]["elapsed_ms"] = 25.0  # a slow median iteration...
    assert rc.dpu_check(runs).passed  # ...within 1.5x of sync's median (10)
    for r in runs["offload-dpu"][2:]:
        r["elapsed_ms"] = 16.0
    assert not rc.dpu_check(runs).passed
    assert not rc.dpu_verdict(0.0, float("nan"), 1.0, 1.5, "x").passed


def test_phase_checks():
    runs = _runs()
    assert all(c.passed for c in rc.phase_checks(runs, cuda=True))
    assert len(rc.phase_checks(runs, cuda=False)) == len(runs)  # no ratio in the rehearsal
    runs["offload"][3]["phase_optimizer_ms"] = 5.0  # 0.5 + 7 + 5 > 10 ms + 1
    runs["offload-dpu"][3].pop("phase_zero_grad_ms")
    for r in runs["offload-dpu"]:
        r["phase_forward_backward_ms"] = 8.1  # 8.1 / 7 > 1.15
    got = {c.name: c.passed for c in rc.phase_checks(runs, cuda=True)}
    assert not got["offload.phases_minus_iteration_ms"]
    assert not got["offload-dpu.phases_minus_iteration_ms"]
    assert got["offload.forward_backward_ratio"] and not got["offload-dpu.forward_backward_ratio"]


def test_dpu_interleaved_judges_both_optimizers_stepped_in_turn():
    check = dpu_interleaved("cpu", steps=4)
    assert check.name == "offload-dpu.ms_per_iter" and check.value > 0
    assert "stepped in turn" in check.expected
    assert rc.tflops_check("t", 0.8, 1.0, rehearsal=False).passed
    assert not rc.tflops_check("t", 0.7, 1.0, rehearsal=False).passed
    assert rc.tflops_check("t", 0.001, 1.0, rehearsal=True).passed
    assert not rc.tflops_check("t", 1.3, 1.0, rehearsal=True).passed


# ------------------------------------------------------------------ calibration helpers
def test_host_memory_takes_the_cgroup_limit_and_memavailable(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 1000000 kB\nMemAvailable: 500000 kB\n")
    assert host_memory_bytes(str(tmp_path)) == 500000 * 1024
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/memory.max").write_text("1048576\n")
    assert host_memory_bytes(str(tmp_path)) == 1048576
    (tmp_path / "sys/fs/cgroup/memory.max").write_text("max\n")
    assert host_memory_bytes(str(tmp_path)) == 500000 * 1024


def test_usable_cores_honour_a_cpu_quota(tmp_path):
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
    assert usable_cores(str(tmp_path)) == len(os.sched_getaffinity(0))
    (tmp_path / "sys/fs/cgroup/cpu.max").write_text("100000 100000\n")
    assert usable_cores(str(tmp_path)) == 1
    (tmp_path / "sys/fs/cgroup/cpu.max").write_text("max 100000\n")
    assert usable_cores(str(tmp_path)) == len(os.sched_getaffinity(0))


# ------------------------------------------------------------------ the script
def _script(*args, **env):
    return subprocess.run(
        ["bash", os.path.join(ROOT, "scripts/device_check.sh"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=900,
    )


def test_without_a_gpu_or_the_flag_it_exits_2_with_one_line():
    import torch

    r = _script("--cpu-rehersal")  # a bad argument is refused on any machine
    assert r.returncode == 2 and "unknown argument '--cpu-rehersal'" in r.stderr
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: without the flag the script runs the proof")
    r = _script()
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no CUDA device" in r.stderr and "--cpu-rehearsal" in r.stderr


@pytest.mark.slow
def test_the_cpu_rehearsal_passes_every_check():
    # not tmp_path: pytest prunes its old temporary directories while the proof runs
    with tempfile.TemporaryDirectory(prefix="device_proof_") as out:
        r = _script("--cpu-rehearsal", OUT=out, PYTHON=sys.executable)
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
        assert os.path.getsize(os.path.join(out, "proof.log")) > 0
        assert os.path.exists(os.path.join(out, "calib.json"))
    failed = [c for c in summary["checks"] if not c["passed"]]
    assert r.returncode == 0 and not failed, (failed, r.stdout[-3000:])
    assert summary["rehearsal"] and len(summary["checks"]) >= 10 and summary["not_covered"]
    names = {c["name"] for c in summary["checks"]}
    for name in (
        "calib.gemm_tflops",
        "host_adam.ours_rem_q8mom.of_ceiling",
        "pytest.failed",
        "offload.loss@1",
        "profile.d2h_overlap_share",
    ):
        assert name in names


def test_practicality_and_overlap_checks():
    """practicality = no-offload-k8's median step / the run's; on a GPU the overlapped run
    must reach 0.9; its losses are the synchronous run's, bitwise, with no replay."""
    from mp_offload.device_proof.practicality import (
        overlap_checks,
        practicality,
        practicality_checks,
    )

    runs = _runs()
    assert practicality(runs, "offload-k8-device") == pytest.approx(0.75)
    assert practicality(runs, "offload-k8-device-overlap") == pytest.approx(9 / 9.5)
    for cuda in (False, True):
        assert all(c.passed for c in practicality_checks(runs, cuda))
    assert all(c.passed for c in overlap_checks(runs, TINY))
    for r in runs["offload-k8-device-overlap"][2:]:
        r["elapsed_ms"] = 10.5  # 9 / 10.5 < 0.9: below the goal on a GPU only
    got = {c.name: c.passed for c in practicality_checks(runs, cuda=True)}
    assert not got["offload-k8-device-overlap.practicality"]
    assert all(c.passed for c in practicality_checks(runs, cuda=False))
    runs["no-offload-k8"] = []  # nothing measured: a failed check, not a crash
    assert not any(c.passed for c in practicality_checks(runs, cuda=False))
    faults = {
        "offload-k8-device-overlap.losses": lambda r: r["offload-k8-device-overlap"][5].update(
            loss=r["offload-k8-device-overlap"][5]["loss"] + 1e-7
        ),
        "offload-k8-device-overlap.replays": lambda r: r["offload-k8-device-overlap"][-1].update(
            overlap_replays=1
        ),
        "offload-k8-device-overlap.overlap_steps": lambda r: r["offload-k8-device-overlap"][-1].pop(
            "overlap_steps"
        ),
    }
    for name, fault in faults.items():
        runs = _runs()
        fault(runs)
        assert not {c.name: c.passed for c in overlap_checks(runs, TINY)}[name], name
    runs = _runs()
    runs["offload-k8-device-overlap"] = []
    assert not {c.name: c.passed for c in overlap_checks(runs, TINY)}[
        "offload-k8-device-overlap.losses"
    ]


def test_host_adam_checks_judge_each_row_on_the_gpu_host_only(monkeypatch, tmp_path):
    """Each remainder / 8-bit row's paired "of ceiling" is a check: >= 0.9 on the GPU
    host, recorded only in the rehearsal; a bench that did not run is a failed check."""
    from mp_offload.device_proof import host_adam as ha

    fracs = dict(zip(ha.ROWS, (0.95, 0.91, 0.5, None)))
    rows = [{"key": k, "frac_ceiling": f} for k, f in fracs.items()]
    rows.append({"key": "ceiling_rem", "frac_ceiling": 1.0})
    report = {"sizes": {"50000000": {"rows": rows}}}
    assert ha.of_ceiling(report) == fracs
    monkeypatch.setattr(ha, "run_bench", lambda out, rehearsal: (report, ""))
    gpu = {c.name: c.passed for c in ha.host_adam_checks(str(tmp_path), rehearsal=False)}
    assert gpu == {
        "host_adam.ours_rem.of_ceiling": True,
        "host_adam.ours_rem_bf16mom.of_ceiling": True,
        "host_adam.ours_q8mom.of_ceiling": False,
        "host_adam.ours_rem_q8mom.of_ceiling": False,  # not measured: failed, not skipped
    }
    cpu = ha.host_adam_checks(str(tmp_path), rehearsal=True)
    assert [c.passed for c in cpu] == [True, True, True, False]
    assert all("measured only" in c.expected for c in cpu)
    monkeypatch.setattr(ha, "run_bench", lambda out, rehearsal: (None, "exit 2 (host_adam.out)"))
    (bad,) = ha.host_adam_checks(str(tmp_path), rehearsal=False)
    assert bad.name == "host_adam.bench" and not bad.passed


def test_host_adam_bench_command_runs_the_rows_on_all_cores(monkeypatch, tmp_path):
    from mp_offload.device_proof import host_adam as ha

    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"], seen["timeout"] = cmd, kw["timeout"]
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            f.write('{"sizes": {}}')
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(ha.subprocess, "run", fake_run)
    monkeypatch.setattr(ha, "usable_cores", lambda: 16)
    report, why = ha.run_bench(str(tmp_path), rehearsal=False)
    assert report == {"sizes": {}} and why == ""
    cmd = seen["cmd"]
    assert os.path.isfile(cmd[1]) and cmd[1].endswith("bench/bench_cpu_adam.py")
    assert cmd[cmd.index("--rows") + 1] == ",".join(ha.ROWS)
    assert cmd[cmd.index("--threads") + 1] == "16" and cmd[cmd.index("--sizes") + 1] == "5e7"
    with open(os.path.join(ROOT, "scripts/device_check.sh")) as f:
        limits = re.findall(r"LIMITS=\(([\d ]+)\)", f.read())
    gpu = [int(x) for x in limits[1].split()]  # build, then the stages in order
    stage = gpu[1 + list(ck.STAGES).index("host_adam")]
    assert seen["timeout"] + 3 <= stage  # the bench ends (or is stopped) inside the stage
