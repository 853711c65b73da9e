"""Workers end with their launcher (Linux): the parent-death signal.

A launcher killed with SIGKILL (``kill -9`` of torchrun, an OOM kill) cannot stop its
workers; they would go on training unsupervised, holding the GPUs. ``exit_with_parent``
asks the kernel to send SIGTERM when the parent dies: the training loop then finishes
its step, saves (with --save) and exits, as for a scheduler's SIGTERM.

The request only covers a parent that is still alive when it is made. The parent is
recorded when this module is imported (``pretrain_gpt.py`` imports it before torch,
which takes seconds), and ``exit_with_parent`` checks it is still the parent after the
request, so a launcher that died in between is noticed too.

No torch here: importing this module must be instant. For the same reason it also holds
``stop_while_starting``: a Ctrl-C or SIGTERM during the slow imports that follow ends the
process with one line, until the run installs its own handlers (``stopping.py``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PARENT = os.getppid()


def _forked() -> None:
    """A process forked after the import (a fork server's worker) has its forker as parent."""
    global _PARENT
    _PARENT = os.getppid()


os.register_at_fork(after_in_child=_forked)


def launched() -> bool:
    """Started by a launcher (torchrun and torch.multiprocessing set LOCAL_RANK). A plain
    ``python pretrain_gpt.py`` under nohup must outlive its shell, so it is left alone."""
    return "LOCAL_RANK" in os.environ


def exit_with_parent(sig: int = signal.SIGTERM) -> str | None:
    """Arm the parent-death signal; a reason to stop now when the launcher is already
    gone, else None (also where there is no such signal: not Linux, not launched)."""
    if not sys.platform.startswith("linux") or not launched():
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return None
    except (OSError, AttributeError):
        return None
    if os.getppid() != _PARENT:
        return (
            f"the launcher (pid {_PARENT}) exited before this worker started; "
            f"stopping (nothing trained yet)"
        )
    return None


def _is_reporting_rank() -> bool:
    """LOCAL_RANK 0, else RANK 0 (``distributed.is_reporting_rank`` before torch)."""
    for name in ("LOCAL_RANK", "RANK"):
        if name in os.environ:
            return os.environ[name] == "0"
    return True


def stop_while_starting(prog: str = "pretrain_gpt.py") -> None:
    """SIGINT/SIGTERM until the run's own handlers take over: one line (once per node),
    exit 128 + the signal, instead of a KeyboardInterrupt traceback from inside an import
    or the silent death of SIGTERM's default."""

    def handler(signum, frame):
        if _is_reporting_rank():
            name = signal.Signals(signum).name
            line = f"{prog}: error: {name} came during start-up: stopping now, nothing trained\n"
            os.write(2, line.encode())
        os._exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
