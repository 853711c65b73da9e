"""Megatron-style pretraining batch sampler and a numpy collate function."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np


class PretrainingSampler:
    """Batch sampler over sample indices ``consumed_samples .. total_samples - 1``.

    Consecutive indices form global batches of ``micro_batch_size *
    data_parallel_size``; each DP rank yields its own contiguous
    ``micro_batch_size`` slice. Because the walk is sequential (the dataset
    itself is already shuffled), resuming with ``consumed_samples`` yields
    exactly what an uninterrupted run would from that point on.

    drop_last=False also yields the final partial global batch, sliced like
    the full ones (so trailing ranks may get a short batch or nothing).
    Usable as ``torch.utils.data.DataLoader(ds, batch_sampler=...)``.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        if total_samples <= 0:
            raise ValueError(f"total_samples must be positive, got {total_samples}")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} outside [0, {total_samples}]")
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError("micro_batch_size and data_parallel_size must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank} outside [0, {data_parallel_size})"
            )
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_rank = int(data_parallel_rank)
        self.data_parallel_size = int(data_parallel_size)
        self.drop_last = bool(drop_last)
        self.global_batch = self.micro_batch_size * self.data_parallel_size

    def _slice(self, batch_start: int, batch_end: int) -> list[int]:
        lo = batch_start + self.data_parallel_rank * self.micro_batch_size
        hi = min(lo + self.micro_batch_size, batch_end)
        return list(range(lo, hi))

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        full = remaining // self.global_batch
        if self.drop_last or remaining % self.global_batch == 0:
            return full
        tail_start = self.consumed_samples + full * self.global_batch
        return full + (1 if self._slice(tail_start, self.total_samples) else 0)

    def __iter__(self) -> Iterator[list[int]]:
        start = self.consumed_samples
        while start + self.global_batch <= self.total_samples:
            yield self._slice(start, start + self.global_batch)
            start += self.global_batch
        if not self.drop_last and start < self.total_samples:
            tail = self._slice(start, self.total_samples)
            if tail:
                yield tail


def collate(samples: Sequence[dict]) -> dict:
    """List of ``{"text": int[s+1]}`` -> ``{"text": int64[b, s+1]}`` (numpy)."""
    if not samples:
        raise ValueError("cannot collate an empty batch")
    return {"text": np.stack([np.asarray(s["text"], dtype=np.int64) for s in samples])}
