"""Gradient reduction for the ZeRO optimizer: bucket hooks, reduce-scatter, host streaming.

Each parameter's gradient is copied into its bucket's buffer as soon as autograd has
accumulated it (and freed, so the device never keeps a full-size gradient). A full
bucket is averaged and reduce-scattered over the DP group asynchronously; this rank's
reduced chunk then goes into the fp32 gradient slice the optimizer owns: on CUDA with
offload, copied down into pinned staging and added on a worker thread as the copy
lands (overlapping the rest of backward), elsewhere added in place. Two bucket buffers
(double buffering): one bucket's reduce-scatter overlaps the backward that fills the next.

This is the line Megatron-core draws between its DDP gradient buffers and its
distributed optimizer; the optimizer (``zero.py``) owns the state and the update.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel_state import ParallelGroup
from .host_accumulator import HostAccumulator
from .layout import FlatLayout

# torch >= 2.13 renamed the tensor collectives; keep working on older releases too.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

BUCKET_BUFFERS = 2  # gradient bucket buffers on the device (double buffering)


class CopyStream:
    """Device->host copies of reduced chunks on their own CUDA stream.

    On the compute stream the copies would queue behind the rest of backward's kernels,
    adding PCIe time to backward instead of overlapping it. The copy stream first waits
    for the compute stream (where the reduced chunk became ready), records an event when
    the copy is done, and tells the caching allocator that the source is in use there.
    """

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        """Queue ``dst.copy_(src)``; returns the event that marks it done."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        src.record_stream(self.stream)
        return done

    @staticmethod
    def before_reuse(done) -> None:
        """The compute stream may overwrite a copied buffer only after its copy finished."""
        torch.cuda.current_stream().wait_event(done)


class GradientReducer:
    def __init__(self, layout: FlatLayout, dp: ParallelGroup, device: torch.device, dtype,
                 grad_staging: torch.Tensor | None = None, copier=None,
                 count_traffic: bool = True):
        """``grad_staging`` (pinned host memory) and ``copier`` (a ``CopyStream``) exist
        together, on CUDA with offload; ``count_traffic``: chunks cross to the host."""
        self.layout, self.dp, self.device, self.dtype = layout, dp, device, dtype
        self.grad_staging, self.copier = grad_staging, copier
        self.target: torch.Tensor | None = None  # the fp32 slice chunks are added into
        self.count_traffic = count_traffic
        self.bytes_down = 0
        self._slot = {id(s.param): s for s in layout.slots}
        self._arrived = [0] * len(layout.buckets)
        self._launched = [False] * len(layout.buckets)
        self._buffers: dict[int, torch.Tensor] = {}  # bucket index -> its buffer
        self._pool: list[tuple] = []  # (buffer, event of the copy still reading it, or None)
        self._pending: list[tuple] = []  # (bucket, work, chunk_out, buffer)
        self._accumulator = HostAccumulator(device) if grad_staging is not None else None
        self.max_bucket = max(b.numel for b in layout.buckets)
        self.num_buffers = 0
        for s in layout.slots:
            s.param.register_post_accumulate_grad_hook(self._grad_ready)

    def buffer_bytes(self) -> int:
        return self.max_bucket * torch.empty((), dtype=self.dtype).element_size() * max(
            self.num_buffers, 1)

    def _take_buffer(self) -> torch.Tensor:
        if not self._pool and self._pending and self.num_buffers >= BUCKET_BUFFERS:
            self._drain_one()  # free the oldest in-flight bucket
        if self._pool:
            buf, reading = self._pool.pop()
            if reading is not None:
                self.copier.before_reuse(reading)
            return buf
        self.num_buffers += 1
        return torch.empty(self.max_bucket, dtype=self.dtype, device=self.device)

    def _grad_ready(self, param: torch.Tensor) -> None:
        slot = self._slot[id(param)]
        b = self.layout.buckets[slot.bucket]
        buf = self._buffers.get(b.index)
        if buf is None:
            buf = self._buffers[b.index] = self._take_buffer()
            buf[:b.numel].zero_()
        off = slot.start - b.start
        buf[off:off + slot.numel].copy_(param.grad.reshape(-1))
        param.grad = None  # the device never keeps a full-size gradient
        self._arrived[b.index] += 1
        if self._arrived[b.index] == len(b.slots):
            self._launch(b)

    def _launch(self, b) -> None:
        buf = self._buffers.pop(b.index, None)
        if buf is None:  # no gradient reached this bucket: still take part in the collective
            buf = self._take_buffer()
            buf[:b.numel].zero_()
        data = buf[:b.numel]
        data.div_(self.dp.size)  # average before summing: keeps fp16 sums in range
        if self.dp.size > 1:
            out = torch.empty(b.chunk, dtype=self.dtype, device=self.device)
            work = _reduce_scatter(out, data, group=self.dp.torch_group(), async_op=True)
        else:
            out, work = data, None
        self._pending.append((b, work, out, buf))
        self._launched[b.index] = True

    def _drain_one(self) -> None:
        b, work, out, buf = self._pending.pop(0)
        if work is not None:
            work.wait()
        lo, hi = b.host_offset, b.host_offset + b.chunk
        grad = self.target[lo:hi]
        landed = None
        if self.grad_staging is not None:  # CUDA + offload: 2 bytes/param down
            stage = self.grad_staging[lo:hi]
            landed = self.copier.copy(stage, out)
            self._accumulator.add(grad, stage, landed)  # fp32 add overlaps the backward
        else:
            grad.add_(out.to(grad.device))
        if self.count_traffic:
            self.bytes_down += b.chunk * out.element_size()
        # With DP=1 the chunk is the buffer itself: reuse waits for its copy (DP>1 copies a
        # separate output tensor, kept alive for its stream by record_stream).
        self._pool.append((buf, landed if out.data_ptr() == buf.data_ptr() else None))

    def finish(self) -> None:
        """End of one backward: launch what is left, wait for every chunk to land."""
        # Buckets whose params got no gradient (or an unused param) still launch, in order,
        # so every DP rank issues the same collectives.
        for b in self.layout.buckets:
            if not self._launched[b.index]:
                self._launch(b)
        while self._pending:
            self._drain_one()
        if self._accumulator is not None:
            self._accumulator.wait()
        self._arrived = [0] * len(self.layout.buckets)
        self._launched = [False] * len(self.layout.buckets)
