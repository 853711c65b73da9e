"""A stream-race checker on the CPU: the optimizer's ``streams`` seam with GPU semantics.

``RaceStreams`` takes the asynchronous (GPU) path of the optimizer, the reducer, the host
worker and the schedules, and makes every copy *late*, as a GPU may:
- a copy down lands only when something orders it (a wait on its event, a stream's
  ``before_reuse`` of its event, a ``drain``); until then its destination holds garbage
  (NaN), and a host kernel that reads it fails with the call site of the copy;
- the copy reads its source when it lands: a source rewritten before that (a bucket
  buffer reused too early) fails, naming the copy's call site;
- a copy up is ordered before the device's own readers (one stream), but the host may
  rewrite its source only after waiting on an event recorded after it: a host kernel
  that writes a staging an unwaited upload still reads fails.
A wait observes only what it orders: a worker thread's wait never lands other copies.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass, field

import torch

from mp_offload.optimizer.streams import HostStreams


class StreamRace(AssertionError):
    pass


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    lo = t.storage_offset() * t.element_size()
    return t.untyped_storage().data_ptr(), lo, lo + t.numel() * t.element_size()


def _overlaps(a, b) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


@dataclass(eq=False)
class _Copy:
    dst: torch.Tensor
    src: torch.Tensor
    snapshot: torch.Tensor
    site: str
    up: bool = False
    landed: bool = False
    events: list = field(default_factory=list)


class _Event:
    def __init__(self, checker, copies):
        self.checker, self.copies = checker, copies

    def synchronize(self):
        self.checker.wait(self)

    def query(self):
        return all(c.landed for c in self.copies)


def _site() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "stream_checker" not in f.filename]
    f = frames[-1]
    return f"{f.filename.split('/mp_offload/')[-1]}:{f.lineno} ({f.name})"


class RaceStreams(HostStreams):
    asynchronous = True

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.down: list[_Copy] = []
        self.up: list[_Copy] = []
        self._lock = threading.RLock()
        self.landed = self.orders = 0

    # ---------------------------------------------------------------- copies
    def copy_down(self, dst, src, after=None):
        if after is not None:
            after.wait()  # gloo: the collective is done on the host
        c = _Copy(dst, src, src.detach().clone(), _site())
        with self._lock:
            dst.fill_(float("nan")) if dst.is_floating_point() else dst.zero_()
            self.down.append(c)
        return _Event(self, [c])

    def copy_up(self, dst, src) -> None:
        dst.copy_(src)  # the device's readers are queued behind it on the same stream
        if _span(dst) == _span(src):  # a CPU device whose Adam writes the params in place
            return
        with self._lock:
            self.up.append(_Copy(dst, src, src.detach().clone(), _site(), up=True))

    def _land(self, c: _Copy) -> None:
        if c.landed:
            return
        if not torch.equal(c.src, c.snapshot):
            raise StreamRace(
                f"the source of the copy down at {c.site} was rewritten before it landed"
            )
        c.dst.copy_(c.snapshot)
        c.landed = True
        self.landed += 1

    # ---------------------------------------------------------------- events
    def record(self):
        with self._lock:
            pending = [c for c in self.up if not c.landed]
            return _Event(self, pending)

    def wait(self, event) -> None:
        if event is None:
            return
        with self._lock:
            self.orders += 1
            for c in event.copies:
                if c.up:
                    c.landed = True
                else:
                    self._land(c)

    def before_reuse(self, event) -> None:
        self.wait(event)  # the compute stream waits: the copy is before the reuse

    def drain(self) -> None:
        with self._lock:
            for c in self.down:
                self._land(c)

    def host_access(self, reads=(), writes=()) -> None:
        with self._lock:
            for t in reads:
                for c in self.down:
                    if not c.landed and _overlaps(_span(t), _span(c.dst)):
                        raise StreamRace(
                            f"a host kernel read the destination of the copy down at {c.site} "
                            f"before anything ordered it (an event wait or a drain)"
                        )
            for t in writes:
                for c in self.up:
                    if not c.landed and _overlaps(_span(t), _span(c.src)):
                        raise StreamRace(
                            f"a host kernel wrote the source of the copy up at {c.site} before "
                            f"waiting on an event recorded after it"
                        )
            self.down = [c for c in self.down if not c.landed]
            self.up = [c for c in self.up if not c.landed]
