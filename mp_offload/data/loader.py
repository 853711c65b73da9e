"""Micro-batches for the training loop: TP rank 0 reads, the TP group receives a broadcast.

Each DP rank reads its own slice of every global batch (PretrainingSampler); within
a TP group only rank 0 touches the dataset, so a TP=8 job does not read everything
eight times.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..parallel_state import ParallelGroup
from .samplers import PretrainingSampler, collate


class MockGPTDataset:
    """A synthetic but learnable stream: arithmetic progressions modulo the vocabulary.

    Sample i starts at a random token and steps by one of a few strides, so a model
    can drive the loss well below log(vocab) — enough to see training work.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        rng = np.random.default_rng((self.seed, idx))
        start = rng.integers(0, self.vocab_size)
        stride = rng.choice([1, 2, 3, 5, 7])
        text = (start + stride * np.arange(self.seq_length + 1)) % self.vocab_size
        return {"text": text.astype(np.int64)}


class SizedPlaceholder:
    """What a TP rank that does not read data holds for a split: only its length."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length


class BatchIterator:
    """Yields [micro, seq+1] int64 token tensors on ``device``, resumable from a sample count.

    Every rank of the TP group runs the same sampler (non-readers over a
    ``SizedPlaceholder``), so all of them know when the data ends without a per-batch
    flag read back from the device (a host-device sync per micro-batch on CUDA).
    """

    def __init__(
        self,
        dataset,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seq_length: int,
        device,
        tp_group: ParallelGroup | None = None,
        tp_src: int = 0,
        is_reader: bool = True,
    ):
        self.dataset, self.device = dataset, device
        self.shape = (micro_batch_size, seq_length + 1)
        self.tp_group = tp_group or ParallelGroup.single()
        self.tp_src, self.is_reader = tp_src, is_reader
        self._indices = iter(
            PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
        )

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        idx = next(self._indices)  # StopIteration on every rank of the group alike
        if self.is_reader:
            batch = torch.from_numpy(collate([self.dataset[i] for i in idx])["text"])
            batch = batch.to(self.device, non_blocking=True)
        else:
            batch = torch.empty(self.shape, dtype=torch.int64, device=self.device)
        if self.tp_group.size > 1:
            dist.broadcast(batch, self.tp_src, group=self.tp_group.torch_group())
        return batch
