"""The stages of the device proof; each returns its named checks."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import torch

from . import run_checks as rc
from .calibrate import calibrate
from .checks import Check, at_least, equal
from .dpu_timing import dpu_interleaved
from .host_adam import host_adam_checks
from .junit import junit_counts
from .practicality import overlap_checks, practicality_checks
from .runs import GPU, TINY, run_all

# What each check's threshold is on a GPU, and in the rehearsal (the CPU as the device).
FLOORS = {  # GB/s or TFLOPS that a working H100/H200-class machine beats with room
    False: dict(
        d2h_gbs=10.0, h2d_gbs=10.0, host_stream_gbs=5.0, device_mem_gbs=500.0, gemm_tflops=200.0
    ),
    True: dict(
        d2h_gbs=0.05, h2d_gbs=0.05, host_stream_gbs=0.05, device_mem_gbs=0.05, gemm_tflops=0.001
    ),
}
PROOF_TESTS = 7  # test_cuda_proof.py: one test per property, each on this device
MIN_OVERLAP = {False: 0.5, True: 0.0}


def say(msg: str) -> None:
    print(f"device_proof: {msg}", flush=True)


def device(rehearsal: bool) -> str:
    return "cpu" if rehearsal else "cuda"


def preflight(out: str, rehearsal: bool) -> list[Check]:
    say(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    say(f"cores in the affinity mask: {len(os.sched_getaffinity(0))}")
    checks = []
    try:
        from .. import _cpu_adam, _host_ops  # noqa: F401  (the build, in place)

        checks.append(Check("preflight.extensions_import", True, _cpu_adam.simd_level(), "import"))
    except ImportError as e:
        checks.append(Check("preflight.extensions_import", False, str(e), "import"))
    if not rehearsal:
        checks.append(equal("preflight.cuda_available", torch.cuda.is_available(), True))
        if not checks[-1].passed:
            return checks
    big = not rehearsal
    calib = calibrate(torch.device(device(rehearsal)), 512 if big else 16, 8192 if big else 256)
    with open(os.path.join(out, "calib.json"), "w") as f:
        json.dump(calib, f, indent=1)
    say(
        "calibration: "
        + ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in calib.items()
        )
    )
    for key, floor in FLOORS[rehearsal].items():
        checks.append(at_least(f"calib.{key}", calib[key], floor))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    # MemAvailable (or a cgroup limit) is below MemTotal on any running machine
    mem = calib["host_memory_gb"]
    ok = 0 < mem < total
    checks.append(Check("calib.host_memory_gb", ok, mem, f"in (0, {total:.4g}) (below MemTotal)"))
    return checks


def pytest_stage(out: str, rehearsal: bool) -> list[Check]:
    xml = os.path.join(out, "pytest.xml")
    # Rehearsal: the proof tests' CPU cases (the same bodies as their CUDA cases).
    sel = ["tests/test_cuda_proof.py", "-m", "not cuda"] if rehearsal else ["tests", "-m", "cuda"]
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        # its own --basetemp: pytest prunes the user's old temporary directories, a test's too
        f"--basetemp={os.path.join(out, 'pytest_tmp')}",
        f"--junitxml={xml}",
        *sel,
    ]
    with open(os.path.join(out, "pytest.out"), "w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        with open(xml) as f:
            counts = junit_counts(f.read())
    except (OSError, ValueError) as e:
        return [Check("pytest.report", False, str(e), "a JUnit report")]
    say(
        f"pytest: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    )
    for name in counts["failed_names"]:
        say(f"pytest FAILED: {name}")
    proof = sum("test_cuda_proof" in n for n in counts["passed_names"])
    return [
        equal("pytest.failed", counts["failed"], 0),
        equal("pytest.skipped", counts["skipped"], 0, " (every selected test ran)"),
        at_least("pytest.proof_tests_passed", proof, PROOF_TESTS),
    ]


def runs_stage(out: str, rehearsal: bool) -> list[Check]:
    try:
        with open(os.path.join(out, "calib.json")) as f:
            calib = json.load(f)
    except (OSError, ValueError) as e:
        return [Check("runs.calibration", False, str(e), "calib.json from the preflight")]
    size, cuda = (TINY if rehearsal else GPU), not rehearsal
    dev_gb = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else 80.0
    host_gb = calib["host_memory_gb"] * 1e9 / 2**30
    records, plans = run_all(sys.executable, size, out, dev_gb, host_gb, say)
    from ..planner.throughput import measure_adam_rate

    machine = rc.machine_from(calib, measure_adam_rate())
    checks = rc.loss_checks(records, size) + rc.traffic_checks(records, plans, cuda)
    checks += rc.memory_checks(records, plans, cuda) + rc.phase_checks(records, cuda)
    # the rehearsal steps both optimizers in turn: runs made one after the other on a
    # shared CPU differ by 10x in speed
    checks.append(dpu_interleaved() if rehearsal else rc.dpu_check(records))
    checks += rc.tflops_checks(records, size, machine, rehearsal)
    checks += practicality_checks(records, cuda) + overlap_checks(records, size)
    return checks


def profile_stage(out: str, rehearsal: bool) -> list[Check]:
    from .profiled import profiled_share

    got = profiled_share(device(rehearsal))
    say(
        f"profiled step: {got['copies']} D2H copies, {got['kernels']} kernels, "
        f"overlap {got['share']}"
    )
    why = " (rehearsal: the CPU copies inline, on the compute thread)" if rehearsal else ""
    share = got["share"]
    check = (
        equal("profile.d2h_overlap_share", share, 0.0, why)
        if rehearsal
        else at_least("profile.d2h_overlap_share", share, MIN_OVERLAP[False])
    )
    return [at_least("profile.d2h_copies", got["copies"], 1), check]


STAGES = dict(
    preflight=preflight,
    pytest=pytest_stage,
    runs=runs_stage,
    profile=profile_stage,
    host_adam=host_adam_checks,
)
