"""Weighted blend of several datasets with a deterministic, error-minimising schedule."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) for ``size`` blended samples.

    Greedy earliest-deadline schedule (Tijdeman's chairman assignment): at
    step n, among datasets whose deficit ``w[d] * n - count[d]`` is at least
    delta = 1 / (2k - 2), pick the one whose next sample is due soonest,
    ``(count[d] + 1 - delta) / w[d]`` (ties: lowest d). Unlike "largest
    deficit first", this provably keeps every running count within
    ``1 - delta`` (< 1) of ``w[d] * n`` at every n. Each dataset is read in
    its own order 0, 1, 2, ...
    """
    w = [float(x) for x in weights]
    total = sum(w)
    if not w or total <= 0 or any(x < 0 for x in w):
        raise ValueError(f"weights must be non-negative with a positive sum: {list(weights)}")
    w = [x / total for x in w]
    live = [d for d in range(len(w)) if w[d] > 0]  # zero-weight datasets never get samples
    delta = 1.0 / (2 * len(live) - 2) if len(live) > 1 else 0.5
    counts = [0] * len(w)
    dataset_index = np.empty(size, dtype=np.int32)
    sample_index = np.empty(size, dtype=np.int64)
    for i in range(size):  # plain Python: a handful of datasets, ~1 us per sample
        n = i + 1
        best, best_due = -1, 0.0
        for d in live:
            if w[d] * n - counts[d] >= delta - 1e-9:  # tolerance for float rounding
                due = (counts[d] + 1 - delta) / w[d]
                if best < 0 or due < best_due:
                    best, best_due = d, due
        if best < 0:  # cannot happen in exact arithmetic; stay safe under rounding
            best = max(live, key=lambda d: w[d] * n - counts[d])
        dataset_index[i] = best
        sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """``ds[i]`` is sample ``dataset_sample_index[i]`` of ``datasets[dataset_index[i]]``.

    The schedule is fully determined by the weights and size; ``seed`` is kept
    for interface parity (the components are already shuffled by their seeds).
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int, seed: int = 0):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("need one weight per dataset (and at least one dataset)")
        self.datasets = list(datasets)
        self.size = int(size)
        self.seed = int(seed)
        total = float(sum(weights))
        self.weights = [float(x) / total for x in weights]
        self.dataset_index, self.dataset_sample_index = build_blending_indices(
            self.weights, self.size
        )
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (ds, c) in enumerate(zip(self.datasets, counts)):
            if c > len(ds):
                raise ValueError(
                    f"blend needs {c} samples from dataset {d} but it has only {len(ds)}"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict:
        idx = int(idx)
        if idx < 0:
            idx += self.size
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for {self.size} samples")
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]
