"""What the device side and the host side of the ZeRO optimizer share: one face.

A side owns a run of whole buckets (its part of this rank's slice, ``offset`` on) and
everything of their optimizer state. The reducer hands it each reduced chunk
(``launched`` when the reduce-scatter is queued, ``receive`` once it is done); the
schedule asks it to ``step`` and ``publish``; checkpoints read and write it through
``parts``/``target``/``commit`` (a save through ``saved_chunks`` where ``converts``);
reports and the plan through ``buffers``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..ops.host_ops import sum_squares
from .adam_calls import piece_segments


@dataclass(frozen=True)
class Piece:
    """One bucket's chunk as a side steps it: ``lo`` in the side's buffers, ``n`` long."""

    bucket: object  # layout.Bucket
    lo: int
    n: int
    segments: tuple  # (lo, hi, slot or None) relative to lo (adam_calls.piece_segments)


@dataclass(frozen=True)
class Micro:
    """Which backward call a delivered chunk comes from: ``first`` overwrites, ``last``
    completes the gradient; ``whole``: the chunk is the step's whole gradient (one
    micro-batch, or the device's own sum of them)."""

    first: bool
    last: bool
    whole: bool


def sum_of_squares(t: torch.Tensor, ranges) -> torch.Tensor:
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


def no_phase(name: str):
    """The default phase timer: times nothing (``ZeroOptimizer.set_phase_timer``)."""
    return contextlib.nullcontext()


class Side:
    """The bookkeeping of a side: its buckets, their pieces and norm ranges."""

    phase = staticmethod(no_phase)  # a benchmark's timer: phase(name) -> context manager

    def __init__(self, layout, bucket_range: tuple[int, int], streams):
        first, end = bucket_range
        self.layout, self.streams = layout, streams
        self.buckets = layout.buckets[first:end]
        self.offset = self.buckets[0].slice_offset if self.buckets else 0
        self.numel = sum(b.chunk for b in self.buckets)
        self.norm_parts: list[torch.Tensor] = []
        ranges = layout.norm_ranges()
        self.norm_ranges = {b.index: ranges[b.index] for b in self.buckets}
        self.pieces = [
            Piece(b, b.slice_offset - self.offset, b.chunk, self._segments(b.slice_offset, b.chunk))
            for b in self.buckets
            if b.chunk
        ]

    def _segments(self, lo: int, n: int):
        return piece_segments(self.layout, lo, lo + n)

    def owns(self, slice_offset: int) -> bool:
        return self.offset <= slice_offset < self.offset + self.numel

    def start_step(self) -> None:
        self.norm_parts = []

    def launched(self, b, out: torch.Tensor, work, micro: Micro):
        """Bucket ``b``'s reduce-scatter into ``out`` is queued (``work``); returns a token
        for ``receive``."""
        return None

    def end_backward(self, micro: Micro) -> None:
        """Every chunk of this backward call has been received."""

    def wait(self) -> None:
        """Until nothing this side queued still writes its gradients."""

    def converts(self, key: str) -> bool:
        """Whether ``parts(key)`` is a temporary (a converted form, or a copy to the
        host): a save then writes ``saved_chunks`` instead, one chunk at a time."""
        return self.parts(key).device.type != "cpu"

    def saved_chunks(self, key: str, n: int):
        """``parts(key)`` as fp32 host tensors of at most ``n`` elements, in order."""
        t = self.parts(key)
        for a in range(0, t.numel(), n):
            yield t[a : a + n].to(device="cpu", dtype=torch.float32)

    def chunk_norm(self, b, t: torch.Tensor) -> None:
        self.norm_parts.append(sum_of_squares(t, self.norm_ranges[b.index]))
