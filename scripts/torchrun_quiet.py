"""Run torchrun with its own failure report filtered out of stderr (scripts/common.sh),
and own how the job stops.

torchrun follows every clean one-line error of pretrain_gpt.py with its own log lines and
a ChildFailedError traceback (~55 lines), and a Ctrl-C with a SignalException traceback;
the project's line is then buried. This passes the workers' output through unchanged and
drops only torchrun's: its logger lines (``E1201 20:19:45.43 123 .../torch/distributed/
elastic/...``), its start-up banner (a blank line, then the OMP_NUM_THREADS notice between
two rules of asterisks: the project sets its own threads), and a traceback whose first
frame is the launcher's (``File "<frozen runpy>"``) up to the end of its failure table. A
worker's own traceback (a bug) is kept.

Stopping. torchrun runs in a session of its own, so a Ctrl-C (SIGINT to the terminal's
process group) or a SIGTERM reaches it once, from here; this says what happens next in
one line and passes the signal on; torchrun passes it to every worker. Each worker
finishes its step, saves and exits (mp_offload/runtime/stopping.py), however long the step takes:
torchrun is given TORCH_ELASTIC_SHUTDOWN_TIMEOUT = an hour (its own default, 30 s, would
SIGKILL a long step unsaved), unless the caller set it. A worker left stopped (SIGSTOP)
after others have exited can neither save nor exit: it is killed, with a line naming it.
A second signal kills every worker at once, with a line. torchrun dies with this process
(the parent-death signal), and a worker torchrun had to kill is named, not hidden.

Exit status: torchrun's, except after a stop signal: 128 + the signal (130 for Ctrl-C,
the shell's convention), or 1 if a worker reported an error.

    python scripts/torchrun_quiet.py TORCHRUN_ARGS...
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time

_LOGGER = re.compile(r"^[EWIDF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ .*torch/distributed/")
_BANNER = re.compile(r"^\*{20,}$")
_NOTICE = re.compile(r"^Setting OMP_NUM_THREADS environment variable for each process")
_ERROR = re.compile(r"^\S+: error: ")
_KILLED = re.compile(r"Unable to shutdown process (\d+) via")
PROG = "torchrun_quiet.py"
SHUTDOWN_TIMEOUT_S = 3600  # torchrun's wait for stopping workers before it SIGKILLs them
STOP_GRACE_ENV = "MP_OFFLOAD_STOP_GRACE_S"  # the workers' wait for a stalled peer


class Filter:
    """Line by line: True for the lines to show."""

    def __init__(self):
        self.held: str | None = None  # a "Traceback" line, until its first frame is seen
        self.in_report = False  # inside torchrun's traceback and failure table
        self.rules = 0  # "=====" lines seen in the failure table (it ends with the 3rd)
        self.errors = 0
        self.started = False  # a line has been shown (a blank line before that is the banner's)

    def feed(self, line: str) -> list[str]:
        text = line.rstrip("\n")
        if self.in_report:
            self.rules += text.startswith("=" * 20)
            self.in_report = self.rules < 3
            return []
        if self.held is not None:
            held, self.held = self.held, None
            if text.lstrip().startswith('File "<frozen runpy>"'):
                self.in_report, self.rules = True, 0
                return []
            return [held, *self.feed(line)]
        if text == "Traceback (most recent call last):":
            self.held = line
            return []
        if _LOGGER.match(text) or _BANNER.match(text) or _NOTICE.match(text):
            return []
        if not text and not self.started:
            return []
        self.started = True
        self.errors += bool(_ERROR.match(text))
        return [line]

    def flush(self) -> list[str]:
        held, self.held = self.held, None
        return [held] if held is not None else []


def say(text: str) -> None:
    sys.stderr.write(f"{PROG}: {text}\n")
    sys.stderr.flush()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, T, Z...), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _rank(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        return f"rank {env[b'RANK'].decode()}"
    except (OSError, KeyError):
        return "a worker"


def _kill(pid: int) -> None:
    for kill in (os.killpg, os.kill):  # each worker leads a process group of its own
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


class Stop:
    """The stop request: the first signal goes to torchrun; a second kills the workers."""

    def __init__(self, job: subprocess.Popen):
        self.job, self.signal, self.workers = job, None, set()

    def handler(self, signum, frame) -> None:
        self.workers.update(_children(self.job.pid))
        name = signal.Signals(signum).name
        if self.signal is None:
            self.signal = signum
            grace = os.environ.get(STOP_GRACE_ENV, "60")
            say(
                f"{name}: stopping: each rank finishes its step, saves (with --save) and "
                f"exits; a rank whose peers stop answering gives up after {grace} s, without "
                f"saving ({STOP_GRACE_ENV}); {name} again stops at once, without saving"
            )
            self.job.send_signal(signum)
            threading.Thread(target=self._reap_stopped, daemon=True).start()
            return
        alive = [w for w in self.workers if _state(w) not in (None, "Z")]
        for w in alive:
            _kill(w)
        say(
            f"{name} again: killed {len(alive)} worker(s) at once; the step in flight is "
            f"not saved (the latest checkpoint is as it was)"
        )

    def _reap_stopped(self) -> None:
        """Once a worker has exited, one that is stopped (SIGSTOP) is killed: its peers
        are gone, it can neither save nor exit, and torchrun would wait an hour."""
        while self.job.poll() is None:
            self.workers.update(_children(self.job.pid))
            states = {w: _state(w) for w in self.workers}
            alive = [w for w, st in states.items() if st not in (None, "Z")]
            if len(alive) < len(states) and alive and all(states[w] == "T" for w in alive):
                for w in alive:
                    say(f"{_rank(w)} (pid {w}) is stopped (SIGSTOP) and cannot stop: killed it")
                    _kill(w)
            time.sleep(0.5)


def _die_with_parent() -> None:
    """In torchrun's process: SIGTERM when this launcher dies (Linux), so that a kill -9
    of the launcher still stops the workers, saving."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    env = dict(os.environ)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *argv],
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=env,
        start_new_session=True,  # signals reach torchrun from here, once
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )
    stop = Stop(job)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop.handler)
    keep = Filter()
    for line in job.stderr:
        killed = _KILLED.search(line)
        if killed:
            say(
                f"{_rank(int(killed.group(1)))} (pid {killed.group(1)}) had not stopped "
                f"{env['TORCH_ELASTIC_SHUTDOWN_TIMEOUT']} s after the stop request: torchrun "
                f"killed it; what it had not saved is lost"
            )
        for out in keep.feed(line):
            sys.stderr.write(out)
            sys.stderr.flush()
    for out in keep.flush():
        sys.stderr.write(out)
    code = job.wait()
    if stop.signal is not None:
        return 1 if keep.errors else 128 + stop.signal
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
