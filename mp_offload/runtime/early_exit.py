"""Ending a job on an error every rank reached, before the process group exists and
without torch: ``pretrain_gpt.py`` checks its flags with this before importing torch (a
torch import takes seconds, a minute on a loaded machine), and ``distributed.fail`` ends
that way too until the group exists.

The line is printed once for the job, by the reporting rank (LOCAL_RANK 0, else RANK 0:
one line per node's log); the other ranks print nothing and wait for the launcher to stop
them once the reporting rank has exited, so that none ends the job before the reason is
out.
"""

from __future__ import annotations

import os
import signal
import sys
import time

PROG = "pretrain_gpt.py"

# How long a rank that is not the reporting one waits for the launcher to stop it.
QUIET_RANK_WAIT_S = 30.0


def reporting_rank() -> bool:
    """LOCAL_RANK 0 (else RANK 0); True for a process without a launcher."""
    for name in ("LOCAL_RANK", "RANK"):
        if name in os.environ:
            return int(os.environ[name]) == 0
    return True


def say(msg: str) -> None:
    """Write ``msg`` to stderr as one write(2) per line (ranks share the launcher's pipe,
    and print()'s separate writes of text and newline can interleave)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(2, "".join(f"{line}\n" for line in msg.splitlines()).encode())
    except (OSError, ValueError):  # the launcher (and its pipe) may be gone
        pass


def wait_for_the_launcher(code: int) -> None:
    """A quiet rank of a multi-process job: wait (at most ``QUIET_RANK_WAIT_S``) for the
    launcher's SIGTERM, which follows the reporting rank's exit."""
    if reporting_rank() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    signal.signal(signal.SIGTERM, lambda *_: os._exit(code))
    time.sleep(QUIET_RANK_WAIT_S)


def refuse(msg: str, code: int = 2) -> None:
    """Exit with ``code``, ``msg`` (every rank reached it) printed once for the job as
    ``pretrain_gpt.py: error: ...``, one line per line of ``msg``."""
    if reporting_rank():
        say("\n".join(f"{PROG}: error: {line}" for line in msg.splitlines() or [""]))
    wait_for_the_launcher(code)
    sys.exit(code)


def finished() -> None:
    """End a process whose run finished (its process group destroyed, its files closed)
    at once: the C++ runtime's teardown at interpreter exit has aborted a rank now and
    then ("terminate called without an active exception", exit -6) after a complete
    run, which torchrun then reports as the job's failure. Only under torchrun: a plain
    process (a dry run, a caller that reads its own figures at exit) exits as usual."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
