"""The optimizer's one seam to the device's streams and events (copies down and up).

Every asynchronous copy, event, stream wait and thread binding of the optimizer, the
reducer, the host accumulator and the schedules' threads goes through one ``streams``
object:
- ``CudaStreams``: the real thing on a GPU. Copies down run on their own stream, so they
  overlap the rest of backward instead of queueing behind its kernels; copies up (and
  each bucket's all-gather right after its copy) on another, so the next forward starts
  once its first bucket is there instead of behind every upload; events are blocking (a
  waiting thread sleeps instead of spinning).
- ``HostStreams``: a CPU "device": copies are synchronous, events are None.
- the tests' race checker (``tests/stream_checker.py``) runs ``CudaStreams`` itself on
  the CPU under a fake ``torch.cuda`` whose copies complete late unless ordered, to
  catch a missing wait, ``wait_stream`` or ``record_stream`` without a GPU.
``host_access`` is called where a C++ kernel reads or writes host memory through raw
pointers (invisible to torch): a no-op here, a check in the race checker.
"""

from __future__ import annotations

import torch

from .host_memory import set_thread_device


class HostStreams:
    """The device is the CPU: every copy is done when it returns."""

    asynchronous = False

    def __init__(self, device: torch.device | None = None):
        self.device = device or torch.device("cpu")

    def copy_down(self, dst: torch.Tensor, src: torch.Tensor, after=None):
        """``dst.copy_(src)`` once ``after`` (a collective's work, or None) is done;
        returns the event that marks the copy done (None: it is)."""
        if after is not None:
            after.wait()
        dst.copy_(src)
        return None

    def open_uploads(self) -> None:
        """The copies up that follow overwrite what the compute stream queued so far reads
        (the last backward's weights): they wait for it."""

    def copy_up(self, dst: torch.Tensor, src: torch.Tensor, then=None, after=None):
        """Queue ``dst.copy_(src)`` (host -> device) and ``then()`` (a bucket's all-gather,
        or None) behind it; returns the event that marks both done (None: they are).
        ``after``: an event (a copy down's) that orders the copy instead of
        ``open_uploads``: the last readers of ``dst`` came before it."""
        if dst is not None:
            dst.copy_(src)
        if then is not None:
            then()
        return None

    def wait_upload(self, event) -> None:
        """What the current stream queues next (a forward reading the params) runs after
        ``event``, a ``copy_up``'s."""

    def before_reuse(self, event) -> None:
        """The compute stream may overwrite a copy's source only after ``event``."""

    def drain(self) -> None:
        """The host is about to read what came down: wait for every copy."""

    def wait(self, event) -> None:
        """The calling thread sleeps until ``event`` (None: nothing to wait for)."""
        if event is not None:
            event.synchronize()

    def bind_thread(self) -> None:
        """A new thread that will touch the device binds to the rank's device first."""
        set_thread_device(self.device)

    def host_access(self, reads=(), writes=()) -> None:
        """A C++ kernel is about to read ``reads`` and write ``writes`` (host tensors,
        through raw pointers that no stream or allocator sees)."""


class CudaStreams(HostStreams):
    """Copies down on one side stream, copies up on another; blocking events. ``cuda``:
    the ``torch.cuda`` module (the race checker passes its fake)."""

    asynchronous = True

    def __init__(self, device: torch.device, cuda=torch.cuda):
        super().__init__(device)
        self.cuda = cuda
        self.stream = cuda.Stream(device)  # copies down
        self.up = cuda.Stream(device)  # copies up, and the all-gathers behind them

    def copy_down(self, dst, src, after=None):
        compute = self.cuda.current_stream()
        with self.cuda.stream(self.stream):
            if after is not None:
                after.wait()  # NCCL: this stream waits for the collective, the host does not
            else:
                self.stream.wait_stream(compute)
            dst.copy_(src, non_blocking=True)
            done = self.cuda.Event(blocking=True)
            done.record(self.stream)
        src.record_stream(self.stream)  # the caching allocator: in use on the copy stream
        return done

    def open_uploads(self) -> None:
        self.up.wait_stream(self.cuda.current_stream())

    def copy_up(self, dst, src, then=None, after=None):
        with self.cuda.stream(self.up):
            if after is not None:
                self.up.wait_event(after)
            if dst is not None:  # None: only ``then`` (the gather of a bucket already up)
                dst.copy_(src, non_blocking=True)  # pinned source: no allocator hand-back
            if then is not None:
                then()  # NCCL waits for this stream: the gather starts when the copy is done
            done = self.cuda.Event(blocking=True)
            done.record(self.up)
        return done

    def wait_upload(self, event) -> None:
        if event is not None:
            self.cuda.current_stream().wait_event(event)

    def before_reuse(self, event) -> None:
        if event is not None:
            self.cuda.current_stream().wait_event(event)

    def drain(self) -> None:
        done = self.cuda.Event(blocking=True)
        done.record(self.stream)
        done.synchronize()


def streams_for(device: torch.device, pinned: bool) -> HostStreams:
    """The real streams of ``device`` (CUDA with a pinned host staging), else the CPU's."""
    return CudaStreams(device) if pinned else HostStreams(device)
