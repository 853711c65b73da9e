"""A stream-race checker on the CPU: the production ``CudaStreams`` under a fake ``torch.cuda``.

``RaceStreams`` is ``mp_offload.optimizer.streams.CudaStreams`` itself, built with
``FakeCuda`` for its ``cuda`` module, so the optimizer, the reducer, the host worker and
the schedules' threads take the GPU path, and every stream, event, ``wait_stream``,
``wait_event``, ``record_stream``, ``synchronize`` and non-blocking copy they issue goes
through the fake. The copies and ``record_stream`` calls inside the seam are captured by
a torch function mode around the seam's copy methods. The model, the worst a GPU may do:

- A copy on a side stream (a copy down) is *late*: it lands only when something orders
  it, a stream's ``wait_event`` on an event recorded after it (``before_reuse``) or the
  host's ``synchronize`` of one (the worker's wait, ``drain``). Until then its destination
  holds garbage (NaN). The copy reads its source when it lands: a source rewritten
  before that fails, naming the copy's call site.
- The host sees a copy down only through ``synchronize`` of an event recorded after it: a
  host kernel (``host_access``) that reads a destination before that fails, even if a
  stream wait already landed the copy. A wait lands only what its event covers (the
  copies queued on that stream before the event): a worker thread's wait observes its
  own copy and never pulls a later one ahead.
- The caller of ``copy_down`` has just queued the writes of the source on the compute
  stream. A copy whose stream is not ordered after them (``wait_stream(compute)``, a
  ``wait_event`` of an event recorded on compute, or a collective's ``wait``) may read
  the source before they land: it fails at once.
- The caller may drop the source as soon as ``copy_down`` returns (with DP > 1 the
  reduced chunk is a fresh allocation), and the caching allocator then hands its memory
  to the compute stream's next allocation while the copy may still read it. So a copy
  down whose source was not ``record_stream``-ed on the copy's stream by then fails.
- A copy up runs on its own stream too, and is late the same way: its destination (the
  weights) holds NaN until a stream waits on an event after it (``wait_upload``, which a
  module's forward does for its own buckets) or the host synchronizes one. It overwrites
  weights the backward read, so its stream must be ordered after the compute stream's
  reads of them or it fails at once: after the whole backward (``open_uploads``), or,
  once ``attach(opt)`` told the checker which bucket's weights a copy up writes, after
  that bucket's launch (the overlap's speculative uploads wait for its copy down).
  ``watch(model)`` fails a module's forward that starts while a copy up into its own
  parameters has not landed. The host may rewrite a copy up's source only after it
  synchronized an event recorded after the copy: a host kernel that writes it earlier
  fails. (A copy on the compute stream is done at once.)
- Device memory is what the copies move across: the source of a copy down, the
  destination of a copy up (their storages are kept alive, so the address of one is never
  a host buffer's later). A host kernel handed device memory fails, as a CPU-only kernel
  handed a CUDA tensor does on a GPU. (The tensors themselves are CPU tensors.)
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from dataclasses import dataclass

import pytest
import torch
from torch.overrides import TorchFunctionMode

from mp_offload.optimizer.streams import CudaStreams


class StreamRace(AssertionError):
    pass


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    lo = t.storage_offset() * t.element_size()
    return t.untyped_storage().data_ptr(), lo, lo + t.numel() * t.element_size()


def _overlaps(a, b) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def _where(f) -> str:
    return f"{f.filename.split('/mp_offload/')[-1].split('/tests/')[-1]}:{f.lineno} ({f.name})"


def _site() -> str:
    """The production line that issued the copy (and its caller, when it is the seam)."""
    frames = [
        f
        for f in traceback.extract_stack()
        if not any(k in f.filename for k in ("stream_checker", "/torch/", "contextlib"))
    ]
    site = _where(frames[-1])
    if frames[-1].filename.endswith("streams.py") and len(frames) > 1:
        site += f" called from {_where(frames[-2])}"
    return site


@dataclass(eq=False)
class _Copy:
    dst: torch.Tensor
    src: torch.Tensor
    snapshot: torch.Tensor
    site: str
    stream: FakeStream
    up: bool = False
    landed: bool = False  # the data moved (a stream or the host ordered it)
    seen: bool = False  # the host synchronized an event after it


class FakeStream(torch.Stream):
    """A stream of the fake (a real ``torch.Stream`` to the argument parser, so that
    ``record_stream`` accepts it). ``knows``: the compute stream's tick it is ordered
    after (the compute stream's own tick, for it)."""

    __eq__, __hash__ = object.__eq__, object.__hash__

    def __new__(cls, cuda, name):
        return super().__new__(cls, device="cpu")

    def __init__(self, cuda, name):
        self.cuda, self.name, self.knows = cuda, name, 0
        self.copies: list[_Copy] = []

    def wait_event(self, event) -> None:
        self.cuda.stream_waits(self, event)

    def wait_stream(self, other) -> None:
        event = FakeEvent(self.cuda)
        event.record(other)
        self.wait_event(event)

    def __repr__(self):
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, cuda, enable_timing=False, blocking=False, interprocess=False):
        self.cuda, self.blocking = cuda, blocking
        self.copies: list[_Copy] = []
        self.knows = 0

    def record(self, stream=None) -> None:
        stream = self.cuda.current_stream() if stream is None else stream
        with self.cuda.lock:
            self.copies = [c for c in stream.copies if not c.seen]
            self.knows = stream.knows

    def synchronize(self) -> None:
        self.cuda.host_waits(self)

    def query(self) -> bool:
        return all(c.landed for c in self.copies)


class FakeCuda:
    """The part of ``torch.cuda`` that ``CudaStreams`` uses, with late copies."""

    def __init__(self):
        self.lock = threading.RLock()
        self.compute = FakeStream(self, "compute")
        self.streams = [self.compute]
        self._current = threading.local()
        self.landed = self.orders = self.ups = 0  # copies down landed, waits, copies up
        # in the current copy_down: the copies down issued, the record_stream calls made
        self.issued: list[_Copy] = []
        self.up_offsets: list[int] = []  # where each side-stream copy up writes, in order
        # flat offset of a bucket's chunk -> the compute stream's tick at its last launch
        self.read_until: dict[int, int] = {}
        self.recorded: list[tuple[int, FakeStream]] = []  # (the storage's address, stream)
        self.device_memory: dict[int, tuple] = {}  # address -> (its storage, what it is)

    # ------------------------------------------------------------- the module's face
    def Stream(self, device=None, priority=0):  # noqa: N802 - torch.cuda's name
        self.streams.append(FakeStream(self, f"side{len(self.streams)}"))
        return self.streams[-1]

    def Event(self, **kw):  # noqa: N802 - torch.cuda's name
        return FakeEvent(self, **kw)

    def _stack(self) -> list[FakeStream]:
        if not hasattr(self._current, "stack"):
            self._current.stack = [self.compute]  # every thread starts on the default
        return self._current.stack

    def current_stream(self, device=None) -> FakeStream:
        return self._stack()[-1]

    @contextlib.contextmanager
    def stream(self, s):
        if s is None:
            yield
            return
        self._stack().append(s)
        try:
            yield
        finally:
            self._stack().pop()

    # ----------------------------------------------------------------- the model
    def tick(self) -> None:
        """The compute stream queued new work (the source of the next copy down)."""
        self.compute.knows += 1

    def issue(self, dst, src) -> None:
        """``dst.copy_(src, non_blocking=True)`` on the current stream."""
        s, site = self.current_stream(), _site()
        with self.lock:
            if s is self.compute:
                dst.copy_(src)  # the device's readers are queued behind it
                if _span(dst) != _span(src):  # not a CPU placement's in-place params
                    s.copies.append(_Copy(dst, src, src, site, s, up=True, landed=True))
                    self.ups += 1
                    self._on_device(dst, f"the destination of the copy up at {site}")
                return
            up = getattr(self._current, "uploading", False)  # this thread is in ``copy_up``
            needed = self.compute.knows
            if up and dst.storage_offset() in self.read_until:  # reads of its weights end there
                needed = self.read_until[dst.storage_offset()]
            if s.knows < needed and up:
                raise StreamRace(
                    f"the copy up at {site} may overwrite the weights before the compute "
                    f"stream's reads of them: its stream did not wait for the compute stream"
                )
            if s.knows < self.compute.knows and not up:
                raise StreamRace(
                    f"the copy down at {site} may read its source before the compute "
                    f"stream's writes to it: its stream did not wait for the compute stream"
                )
            s.copies.append(_Copy(dst, src, src.detach().clone(), site, s, up=up))
            if up:
                self.ups += 1
                self.up_offsets.append(dst.storage_offset())
                self._on_device(dst, f"the destination of the copy up at {site}")
            else:
                self.issued.append(s.copies[-1])
                self._on_device(src, f"the source of the copy down at {site}")
            dst.fill_(float("nan")) if dst.is_floating_point() else dst.zero_()

    def _on_device(self, t: torch.Tensor, what: str) -> None:
        storage = t.untyped_storage()
        self.device_memory.setdefault(storage.data_ptr(), (storage, what))

    def _land(self, c: _Copy) -> None:
        if c.landed:
            return
        if not torch.equal(c.src, c.snapshot):
            way = "up" if c.up else "down"
            raise StreamRace(
                f"the source of the copy {way} at {c.site} was rewritten before it landed"
            )
        c.dst.copy_(c.snapshot)
        c.landed = True
        self.landed += 1

    def stream_waits(self, s: FakeStream, event: FakeEvent) -> None:
        """``s`` runs what follows after ``event``: its copies land first."""
        with self.lock:
            self.orders += 1
            s.knows = max(s.knows, event.knows)
            for c in event.copies:
                self._land(c)

    def host_waits(self, event: FakeEvent) -> None:
        """The host (any thread) is past ``event``: its copies are done and seen."""
        with self.lock:
            self.orders += 1
            for c in event.copies:
                self._land(c)
                c.seen = True

    def pending(self) -> list[_Copy]:
        """The copies the host has not seen done, on every stream."""
        with self.lock:
            out = []
            for s in self.streams:
                s.copies = [c for c in s.copies if not c.seen]
                out += s.copies
            return out


class _Capture(TorchFunctionMode):
    """Routes the seam's non-blocking copies and ``record_stream`` calls to the fake."""

    def __init__(self, cuda: FakeCuda):
        super().__init__()
        self.cuda = cuda

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and kwargs.get("non_blocking"):
            return self.cuda.issue(*args)
        if func is torch.Tensor.record_stream:
            t, s = args
            self.cuda.recorded.append((t.untyped_storage().data_ptr(), s))
            return None
        return func(*args, **kwargs)


class _Work:
    """A collective's work: its ``wait`` orders the current stream after the collective,
    which the compute stream launched after its own writes."""

    def __init__(self, work, cuda: FakeCuda):
        self.work, self.cuda = work, cuda

    def wait(self):
        self.work.wait()
        s = self.cuda.current_stream()
        s.knows = max(s.knows, self.cuda.compute.knows)


class RaceStreams(CudaStreams):
    """The production ``CudaStreams`` on the fake; ``host_access`` checks the host's
    raw-pointer reads and writes against the copies in flight."""

    def __init__(self):
        self.fake = FakeCuda()
        super().__init__(torch.device("cpu"), cuda=self.fake)

    @property
    def landed(self) -> int:
        return self.fake.landed

    @property
    def orders(self) -> int:
        return self.fake.orders

    @property
    def ups(self) -> int:
        return self.fake.ups

    def attach(self, opt) -> None:
        """Which weights each copy down's bucket holds (the optimizer's layout): a copy up
        into a bucket's chunk need only follow the compute stream's work up to that
        bucket's launch, the last that reads its weights in a backward."""
        host = opt.host_side
        self._chunk_of = {}
        for p in host.pieces:
            self._chunk_of[p.lo] = p.bucket.chunk_range(host.dp_rank)[0]
        self._stagings = [(t.untyped_storage().data_ptr(), t) for t in host.staging_copies]

    def _launched(self, dst) -> None:
        for ptr, staging in getattr(self, "_stagings", ()):
            if dst.untyped_storage().data_ptr() == ptr:
                at = self._chunk_of.get(dst.storage_offset() - staging.storage_offset())
                if at is not None:
                    self.fake.read_until[at] = self.fake.compute.knows

    def copy_down(self, dst, src, after=None):
        fake = self.fake
        fake.tick()
        self._launched(dst)
        fake.issued, fake.recorded = [], []
        with _Capture(fake):
            done = super().copy_down(dst, src, None if after is None else _Work(after, fake))
        for c in fake.issued:
            ptr = c.src.untyped_storage().data_ptr()
            if not any(p == ptr and s is c.stream for p, s in fake.recorded):
                raise StreamRace(
                    f"the source of the copy down at {c.site} is not recorded on the copy's "
                    f"stream (record_stream): once dropped, its memory may be handed out "
                    f"again while the copy still reads it"
                )
        return done

    def copy_up(self, dst, src, then=None, after=None):
        self.fake._current.uploading = True  # the side-stream copy goes host -> device
        try:
            with _Capture(self.fake):
                return super().copy_up(dst, src, then, after)
        finally:
            self.fake._current.uploading = False

    def watch(self, model: torch.nn.Module) -> None:
        """Fail a module's forward that starts while a copy up into its own parameters
        has not landed (hooks registered after the optimizer's: they run after its waits).
        ``in_flight``: per forward call, the copies up not landed yet (anywhere)."""
        self.in_flight: list[int] = []
        for name, m in model.named_modules():
            own = [p for p in m.parameters(recurse=False)]
            if own:
                m.register_forward_pre_hook(lambda mod, args, n=name, own=own: self._reads(n, own))

    def _reads(self, name: str, params) -> None:
        late = [c for c in self.fake.pending() if c.up and not c.landed]
        self.in_flight.append(len(late))
        for c in late:
            if any(_overlaps(_span(p.detach()), _span(c.dst)) for p in params):
                raise StreamRace(
                    f"the forward of {name or 'the model'} read weights before their copy up "
                    f"at {c.site} landed (it did not wait on the copy's event)"
                )

    def host_access(self, reads=(), writes=()) -> None:
        for t in (*reads, *writes):
            on_device = self.fake.device_memory.get(t.untyped_storage().data_ptr())
            if on_device is not None:
                raise StreamRace(
                    f"a host kernel was handed device memory ({on_device[1]}): a CPU-only "
                    f"kernel cannot read a CUDA tensor"
                )
        for c in self.fake.pending():
            for t in reads:
                if not c.up and _overlaps(_span(t), _span(c.dst)):
                    raise StreamRace(
                        f"a host kernel read the destination of the copy down at {c.site} "
                        f"before the host waited for it (an event's synchronize or a drain)"
                    )
            for t in writes:
                if c.up and _overlaps(_span(t), _span(c.src)):
                    raise StreamRace(
                        f"a host kernel wrote the source of the copy up at {c.site} before "
                        f"waiting on an event recorded after it"
                    )


@contextlib.contextmanager
def gpu_placement():
    """The optimizer places its buffers as on a GPU (the host staging pinned, new params
    uploaded from a param staging, never written in place) though its tensors are the
    CPU's: the placement the streams above stand for. Pinning is a no-op here."""
    from mp_offload.optimizer import placement as where
    from mp_offload.optimizer import zero
    from mp_offload.optimizer.host_memory import host_empty

    def unpinned(numel, dtype, pin):
        return host_empty(numel, dtype, pin, register=lambda t, nbytes: None)

    real = zero.placement
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(zero, "placement", lambda layout, o, device_type: real(layout, o, "cuda"))
        patch.setattr(where, "host_empty", unpinned)
        yield
