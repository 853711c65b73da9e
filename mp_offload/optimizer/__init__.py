"""Optimizers: the ZeRO(-Offload) optimizer and the unpartitioned torch-AdamW reference.

Both implement ``base.Optimizer``; ``build_optimizer`` picks one from the flags.
"""

from __future__ import annotations

import torch

from .. import parallel_state as ps
from .base import DEFAULT_BUCKET_SIZE, Optimizer, StepResult
from .options import OptimizerOptions, compute_dtype
from .torch_adamw import TorchAdamWOptimizer


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
    import dataclasses

    from .offload_adamw import OffloadAdamW

    # One code path with the public optimizer: the loop drives its engine (``.zero``),
    # which keeps the model's parameter order (``model=``) and Megatron's two groups.
    options = OptimizerOptions.from_args(args)
    modes = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    named = list(model.named_parameters())
    groups = [
        dict(params=[(n, p) for n, p in named if p.ndim > 1], weight_decay=o.weight_decay),
        dict(params=[(n, p) for n, p in named if p.ndim <= 1], weight_decay=0.0),
    ]
    common = {k: v for k, v in common.items() if k not in ("dp", "tp", "weight_decay")}
    return OffloadAdamW(
        [g for g in groups if g["params"]], **common, **modes, model=model, device=device,
        dp_group=ps.get_data_parallel_group(), tp_group=ps.get_tensor_model_parallel_group(),
    ).zero  # fmt: skip


__all__ = [
    "build_optimizer",
    "compute_dtype",
    "DEFAULT_BUCKET_SIZE",
    "Optimizer",
    "OptimizerOptions",
    "StepResult",
    "TorchAdamWOptimizer",
]
