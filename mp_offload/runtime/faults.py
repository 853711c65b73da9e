"""Fault injection for the tests: the one place where the code may kill its own process.

Both hooks read an environment variable and do nothing without it:
  MP_OFFLOAD_FAULT_ONCE=<marker file>:<iteration>   kill this rank after that iteration,
                                                    once (the marker file remembers it)
  MP_OFFLOAD_CKPT_FAULT=<point>[:<iteration>]       kill the saving process at a named
                                                    point of a checkpoint save
  MP_OFFLOAD_FAULT_STALL=<rank>:<iteration>:<secs>  stall that global rank (RANK) after
                                                    that iteration, as a hung rank would
                                                    (a SIGTERM ends the stall)
  MP_OFFLOAD_CKPT_ENOSPC=<point>[:<iteration>]      raise ENOSPC (a full disk) there instead
  MP_OFFLOAD_FAULT_STOP=<rank>:<iteration>          SIGSTOP that global rank as it starts
                                                    that iteration (the others then wait
                                                    in the TP and DP groups' collectives)
  MP_OFFLOAD_FAULT_SLOW=<iteration>:<secs>          make that iteration's step last secs
                                                    longer on every rank (a long step: a
                                                    signal does not shorten it); rank 0
                                                    says so on stderr as it starts
"""

from __future__ import annotations

import errno
import os
import signal
import time


def after_iteration(iteration: int) -> None:
    spec = os.environ.get("MP_OFFLOAD_FAULT_ONCE")
    if spec:
        marker, at = spec.rsplit(":", 1)
        if iteration == int(at) and _claim(marker):
            os._exit(13)
    stall = os.environ.get("MP_OFFLOAD_FAULT_STALL")
    if stall:
        rank, at, seconds = stall.split(":")
        if iteration == int(at) and os.environ.get("RANK", "0") == rank:
            _stall(float(seconds))


def _stall(seconds: float) -> None:
    """Sleep, but end early on SIGTERM and pass it on to the loop's own handler: torchrun
    SIGTERMs the other workers once one has failed and SIGKILLs them only 30 s later
    (whatever --shutdown-timeout says), a wait the tests would spend for nothing."""
    asked: list[int] = []
    loop_handler = signal.signal(signal.SIGTERM, lambda *_: asked.append(1))
    try:
        deadline = time.monotonic() + seconds
        while not asked and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGTERM, loop_handler)
    if asked and callable(loop_handler):
        loop_handler(signal.SIGTERM, None)


def before_iteration(iteration: int) -> None:
    spec = os.environ.get("MP_OFFLOAD_FAULT_STOP")
    if spec:
        rank, at = spec.split(":")
        if iteration == int(at) and os.environ.get("RANK", "0") == rank:
            os.kill(os.getpid(), signal.SIGSTOP)
    spec = os.environ.get("MP_OFFLOAD_FAULT_SLOW")
    if spec:
        at, seconds = spec.split(":")
        if iteration == int(at):
            if os.environ.get("RANK", "0") == "0":
                os.write(2, f"fault: the step of iteration {at} lasts {seconds} s more\n".encode())
            deadline = time.monotonic() + float(seconds)
            while time.monotonic() < deadline:  # as compute would: signals do not end it
                time.sleep(max(0.0, deadline - time.monotonic()))


def checkpoint_point(point: str, iteration: int) -> None:
    spec = os.environ.get("MP_OFFLOAD_CKPT_FAULT", "")
    where, _, at = spec.partition(":")
    if where == point and (not at or int(at) == iteration):
        os._exit(17)
    where, _, at = os.environ.get("MP_OFFLOAD_CKPT_ENOSPC", "").partition(":")
    if where == point and (not at or int(at) == iteration):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _claim(marker: str) -> bool:
    """True for the one process that creates ``marker`` (O_EXCL: two ranks reaching the
    iteration together cannot both see it missing and both die, leaving no survivor)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
