"""Stops that always end saved, or with one line saying why not: Ctrl-C or SIGTERM during
a step longer than torchrun's own 30 s grace, under a stalled (SIGSTOPped) peer, twice,
and during start-up (mp_offload/runtime/stopping.py, scripts/torchrun_quiet.py)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import HANG_TIMEOUT, ROOT
from pretrain_runs import (
    ERROR,
    PRETRAIN,
    TINY,
    assert_one_line,
    pretrain_env,
    run_pretrain,
    snapshot,
)

from mp_offload.checkpoint import read_latest

QUIET = os.path.join(ROOT, "scripts", "torchrun_quiet.py")
GRACE = 5  # MP_OFFLOAD_STOP_GRACE_S in these tests: seconds a rank waits for a stalled peer


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo.extend(children.get(out[-1], []))
    return out


def _kill_all(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_sigterm_under_a_stopped_peer_ends_every_rank_within_the_grace(tmp_path):
    """Rank 1 of 2 is SIGSTOPped at iteration 5; SIGTERM to the launcher. Rank 0, waiting
    in a collective for it, gives up after the grace period with one line naming rank 1
    and the iteration; the launcher kills the stopped rank; no process is left and the
    latest checkpoint (iteration 4) is untouched. (Before: rank 0 waited for
    --distributed-timeout-minutes, 10 min.)"""
    ck = str(tmp_path / "ck")
    job = subprocess.Popen(
        [sys.executable, QUIET, "--standalone", "--nproc-per-node", "2", PRETRAIN, *TINY]
        + ["--mock-data", "--train-iters", "1000", "--save-interval", "2", "--save", ck],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=pretrain_env(MP_OFFLOAD_FAULT_STOP="1:5", MP_OFFLOAD_STOP_GRACE_S=str(GRACE)),
    )  # fmt: skip
    try:
        deadline, stopped = time.time() + 240, []
        while not stopped and time.time() < deadline and job.poll() is None:
            time.sleep(0.5)
            stopped = [p for p in _tree(job.pid) if _state(p) == "T"]
        assert stopped, "rank 1 never reached iteration 5"
        processes, latest = _tree(job.pid), read_latest(ck)
        before = snapshot(ck)
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=GRACE + 60)  # not the 10 minutes of the collective
    finally:
        left = [p for p in _tree(job.pid) if _state(p) not in (None, "Z")]
        _kill_all(_tree(job.pid))
    errors = [ln for ln in err.splitlines() if ln.startswith(ERROR)]
    assert len(errors) == 1, err[-3000:]
    assert (
        f"SIGTERM asked this job to stop during iteration 5, but rank 1 stopped answering: "
        f"no heartbeat for {GRACE} s" in errors[0]
    ), errors
    assert f"the latest checkpoint in --save {ck} is iteration 4, as it was" in errors[0]
    assert "is stopped (SIGSTOP) and cannot stop: killed it" in err, err[-3000:]
    assert job.returncode == 1 and "Traceback" not in err, (job.returncode, err[-3000:])
    assert latest == 4 and read_latest(ck) == 4 and snapshot(ck) == before
    assert not left and not [p for p in processes if _state(p) not in (None, "Z")]


@pytest.mark.slow
def test_ctrl_c_through_the_quick_start_script_during_a_60_s_step_saves_that_step(tmp_path):
    """The README's quick start, its step 3 made to last 60 s (longer than torchrun's own
    30 s before it SIGKILLs), Ctrl-C (SIGINT to the process group) during it: the step
    finishes, its checkpoint is written, and the script ends with the project's lines.
    (Before: torchrun killed the ranks after 30 s, nothing was saved, nothing said.)"""
    run = tmp_path / "run"
    env = pretrain_env(
        SKIP_SETUP="1", RUN_DIR=str(run), TRAIN_ITERS="1000", NPROC="2", TP="1",
        PYTHON=sys.executable, PYTHONPATH=ROOT, MP_OFFLOAD_FAULT_SLOW="3:60",
    )  # fmt: skip
    job = subprocess.Popen(
        ["bash", "scripts/pretrain_gpt_tiny_cpu.sh", "--num-layers", "2", "--hidden-size", "64"]
        + ["--eval-iters", "2", "--save-interval", "2", "--log-json", str(tmp_path / "log")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # a terminal's Ctrl-C reaches the whole process group
    )  # fmt: skip
    try:
        for line in job.stdout:
            if line.startswith("fault: the step of iteration 3 lasts 60 s more"):
                break
        time.sleep(1)
        os.killpg(job.pid, signal.SIGINT)
        rest, _ = job.communicate(timeout=300)
    finally:
        _kill_all(_tree(job.pid))
    assert job.returncode == 130, rest[-3000:]
    assert "stop requested: exiting after iteration 3" in rest and "Traceback" not in rest, rest
    assert "   checkpoint  " in rest and f"{run}/ckpt (iteration 3)" in rest, rest[-2000:]
    assert (
        rest.rstrip()
        .splitlines()[-1]
        .startswith("pretrain_gpt_tiny_cpu.sh: training stopped (exit 130) after")
    ), rest[-1000:]
    assert read_latest(str(run / "ckpt")) == 3
    with open(tmp_path / "log") as f:
        trained = [json.loads(ln)["iteration"] for ln in f if '"loss"' in ln]
    assert trained[-1] == 3, trained


@pytest.mark.slow
def test_a_second_signal_stops_at_once_saving_nothing_more(tmp_path):
    """Ctrl-C twice during a 60 s step (no launcher): the second ends the run at once,
    with one line; the checkpoint of iteration 2 stays the latest."""
    ck = str(tmp_path / "ck")
    job = subprocess.Popen(
        [sys.executable, PRETRAIN, *TINY, "--mock-data", "--train-iters", "1000"]
        + ["--save-interval", "2", "--save", ck],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=pretrain_env(MP_OFFLOAD_FAULT_SLOW="3:60"),
    )  # fmt: skip
    try:
        for line in job.stderr:
            if line.startswith("fault: the step of iteration 3"):
                break
        job.send_signal(signal.SIGINT)
        time.sleep(1)
        job.send_signal(signal.SIGINT)
        _, err = job.communicate(timeout=HANG_TIMEOUT)  # the line says it did not wait
    finally:
        job.kill()
    res = subprocess.CompletedProcess(job.args, job.returncode, "", err)
    assert_one_line(
        res,
        f"SIGINT again during iteration 3: stopping now, no checkpoint written (the latest "
        f"checkpoint in --save {ck} is iteration 2, as it was)",
        code=130,
    )
    assert read_latest(ck) == 2


def _catches(pid: int, sig: int) -> bool:
    """``pid`` has a handler for ``sig`` (its SigCgt mask in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(ln.split()[1] for ln in f if ln.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(mask, 16) >> (sig - 1) & 1)


def _signalled_when(job, ready, sig) -> subprocess.CompletedProcess:
    try:
        deadline = time.time() + 120
        while not ready() and time.time() < deadline:
            time.sleep(0.01)
        job.send_signal(sig)
        _, err = job.communicate(timeout=HANG_TIMEOUT)
    finally:
        job.kill()
    return subprocess.CompletedProcess(job.args, job.returncode, "", err)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_signal_during_start_up_is_one_line():
    """SIGTERM while torch is being imported, and to a rank waiting alone at the
    rendezvous: one line, exit 143, not the silent death of the default handler (nor,
    for SIGINT, a KeyboardInterrupt traceback)."""
    from dist_helpers import free_port

    run = [sys.executable, PRETRAIN, *TINY, "--mock-data", "--train-iters", "4"]
    job = subprocess.Popen(
        run,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=pretrain_env(),
    )
    res = _signalled_when(job, lambda: _catches(job.pid, signal.SIGTERM), signal.SIGTERM)
    assert_one_line(res, "SIGTERM came during start-up: stopping now, nothing trained", code=143)
    lone = dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    job = subprocess.Popen(
        run,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=pretrain_env(**lone),
    )
    res = _signalled_when(
        job, lambda: "waiting for 2 ranks" in job.stderr.readline(), signal.SIGTERM
    )
    assert_one_line(
        res,
        "SIGTERM came during the rendezvous: stopping now, no checkpoint written (no --save: "
        "nothing was being saved)",
        code=143,
    )


def test_a_bad_stop_grace_is_one_line():
    res = run_pretrain(*TINY, "--mock-data", "--train-iters", "2", MP_OFFLOAD_STOP_GRACE_S="0")
    assert_one_line(res, "MP_OFFLOAD_STOP_GRACE_S='0': give the seconds a stopping rank", code=2)
