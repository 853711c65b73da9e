"""Adam on a flat slice where the state is on the device: torch's fused AdamW kernel
(``fused_adam_step``) or the same math in torch ops (``torch_adam_step``).

Same signature and math as the C++ kernel (mp_offload.ops.cpu_adam.adam_step), so
the ZeRO optimizer calls any of them the same way; ``device_adam`` picks one.
"""

from __future__ import annotations

import functools
import math

import torch


@torch.no_grad()
def torch_adam_step(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    adamw=True,
    bias_correction=True,
    param_out=None,
    grad_scale=1.0,
    decay_runs=None,
):
    """``decay_runs``: (start, end) ranges that get ``weight_decay``; the rest get none
    (None: everywhere). Moments may be bf16: stepped in fp32, stored rounded to nearest."""
    if decay_runs is not None:
        lo = 0
        for n, decay in zip(*_cut(param.numel(), decay_runs)):
            hi = lo + n
            torch_adam_step(
                param[lo:hi],
                grad[lo:hi],
                exp_avg[lo:hi],
                exp_avg_sq[lo:hi],
                step=step,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=eps,
                weight_decay=weight_decay if decay else 0.0,
                adamw=adamw,
                bias_correction=bias_correction,
                param_out=None if param_out is None else param_out[lo:hi],
                grad_scale=grad_scale,
            )
            lo = hi
        return
    m = exp_avg if exp_avg.dtype == torch.float32 else exp_avg.float()
    v = exp_avg_sq if exp_avg_sq.dtype == torch.float32 else exp_avg_sq.float()
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if weight_decay:
        if adamw:
            param.mul_(1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * param
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
    param.addcdiv_(m, denom, value=-lr / bc1)
    if m is not exp_avg:
        exp_avg.copy_(m)
    if v is not exp_avg_sq:
        exp_avg_sq.copy_(v)
    if param_out is not None:
        param_out.copy_(param)


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


def device_adam(device: torch.device, exp_avg_dtype, exp_avg_sq_dtype):
    """The Adam for a slice whose state is on ``device`` (the device share, or the whole
    slice without offload): torch's fused AdamW where it runs (CUDA; the CPU from torch
    2.4), one kernel per weight-decay setting instead of ~10 elementwise launches per
    decay run. Only with fp32 moments: the kernel reads every list in the params' dtype
    (the fp32 master), so bf16 moments step with the torch ops."""
    moments32 = exp_avg_dtype == exp_avg_sq_dtype == torch.float32
    if moments32 and fused_adamw_available(device.type):
        return fused_adam_step
    return torch_adam_step


def _cut(numel: int, decay_runs) -> tuple[list[int], list[bool]]:
    """Lengths of the consecutive pieces [0, numel) cut at every run boundary, and whether
    each piece gets weight decay (every piece does when ``decay_runs`` is None)."""
    if decay_runs is None:
        return [numel], [True]
    cuts = sorted({0, numel, *(x for run in decay_runs for x in run)})
    decayed = set(map(tuple, decay_runs))
    pieces = [(lo, hi) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]
    return [hi - lo for lo, hi in pieces], [p in decayed for p in pieces]


@torch.no_grad()
def fused_adam_step(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    adamw=True,
    bias_correction=True,
    param_out=None,
    grad_scale=1.0,
    decay_runs=None,
):
    """``torch_adam_step`` through ``torch._fused_adamw_``: one call per weight-decay
    setting, every piece of the slice one tensor of its lists. The kernel's own rounding
    (it divides by the inverse of ``grad_scale``; fp32 throughout), and it leaves ``grad``
    unscaled in place (AMP's unscale): the optimizer reads no gradient after its Adam."""
    if not (adamw and bias_correction):  # the kernel is bias-corrected AdamW only
        return torch_adam_step(
            param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
            eps=eps, weight_decay=weight_decay, adamw=adamw, bias_correction=bias_correction,
            param_out=param_out, grad_scale=grad_scale, decay_runs=decay_runs,
        )  # fmt: skip
    lengths, decays = _cut(param.numel(), decay_runs)
    views = [t.split(lengths) for t in (param, grad, exp_avg, exp_avg_sq)]
    steps = torch.full((len(lengths),), float(step), device=param.device).unbind()
    inv = None
    if grad_scale != 1.0:  # the kernel divides the gradients by grad_scale (AMP's unscale)
        inv = torch.full((), 1.0 / grad_scale, dtype=torch.float32, device=param.device)
    for want in (True, False):
        idx = [i for i, d in enumerate(decays) if d == want]
        if idx:
            p, g, m, v = ([t[i] for i in idx] for t in views)
            torch._fused_adamw_(
                p, g, m, v, [], [steps[i] for i in idx], lr=lr, beta1=beta1, beta2=beta2,
                weight_decay=weight_decay if want else 0.0, eps=eps, amsgrad=False,
                maximize=False, grad_scale=inv,
            )  # fmt: skip
    if param_out is not None:
        param_out.copy_(param)
