"""When the host side steps and publishes: the optimizer step's timing, one class each.

- ``Synchronous``: at the step, the device side's Adam and publish are queued first
  (they run beside the host's; its buckets are the forward's first), then the host's Adam
  bucket by bucket in forward order, each bucket's copy up (and all-gather) queued right
  after its piece.
- ``Delayed`` (``--dpu-warmup-steps N``, one-step delayed parameter update): after N
  synchronous steps, step t's host Adam runs on a thread behind forward/backward of
  t+1 and its params go up at step t+1 (or at ``flush``); backward t+1 writes the other
  gradient buffer meanwhile.
- ``Overlapped`` (``--overlap-cpu-optimizer``): each host bucket is stepped on the host
  worker as soon as its gradient is final, speculatively (no clipping, no overflow, the
  param groups' hyperparameters as they are then), into the second state copy, and its
  new params go up at once (backward reads no weight of a bucket whose gradient is
  final). At the step the real global norm is known: if the real step is the speculated
  one the copies swap (bitwise the synchronous step) and only the all-gathers remain;
  otherwise (clipping, or an LR changed since) the step is recomputed from the committed
  copy and goes up again; an fp16 overflow drops the speculation and puts the committed
  params back.
A schedule uses the sides' public faces only (``side.py``) and the optimizer's
``publish``; it holds its own thread, events and second copies.
"""

from __future__ import annotations

import threading
import time


class Synchronous:
    def __init__(self, device, host, publish):
        self.device, self.host, self.publish = device, host, publish

    def begin(self, step_count: int, scale: float) -> None:
        """A new step starts (``zero_grad``)."""

    def end_backward(self) -> None:
        """The step begins: backward is over."""

    def skip(self) -> None:
        """fp16 overflow: nothing was stepped."""

    def step(self, hyper, step_count: int) -> None:
        if self.device is not None:
            self.device.step(hyper)  # queued first: runs beside the host's
            self.publish(host=False)  # its gathers first in line: the forward's first buckets
        if self.host is not None:
            self.host.step(hyper, upload=True)
        self.publish(uploaded=True, device=False)

    def flush(self) -> None:
        """Apply an update still in flight (before saving or at the end)."""

    def stats(self) -> dict:
        return {}


class Delayed(Synchronous):
    def __init__(self, device, host, publish, warmup_steps: int):
        super().__init__(device, host, publish)
        self.warmup_steps = warmup_steps
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def step(self, hyper, step_count: int) -> None:
        if step_count <= self.warmup_steps:
            return super().step(hyper, step_count)
        self.flush()  # params of step t-1 go up now; t runs behind forward t+1
        # The device side steps now, from this thread (stream order: before backward t+1
        # overwrites its gradient); its result is published with the host's, at t+1.
        if self.device is not None:
            self.device.step(hyper)
        grad = self.host.adam_grads  # read by the thread while backward t+1 fills the other
        self._thread = threading.Thread(target=self._run, args=(hyper, grad), name="dpu-adam")
        self._thread.daemon = True
        self._thread.start()
        self.host.alternate_grads()  # backward t+1 writes into the other buffer

    def _run(self, hyper, grad) -> None:
        """The DPU thread: its failure is kept and raised by the training thread, before
        any half-updated parameter is published."""
        try:
            self.host.streams.bind_thread()
            self.host.step(hyper, upload=False, grad=grad)
        except BaseException as e:  # noqa: BLE001 - re-raised by flush
            self._error = e

    def flush(self) -> None:
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(
                f"the delayed (DPU) optimizer step failed: {type(err).__name__}: {err}"
            ) from err
        self.publish(uploaded=False)


class Overlapped(Synchronous):
    def __init__(self, device, host, publish, hyper_of):
        """``hyper_of(grad_scale, stepped=None)``: the optimizer's step hyperparameters as
        they would be now (every parameter stepped)."""
        super().__init__(device, host, publish)
        self.hyper_of = hyper_of
        host.start_worker()  # a real thread on the CPU too
        host.on_final, host.defer_wait = self.work, True
        self.replays = self.steps = 0  # steps recomputed / steps taken, this session
        self.record: dict = {}
        self._spans: list[tuple[float, float]] = []
        self._done: set[int] = set()
        self._spec = None

    def begin(self, step_count: int, scale: float) -> None:
        self.scale, self._spans, self._done, self._spec = scale, [], set(), None

    def work(self, b, landed=None):
        """The worker's job once bucket ``b``'s gradient is final: its speculative step, and
        its new params up behind ``landed`` (its copy down's event: that copy followed the
        backward kernels that read the bucket's weights, and none reads them after)."""
        piece = self.host.by_bucket.get(b.index)
        if piece is None:  # an empty chunk: nothing to step
            return lambda: None

        def run():
            t0 = time.perf_counter()
            live, spare = self.host.states
            if self._spec is None:  # the first piece: what this step assumes
                self.host.streams.wait(spare.uploaded)  # its staging's last copy up
                self._spec = self.hyper_of(1.0 / self.scale)
            try:
                self.host.step_piece(piece, self._spec, live, spare, self.host.adam_grads)
            except Exception as e:  # raised by the step's wait, named
                raise RuntimeError(f"the speculative CPU Adam of bucket {b.index} failed") from e
            spare.uploaded = self.host.upload(piece, spare, gather=False, after=landed)
            self._spans.append((t0, time.perf_counter()))
            self._done.add(b.index)

        return run

    def end_backward(self) -> None:
        """Backward is over. The worker's sums (k > 1 on the host) give the host's part of
        the global norm: wait for it now. Otherwise the norm is the device's, and the wait
        comes at the step, after the device side's Adam is queued: it runs beside."""
        self._end, self._wait_ms, self._waited = time.perf_counter(), 0.0, False
        if not self.host.reads_staging:
            self._wait()

    def _wait(self) -> None:
        if not self._waited:
            t0 = time.perf_counter()
            self.host.wait()
            self._wait_ms, self._waited = (time.perf_counter() - t0) * 1e3, True

    def skip(self) -> None:
        """fp16 overflow: the spare copy is dropped (the next step overwrites it); the
        params the speculation wrote in place or sent up are put back from the committed
        state."""
        self._wait()
        self.host.restore_params()
        self.host.open_uploads()
        for p in self.host.pieces:
            self.host.upload(p, self.host.states[0], gather=False)
        self.host.mark_uploaded()
        self._report(replayed=False, replay_ms=0.0)

    def step(self, hyper, step_count: int) -> None:
        if self.device is not None:
            self.device.step(hyper)  # queued before the wait for the worker: runs beside it
            self.publish(host=False)
        self._wait()
        missing = set(self.host.by_bucket) - self._done
        if missing:  # every host bucket's chunk is delivered each step: a bug otherwise
            raise RuntimeError(f"overlap: buckets {sorted(missing)} were never stepped")
        self.host.swap_states()
        replayed = hyper != self._spec
        t0 = time.perf_counter()
        new, old = self.host.states
        if replayed:  # the replay rewrites the staging the speculation's copies up read
            self.host.streams.wait(new.uploaded)
        for p in self.host.pieces:
            if replayed:  # from the old copy (now the spare) with the real hyperparameters
                self.host.step_piece(p, hyper, old, new, self.host.adam_grads)
            self.host.upload(p, new if replayed else None)  # committed: only the gathers
        self._report(replayed, (time.perf_counter() - t0) * 1e3 if replayed else 0.0)
        self.steps += 1
        self.replays += replayed
        self.publish(uploaded=True, device=False)

    def _report(self, replayed: bool, replay_ms: float) -> None:
        hidden = sum(max(0.0, min(e, self._end) - s) for s, e in self._spans) * 1e3
        self.record = dict(
            replayed=int(replayed),
            host_hidden_ms=hidden,
            host_exposed_ms=self._wait_ms + replay_ms,
            host_worker_ms=sum(e - s for s, e in self._spans) * 1e3,
        )

    def stats(self) -> dict:
        """The last step's record and this session's counts (the run summary's rate)."""
        return dict(self.record, overlap_steps=self.steps, overlap_replays=self.replays)


def schedule_for(options, device, host, publish, hyper_of) -> Synchronous:
    """The options' schedule (their legal combinations: ``options.RULES``)."""
    if options.overlap_cpu_optimizer:
        return Overlapped(device, host, publish, hyper_of)
    if options.dpu_warmup_steps is not None:
        return Delayed(device, host, publish, options.dpu_warmup_steps)
    return Synchronous(device, host, publish)
