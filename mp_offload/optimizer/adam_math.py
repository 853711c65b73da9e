"""Adam on a flat slice with torch ops: the device path when offload is off.

Same signature and math as the C++ kernel (mp_offload.ops.cpu_adam.adam_step), so
the ZeRO optimizer calls either one the same way.
"""

from __future__ import annotations

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
        cuts = sorted({0, param.numel(), *(x for run in decay_runs for x in run)})
        decayed = set(map(tuple, decay_runs))
        for lo, hi in zip(cuts, cuts[1:]):
            if hi > lo:
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
                    weight_decay=weight_decay if (lo, hi) in decayed else 0.0,
                    adamw=adamw,
                    bias_correction=bias_correction,
                    param_out=None if param_out is None else param_out[lo:hi],
                    grad_scale=grad_scale,
                )
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
