"""Learning-rate schedule counted in samples, as Megatron does.

Linear warmup to ``max_lr``, then constant, linear or cosine decay to ``min_lr``;
past the decay horizon the rate stays at ``min_lr``. Counting samples (not steps)
keeps the schedule right when the global batch size changes on resume.
"""

from __future__ import annotations

import math


class LRScheduler:
    def __init__(
        self,
        max_lr: float,
        min_lr: float,
        warmup_samples: int,
        decay_samples: int,
        style: str = "cosine",
    ):
        if style not in ("constant", "linear", "cosine"):
            raise ValueError(f"--lr-decay-style {style!r} is not one of constant, linear, cosine")
        if min_lr > max_lr:
            raise ValueError(f"--min-lr {min_lr} exceeds --lr {max_lr}")
        self.max_lr, self.min_lr, self.style = max_lr, min_lr, style
        self.warmup, self.decay = warmup_samples, max(decay_samples, warmup_samples)

    def get_lr(self, consumed_samples: int) -> float:
        if self.warmup > 0 and consumed_samples < self.warmup:
            return self.max_lr * consumed_samples / self.warmup
        if self.style == "constant":
            return self.max_lr
        if consumed_samples >= self.decay:
            return self.min_lr
        ratio = (consumed_samples - self.warmup) / (self.decay - self.warmup)
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if self.style == "cosine" else 1.0 - ratio
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    @classmethod
    def from_args(cls, args) -> LRScheduler:
        """The run's schedule: Megatron's iteration flags turned into sample counts."""
        o, gbs = args.optim, args.train.global_batch_size
        return cls(
            o.lr,
            o.min_lr,
            o.lr_warmup_iters * gbs,
            (o.lr_decay_iters or args.train.train_iters) * gbs,
            o.lr_decay_style,
        )
