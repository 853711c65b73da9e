"""How a run stops when asked: SIGINT (Ctrl-C) or SIGTERM (a scheduler, the launcher, the
launcher's death through ``lifeline``).

During the loop (``StopFlag``) the step in flight finishes, however long it takes; at its
end the ranks agree (one all-reduce), save that step (with --save) and exit. A second
signal stops a rank at once, saving nothing more.

A peer that stalls (or was stopped with SIGSTOP) would keep the others in a collective
until --distributed-timeout-minutes. So each rank of a job of several runs a watchdog
thread: it wakes on the signal itself (Python's wakeup fd), even while the main thread
waits inside a collective, and it keeps a heartbeat counter in the rendezvous store. Once
a stop was asked for, a peer whose counter has not moved for the grace period
($MP_OFFLOAD_STOP_GRACE_S, default 60 s) cannot answer the collective the rank waits in:
the rank prints one line for the job naming that peer and the phase, and exits (status 1),
abandoning the collective. Nothing half-saved is published (saves are crash-safe), so the
latest checkpoint is as it was. A store that stops answering (its host is gone) names no
one: the collectives' own timeout then bounds the wait.

Outside the loop (``stop_outside_the_loop``: start-up, the final evaluation and sample) a
signal ends the run at once, with one line saying so and which checkpoint is the latest.
The launcher (scripts/torchrun_quiet.py) gives the ranks the time all this takes.
"""

from __future__ import annotations

import math
import os
import select
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from .. import parallel_state as ps
from .distributed import PROG, current_phase, fail, is_reporting_rank, say, store_client

STOP_GRACE_ENV = "MP_OFFLOAD_STOP_GRACE_S"
DEFAULT_STOP_GRACE_S = 60.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)
_ALIVE = "mp_offload/alive/"  # + rank: the heartbeat counter; -1 once the loop is over
_DONE = -1


def stop_grace_problem() -> str | None:
    """A line for a bad $MP_OFFLOAD_STOP_GRACE_S (checked at start-up), else None."""
    text = os.environ.get(STOP_GRACE_ENV)
    if text is None:
        return None
    try:
        ok = math.isfinite(float(text)) and float(text) > 0
    except ValueError:
        ok = False
    return (
        None
        if ok
        else (
            f"{STOP_GRACE_ENV}={text!r}: give the seconds a stopping rank waits for a peer "
            f"that stopped answering, > 0 (default {DEFAULT_STOP_GRACE_S:g})"
        )
    )


def stop_grace_s() -> float:
    return float(os.environ.get(STOP_GRACE_ENV, DEFAULT_STOP_GRACE_S))


def latest_note(save: str | None) -> str:
    """Which checkpoint a stop leaves as the latest, as a phrase."""
    if not save:
        return "no --save: nothing was being saved"
    from ..checkpoint import CheckpointError, read_latest

    try:
        latest = read_latest(save)
    except (CheckpointError, OSError):
        latest = None
    if latest is None:
        return f"--save {save} holds no checkpoint"
    return f"the latest checkpoint in --save {save} is iteration {latest}, as it was"


def _stop_now(sig: int, save: str | None, how: str) -> None:
    """From the main thread: one line for the job (before the process group exists, from
    the reporting rank), exit 128 + the signal's number."""
    text = (
        f"{signal.Signals(sig).name} {how} during {current_phase()}: stopping now, no "
        f"checkpoint written ({latest_note(save)})"
    )
    if dist.is_initialized() or is_reporting_rank():
        fail(text, code=128 + sig, everywhere=False)
    sys.exit(128 + sig)


def stop_outside_the_loop(save: str | None) -> dict:
    """SIGINT/SIGTERM before and after the training loop end the run at once; returns
    the handlers replaced (``restore_handlers``)."""
    return {
        sig: signal.signal(sig, lambda signum, frame: _stop_now(signum, save, "came"))
        for sig in SIGNALS
    }


def restore_handlers(handlers: dict) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


class StopFlag:
    """The stop request during the loop: ``requested`` once SIGINT/SIGTERM came; ``agreed``
    shares it between the ranks at the end of each step. A context manager: on exit the
    handlers it replaced are back and its watchdog has ended."""

    def __init__(self, save: str | None = None, grace_s: float | None = None):
        self.save = save
        self.grace = stop_grace_s() if grace_s is None else grace_s
        self.signal: int | None = None  # the first stop signal
        self.requested_at: float | None = None
        self._lock = threading.RLock()  # the main thread's handler may interrupt it
        self._handled = 0
        self.previous = {sig: signal.signal(sig, self._handler) for sig in SIGNALS}
        several = dist.is_initialized() and dist.get_world_size() > 1
        self.watchdog = _Watchdog(self) if several else None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def note(self, sig: int) -> None:
        """A stop signal came (seen by the main thread's handler or by the watchdog)."""
        with self._lock:
            if self.signal is None:
                self.signal, self.requested_at = sig, time.monotonic()

    def _handler(self, signum, frame):
        self.note(signum)
        self._handled += 1
        if self._handled > 1 and self.watchdog is None:  # the watchdog counts its own
            _stop_now(signum, self.save, "again")

    def restore(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None
        restore_handlers(self.previous)

    def __enter__(self) -> StopFlag:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def agreed(self) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0], device=ps.comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0


class _Watchdog:
    """The thread that sees stop signals while the main one is blocked, and gives up when
    a peer stopped answering (the module's docstring)."""

    def __init__(self, flag: StopFlag):
        self.flag, self.rank, self.world = flag, dist.get_rank(), dist.get_world_size()
        self.period = min(5.0, max(0.1, flag.grace / 5))
        # The store connection and the heartbeats start with a stop request: a run that
        # is never asked to stop keeps no second client of the store (at interpreter exit
        # its C++ teardown, after the process group's, could abort the process).
        self.store = None
        self._store_timeout = min(5.0, max(1.0, flag.grace / 4))
        self.keys = [f"{_ALIVE}{r}" for r in range(self.world)]
        self.seen: dict[int, tuple] = {}  # peer -> (its counter, when it last moved)
        self.signals = 0
        self._done = threading.Event()
        self._read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._write_fd = write_fd
        self._old_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self.thread = threading.Thread(target=self._run, name="stop-watchdog", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            if select.select([self._read_fd], [], [], self.period)[0]:
                self._signals(os.read(self._read_fd, 64))
            if self._done.is_set():
                return
            if self.flag.requested and self.store is None:
                self.store = store_client(self._store_timeout)
            self._beat()
            if self.flag.requested:
                stalled = self._stalled()
                if stalled:
                    self._give_up(stalled)

    def _signals(self, data: bytes) -> None:
        for sig in data:
            if sig in SIGNALS:
                self.signals += 1
                self.flag.note(sig)
                if self.signals > 1:
                    self._exit(
                        f"{signal.Signals(sig).name} again during {current_phase()}: "
                        f"stopping now, no checkpoint written ({latest_note(self.flag.save)})",
                        128 + sig,
                    )

    def _beat(self) -> None:
        if self.store is not None:
            try:
                self.store.add(self.keys[self.rank], 1)
            except Exception:  # noqa: BLE001 - the store's host may be gone: no heartbeats
                pass

    def _counters(self) -> dict[int, int | None] | None:
        """Every peer's heartbeat counter (None: never started), or None when the store
        does not answer."""
        peers = [r for r in range(self.world) if r != self.rank]
        keys = [self.keys[r] for r in peers]
        try:
            if self.store.check(keys):
                return {r: int(v) for r, v in zip(peers, self.store.multi_get(keys))}
            return {
                r: int(self.store.get(k)) if self.store.check([k]) else None
                for r, k in zip(peers, keys)
            }
        except Exception:  # noqa: BLE001 - it cannot tell: the collectives' timeout will
            return None

    def _stalled(self) -> list[int]:
        """The peers whose heartbeat has not moved for the grace period since the stop
        request (a peer out of the loop is not waited for)."""
        if self.store is None:
            return []
        counters = self._counters()
        if counters is None:
            return []
        now = time.monotonic()
        for r, value in counters.items():
            last = self.seen.get(r)
            if last is None or last[0] != value:  # first look: the stop request's time
                self.seen[r] = (value, self.flag.requested_at if last is None else now)
        return [
            r
            for r, (value, since) in sorted(self.seen.items())
            if value != _DONE and now - since >= self.flag.grace
        ]

    def _give_up(self, stalled: list[int]) -> None:
        ranks = f"rank{'s' if len(stalled) > 1 else ''} {', '.join(map(str, stalled))}"
        name = signal.Signals(self.flag.signal).name
        self._exit(
            f"{name} asked this job to stop during {current_phase()}, but {ranks} stopped "
            f"answering: no heartbeat for {self.flag.grace:g} s (stalled, or stopped with "
            f"SIGSTOP?); this rank abandons the collective it waits in and exits without a "
            f"checkpoint ({latest_note(self.flag.save)}; {STOP_GRACE_ENV} sets the wait)",
            1,
        )

    def _exit(self, msg: str, code: int) -> None:
        """One line for the job (the first rank to claim it in the store prints), then
        end the process at once: the main thread may be blocked in a collective."""
        claimed = True
        if self.store is not None:
            try:
                claimed = self.store.add("mp_offload/reported", 1) == 1
            except Exception:  # noqa: BLE001 - no store: say it here
                pass
        if claimed:
            say(f"{PROG}: error: {msg}")
        os._exit(code)

    def close(self) -> None:
        """The loop is over: stop the thread, tell the peers not to wait for this rank,
        give the wakeup fd back."""
        self._done.set()
        try:
            os.write(self._write_fd, b"\0")  # wake the thread now
        except BlockingIOError:  # full of signal bytes: it wakes anyway
            pass
        self.thread.join(timeout=self.period + 10.0)
        # Only a run asked to stop touches the store (a peer asked later, with this rank
        # gone, gives up on it after the grace: the latest checkpoint stays as it is).
        if self.store is not None:
            try:
                self.store.set(self.keys[self.rank], str(_DONE))
            except Exception:  # noqa: BLE001 - nobody to tell
                pass
        # The client connection goes now, not at interpreter exit (after the process
        # group's teardown, where a C++ store's destruction can abort the process).
        self.store = None
        signal.set_wakeup_fd(self._old_wakeup)
        os.close(self._read_fd)
        os.close(self._write_fd)
