"""Gradient reduction for the ZeRO optimizer: bucket hooks, reduce-scatter, delivery, norm.

Each parameter's gradient goes into its bucket's buffer as soon as autograd has
accumulated it (and is freed, so the device never keeps a full-size gradient). A full
bucket is averaged and reduce-scattered over the DP group asynchronously, and this
rank's reduced chunk is delivered to where the optimizer wants it (``GradTargets``):
- offload, the final gradient (one micro-batch, or ``accumulate_on_device``): copied down
  into the low-precision host staging that the CPU Adam reads directly;
- offload, k > 1 micro-batches accumulated on the host: copied down, then copied (first
  micro-batch) or added (later ones) into the fp32 gradient slice, on a worker thread as
  the copies land (CUDA), or in place (CPU);
- no offload: copied or added into the fp32 gradient slice on the device; so are the
  chunks of the first ``device_buckets`` buckets with partial offload (``device_share.py``).
The squared gradient norm is computed where the final gradient first exists, so the host
never makes a separate pass for it: from each reduced chunk on the device (final chunks),
or on the host in the pass that adds the last micro-batch. Two bucket buffers (double
buffering): one bucket's reduce-scatter overlaps the backward that fills the next.

With ``accumulate_on_device`` the micro-batches' gradients are summed in one fp32 device
buffer laid out like the flat parameters (as the host path sums them), and only the last
micro-batch reduce-scatters it, bucket by bucket as backward completes them: one
reduce-scatter and 6 B/param of host<->device traffic per step for any k.

On CUDA each host chunk's copy down is queued when its bucket is launched (``CopyStream``),
so it overlaps the rest of backward; the compute stream waits for it only when it reuses
that bucket's buffer. At most ``BUCKET_BUFFERS`` reduced chunks are pending.

This is the line Megatron-core draws between its DDP gradient buffers and its
distributed optimizer; the optimizer (``zero.py``) owns the state and the update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ops.host_ops import accumulate_, sum_squares
from ..parallel_state import ParallelGroup
from .host_accumulator import HostAccumulator
from .layout import FlatLayout
from .placement import BUCKET_BUFFERS, Placement, allocate

# torch >= 2.13 renamed the tensor collectives; keep working on older releases too.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CopyStream:
    """Device->host copies of reduced chunks on their own CUDA stream.

    On the compute stream the copies would queue behind the rest of backward's kernels,
    adding PCIe time to backward instead of overlapping it. A copy is queued as soon as
    its bucket is launched: the copy stream first waits for where the chunk becomes ready
    (the reduce-scatter's work with DP > 1, else the compute stream), records an event
    when the copy is done, and tells the caching allocator the source is in use there.
    The events are blocking: a thread that waits on one sleeps instead of spinning.
    """

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None):
        """Queue ``dst.copy_(src)`` after ``after`` (a collective's work, or None: after
        what the compute stream queued so far); returns the event that marks it done."""
        compute = torch.cuda.current_stream()
        with torch.cuda.stream(self.stream):
            if after is not None:
                after.wait()  # NCCL: this stream waits for the collective, the host does not
            else:
                self.stream.wait_stream(compute)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event(blocking=True)
            done.record(self.stream)
        src.record_stream(self.stream)
        return done

    @staticmethod
    def before_reuse(done) -> None:
        """The compute stream may overwrite a copied buffer only after its copy finished."""
        torch.cuda.current_stream().wait_event(done)

    def drain(self) -> None:
        """The host is about to read what was copied: wait (sleeping) for every copy."""
        done = torch.cuda.Event(blocking=True)
        done.record(self.stream)
        done.synchronize()


@dataclass
class GradTargets:
    """Where one step's reduced chunks go (host-slice layout, this rank's elements)."""

    staging: torch.Tensor | None  # offload: the chunks as they come down (reduce dtype)
    grads: torch.Tensor | None  # fp32 accumulation slice (host with offload, else device)
    # partial offload: the fp32 gradient of the buckets kept on the device (slice offsets)
    device_grads: torch.Tensor | None = None


def _sum_squares(t: torch.Tensor, ranges) -> torch.Tensor:
    """Sum of squares (fp64 scalar, on t's device) over ``ranges`` of the 1-D tensor ``t``."""
    if t.device.type == "cpu":  # the C++ pass (fp64, fixed order); torch's widens a copy first
        return sum_squares(t, ranges)
    views = [t[a:z] for a, z in ranges]
    if not views:
        return torch.zeros((), dtype=torch.float64, device=t.device)
    # fp64 accumulation, as the host's C++ pass sums squares: the device and host paths
    # of the same gradient then clip by the same factor (fp32 partial norms differ ~1e-7).
    norms = torch._foreach_norm(views, 2, dtype=torch.float64)
    return torch.stack(norms).square().sum()


class GradientReducer:
    def __init__(
        self,
        layout: FlatLayout,
        dp: ParallelGroup,
        device: torch.device,
        place: Placement,
        copier=None,
    ):
        """``place``: the rank's buffers (``placement.py``): the bucket buffers' dtype and
        size, the device accumulation buffer, where each chunk goes (the leading
        ``device_buckets`` stay on the device with partial offload; host targets start
        after them) and whether Adam reads the staging itself. ``copier`` (a
        ``CopyStream``) on CUDA with offload."""
        o = place.options
        buckets = place.buffer("grad_buckets")
        self.layout, self.dp, self.device, self.dtype = layout, dp, device, buckets.dtype
        self.offload, self.copier = place.offloaded, copier
        self.device_buckets, self.share_numel = place.device_buckets, place.share_numel
        self.micro_batches = o.micro_batches
        self.accumulate_on_device = o.accumulates_on_device
        self.adam_reads_staging = place.adam_reads_staging
        self.targets: GradTargets | None = None
        self.bytes_down = 0
        self.micro = 0  # backward calls so far in this step
        self._norm_parts: list[torch.Tensor] = []
        self._slot = {id(s.param): s for s in layout.slots}
        self._norm_ranges = self._ranges_for_norm()
        self._arrived = [0] * len(layout.buckets)
        self._launched = [False] * len(layout.buckets)
        self._buffers: dict[int, torch.Tensor] = {}  # bucket index -> its buffer
        self._pool: list[tuple] = []  # (buffer, event of the copy still reading it, or None)
        self._pending: list[tuple] = []  # (bucket, work, chunk_out, buffer)
        # The overlap (``overlap.py``) queues each final chunk's speculative Adam on the
        # same worker, after that chunk's host sum: a real thread on the CPU too.
        self.overlap = o.overlap_cpu_optimizer and self.offload
        self.on_final = None  # overlap: bucket -> the host work once its gradient is final
        worker = self.offload and copier is not None and not self.adam_reads_staging
        self._accumulator = HostAccumulator(device) if worker or self.overlap else None
        self.max_bucket = buckets.numel
        self.num_buffers = 0  # the bucket buffers are made as backward first needs them
        # The dtype of the chunks that come down: the sum itself with device accumulation.
        self.staging_dtype = place.chunk_dtype
        self.acc_buffer = None
        if place.has("grad_accumulation"):
            (self.acc_buffer,) = allocate(place.buffer("grad_accumulation"), device)
            self._touched: set[int] = set()
        for s in layout.slots:
            s.param.register_post_accumulate_grad_hook(self._grad_ready)

    # ----------------------------------------------------------------- set-up
    def _ranges_for_norm(self) -> list[list[tuple[int, int]]]:
        """Per bucket, the ranges of its chunk that count for the norm (merged runs)."""
        out: list[list[tuple[int, int]]] = [[] for _ in self.layout.buckets]
        starts = [b.slice_offset for b in self.layout.buckets]
        b = 0
        for seg in self.layout.segments:
            while b + 1 < len(starts) and seg.slice_start >= starts[b + 1]:
                b += 1
            if not seg.counts_for_norm or seg.slice_end <= seg.slice_start:
                continue
            a, z = seg.slice_start - starts[b], seg.slice_end - starts[b]
            if out[b] and out[b][-1][1] == a:
                out[b][-1] = (out[b][-1][0], z)
            else:
                out[b].append((a, z))
        return out

    def buffer_bytes(self) -> int:
        """Device bytes of the bucket buffers."""
        e = self.dtype.itemsize
        return self.max_bucket * e * max(self.num_buffers, 1)

    # ------------------------------------------------------------- one step
    def start_step(self, targets: GradTargets) -> None:
        self.wait_host()  # nothing of the last step may still write into the targets
        self.targets, self.micro = targets, 0
        self._norm_parts = []

    def norm_squared(self) -> torch.Tensor:
        """This rank's squared gradient norm over its chunks (after the last micro-batch)."""
        if self.micro != self.micro_batches:
            raise RuntimeError(
                f"optimizer step after {self.micro} of {self.micro_batches} "
                f"backward calls (micro-batches) in this step"
            )
        self.wait_host()  # the host parts are summed on the worker
        parts = self._norm_parts
        if not parts:
            return torch.zeros((), dtype=torch.float64)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in parts:  # partial offload: device-share parts and host parts
            by_device.setdefault(p.device, []).append(p)
        sums = [torch.stack(group).sum() for group in by_device.values()]
        if len(sums) == 1:
            return sums[0]
        # summed where they are first: one device->host sync, not one per bucket
        return torch.stack([t if t.device.type == "cpu" else t.cpu() for t in sums]).sum()

    @property
    def _last_micro_batch(self) -> bool:
        return self.micro == self.micro_batches - 1

    # ---------------------------------------------------------------- backward
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
        if self.micro >= self.micro_batches:
            raise RuntimeError(
                f"more backward calls than the {self.micro_batches} "
                f"micro-batches per step this optimizer was built for"
            )
        slot = self._slot[id(param)]
        b = self.layout.buckets[slot.bucket]
        grad = param.grad.reshape(-1)
        if self.acc_buffer is not None:
            dst = self.acc_buffer[slot.start : slot.start + slot.numel]
            dst.add_(grad) if id(param) in self._touched else dst.copy_(grad)
            self._touched.add(id(param))
            param.grad = None
            if not self._last_micro_batch:
                return
        else:
            buf = self._buffers.get(b.index)
            if buf is None:
                buf = self._buffers[b.index] = self._take_buffer()
                buf[: b.numel].zero_()
            off = slot.start - b.start
            buf[off : off + slot.numel].copy_(grad)
            param.grad = None  # the device never keeps a full-size gradient
        self._arrived[b.index] += 1
        if self._arrived[b.index] == len(b.slots):
            self._launch(b)

    def _bucket_data(self, b) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the bucket's gradient, the pooled buffer holding it or None)."""
        if self.acc_buffer is not None:
            for s in b.slots:  # a parameter without a gradient this step contributes zero
                if id(s.param) not in self._touched:
                    self.acc_buffer[s.start : s.start + s.numel].zero_()
            return self.acc_buffer[b.start : b.end], None
        buf = self._buffers.pop(b.index, None)
        if buf is None:  # no gradient reached this bucket: still take part in the collective
            buf = self._take_buffer()
            buf[: b.numel].zero_()
        return buf[: b.numel], buf

    def _to_host(self, b) -> bool:
        return self.offload and b.index >= self.device_buckets

    def _launch(self, b) -> None:
        # Each pending bucket holds a reduced chunk: at most BUCKET_BUFFERS stay alive.
        while len(self._pending) >= BUCKET_BUFFERS:
            self._drain_one()
        data, buf = self._bucket_data(b)
        if self.dp.size > 1:  # x / 1 is x exactly: one DP rank skips the pass over the bucket
            data.div_(self.dp.size)  # average before summing: keeps fp16 sums in range
        if self.dp.size > 1:
            out = torch.empty(b.chunk, dtype=data.dtype, device=self.device)
            work = _reduce_scatter(out, data, group=self.dp.torch_group(), async_op=True)
        else:
            out, work = data, None
        # On CUDA the copy down is queued now, so it overlaps the rest of backward; the
        # compute stream waits for it only when it reuses the buffer (``_take_buffer``).
        early = self.copier is not None and self._to_host(b)
        landed = self._copy_down(b, out, work) if early else None
        self._pending.append((b, work, out, buf, early, landed))
        self._launched[b.index] = True

    def _drain_one(self) -> None:
        b, work, out, buf, copied, landed = self._pending.pop(0)
        if work is not None:
            work.wait()  # the compute stream (gloo: the host) after the reduce-scatter
        self._reduce_on_device(b, out)
        if self._to_host(b) and not copied:
            landed = self._copy_down(b, out, None)
        if buf is not None:
            # Reuse waits for the bucket's copy down: with DP=1 it reads the buffer itself;
            # with DP>1 it reads the chunk, and the wait bounds the chunks still in flight.
            self._pool.append((buf, landed))

    def _reduce_on_device(self, b, out: torch.Tensor) -> None:
        """The device's part of a reduced chunk: its norm where it is final, and the copy
        or add into the device gradient (no offload, or a bucket of the device share)."""
        lo, hi = b.slice_offset, b.slice_offset + b.chunk
        ranges, final = self._norm_ranges[b.index], self._last_micro_batch
        # With device accumulation a chunk is delivered once per step: it is the whole sum.
        overwrite = self.micro == 0 or self.accumulate_on_device
        whole_gradient = self.micro_batches == 1 or self.accumulate_on_device
        if final and whole_gradient:
            self._norm_parts.append(_sum_squares(out, ranges))  # on the device, no host pass
        if self._to_host(b):
            return
        grads = self.targets.grads if not self.offload else self.targets.device_grads
        grad = grads[lo:hi]
        grad.copy_(out) if overwrite else grad.add_(out)
        if final and not whole_gradient:
            self._norm_parts.append(_sum_squares(grad, ranges))

    def _copy_down(self, b, out: torch.Tensor, work):
        """Copy one reduced chunk into the host staging (after ``work``, its collective);
        queue the host sum of it; returns the copy's event (None: copied already)."""
        lo = b.slice_offset - self.share_numel  # host buffers start after the device share
        stage = self.targets.staging[lo : lo + b.chunk]
        self.bytes_down += b.chunk * out.element_size()
        landed = None
        if self.copier is not None:
            landed = self.copier.copy(stage, out, after=work)
        else:
            stage.copy_(out)
        if not self.adam_reads_staging:
            overwrite, final = self.micro == 0, self._last_micro_batch
            grad = self.targets.grads[lo : lo + b.chunk]
            work = self._host_accumulate(grad, stage, overwrite, final, self._norm_ranges[b.index])
            if self._accumulator is not None:
                self._accumulator.submit(work, landed)  # overlaps the rest of backward
            else:
                work()
        if self.on_final is not None and self._last_micro_batch:
            self._accumulator.submit(self.on_final(b), landed)  # FIFO: after its host sum
        return landed

    def _host_accumulate(self, grad, stage, overwrite: bool, final: bool, ranges):
        def work():
            # C++ (torch's fp32 += bf16 is slow); the last micro-batch completes the
            # gradient, so its pass also sums the squares for the norm: no second read.
            norm = accumulate_(
                grad, stage, overwrite=overwrite, norm_ranges=ranges if final else None
            )
            if final:
                self._norm_parts.append(norm)

        return work

    def wait_host(self) -> None:
        """Until the worker has done all the host work queued (sums, speculative Adam)."""
        if self._accumulator is not None:
            self._accumulator.wait()

    def finish(self) -> None:
        """End of one backward: launch what is left, wait for every chunk to land."""
        if self.acc_buffer is None or self._last_micro_batch:
            # Buckets whose params got no gradient (or an unused param) still launch, in
            # order, so every DP rank issues the same collectives.
            for b in self.layout.buckets:
                if not self._launched[b.index]:
                    self._launch(b)
            while self._pending:
                self._drain_one()
            if not (self.overlap and self._last_micro_batch):  # overlap: the step waits
                self.wait_host()
            if self.adam_reads_staging and self.copier is not None:
                self.copier.drain()  # Adam reads the staging next
        if self.acc_buffer is not None and self._last_micro_batch:
            self._touched.clear()
        self.micro += 1
        self._arrived = [0] * len(self.layout.buckets)
        self._launched = [False] * len(self.layout.buckets)
