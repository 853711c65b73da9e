"""Adam on a flat slice with torch ops: the device path when offload is off.

Same signature and math as the C++ kernel (mp_offload.ops.cpu_adam.adam_step), so
the ZeRO optimizer calls either one the same way.
"""
from __future__ import annotations

import math

import torch


@torch.no_grad()
def torch_adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps,
                    weight_decay, adamw=True, bias_correction=True, param_out=None,
                    grad_scale=1.0):
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if weight_decay:
        if adamw:
            param.mul_(1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * param
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bc1 = 1.0 - beta1 ** step if bias_correction else 1.0
    bc2 = 1.0 - beta2 ** step if bias_correction else 1.0
    denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bc1)
    if param_out is not None:
        param_out.copy_(param)
