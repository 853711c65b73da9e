"""The unpartitioned reference: torch.optim.AdamW on the device, DP-averaged grads.

Kept for good as what the ZeRO optimizer is checked against. Same interface as
ZeRO's: ``zero_grad``, ``backward(loss)``, ``step(lr) -> StepResult``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .grads import allreduce_gradients, clip_coefficient, params_grad_norm


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool = False
    loss_scale: float = 1.0


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and LayerNorm (every 1-D parameter)."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return [dict(params=decay, weight_decay=weight_decay),
            dict(params=no_decay, weight_decay=0.0)]


class TorchAdamWOptimizer:
    def __init__(self, model: torch.nn.Module, *, lr: float, weight_decay: float,
                 betas: tuple[float, float], eps: float, clip_grad: float,
                 dp_group, tp_group, tp_rank: int):
        self.model = model
        self.params = list(model.parameters())
        self.inner = torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas,
                                       eps=eps)
        self.clip_grad = clip_grad
        self.dp_group, self.tp_group, self.tp_rank = dp_group, tp_group, tp_rank

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        allreduce_gradients(self.params, self.dp_group)
        norm = params_grad_norm(self.params, self.tp_rank, self.tp_group)
        coeff = clip_coefficient(norm, self.clip_grad)
        if coeff < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coeff)
        for g in self.inner.param_groups:
            g["lr"] = lr
        self.inner.step()
        return StepResult(grad_norm=norm)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
