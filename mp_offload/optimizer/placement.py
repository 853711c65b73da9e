"""Where every ZeRO buffer lives, decided once (docs/DESIGN.md §3).

``placement(layout, options, device_type)`` is a pure function, like ``FlatLayout``: no
tensors. It turns one rank's layout and the ``OptimizerOptions`` into every buffer the
optimizer holds (name, report category, side, dtype, elements, pinned, copies).
``ZeroOptimizer`` allocates exactly these, the reducer takes its delivery targets and the
device/host split from it, and the planner sums its bytes: one rule, three users.

Side "host" is the CPU; "device" is the rank's device. Without offload the optimizer
state is on the device. A buffer listed with ``copies=0`` is not allocated; it is kept
so that its report category exists (with 0 bytes) as ``memory_bytes()`` reports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .host_memory import host_empty
from .options import OptimizerOptions
from .split import actual_fraction, host_buckets, split_buckets

BUCKET_BUFFERS = 2  # gradient bucket buffers on the device (double buffering)
Q8_BLOCK = 256  # elements per scale of an 8-bit moment (the kernel's, ops.adam_args.Q8_BLOCK)
STATE = ("master", "exp_avg", "exp_avg_sq", "grads")  # the slice's per-element state


@dataclass(frozen=True)
class Buffer:
    name: str  # unique: "master", "share.master", "grad_staging", ...
    category: str  # its key in memory_bytes() and the plan
    side: str  # "device" or "host"
    dtype: torch.dtype
    numel: int
    copies: int = 1  # DPU: two gradient buffers; the overlap: two states; 0: not allocated
    pinned: bool = False  # page-locked (exact size) for asynchronous copies
    zeroed: bool = True  # False: uninitialised (every element is written before use)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize * self.copies


@dataclass(frozen=True)
class Placement:
    options: OptimizerOptions
    buffers: tuple[Buffer, ...]
    offloaded: bool  # any state on the host
    device_buckets: int  # buckets whose state is on the device (all of them without offload)
    share_numel: int  # partial offload: the elements of those buckets
    actual_offload_fraction: float
    adam_reads_staging: bool  # the chunk that comes down is the step's whole gradient
    chunk_dtype: torch.dtype  # of the reduced chunks (the sum, with device accumulation)
    adam_writes_flat: bool  # Adam writes the new params into the model's own storage
    pinned: bool  # the host staging is pinned (CUDA with offload)
    host_pieces: tuple[int, ...]  # lengths of the host buckets' chunks (Adam pieces)
    chunks: tuple[int, ...] = ()  # every bucket's chunk, in slice order

    @property
    def split_bf16(self) -> bool:
        """bf16 params made on the host from the fp32 master use split_fp32's rule (the bits
        adam_step_remainder keeps), so the run is the same with or without remainders."""
        return self.offloaded and self.options.dtype == torch.bfloat16

    @property
    def device_range(self) -> tuple[int, int]:
        """(first, end) bucket indices of the buckets the device side steps: the last
        ones, whose gradients arrive last (their host step could not hide behind backward)."""
        return (len(self.chunks) - self.device_buckets, len(self.chunks))

    @property
    def host_range(self) -> tuple[int, int]:
        """(first, end) bucket indices of the host side's buckets (empty without offload)."""
        return (0, len(self.chunks) - self.device_buckets) if self.offloaded else (0, 0)

    def buffer(self, name: str) -> Buffer:
        return next(b for b in self.buffers if b.name == name)

    def has(self, name: str) -> bool:
        return any(b.name == name for b in self.buffers)

    def bytes(self, side: str) -> dict[str, int]:
        """Bytes by report category on ``side``, in the order memory_bytes() reports."""
        out: dict[str, int] = {}
        for b in self.buffers:
            if b.side == side:
                out[b.category] = out.get(b.category, 0) + b.nbytes
        return out


def _split(chunks, o: OptimizerOptions) -> tuple[int, float]:
    """(device buckets, actual offload fraction): partial offload keeps the last buckets
    on the device (``split.py``); nothing splits off without offload."""
    if not o.offloaded:
        return len(chunks), 0.0
    kept = split_buckets(chunks, o.offload_fraction)
    return kept, actual_fraction(chunks, kept)


def _state(o: OptimizerOptions, n: int, share: int, grad_copies: int, pieces) -> list[Buffer]:
    """The slice's master, moments and fp32 gradient: ``n`` elements on the host with
    offload (on the device without), and the device share's ``share`` on the device.
    ``pieces``: the host chunk lengths (an 8-bit moment's blocks restart at each)."""
    moments = (o.exp_avg_dtype, o.exp_avg_sq_dtype)
    dtypes = dict(zip(STATE, (torch.float32, *moments, torch.float32)))
    # The fp32 gradient sums k > 1 micro-batches on the host, or is any gradient without
    # offload; Adam reads the grad staging itself when that is already the whole gradient.
    # The overlap's speculative step writes the next state into a second copy (ping-pong).
    state = 2 if o.overlap_cpu_optimizer else 1
    copies = dict(master=state, exp_avg=state, exp_avg_sq=state, grads=grad_copies)
    side = "host" if o.offloaded else "device"
    host = dict(dtypes, master=torch.int16 if o.store_param_remainders else torch.float32)
    out = [Buffer(k, k, side, host[k], n, copies[k]) for k in STATE]
    scales = sum(-(-c // Q8_BLOCK) for c in pieces)
    out += [
        Buffer(k + ".scales", k, side, torch.float32, scales)
        for k in STATE
        if host[k] == torch.uint8
    ]
    if share:  # the device share's own fp32 master, moments and fp32 gradient
        out += [Buffer("share." + k, k, "device", dtypes[k], share) for k in STATE]
    return out


def placement(layout, o: OptimizerOptions, device_type: str) -> Placement:
    """Every buffer of one rank. ``layout``: a ``FlatLayout`` or the planner's
    ``RankShapes`` (``numel``, ``chunks``, ``max_bucket``); ``device_type``: of the
    rank's device ("cuda": the staging is pinned; "cpu": tests, where the params can be
    their own staging)."""
    chunks = list(layout.chunks)
    device_buckets, actual = _split(chunks, o)
    first = host_buckets(chunks, device_buckets)  # the device share's first bucket
    share = sum(chunks[first:]) if o.offloaded else 0
    n = sum(chunks) - share  # elements of the host buffers (device ones without offload)
    reads_staging = o.offloaded and (o.micro_batches == 1 or o.accumulates_on_device)
    chunk_dtype = o.accumulate_dtype if o.accumulates_on_device else o.reduce_dtype or o.dtype
    # On a CPU "device" with one DP rank the slice is the flat buffer element for element:
    # Adam writes the new params into the model's own storage, and the publish copies each
    # view onto itself, which torch skips. Not with DPU: forward t+1 must not see step t's
    # update while it is written. (One DP rank: the slice is as long as the flat buffer.)
    # With the overlap too: it writes a bucket's params once its gradient is final (nothing
    # of this backward reads them again) and a skip puts the old ones back from the master;
    # but not with remainders, whose hi is state that the speculation must not overwrite.
    below_fp32 = o.dtype != torch.float32
    writes_flat = (
        below_fp32
        and o.offloaded
        and device_type == "cpu"
        and o.dpu_warmup_steps is None
        and not (o.overlap_cpu_optimizer and o.store_param_remainders)
        and n == layout.numel
    )
    pinned = device_type == "cuda" and o.offloaded
    copies = 2 if o.dpu_warmup_steps is not None else 1  # DPU: backward t+1 writes the other
    buffers = [
        Buffer("params", "params", "device", o.dtype, layout.numel),
        Buffer(
            "grad_buckets",
            "grad_buckets",
            "device",
            o.reduce_dtype or o.dtype,
            layout.max_bucket,
            min(BUCKET_BUFFERS, len(chunks)),
            zeroed=False,
        ),
    ]
    if o.accumulates_on_device:  # padding stays zero: no slot ever writes it
        buffers.append(
            Buffer("grad_accumulation", "grad_accumulation", "device", chunk_dtype, layout.numel)
        )
    # Offload: new low-precision params go up from the param staging (none in fp32: the
    # master goes up), gradients come down into the grad staging, both pinned on CUDA.
    up = o.offloaded and below_fp32 and not writes_flat
    down = (copies if reads_staging else 1) if o.offloaded else 0
    ping = int(o.overlap_cpu_optimizer)  # the speculation's params go to a second staging
    buffers += [
        Buffer("param_staging", "staging", "host", o.dtype, n, up * (1 + ping), pinned, False),
        Buffer("grad_staging", "staging", "host", chunk_dtype, n, down, pinned, zeroed=False),
    ]
    pieces = tuple(c for c in chunks[:first] if c) if o.offloaded else ()
    buffers += _state(o, n, share, 0 if reads_staging else copies, pieces)
    return Placement(o, tuple(buffers), o.offloaded, device_buckets, share, actual,
                     reads_staging, chunk_dtype, writes_flat, pinned, pieces,
                     tuple(chunks))  # fmt: skip


def allocate(buf: Buffer, device: torch.device) -> list[torch.Tensor]:
    """The ``copies`` tensors of ``buf`` (its host side on the CPU, exact-size pinned)."""
    where = torch.device("cpu") if buf.side == "host" else device
    if buf.side == "host" and not buf.zeroed:
        return [host_empty(buf.numel, buf.dtype, buf.pinned) for _ in range(buf.copies)]
    make = torch.zeros if buf.zeroed else torch.empty
    return [make(buf.numel, dtype=buf.dtype, device=where) for _ in range(buf.copies)]
