"""Gradient reduction for the ZeRO optimizer: bucket hooks, reduce-scatter, delivery.

Each parameter's gradient goes into its bucket's buffer as soon as autograd has
accumulated it (and is freed, so the device never keeps a full-size gradient). A full
bucket is averaged and reduce-scattered over the DP group asynchronously, and this
rank's reduced chunk is handed to the side that owns the bucket (its route: the device
side or the host side, ``side.py``): ``launched`` when the collective is queued (a GPU's
copy down starts there, overlapping the rest of backward), ``receive`` once it is done.
What a side does with a chunk, and where the squared gradient norm is summed, is the
side's. Two bucket buffers (double buffering): one bucket's reduce-scatter overlaps the
backward that fills the next; a buffer is reused only after its chunk's copy (the event
its side returned).

With ``accumulate_on_device`` (``DeviceAccumulation``) the micro-batches' gradients are
summed in one fp32 device buffer laid out like the flat parameters, and only the last
micro-batch reduce-scatters it, bucket by bucket as backward completes them: one
reduce-scatter and one chunk a bucket per step, for any k.
"""

from __future__ import annotations

import torch

from ..parallel_state import reduce_scatter_tensor
from .layout import FlatLayout
from .placement import BUCKET_BUFFERS, Placement, allocate
from .side import Micro, no_phase


class BucketBuffers:
    """Each micro-batch's gradients go into pooled bucket buffers (the usual path)."""

    whole = False  # a chunk is one micro-batch's

    def __init__(self, layout, place: Placement, device, streams, drain_one):
        buckets = place.buffer("grad_buckets")
        self.dtype, self.max_bucket, self.device = buckets.dtype, buckets.numel, device
        self.streams, self._drain_one = streams, drain_one
        self.num_buffers = 0  # made as backward first needs them
        self._buffers: dict[int, torch.Tensor] = {}  # bucket index -> its buffer
        self._pool: list[tuple] = []  # (buffer, event of the copy still reading it, or None)

    def _take(self, pending: int) -> torch.Tensor:
        if not self._pool and pending and self.num_buffers >= BUCKET_BUFFERS:
            self._drain_one()  # free the oldest in-flight bucket
        if self._pool:
            buf, reading = self._pool.pop()
            self.streams.before_reuse(reading)
            return buf
        self.num_buffers += 1
        return torch.empty(self.max_bucket, dtype=self.dtype, device=self.device)

    def take(self, slot, b, grad: torch.Tensor, last: bool, pending: int) -> bool:
        buf = self._buffers.get(b.index)
        if buf is None:
            buf = self._buffers[b.index] = self._take(pending)
            buf[: b.numel].zero_()
        off = slot.start - b.start
        buf[off : off + slot.numel].copy_(grad)
        return True

    def bucket_data(self, b, pending: int):
        """(the bucket's gradient, the pooled buffer holding it)."""
        buf = self._buffers.pop(b.index, None)
        if buf is None:  # no gradient reached this bucket: still take part in the collective
            buf = self._take(pending)
            buf[: b.numel].zero_()
        return buf[: b.numel], buf

    def release(self, buf, landed) -> None:
        self._pool.append((buf, landed))

    def reduces(self, last: bool) -> bool:
        return True

    def end_backward(self, last: bool) -> None:
        pass

    def nbytes(self) -> dict:
        return dict(grad_buckets=self.max_bucket * self.dtype.itemsize * max(self.num_buffers, 1))


class DeviceAccumulation(BucketBuffers):
    """The micro-batches are summed in one device buffer; only the last reduces."""

    whole = True  # the chunk is the step's whole gradient

    def __init__(self, layout, place: Placement, device, streams, drain_one):
        super().__init__(layout, place, device, streams, drain_one)
        (self.buffer,) = allocate(place.buffer("grad_accumulation"), device)
        self._touched: set[int] = set()

    def take(self, slot, b, grad: torch.Tensor, last: bool, pending: int) -> bool:
        dst = self.buffer[slot.start : slot.start + slot.numel]
        dst.add_(grad) if slot.index in self._touched else dst.copy_(grad)
        self._touched.add(slot.index)
        return last

    def bucket_data(self, b, pending: int):
        for s in b.slots:  # a parameter without a gradient this step contributes zero
            if s.index not in self._touched:
                self.buffer[s.start : s.start + s.numel].zero_()
        return self.buffer[b.start : b.end], None

    def reduces(self, last: bool) -> bool:
        return last

    def end_backward(self, last: bool) -> None:
        if last:
            self._touched.clear()

    def nbytes(self) -> dict:
        return dict(
            super().nbytes(), grad_accumulation=self.buffer.numel() * self.buffer.element_size()
        )


def gradient_source(layout, place: Placement, device, streams, drain_one) -> BucketBuffers:
    kind = DeviceAccumulation if place.has("grad_accumulation") else BucketBuffers
    return kind(layout, place, device, streams, drain_one)


class GradientReducer:
    phase = staticmethod(no_phase)  # a benchmark's timer (``ZeroOptimizer.set_phase_timer``)

    def __init__(self, layout: FlatLayout, dp, device, place: Placement, routes, streams):
        """``routes``: bucket index -> the side that owns it; ``streams``: ``streams.py``."""
        self.layout, self.dp, self.device, self.routes = layout, dp, device, routes
        self.sides = list({id(s): s for s in routes}.values())
        self.micro_batches = place.options.micro_batches
        self.source = gradient_source(layout, place, device, streams, self._drain_one)
        self.micro = 0  # backward calls so far in this step
        # A plain loss.backward() (OffloadAdamW in a user's loop) ends with ``finish`` queued
        # on autograd's engine by the first hook; ZeroOptimizer.backward calls it itself.
        self.driving = self._queued = False
        self.got_grad = torch.zeros(len(layout.slots), dtype=torch.uint8)
        self._slot = {id(s.param): s for s in layout.slots}
        self._arrived = [0] * len(layout.buckets)
        self._launched = [False] * len(layout.buckets)
        self._pending: list[tuple] = []  # (bucket, work, chunk_out, buffer, token)
        for s in layout.slots:
            s.param.register_post_accumulate_grad_hook(self._grad_ready)

    def start_step(self) -> None:
        for side in self.sides:
            side.wait()  # nothing of the last step may still write into the targets
            side.start_step()
        self.micro = 0
        self.got_grad.zero_()

    def norm_squared(self) -> torch.Tensor:
        """This rank's squared gradient norm over its chunks (after the last micro-batch)."""
        if self.micro != self.micro_batches:
            raise RuntimeError(
                f"optimizer step after {self.micro} of {self.micro_batches} "
                f"backward calls (micro-batches) in this step"
            )
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for side in self.sides:
            side.wait()  # the host parts are summed on the worker
            for p in side.norm_parts:
                by_device.setdefault(p.device, []).append(p)
        sums = [torch.stack(group).sum() for group in by_device.values()]
        if not sums:
            return torch.zeros((), dtype=torch.float64)
        # summed where they are first: one device->host sync, not one per bucket
        return torch.stack([t.cpu() for t in sums]).sum() if len(sums) > 1 else sums[0]

    def _micro(self) -> Micro:
        whole = self.source.whole or self.micro_batches == 1
        last = self.micro == self.micro_batches - 1
        return Micro(first=self.micro == 0 or self.source.whole, last=last, whole=whole)

    def _grad_ready(self, param: torch.Tensor) -> None:
        with self.phase("backward hook: grad -> bucket copy"):
            self._take(param)

    def _finish_queued(self) -> None:
        self._queued = False
        self.finish()

    def _take(self, param: torch.Tensor) -> None:
        if not (self.driving or self._queued):
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_queued)
        if self.micro >= self.micro_batches:
            raise RuntimeError(
                f"more backward calls than the {self.micro_batches} "
                f"micro-batches per step this optimizer was built for"
            )
        slot = self._slot[id(param)]
        b = self.layout.buckets[slot.bucket]
        self.got_grad[slot.index] = 1
        counts = self.source.take(
            slot, b, param.grad.reshape(-1), self._micro().last, len(self._pending)
        )
        param.grad = None  # the device never keeps a full-size gradient
        if counts:
            self._arrived[b.index] += 1
            if self._arrived[b.index] == len(b.slots):
                self._launch(b)

    def _launch(self, b) -> None:
        # Each pending bucket holds a reduced chunk: at most BUCKET_BUFFERS stay alive.
        while len(self._pending) >= BUCKET_BUFFERS:
            self._drain_one()
        with self.phase("reduce-scatter: divide + launch"):
            self._reduce_scatter(b)

    def _reduce_scatter(self, b) -> None:
        data, buf = self.source.bucket_data(b, len(self._pending))
        work = None
        if self.dp.size > 1:  # x / 1 is x exactly: one DP rank skips the pass over the bucket
            data.div_(self.dp.size)  # average before summing: keeps fp16 sums in range
            out = torch.empty(b.chunk, dtype=data.dtype, device=self.device)
            work = reduce_scatter_tensor(out, data, group=self.dp.torch_group(), async_op=True)
        else:
            out = data
        token = self.routes[b.index].launched(b, out, work, self._micro())
        self._pending.append((b, work, out, buf, token))
        self._launched[b.index] = True

    def _drain_one(self) -> None:
        b, work, out, buf, token = self._pending.pop(0)
        if work is not None:
            with self.phase("reduce-scatter: wait"):
                work.wait()  # the compute stream (gloo: the host) after the reduce-scatter
        with self.phase("drain chunk: device part (+ norm)"):
            self._receive(b, out, buf, token)

    def _receive(self, b, out, buf, token) -> None:
        landed = self.routes[b.index].receive(b, out, token, self._micro())
        if buf is not None:
            # Reuse waits for the bucket's copy down: with DP=1 it reads the buffer itself;
            # with DP>1 it reads the chunk, and the wait bounds the chunks still in flight.
            self.source.release(buf, landed)

    def finish(self) -> None:
        """End of one backward: launch what is left, hand every chunk to its side."""
        micro = self._micro()
        if self.source.reduces(micro.last):
            # Buckets whose params got no gradient (or an unused param) still launch, in
            # order, so every DP rank issues the same collectives.
            for b in self.layout.buckets:
                if not self._launched[b.index]:
                    self._launch(b)
            while self._pending:
                self._drain_one()
            for side in self.sides:
                side.end_backward(micro)
        self.source.end_backward(micro.last)
        self.micro += 1
        self._arrived = [0] * len(self.layout.buckets)
        self._launched = [False] * len(self.layout.buckets)

    def buffer_bytes(self) -> dict:
        """Device bytes of the bucket buffers (and the accumulation buffer)."""
        return self.source.nbytes()
