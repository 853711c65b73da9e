"""Ranks that wait alone, stall, are stopped or lose their launcher end as one named line
on every rank, never a hang; the kill-once fault claims exactly one rank. The rest of
docs/RELIABILITY.md's promises are in test_reliability.py; the tiny run and the checks
both share are in pretrain_runs.py.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from dist_helpers import free_port, run_distributed
from helpers import ROOT
from pretrain_runs import ERROR, PRETRAIN, TINY, assert_one_line, pretrain_env, run_pretrain


# --------------------------------------------------------------------- 5. rendezvous
@pytest.mark.slow
def test_lone_rank_times_out_with_a_line():
    """WORLD_SIZE=2 but one process: it says what it waits for, then gives up with a line
    after --distributed-timeout-minutes instead of waiting forever."""
    port = free_port()
    t0 = time.time()
    res = run_pretrain(
        *TINY,
        "--mock-data",
        "--train-iters",
        "2",
        "--distributed-timeout-minutes",
        "0.05",
        timeout=120,
        WORLD_SIZE="2",
        RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    line = assert_one_line(
        res,
        f"timed out after 3 s waiting for 2 ranks at 127.0.0.1:{port} "
        f"(1 of 2 joined; this is rank 0)",
        code=1,
    )
    assert f"pretrain_gpt.py: waiting for 2 ranks at 127.0.0.1:{port}" in res.stderr, line
    assert time.time() - t0 < 100


@pytest.mark.slow
def test_a_stalled_rank_is_named_by_the_ranks_that_waited_for_it():
    """Rank 1 of 2 sleeps in iteration 3: rank 0's collective times out after
    --distributed-timeout-minutes, and the one line names rank 1 (gloo does not)."""
    t0 = time.time()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            PRETRAIN,
            *TINY,
            "--mock-data",
            "--train-iters",
            "6",
            "--distributed-timeout-minutes",
            "0.1",
        ],
        capture_output=True,
        text=True,
        timeout=200,
        env=pretrain_env(MP_OFFLOAD_FAULT_STALL="1:3:90"),
        cwd=ROOT,
    )
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith(ERROR)]
    assert res.returncode != 0 and len(errors) == 1, (res.returncode, res.stderr[-3000:])
    assert (
        "timed out after 6 s during iteration 3 waiting for rank 1, which did not reach it"
    ) in errors[0], errors[0]
    # torchrun's own failure report (with its traceback) may follow; none of ours
    assert "mp_offload/" not in res.stderr and 'pretrain_gpt.py", line' not in res.stderr
    assert time.time() - t0 < 80  # not the stalled rank's 90 s


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (torchrun puts each worker in its own session)."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo.extend(children.get(p, []))
    for p in seen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def _initialize_twice(rank, world):
    from mp_offload import parallel_state as ps

    ps.initialize_model_parallel(1)
    with pytest.raises(ps.ParallelStateError, match="initialize_model_parallel called twice"):
        ps.initialize_model_parallel(1)


def test_a_second_initialize_model_parallel_is_refused():
    run_distributed(_initialize_twice, 1)


@pytest.mark.slow
def test_a_rank_stopped_at_tp2_dp2_is_named_and_ends_the_job():
    """SIGSTOP of rank 1 at TP=2 x DP=2: the TP and DP groups have the flag's timeout too
    (they kept gloo's 30 minutes), so the job ends within 90 s with a line naming rank 1."""
    t0 = time.time()
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        + ["--nproc-per-node", "4", PRETRAIN, *TINY, "--mock-data", "--train-iters", "8"]
        + ["--tensor-model-parallel-size", "2", "--distributed-timeout-minutes", "0.25"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=pretrain_env(MP_OFFLOAD_FAULT_STOP="1:3"),
        cwd=ROOT,
    )
    try:
        _, stderr = job.communicate(timeout=150)
    finally:
        _kill_tree(job.pid)  # the stopped rank too, should the job have hung
    res = subprocess.CompletedProcess(job.args, job.returncode, "", stderr)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith(ERROR)]
    assert res.returncode != 0 and len(errors) == 1, (res.returncode, res.stderr[-3000:])
    assert "timed out after 15 s during iteration 3 waiting for rank 1," in errors[0], errors
    assert time.time() - t0 < 90


# ------------------------------------------------------------ 6. the launcher dies
LAUNCHER = """
import subprocess, sys, time
out = open(sys.argv[1], "w")
worker = subprocess.Popen(sys.argv[2:], stdout=out, stderr=subprocess.STDOUT)
print(worker.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaps (it is not our child)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_worker_exits_when_its_launcher_is_killed(tmp_path):
    """kill -9 of the launcher: the worker gets SIGTERM, finishes its step, saves, exits."""
    from mp_offload.checkpoint import read_latest

    log, ck = tmp_path / "log.jsonl", tmp_path / "ck"
    cmd = [
        sys.executable,
        PRETRAIN,
        *TINY,
        "--mock-data",
        "--train-iters",
        "100000",
        "--log-json",
        str(log),
        "--save",
        str(ck),
    ]
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "out"), *cmd],
        env=pretrain_env(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = int(launcher.stdout.readline())
    try:
        deadline = time.time() + 180
        while time.time() < deadline and (not log.exists() or len(log.read_text()) < 2000):
            time.sleep(0.5)
        assert log.exists(), (tmp_path / "out").read_text()[-2000:]
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.time() + 60
        while time.time() < deadline and not _gone(worker):
            time.sleep(0.2)
        assert _gone(worker), "the worker went on training after its launcher died"
    finally:
        launcher.kill()
        if not _gone(worker):
            os.kill(worker, signal.SIGKILL)
    out = (tmp_path / "out").read_text()
    last = [json.loads(line)["iteration"] for line in open(log) if '"loss"' in line][-1]
    assert "stop requested: exiting after iteration" in out, out[-2000:]
    assert read_latest(str(ck)) == last, "the finished step must be saved"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_process_forked_after_the_import_takes_its_forker_as_its_launcher():
    """A fork server's worker (the tests' ranks) is forked after the import recorded the
    parent: its launcher is the process that forked it, not that one's parent."""
    from mp_offload.runtime import lifeline

    pid = os.fork()
    if pid == 0:
        os._exit(0 if lifeline._PARENT == os.getppid() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child kept its forker's parent"


def test_the_kill_once_fault_kills_exactly_one_of_the_ranks_that_race_for_it(tmp_path):
    """MP_OFFLOAD_FAULT_ONCE: ranks reaching the iteration together must not both find the
    marker missing and both die (the probe's "a rank is killed" case then had no survivor
    to name the lost rank). Many threads race for one marker: exactly one claims it."""
    import threading

    from mp_offload.runtime import faults

    marker = str(tmp_path / "killed-once")
    start, wins = threading.Barrier(16), []

    def rank():
        start.wait()
        wins.append(faults._claim(marker))

    threads = [threading.Thread(target=rank) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wins) == [False] * 15 + [True]
