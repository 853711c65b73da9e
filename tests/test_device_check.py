"""The device proof's own logic (scripts/device_check.sh, device_proof/): its summary lines
and deadline, the checks' power to fail, and (slow) the whole CPU rehearsal, whole and
killed half-way."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from helpers import HANG_TIMEOUT

from device_proof import equivalence as eq
from device_proof import report as rp
from device_proof import toy
from device_proof import upload_order as uo
from device_proof.calibrate import host_memory_bytes
from device_proof.overlap import copy_overlap_share, covered, merge

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REHEARSAL_LIMIT_S = 300  # the rehearsal's budget on a 2-core machine
MAX_OUT_FILES = 6


# ------------------------------------------------------------------ overlap arithmetic
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


# ------------------------------------------------------------------ summary lines, deadline
def test_each_line_is_on_disk_when_it_is_written(tmp_path):
    path = str(tmp_path / "summary.txt")
    s = rp.Summary(path, echo=lambda text: None)
    s.add("PASS", "a.b", 0.123456, "== x\tand y", 1.25)
    with open(path) as f:  # read by another handle: written, not buffered
        assert f.read() == "PASS\ta.b\t0.1235\t== x and y\t1.2\n"
    s.add("FIG", "c", "two\nlines", "", 0.0)
    lines = rp.read_summary(path)
    assert [(x.kind, x.value, x.expected) for x in lines][1] == ("FIG", "two lines", "-")
    with pytest.raises(ValueError):
        rp.parse_line("MAYBE\ta\tb\tc\t1.0")


def test_the_deadline_skips_what_would_not_fit_and_says_so(tmp_path):
    now = [0.0]
    budget = rp.Budget(10.0, clock=lambda: now[0])
    s = rp.Summary(str(tmp_path / "summary.txt"), echo=lambda text: None)

    def task():
        now[0] += 6.0
        yield rp.check("t.one", True, 1, "1")

    assert rp.run_task(s, budget, "t", 5.0, task)
    assert not rp.run_task(s, budget, "u", 5.0, task)  # 4 s left: not started
    assert [x.kind for x in s.lines] == ["PASS", "SKIP"]
    assert s.lines[1].name == "u" and "4 s left" in s.lines[1].value


def test_a_task_that_raises_is_a_failed_line_and_the_next_runs(tmp_path):
    s = rp.Summary(str(tmp_path / "summary.txt"), echo=lambda text: None)
    budget = rp.Budget(100.0)

    def broken():
        yield rp.fig("b.first", 1.0)
        raise RuntimeError("split_fp32: x must be a CPU tensor")

    rp.run_task(s, budget, "b", 1.0, broken)
    rp.run_task(s, budget, "c", 1.0, lambda: [rp.check("c.ok", True, 1, "1")])
    got = [(x.kind, x.name) for x in rp.read_summary(s.path)]
    assert got == [("FIG", "b.first"), ("FAIL", "b.error"), ("PASS", "c.ok")]
    assert "must be a CPU tensor" in s.lines[1].value


def test_an_exhausted_deadline_skips_every_task_and_exits_3(tmp_path):
    cmd = [sys.executable, "-m", "device_proof", "--out", str(tmp_path), "--rehearsal"]
    rc = subprocess.run([*cmd, "--deadline-s", "0.5"], cwd=ROOT, capture_output=True).returncode
    lines = rp.read_summary(str(tmp_path / "summary.txt"))
    names = [x.name for x in lines]
    assert rc == 3 and names[0] == "calib.machine" and names[-1] == "smoke.torchrun", names
    assert all(x.kind == "SKIP" for x in lines)
    assert sorted(os.listdir(tmp_path)) == ["calib.json", "summary.txt", "work.tar.gz"]


# ------------------------------------------------------------------ the checks can fail
def _section():
    return eq.Section("cpu", toy.TINY, 3000)


def test_bitwise_and_close_see_one_ulp_and_nans():
    a = torch.randn(100)
    b = a.clone()
    assert eq.bitwise(a, b) == (True, "bitwise equal")
    b[7] = torch.nextafter(b[7], torch.tensor(10.0))
    assert eq.bitwise(a, b) == (False, "1 of 100 elements differ")
    assert not eq.bitwise(a, a.double())[0]
    nan = torch.full((3,), float("nan"))
    assert eq.bitwise(nan, nan.clone())[0]  # the same NaN bits
    assert eq.close(a, b)[0] and not eq.close(a, b + 1e-3)[0]


def test_a_mismatch_in_any_part_is_a_failed_line():
    a = dict(losses=[1.0, 0.5], params=torch.ones(4), master=torch.ones(4))
    b = dict(losses=[1.0, 0.5], params=torch.ones(4), master=torch.ones(4))
    assert all(k == "PASS" for k, *_ in eq.compare("x", a, b, exact=True))
    b["master"] = torch.tensor([1.0, 1.0, 1.0, 1.0000001])
    kinds = {n: k for k, n, *_ in eq.compare("x", a, b, exact=True)}
    assert kinds == {"x.losses": "PASS", "x.params": "PASS", "x.master": "FAIL"}
    b["losses"] = [1.0000001, 0.5]  # where the arithmetic differs, the first loss is exact
    kinds = {n: k for k, n, *_ in eq.compare("x", a, b, exact=False)}
    assert kinds["x.first_loss"] == "FAIL" and kinds["x.master"] == "PASS"


def test_the_order_check_fails_when_the_upload_wait_is_removed():
    """The broken optimizer forgets its upload event after each publish: the host Adam of
    the next step then writes the staging before any wait, and the check says FAIL."""
    good = uo.dpu_run(_section(), steps=3)
    broken = uo.dpu_run(_section(), steps=3, broken=True)
    assert uo._order_line("o", good["ledger"])[0] == "PASS"
    kind, _, value, _ = uo._order_line("o", broken["ledger"])
    assert kind == "FAIL" and "0 waits" in value, value
    assert broken["ledger"].violations  # on the CPU the copies ran: the weights still agree
    lines = {n: k for k, n, *_ in uo.broken_variant(_section())}
    assert lines["upload_order.without_the_wait"] == "PASS"


def test_a_dpu_that_is_synchronous_is_not_delayed(monkeypatch):
    """D stepped synchronously publishes step t at step t: the delayed check fails."""
    zero = toy.zero
    monkeypatch.setattr(
        toy, "zero", lambda m, d, **o: zero(m, d, **{**o, "dpu_warmup_steps": None})
    )
    kinds = {n: k for k, n, *_ in uo.dpu_delayed(_section())}
    assert kinds["dpu.delayed.published"] == "FAIL"


def test_the_traffic_is_counted_from_the_copies(monkeypatch):
    """2 B/param each way from the copies seen; a copy the optimizer skips shows."""
    from device_proof import speed

    b = speed.Bench("cpu", toy.TINY, 2, 0, 1, 3000)
    assert [k for k, *_ in speed.traffic(b)] == ["PASS", "FIG", "PASS", "FIG"]
    from mp_offload.optimizer.host_side import HostSide

    real, skipped = HostSide.upload, []

    def skip_one_upload(side, p, state):
        if not skipped:  # one bucket's params never go up
            skipped.append(p.n)
            return
        real(side, p, state)

    monkeypatch.setattr(HostSide, "upload", skip_one_upload)
    got = {n: (k, v) for k, n, v, _ in speed.traffic(b)}
    assert got["traffic.h2d_bytes_per_param"][0] == "FAIL", got


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


def test_the_library_never_imports_the_proof():
    out = subprocess.run(
        [sys.executable, "-c", "import sys, mp_offload.training, mp_offload.planner; "
         "print(any(m.startswith('device_proof') for m in sys.modules))"],
        capture_output=True, text=True, cwd=ROOT, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "False"
    assert not os.path.exists(os.path.join(ROOT, "mp_offload", "device_proof"))


# ------------------------------------------------------------------ the script
def _script(*args, **env):
    return subprocess.Popen(
        ["bash", os.path.join(ROOT, "scripts/device_check.sh"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHON": sys.executable, **env},
        start_new_session=True,
    )


def test_without_a_gpu_or_the_flag_it_exits_2_with_one_line():
    _, err = _script("--cpu-rehersal").communicate(timeout=HANG_TIMEOUT)  # refused anywhere
    assert "unknown argument '--cpu-rehersal'" in err
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: without the flag the script runs the proof")
    p = _script()
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert "no CUDA device" in err and "--cpu-rehearsal" in err


@pytest.mark.slow
def test_the_cpu_rehearsal_passes_every_check_in_order():
    # not tmp_path: pytest prunes its old temporary directories while the proof runs
    with tempfile.TemporaryDirectory(prefix="device_proof_") as out:
        t0 = time.monotonic()
        p = _script("--cpu-rehearsal", OUT=out)
        stdout, _ = p.communicate(timeout=2 * REHEARSAL_LIMIT_S)
        wall = time.monotonic() - t0
        lines = rp.read_summary(os.path.join(out, "summary.txt"))
        files = os.listdir(out)
    assert p.returncode == 0, stdout[-3000:]
    assert wall <= REHEARSAL_LIMIT_S and len(files) <= MAX_OUT_FILES, (wall, files)
    assert {x.kind for x in lines} <= {"PASS", "FIG"}, [x for x in lines if x.kind == "FAIL"]
    names = [x.name for x in lines]
    order = ["calib.machine", "calib.sdpa_deterministic", "equiv.device_resident_bf16.master",
             "dpu.delayed.published", "upload_order.without_the_wait", "speed.step_ms.overlap",
             "traffic.h2d_bytes_per_param", "smoke.torchrun"]  # fmt: skip
    assert [names.index(n) for n in order] == sorted(names.index(n) for n in order)


@pytest.mark.slow
def test_a_rehearsal_killed_half_way_keeps_the_lines_of_what_ran():
    with tempfile.TemporaryDirectory(prefix="device_proof_") as out:
        path = os.path.join(out, "summary.txt")
        p = _script("--cpu-rehearsal", OUT=out)
        deadline = time.monotonic() + REHEARSAL_LIMIT_S
        while time.monotonic() < deadline and p.poll() is None:
            if os.path.exists(path) and len(open(path).readlines()) >= 12:
                break
            time.sleep(0.2)
        os.killpg(p.pid, signal.SIGKILL)  # the script, the proof and anything they started
        p.communicate()
        lines = rp.read_summary(path)  # every line whole: fields, kind, seconds
        assert len(lines) >= 12 and lines[0].name == "calib.machine"
        assert all(x.kind in ("PASS", "FIG") for x in lines), lines
