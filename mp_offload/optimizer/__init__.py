"""Optimizers: the ZeRO(-Offload) optimizer and the unpartitioned torch-AdamW reference.

Both implement ``base.Optimizer``; ``build_optimizer`` picks one from the flags.
"""

from __future__ import annotations

import torch

from .. import parallel_state as ps
from .base import DEFAULT_BUCKET_SIZE, Optimizer, StepResult
from .torch_adamw import TorchAdamWOptimizer

MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def compute_dtype(args) -> torch.dtype:
    t = args.train
    return torch.float16 if t.fp16 else (torch.bfloat16 if t.bf16 else torch.float32)


def build_optimizer(model: torch.nn.Module, args, device: torch.device) -> Optimizer:
    """Place ``model`` on ``device`` and wrap it with the optimizer chosen by the flags."""
    o = args.optim
    common = dict(
        lr=o.lr,
        weight_decay=o.weight_decay,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps,
        clip_grad=o.clip_grad,
        dp=ps.get_data_parallel_group(),
        tp=ps.get_tensor_model_parallel_group(),
    )
    dtype = compute_dtype(args)
    if o.optimizer == "torch-adamw":
        model.to(device)  # fp32 weights; bf16 runs autocast the forward
        return TorchAdamWOptimizer(
            model, **common, autocast_dtype=None if dtype == torch.float32 else dtype
        )
    from .zero import ZeroOptimizer

    t = args.train
    return ZeroOptimizer(
        model,
        **common,
        device=device,
        dtype=dtype,
        cpu_offload=o.cpu_offload,
        bucket_size=o.reduce_bucket_size,
        dpu_warmup_steps=o.dpu_warmup_steps,
        loss_scale=dict(
            initial=o.initial_loss_scale,
            min=o.min_loss_scale,
            window=o.loss_scale_window,
            hysteresis=o.hysteresis,
        )
        if t.fp16
        else None,
        micro_batches=t.num_micro_batches,  # (config.resolve)
        accumulate_on_device=o.accumulate_grads_on_device,
        reduce_dtype=torch.float32 if o.accumulate_allreduce_grads_in_fp32 else None,
        exp_avg_dtype=MOMENT_DTYPES[o.exp_avg_dtype],
        exp_avg_sq_dtype=MOMENT_DTYPES[o.exp_avg_sq_dtype],
        offload_fraction=1.0
        if o.optimizer_offload_fraction is None
        else o.optimizer_offload_fraction,
    )


__all__ = [
    "build_optimizer",
    "compute_dtype",
    "DEFAULT_BUCKET_SIZE",
    "Optimizer",
    "StepResult",
    "TorchAdamWOptimizer",
]
