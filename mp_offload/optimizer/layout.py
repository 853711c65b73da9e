"""Flat layout of one TP rank's parameters: buckets, and each DP rank's partition of them.

Parameters are laid out in reverse model order (the order backward produces their
gradients) and grouped into buckets of about ``bucket_size`` elements, each padded
to a multiple of ``dp * ALIGN``. Bucket b is reduce-scattered as a unit, so DP rank
d owns the d-th chunk of every bucket; its slice is those chunks back to back (its
optimizer state: on the host with offload, on the device without, or split between them).
The layout is a pure function of (parameter shapes, dp, bucket_size): every rank
computes the same one, and checkpoints record it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..tensor_parallel.utils import is_duplicate_across_tp

ALIGN = 64  # elements: keeps every chunk SIMD- and cache-line aligned


@dataclass
class Slot:
    name: str
    param: torch.nn.Parameter
    start: int  # offset in the flat buffer
    numel: int
    bucket: int
    index: int = 0  # in ``FlatLayout.slots``


@dataclass
class Bucket:
    index: int
    start: int
    end: int
    dp: int
    slots: list[Slot] = field(default_factory=list)
    slice_offset: int = 0  # where this rank's chunk starts in its slice

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def chunk(self) -> int:
        return self.numel // self.dp

    def chunk_range(self, dp_rank: int) -> tuple[int, int]:
        lo = self.start + dp_rank * self.chunk
        return lo, lo + self.chunk


@dataclass
class Segment:
    """A run of this rank's slice belonging to one parameter (or padding)."""

    slice_start: int
    slice_end: int
    slot: int | None  # index of its parameter's slot (None: padding)
    counts_for_norm: bool  # TP-sharded, or TP rank 0 (docs/DESIGN.md §2)


class FlatLayout:
    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        dp: int,
        dp_rank: int,
        tp_rank: int,
        bucket_size: int,
    ):
        if bucket_size < 1:
            raise ValueError(f"--reduce-bucket-size must be >= 1, got {bucket_size}")
        self.dp, self.dp_rank, self.bucket_size = dp, dp_rank, bucket_size
        quantum = dp * ALIGN
        self.slots: list[Slot] = []
        self.buckets: list[Bucket] = []
        offset, current = 0, []

        def close_bucket():
            nonlocal offset, current
            start = current[0].start
            used = offset - start
            end = start + -(-used // quantum) * quantum
            b = Bucket(len(self.buckets), start, end, dp, current)
            self.buckets.append(b)
            offset, current = end, []

        for name, p in reversed(named_params):
            slot = Slot(name, p, offset, p.numel(), len(self.buckets), len(self.slots))
            self.slots.append(slot)
            current.append(slot)
            offset += p.numel()
            if offset - current[0].start >= bucket_size:
                close_bucket()
        if current:
            close_bucket()
        self.numel = offset  # padded total
        host = 0
        for b in self.buckets:
            b.slice_offset = host
            host += b.chunk
        self.slice_numel = host
        self.segments = self._segments(tp_rank)

    def _segments(self, tp_rank: int) -> list[Segment]:
        segs = []
        for b in self.buckets:
            lo, hi = b.chunk_range(self.dp_rank)
            cursor = lo
            for s in b.slots:
                a, z = max(lo, s.start), min(hi, s.start + s.numel)
                if a >= z:
                    continue
                if a > cursor:
                    segs.append(
                        Segment(cursor - lo + b.slice_offset, a - lo + b.slice_offset, None, False)
                    )
                segs.append(
                    Segment(
                        a - lo + b.slice_offset,
                        z - lo + b.slice_offset,
                        s.index,
                        not is_duplicate_across_tp(s.param, tp_rank),
                    )
                )
                cursor = z
            if cursor < hi:
                segs.append(
                    Segment(cursor - lo + b.slice_offset, hi - lo + b.slice_offset, None, False)
                )
        return segs

    @property
    def chunks(self) -> tuple[int, ...]:
        """This DP rank's chunk of each bucket, in slice order."""
        return tuple(b.chunk for b in self.buckets)

    @property
    def max_bucket(self) -> int:
        """Elements of one gradient bucket buffer (the largest bucket)."""
        return max(b.numel for b in self.buckets)

    def owned_pieces(self):
        """(slot, flat-offset-in-param, slice offset, length) for every owned piece of a param."""
        for b in self.buckets:
            lo, hi = b.chunk_range(self.dp_rank)
            for s in b.slots:
                a, z = max(lo, s.start), min(hi, s.start + s.numel)
                if a < z:
                    yield s, a - s.start, a - lo + b.slice_offset, z - a

    def norm_ranges(self) -> list[list[tuple[int, int]]]:
        """Per bucket, the ranges of this rank's chunk that count for the gradient norm
        (merged runs, relative to the chunk)."""
        out: list[list[tuple[int, int]]] = [[] for _ in self.buckets]
        starts = [b.slice_offset for b in self.buckets]
        b = 0
        for seg in self.segments:
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

    def describe(self) -> dict:
        """What a checkpoint records to re-partition later."""
        return dict(
            dp=self.dp,
            bucket_size=self.bucket_size,
            numel=self.numel,
            host_numel=self.slice_numel,
            buckets=[dict(start=b.start, end=b.end) for b in self.buckets],
            slots=[
                dict(name=s.name, start=s.start, numel=s.numel, shape=list(s.param.shape))
                for s in self.slots
            ],
        )


def layout_from_description(desc: dict, dp_rank: int) -> FlatLayout:
    """Rebuild a saved layout (shapes only, on the meta device) as seen by ``dp_rank``."""
    named = [(s["name"], torch.empty(s["shape"], device="meta")) for s in reversed(desc["slots"])]
    layout = FlatLayout(named, desc["dp"], dp_rank, 0, desc["bucket_size"])
    got = [dict(start=b.start, end=b.end) for b in layout.buckets]
    if got != desc["buckets"] or layout.numel != desc["numel"]:
        raise ValueError("saved optimizer layout cannot be reproduced (bucket boundaries differ)")
    return layout
