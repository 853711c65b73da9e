"""The contract every optimizer of the training loop implements.

The loop (``training``) and the checkpoint code (``checkpoint/save.py``, ``load.py``)
use these members and nothing else, so an optimizer is swappable without either of
them probing what it is (tests/test_optimizer_protocol.py holds them to that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .layout import FlatLayout

# Elements per gradient bucket (reduce-scatter unit). The flat layout, and so the
# optimizer slices a checkpoint stores, depends on it: keep it fixed for exact resume.
DEFAULT_BUCKET_SIZE = 5_000_000


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool = False
    loss_scale: float = 1.0


@runtime_checkable
class Optimizer(Protocol):
    #: the checkpoint format of ``state_dict``: "zero" (partitioned fp32 slices that can be
    #: re-partitioned) or "torch-adamw" (torch's own state, same TP/DP sizes only).
    checkpoint_kind: str
    #: dtype to autocast the forward to, or None when the parameters are already in it.
    autocast_dtype: torch.dtype | None
    #: the flat layout of this rank's slice, by which the checkpoint load re-partitions a
    #: "zero" checkpoint saved at other sizes; None for the other kinds.
    layout: FlatLayout | None

    def zero_grad(self, lr: float | None = None) -> None:
        """Start accumulating the gradients of a new step; ``lr``: its learning rate, which
        ``step`` must then get too (the overlapped CPU Adam steps during backward)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch (with loss scaling, gradient reduction)."""

    def step(self, lr: float) -> StepResult:
        """Clip, update, publish the new parameters; fp16 overflow skips (``skipped``)."""

    def flush(self) -> None:
        """Finish an update still in flight (DPU) before saving or at the end."""

    @property
    def skipped_steps(self) -> int:
        """fp16 steps skipped for overflow over the whole run (restored on resume)."""

    def stats(self) -> dict:
        """Figures for the iteration log (may be empty)."""

    def memory_report(self) -> str | None:
        """One line on what this rank holds where, or None."""

    def state_dict(self) -> dict:
        """This rank's optimizer state for a checkpoint (``checkpoint_kind`` format)."""

    def load_state_dict(self, state: dict) -> None:
        """Install a state (re-partitioned by the checkpoint code if the sizes changed)."""
