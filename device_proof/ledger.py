"""The optimizer's host<->device copies as they are issued, timed by events around each,
and the order of the host-side events: copy issued, event recorded, event waited, host
Adam writing a buffer. The traffic figures and the upload-ordering check read this, never
the optimizer's own byte counters.

``CopyLedger`` is a ``streams`` object (``mp_offload/optimizer/streams.py``): the
optimizer is built with it, so every copy down and up, every event recorded and waited
on, and every host Adam write (the ``host_access`` hook before its raw-pointer kernel)
passes through it. It wraps the device's real streams; on the CPU it also takes the
GPU's asynchronous path with fake events that only record their order.

An upload is *retired* once the host waited on an event recorded after it. A host Adam
write into a byte range that an unretired upload reads is a violation: on a GPU the copy
may still be reading while the host overwrites it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from mp_offload.optimizer.streams import HostStreams, streams_for


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _bytes(t: torch.Tensor) -> tuple[int, int]:
    lo = t.storage_offset() * t.element_size()
    return lo, lo + t.numel() * t.element_size()


@dataclass
class Copy:
    direction: str  # "d2h" or "h2d"
    nbytes: int
    storage: int  # the host buffer's storage
    span: tuple[int, int]  # its byte range there
    timing: tuple = ()  # (start, end) events on CUDA, perf_counter seconds on the CPU
    retired: bool = False
    events: list = field(default_factory=list)


class FakeEvent:
    """An event on the CPU, where copies are synchronous: only its identity matters."""

    def synchronize(self):
        pass

    def query(self):
        return True


class CopyLedger(HostStreams):
    """Build the optimizer with ``streams=CopyLedger(device)`` (see the module).
    ``timed``: time each copy; ``delay_s`` (CUDA): before each burst of uploads the
    stream sleeps that long, so a copy still runs when a host that did not wait writes
    its source; ``drop_upload_events``: the deliberately broken optimizer, whose upload
    events are lost (the host then never waits for its copies up)."""

    asynchronous = True

    def __init__(self, device, timed=False, delay_s=0.0, drop_upload_events=False):
        device = torch.device(device)
        super().__init__(device)
        self.inner = streams_for(device, pinned=device.type == "cuda")
        self.cuda = device.type == "cuda"
        self.timed, self.delay_s, self.drop = timed, delay_s, drop_upload_events
        self.copies: list[Copy] = []
        self.violations: list[str] = []
        self.records = self.waits = 0
        self._events: list = []  # kept alive: an event's id must not be reused by another
        self._lock = threading.Lock()
        self._burst = False  # uploads issued since the last event record

    # ---------------------------------------------------------------- copies
    def copy_down(self, dst, src, after=None):
        down = self.inner.stream if self.cuda else None  # the copies down's own stream
        if self.timed and self.cuda:  # the start mark after what the copy waits for
            with torch.cuda.stream(down):
                after.wait() if after is not None else down.wait_stream(torch.cuda.current_stream())
        start = self._mark(down)
        done = self.inner.copy_down(dst, src, after=after) or FakeEvent()
        self._log("d2h", dst, src, start, down)
        return done

    def open_uploads(self) -> None:
        self.inner.open_uploads()
        self._burst = False

    def copy_up(self, dst, src, then=None, after=None):
        if dst is None:  # only the gather of a bucket already up: no copy to log
            return self._covers(self.inner.copy_up(None, None, then, after) or FakeEvent())
        up = self.inner.up if self.cuda else None  # the copies up's own stream
        if self.cuda and self.delay_s > 0 and not self._burst:
            with torch.cuda.stream(up):
                torch.cuda._sleep(int(self.delay_s * _clock_hz()))
        self._burst = True
        if self.cuda and after is not None:  # the start mark after what the copy waits for
            up.wait_event(after)
        start = self._mark(up)
        event = self.inner.copy_up(dst, src, then, after) or FakeEvent()
        self._log("h2d", src, src, start, up)
        return self._covers(event)

    def wait_upload(self, event) -> None:
        if not isinstance(event, FakeEvent):
            self.inner.wait_upload(event)

    def _log(self, direction, host, src, start, stream=None) -> None:
        timing = (start, self._mark(stream)) if self.timed else ()
        nbytes = src.numel() * src.element_size()
        with self._lock:
            self.copies.append(Copy(direction, nbytes, _storage(host), _bytes(host), timing))

    # ---------------------------------------------------------------- events
    def _covers(self, event):
        """``event`` (a copy up's) covers every copy up before it (one stream)."""
        with self._lock:
            self.records += 1
            self._events.append(event)
            for c in self.copies:
                if c.direction == "h2d" and not c.retired:
                    c.events.append(id(event))
        return None if self.drop else event

    def wait(self, event) -> None:
        self.inner.wait(event)
        if event is None:
            return
        with self._lock:
            self.waits += 1
            for c in self.copies:
                if id(event) in c.events:
                    c.retired = True

    def before_reuse(self, event) -> None:
        if not isinstance(event, FakeEvent):
            self.inner.before_reuse(event)

    def drain(self) -> None:
        self.inner.drain()

    def host_access(self, reads=(), writes=()) -> None:
        """The host Adam is about to write ``writes``: no unretired upload may read them."""
        for t in writes:
            storage, (lo, hi) = _storage(t), _bytes(t)
            with self._lock:
                for c in self.copies:
                    a, z = c.span
                    if c.direction == "h2d" and not c.retired and c.storage == storage:
                        if a < hi and lo < z:
                            self.violations.append(
                                f"host Adam wrote {hi - lo} bytes while their upload "
                                f"({c.nbytes} bytes) was not waited for"
                            )
                            break

    # ---------------------------------------------------------------- figures
    def _mark(self, stream=None):
        """A time mark on ``stream`` (None: the current one), where the copy runs."""
        if not self.timed:
            return None
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def nbytes(self, direction: str) -> int:
        return sum(c.nbytes for c in self.copies if c.direction == direction)

    def seconds(self, direction: str) -> float:
        """The copies' own time (CUDA: device time between the events around each)."""
        spans = [c.timing for c in self.copies if c.direction == direction and c.timing]
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in spans) / 1e3
        return sum(b - a for a, b in spans)


def _clock_hz() -> float:
    khz = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "clock_rate", 0)
    return khz * 1e3 if khz else 1.5e9
