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

import functools
from collections.abc import Sequence

import torch

from .adam_math import torch_adam_step


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


@functools.cache
def fused_adamw_available(device_type: str) -> bool:
    """torch's fused AdamW runs on CUDA (torch >= 2.1) and on the CPU from torch 2.4: try it."""
    if not hasattr(torch, "_fused_adamw_"):
        return False
    if device_type == "cuda":
        return True
    try:
        t = [torch.zeros(1)]
        torch._fused_adamw_(
            t,
            [torch.zeros(1)],
            [torch.zeros(1)],
            [torch.zeros(1)],
            [],
            [torch.ones(())],
            lr=0.0,
            beta1=0.9,
            beta2=0.99,
            weight_decay=0.0,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
        )
        return True
    except (RuntimeError, NotImplementedError):
        return False


class DeviceShare:
    """fp32 master, Adam moments and fp32 gradient of the slice's first ``numel`` elements,
    on ``device``. ``decay_runs``: (start, end, decay) runs of that part (relative to it)."""

    def __init__(
        self,
        numel: int,
        device: torch.device,
        decay_runs,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
    ):
        self.numel, self.device = numel, device
        self.master = torch.zeros(numel, dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros(numel, dtype=exp_avg_dtype, device=device)
        self.exp_avg_sq = torch.zeros(numel, dtype=exp_avg_sq_dtype, device=device)
        # Every reduced chunk of these buckets is copied (first micro-batch) or added here.
        self.grads = torch.zeros(numel, dtype=torch.float32, device=device)
        self.decay_ranges = [(a, z) for a, z, decay in decay_runs if decay]
        # The fused kernel takes fp32 moments only; bf16 moments step with torch ops.
        moments32 = exp_avg_dtype == exp_avg_sq_dtype == torch.float32
        self.fused = moments32 and fused_adamw_available(device.type)
        if self.fused:
            self._groups = self._fused_groups(decay_runs)

    def _fused_groups(self, decay_runs) -> list[tuple[bool, list[list[torch.Tensor]]]]:
        """Views of (master, grads, m, v, step) per decay run, made once: one fused call per
        weight-decay setting, each run its own tensor in the call's lists."""
        self._steps = torch.zeros(len(decay_runs), dtype=torch.float32, device=self.device)
        groups = []
        for want in (True, False):
            idx = [i for i, r in enumerate(decay_runs) if r[2] == want]
            lists = [
                [t[decay_runs[i][0] : decay_runs[i][1]] for i in idx]
                for t in (self.master, self.grads, self.exp_avg, self.exp_avg_sq)
            ]
            lists.append([self._steps[i] for i in idx])  # separate step tensors, read only
            if idx:
                groups.append((want, lists))
        return groups

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
        if not self.fused:
            torch_adam_step(
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
            return
        self._steps.fill_(float(step))
        # The kernel divides the gradients by grad_scale (AMP's unscale): pass the inverse.
        inv = (
            None
            if grad_scale == 1.0
            else torch.full((), 1.0 / grad_scale, dtype=torch.float32, device=self.device)
        )
        for decay, (p, g, m, v, steps) in self._groups:
            torch._fused_adamw_(
                p,
                g,
                m,
                v,
                [],
                steps,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=weight_decay if decay else 0.0,
                eps=eps,
                amsgrad=False,
                maximize=False,
                grad_scale=inv,
            )

    def publish(self, flat: torch.Tensor, buckets, dp_rank: int) -> None:
        """Copy (and round) the new master of ``buckets`` into the flat parameter buffer."""
        for b in buckets:
            lo, hi = b.chunk_range(dp_rank)
            flat[lo:hi].copy_(self.master[b.host_offset : b.host_offset + b.chunk])

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
