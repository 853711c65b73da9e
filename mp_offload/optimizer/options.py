"""The ZeRO optimizer's options, translated from the flags once (``OptimizerOptions.from_args``).

``build_optimizer`` builds the optimizer from them and the planner plans from them, so a
flag means the same buffers in both (``placement.py`` turns options into buffers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import DEFAULT_BUCKET_SIZE

MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def compute_dtype(args) -> torch.dtype:
    t = args.train
    return torch.float16 if t.fp16 else (torch.bfloat16 if t.bf16 else torch.float32)


@dataclass(frozen=True)
class OptimizerOptions:
    """How one ZeRO optimizer is built (everything but the hyperparameters and groups).

    ``dpu_warmup_steps`` turns on the one-step delayed update after that many steps;
    ``loss_scale`` (fp16) holds the dynamic loss scaler's settings; ``offload_fraction``
    (with ``cpu_offload``): the share of the slice offloaded, F = 0 being no offload;
    ``accumulate_dtype``: of the device buffer that sums the micro-batches with
    ``accumulate_on_device``; ``reduce_dtype``: of the gradient buckets (None: ``dtype``);
    ``overlap_cpu_optimizer``: the CPU Adam runs on each host chunk during backward
    (``overlap.py``), the state in two copies.
    """

    dtype: torch.dtype = torch.float32  # of the device parameters (the compute dtype)
    cpu_offload: bool = True
    bucket_size: int = DEFAULT_BUCKET_SIZE
    dpu_warmup_steps: int | None = None
    loss_scale: dict | None = None
    micro_batches: int = 1
    accumulate_on_device: bool = False
    reduce_dtype: torch.dtype | None = None
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    offload_fraction: float = 1.0
    accumulate_dtype: torch.dtype = torch.float32
    overlap_cpu_optimizer: bool = False

    @property
    def offloaded(self) -> bool:
        """Any state on the host: F = 0 is exactly the device-resident ZeRO-2."""
        return self.cpu_offload and self.offload_fraction != 0.0

    @property
    def accumulates_on_device(self) -> bool:
        """The micro-batches are summed in a device buffer (only k > 1 has any to sum)."""
        return self.accumulate_on_device and self.micro_batches > 1

    @classmethod
    def from_args(cls, args) -> OptimizerOptions:
        o, t = args.optim, args.train
        loss_scale = dict(
            initial=o.initial_loss_scale,
            min=o.min_loss_scale,
            window=o.loss_scale_window,
            hysteresis=o.hysteresis,
        )
        fraction = o.optimizer_offload_fraction
        return cls(
            dtype=compute_dtype(args),
            cpu_offload=o.cpu_offload,
            bucket_size=o.reduce_bucket_size,
            dpu_warmup_steps=o.dpu_warmup_steps,
            loss_scale=loss_scale if t.fp16 else None,
            micro_batches=t.num_micro_batches,  # (config.resolve)
            accumulate_on_device=o.accumulate_grads_on_device,
            reduce_dtype=torch.float32 if o.accumulate_allreduce_grads_in_fp32 else None,
            exp_avg_dtype=MOMENT_DTYPES[o.exp_avg_dtype],
            exp_avg_sq_dtype=MOMENT_DTYPES[o.exp_avg_sq_dtype],
            offload_fraction=1.0 if fraction is None else fraction,
            overlap_cpu_optimizer=o.overlap_cpu_optimizer,
        )
