"""Partial offload (``--optimizer-offload-fraction F``, Megatron-core's flag): the device share.

With ``--cpu-offload`` each DP rank's slice of the optimizer state normally lives on the
host. With F < 1 the slice is cut once, at a bucket boundary: the first buckets (about
1 - F of the slice) keep their fp32 master, Adam moments and fp32 gradient on the
device and are updated there by torch's fused AdamW; the rest is offloaded as before
and updated by the C++ Adam on the host. A bucket is never half on each side, so every
reduced chunk goes to exactly one place (``GradientReducer``), and the publish and the
all-gather do not care which side wrote a chunk. Checkpoints save the slice's two parts
in order, uncopied, and load at any F: F is a run-time choice (docs/DESIGN.md §3).

``split_buckets`` is a pure function of the per-rank bucket chunk sizes, shared with the
planner, so the plan splits exactly as the optimizer does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .adam_math import device_adam, fused_adam_step


def split_buckets(chunks: Sequence[int], fraction: float) -> int:
    """How many leading buckets (this rank's chunk sizes ``chunks``, in slice order) stay on
    the device at offload fraction ``fraction``: the boundary nearest (1 - F) of the slice,
    a tie going to the host. F = 1 gives 0 (today's offload), F = 0 every bucket."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--optimizer-offload-fraction must be >= 0 and <= 1, got {fraction}")
    want = (1.0 - fraction) * sum(chunks)
    best, best_err, acc = 0, want, 0
    for j, c in enumerate(chunks, 1):
        acc += c
        if abs(acc - want) < best_err:
            best, best_err = j, abs(acc - want)
    return best


def actual_fraction(chunks: Sequence[int], device_buckets: int) -> float:
    """The offload fraction a split really gives: host elements / slice elements."""
    total = sum(chunks)
    return 1.0 - sum(chunks[:device_buckets]) / total if total else 1.0


def clip_runs(runs, lo: int, hi: int) -> list[tuple[int, int, bool]]:
    """``(start, end, decay)`` runs of the slice cut to [lo, hi) and made relative to lo."""
    out = []
    for a, z, decay in runs:
        a, z = max(a, lo), min(z, hi)
        if z > a:
            out.append((a - lo, z - lo, decay))
    return out


class DeviceShare:
    """fp32 master, Adam moments and fp32 gradient of the slice's first elements, on the
    device. ``state``: those four tensors by name (``master``, ``exp_avg``,
    ``exp_avg_sq``, ``grads``: allocated as ``placement.py`` places them);
    ``decay_runs``: (start, end, decay) runs of that part (relative to it)."""

    def __init__(self, state: dict[str, torch.Tensor], decay_runs):
        self.master, self.grads = state["master"], state["grads"]
        self.exp_avg, self.exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        self.numel, self.device = self.master.numel(), self.master.device
        # Every reduced chunk of these buckets is copied (first micro-batch) or added into
        # ``grads``.
        self.decay_ranges = [(a, z) for a, z, decay in decay_runs if decay]
        # torch's fused AdamW where it runs and the moments are fp32 (adam_math.device_adam).
        self._adam = device_adam(self.device, self.exp_avg.dtype, self.exp_avg_sq.dtype)
        self.fused = self._adam is fused_adam_step

    @torch.no_grad()
    def step(
        self,
        *,
        step: int,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        grad_scale: float,
    ) -> None:
        """AdamW over the share (queued on the current stream: asynchronous on a GPU)."""
        if self.numel == 0:
            return
        self._adam(
            self.master,
            self.grads,
            self.exp_avg,
            self.exp_avg_sq,
            step=step,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            grad_scale=grad_scale,
            decay_runs=self.decay_ranges,
        )

    def publish(self, flat: torch.Tensor, buckets, dp_rank: int) -> None:
        """Copy (and round) the new master of ``buckets`` into the flat parameter buffer."""
        for b in buckets:
            lo, hi = b.chunk_range(dp_rank)
            flat[lo:hi].copy_(self.master[b.slice_offset : b.slice_offset + b.chunk])

    def memory_bytes(self) -> dict[str, int]:
        return {
            k: t.numel() * t.element_size()
            for k, t in (
                ("master", self.master),
                ("exp_avg", self.exp_avg),
                ("exp_avg_sq", self.exp_avg_sq),
                ("grads", self.grads),
            )
        }
