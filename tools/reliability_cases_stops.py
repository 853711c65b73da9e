"""The reliability probe's cases of stops, divergence and memory: a diverged fp16 step
never published, a run too big for this host refused, Ctrl-C during a long step, SIGTERM
under a stopped peer, a second signal, a signal at start-up (see
tools/reliability_cases.py). The runners of the cases that need more than one command
are here too.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

from reliability_runs import ROOT, TINY, Case, environment, expand, free_port, pretrain

QUIET = os.path.join(ROOT, "scripts", "torchrun_quiet.py")
GRACE = "5"  # MP_OFFLOAD_STOP_GRACE_S in these cases
FP16 = [*TINY, "--fp16", "--save-interval", "1", "--keep-checkpoints", "1", "--save", "$D/ck-div"]


def _sh(*cmd) -> list:
    return ["bash", "-c", " && ".join(cmd)]


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _tree(pid: int) -> list[int]:
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(
                    int(entry)
                )
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo.extend(children.get(out[-1], []))
    return out


def _start(case, d, **popen):
    return subprocess.Popen(
        expand(case.cmd, d),
        env=environment({k: v.replace("$D", d) for k, v in case.env.items()}),
        cwd=ROOT,
        text=True,
        **popen,
    )


def _finish(job, timeout):
    """(rc, stdout, stderr, problem) once ``job`` ends; "hang" after ``timeout``."""
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in _tree(job.pid):
            os.kill(p, signal.SIGKILL)
        out, err = job.communicate()
        return None, out or "", err or "", "hang"
    return job.returncode, out or "", err or "", None


# ------------------------------------------------------------------ runners and checks
def diverged_not_published(d, rc, out, err):
    import torch

    from mp_offload.checkpoint import list_iterations, read_latest
    from mp_offload.checkpoint.on_disk import iter_dir

    ck = f"{d}/ck-div"
    for it in list_iterations(ck):
        for where, _, names in os.walk(iter_dir(ck, it)):
            for n in (n for n in names if n.endswith(".pt")):
                state = torch.load(os.path.join(where, n), weights_only=True)
                flat = [v for v in state.values() if isinstance(v, torch.Tensor)]
                flat += [t for v in state.values() if isinstance(v, list) for t in v]
                if not all(bool(t.isfinite().all()) for t in flat if t.is_floating_point()):
                    return f"silent: {n} of iteration {it} holds inf or NaN"
    latest = read_latest(ck)
    return None if latest == 3 else f"data lost: the latest checkpoint is {latest}, not 3"


def stopped_peer(case, d):
    """Rank 1 SIGSTOPped at iteration 5, then SIGTERM to the launcher: every process must
    be gone within the grace and a minute, the latest checkpoint (4) unchanged."""
    from mp_offload.checkpoint import read_latest

    job = _start(case, d, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline, stopped = time.time() + case.timeout, []
    while not stopped and time.time() < deadline and job.poll() is None:
        time.sleep(0.5)
        stopped = [p for p in _tree(job.pid) if _state(p) == "T"]
    processes = _tree(job.pid)
    job.send_signal(signal.SIGTERM)
    rc, out, err, problem = _finish(job, float(GRACE) + 60)
    left = [p for p in processes if _state(p) not in (None, "Z")]
    if left and not problem:
        problem = f"hang: {len(left)} process(es) left"
    if not problem and read_latest(f"{d}/ck-stopped") != 4:
        problem = f"data lost: the latest checkpoint is {read_latest(f'{d}/ck-stopped')}"
    return rc, out, err, problem


def quick_start_ctrl_c(case, d):
    """The quick-start script, Ctrl-C to its process group during the 60 s step 3: the
    step must be saved (exit 130 is the script's; judged as a run that must work)."""
    from mp_offload.checkpoint import read_latest

    job = _start(case, d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    for line in job.stdout:
        if line.startswith("fault: the step of iteration 3"):
            break
    time.sleep(1)
    os.killpg(job.pid, signal.SIGINT)
    rc, out, err, problem = _finish(job, case.timeout)
    if not problem and rc != 130:
        problem = f"other: exit {rc}, not 130"
    latest = read_latest(f"{d}/qs/ckpt")
    if not problem and latest != 3:
        problem = f"data lost: the latest checkpoint is {latest}, not 3 (the step in flight)"
    return 0 if rc == 130 else rc, out, err, problem


def signalled(after: str, sig: int, twice: bool = False):
    """A runner: ``sig`` (twice: again a second later) once stderr shows ``after``."""

    def run(case, d):
        job = _start(case, d, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        seen = []
        for line in job.stderr:
            seen.append(line)
            if after in line:
                break
        job.send_signal(sig)
        if twice:
            time.sleep(1)
            job.send_signal(sig)
        rc, out, err, problem = _finish(job, case.timeout)
        return rc, out, "".join(seen) + err, problem

    return run


def _too_big_layers() -> str:
    """Layers of a 4096-wide GPT whose fp32 master, moments and gradient alone (16 B per
    parameter) need ten times this machine's free host memory."""
    sys.path.insert(0, ROOT)
    from mp_offload.memory_check import host_available

    free = host_available()[0] or 256 << 30
    return str(max(1, round(10 * free / (12 * 4096 * 4096 * 16))))


# ------------------------------------------------------------------------ the cases
def stop_cases() -> list:
    """Divergence never published, memory refused, and what a stop signal guarantees."""
    run = " ".join(pretrain(*FP16))  # $D is replaced before bash reads it
    quick = ["bash", "scripts/pretrain_gpt_tiny_cpu.sh", "--num-layers", "2", "--hidden-size",
             "64", "--eval-iters", "2", "--save-interval", "2"]  # fmt: skip
    quick_env = dict(SKIP_SETUP="1", RUN_DIR="$D/qs", TRAIN_ITERS="1000", NPROC="2", TP="1",
                     MP_OFFLOAD_FAULT_SLOW="3:60")  # the script's python3: this one  # fmt: skip
    slow = pretrain(*TINY, "--train-iters", "1000", "--save-interval", "2", "--save", "$D/ck-twice")
    big = ["--num-layers", _too_big_layers(), "--hidden-size", "4096", "--num-attention-heads",
           "32", "--seq-length", "1024", "--micro-batch-size", "1", "--train-iters", "10",
           "--mock-data", "--bf16", "--cpu-offload"]  # fmt: skip
    fake = _sh("printf 'MemAvailable: 1 kB\\n' > $D/meminfo-1k", shlex.join(pretrain(*TINY)))
    c = Case
    return [
        c("checkpoints", "fp16: a diverged step after resuming is not published (keep 1)",
          _sh(f"{run} --train-iters 3", f"{run} --load $D/ck-div --train-iters 12 --lr 1e10"),
          "the checkpoint of iteration 4 was not saved: the weights", code=1,
          check=diverged_not_published),
        c("runtime", "a model 10x this host's free memory", pretrain(*big),
          "GiB of host memory (1 x ", timeout=300),
        c("runtime", "MemAvailable faked at 1 kB", fake, "but 0.0 MiB is available (MemAvailable)",
          env={"MP_OFFLOAD_MEMINFO": "$D/meminfo-1k"}),
        c("runtime", "--skip-memory-check gets past it", _sh(fake[2] + " --skip-memory-check"),
          "memory check skipped (--skip-memory-check)", expect="ok",
          env={"MP_OFFLOAD_MEMINFO": "$D/meminfo-1k"}),
        c("runtime", "SIGTERM under a SIGSTOPped peer (torchrun_quiet 2)",
          [sys.executable, QUIET, "--standalone", "--nproc-per-node=2", pretrain()[1], *TINY,
           "--train-iters", "1000", "--save-interval", "2", "--save", "$D/ck-stopped"],
          "but rank 1 stopped answering: no heartbeat for 5 s", code=1, first=False,
          env={"MP_OFFLOAD_FAULT_STOP": "1:5", "MP_OFFLOAD_STOP_GRACE_S": GRACE},
          runner=stopped_peer, timeout=240),
        c("runtime", "Ctrl-C through the quick-start script during a 60 s step", quick,
          "stop requested: exiting after iteration 3", expect="ok", env=quick_env,
          runner=quick_start_ctrl_c, timeout=300),
        c("runtime", "a second Ctrl-C stops at once", slow, "SIGINT again during iteration 3",
          code=130, env={"MP_OFFLOAD_FAULT_SLOW": "3:60"}, first=False, timeout=50,
          runner=signalled("fault: the step of iteration 3", signal.SIGINT, twice=True)),
        c("runtime", "SIGTERM at the rendezvous", pretrain(*TINY),
          "SIGTERM came during the rendezvous: stopping now", code=143, first=False,
          env=dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())),
          runner=signalled("waiting for 2 ranks", signal.SIGTERM), timeout=60),
        c("configuration", "MP_OFFLOAD_STOP_GRACE_S=0", pretrain(*TINY),
          "MP_OFFLOAD_STOP_GRACE_S='0': give the seconds", env={"MP_OFFLOAD_STOP_GRACE_S": "0"}),
    ]  # fmt: skip
