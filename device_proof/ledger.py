"""The optimizer's host<->device copies as they are issued, timed by events around each,
and the order of the host-side events: copy issued, event recorded, event waited, host
Adam writing a buffer. The traffic figures and the upload-ordering check read this, never
the optimizer's own byte counters.

A copy is one ``aten::copy_`` (seen by a ``TorchDispatchMode``, which autograd's threads
inherit: the gradient hooks issue the copies down) between a device tensor and one of the
optimizer's host buffers: into a grad staging it is down (d2h); from a param staging or a
host master into the parameters' flat buffer it is up (h2d).

An upload is *retired* once the host waited on an event recorded after it on its stream
(or synchronized the device). A host Adam write into a byte range that an unretired
upload reads is a violation: on a GPU the copy may still be reading while the host
overwrites it. The rule is stricter than CUDA's (another sync, an ``.item()``, would also
retire it): the optimizer's own wait must do it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_COPY = torch.ops.aten.copy_.default


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
    stream: int
    timing: tuple = ()  # (start, end) events on CUDA, perf_counter seconds on the CPU
    retired: bool = False
    events: list = field(default_factory=list)


class FakeEvent:
    """``torch.cuda.Event`` on the CPU, where copies are synchronous: it records the order
    of ``record`` and ``synchronize`` for the ledger, nothing more."""

    ledger = None  # set by the ledger that installs the class

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        del enable_timing, blocking, interprocess

    def record(self, stream=None):
        self.ledger.recorded(self, 0)

    def synchronize(self):
        self.ledger.waited(self)

    def wait(self, stream=None):  # a stream's wait: the device waits, not the host
        pass

    def query(self):
        return True


class CopyLedger(TorchDispatchMode):
    """Use as ``with CopyLedger(opt):`` around the steps to observe (see the module).
    ``timed``: time each copy (CUDA events around it); ``delay_s`` (CUDA): before each
    burst of uploads the stream sleeps that long, so a copy still runs when a host that
    did not wait would write its source."""

    def __init__(self, opt, timed: bool = False, delay_s: float = 0.0):
        super().__init__()
        self.opt, self.timed, self.delay_s = opt, timed, delay_s
        self.cuda = opt.device.type == "cuda"
        self.copies: list[Copy] = []
        self.violations: list[str] = []
        self.records = self.waits = 0
        self._events: list = []  # kept alive: an event's id must not be reused by another
        self._lock = threading.Lock()
        self._burst = False  # uploads issued since the last event record
        self._saved: list = []

    # ------------------------------------------------------------ install
    def __enter__(self):
        self._real_event = torch.cuda.Event
        self._saved = [(torch.cuda, "Event", torch.cuda.Event)]
        torch.cuda.Event = self._event_class()
        if self.cuda:
            real_sync = torch.cuda.synchronize
            self._saved.append((torch.cuda, "synchronize", real_sync))
            torch.cuda.synchronize = lambda device=None: (real_sync(device), self.retire_all())[0]
        for state in self._states():
            self._saved.append((state, "step", None))
            state.step = self._watched(state)
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, value in reversed(self._saved):
            if value is None:
                delattr(owner, name)  # the instance's wrapper: the class method again
            else:
                setattr(owner, name, value)
        return super().__exit__(*exc)

    def _event_class(self):
        ledger = self
        if not self.cuda:
            return type("LedgerFakeEvent", (FakeEvent,), {"ledger": ledger})
        real = torch.cuda.Event

        class LedgerEvent(real):
            def record(self, stream=None):
                super().record(stream)
                s = stream or torch.cuda.current_stream()
                ledger.recorded(self, s.cuda_stream)

            def synchronize(self):
                super().synchronize()
                ledger.waited(self)

        return LedgerEvent

    def _states(self) -> list:
        return [s for s in (self.opt.host_state, self.opt.spare_state) if s is not None]

    # ------------------------------------------------------------ events
    def recorded(self, event, stream: int) -> None:
        with self._lock:
            self.records += 1
            self._events.append(event)
            self._burst = False
            for c in self.copies:
                if c.direction == "h2d" and not c.retired and (not self.cuda or c.stream == stream):
                    c.events.append(id(event))

    def waited(self, event) -> None:
        with self._lock:
            self.waits += 1
            for c in self.copies:
                if id(event) in c.events:
                    c.retired = True

    def retire_all(self) -> None:
        with self._lock:
            for c in self.copies:
                c.retired = True

    def _watched(self, state):
        real = state.step

        def step(h, n, grad, dst=None, **hyper):
            to = dst or state
            for buf in (to.hi, to.master):
                if isinstance(buf, torch.Tensor):
                    self._written(buf[h : h + n], h)
            return real(h, n, grad, dst=dst, **hyper)

        return step

    def _written(self, t: torch.Tensor, h: int) -> None:
        storage, (lo, hi) = _storage(t), _bytes(t)
        with self._lock:
            for c in self.copies:
                a, z = c.span
                if not c.retired and c.storage == storage and a < hi and lo < z:
                    self.violations.append(
                        f"host Adam wrote elements from {h} while their upload "
                        f"({c.nbytes} bytes) was not waited for"
                    )
                    return

    # ------------------------------------------------------------ copies
    def _host_storages(self) -> tuple[set, set]:
        """(grad staging storages, storages the params go up from)."""
        o = self.opt
        down = {_storage(t) for t in o.grad_staging}
        up = {_storage(b) for s in self._states() for b in (s.hi, s.master) if b is not None}
        return down, up - {_storage(o.flat)}

    def _direction(self, dst, src) -> str | None:
        if not (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)):
            return None
        if self.cuda and dst.device.type == src.device.type:
            return None
        down, up = self._host_storages()
        if _storage(dst) in down and _storage(src) not in down:
            return "d2h"
        if _storage(dst) == _storage(self.opt.flat) and _storage(src) in up:
            return "h2d"
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _COPY:
            return func(*args, **kwargs)
        direction = self._direction(args[0], args[1])
        if direction is None:
            return func(*args, **kwargs)
        host = args[0] if direction == "d2h" else args[1]
        stream = torch.cuda.current_stream().cuda_stream if self.cuda else 0
        if direction == "h2d" and self.cuda and self.delay_s > 0 and not self._burst:
            torch.cuda._sleep(int(self.delay_s * _clock_hz()))
        self._burst = self._burst or direction == "h2d"
        start = self._mark()
        out = func(*args, **kwargs)
        timing = (start, self._mark()) if self.timed else ()
        nbytes = args[1].numel() * args[1].element_size()
        with self._lock:
            self.copies.append(
                Copy(direction, nbytes, _storage(host), _bytes(host), stream, timing)
            )
        return out

    def _mark(self):
        if not self.timed:
            return None
        if not self.cuda:
            return time.perf_counter()
        e = self._real_event(enable_timing=True)
        e.record()
        return e

    # ------------------------------------------------------------ figures
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
