"""Optimizers: the ZeRO(-Offload) optimizer and the unpartitioned torch-AdamW reference."""
from __future__ import annotations

import torch

from .. import parallel_state as ps
from .torch_adamw import StepResult, TorchAdamWOptimizer


def build_optimizer(model: torch.nn.Module, args, device: torch.device):
    """Place ``model`` on ``device`` and wrap it with the optimizer chosen by the flags."""
    o = args.optim
    common = dict(lr=o.lr, weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2),
                  eps=o.adam_eps, clip_grad=o.clip_grad, dp_group=ps.get_data_parallel_group(),
                  tp_group=ps.get_tensor_model_parallel_group(),
                  tp_rank=ps.get_tensor_model_parallel_rank())
    if o.optimizer == "torch-adamw":
        model.to(device)
        return TorchAdamWOptimizer(model, **common)
    from .zero import ZeroOptimizer
    dtype = torch.float16 if args.train.fp16 else (torch.bfloat16 if args.train.bf16
                                                   else torch.float32)
    return ZeroOptimizer(model, **common, device=device, dtype=dtype, cpu_offload=o.cpu_offload,
                         bucket_size=o.reduce_bucket_size, dpu_warmup_steps=o.dpu_warmup_steps,
                         loss_scale=dict(initial=o.initial_loss_scale, min=o.min_loss_scale,
                                         window=o.loss_scale_window, hysteresis=o.hysteresis)
                         if args.train.fp16 else None)


__all__ = ["build_optimizer", "StepResult", "TorchAdamWOptimizer"]
