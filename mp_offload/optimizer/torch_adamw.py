"""The unpartitioned reference: torch.optim.AdamW on the device, DP-averaged grads.

Kept for good as what the ZeRO optimizer is checked against. Implements the same
``Optimizer`` contract (``base.py``); with ``--bf16`` the fp32 model runs its forward
under bf16 autocast.
"""

from __future__ import annotations

import torch

from ..parallel_state import ParallelGroup
from .base import StepResult
from .grads import allreduce_gradients, clip_coefficient, params_grad_norm


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and LayerNorm (every 1-D parameter)."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]


class TorchAdamWOptimizer:
    checkpoint_kind = "torch-adamw"
    skipped_steps = 0  # no loss scaling: never skips
    layout = None  # not partitioned: its checkpoints reload at the saved sizes only

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        clip_grad: float,
        dp: ParallelGroup,
        tp: ParallelGroup,
        autocast_dtype=None,
    ):
        self.model = model
        self.autocast_dtype = autocast_dtype
        self.params = list(model.parameters())
        self.inner = torch.optim.AdamW(
            param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps
        )
        self.clip_grad = clip_grad
        self.dp_group, self.tp_group = dp, tp

    def zero_grad(self, lr: float | None = None) -> None:
        self.inner.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        allreduce_gradients(self.params, self.dp_group)
        norm = params_grad_norm(self.params, self.tp_group)
        coeff = clip_coefficient(norm, self.clip_grad)
        if coeff < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coeff)
        for g in self.inner.param_groups:
            g["lr"] = lr
        self.inner.step()
        return StepResult(grad_norm=norm)

    def flush(self) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def memory_report(self) -> str | None:
        return None

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
