"""The parallel layout's flag checks, without torch (``config.validate`` runs them before
pretrain_gpt.py imports torch; ``parallel_state`` re-exports them)."""

from __future__ import annotations


class ParallelConfigError(ValueError):
    """An invalid parallel layout; the message names the flag and the numbers."""


def validate_parallel_sizes(
    world_size: int,
    tp: int,
    *,
    num_attention_heads: int | None = None,
    hidden_size: int | None = None,
) -> None:
    """Reject layouts that cannot be split evenly, naming the flag at fault."""
    if tp < 1:
        raise ParallelConfigError(f"--tensor-model-parallel-size must be >= 1, got {tp}")
    if world_size % tp != 0:
        raise ParallelConfigError(
            f"--tensor-model-parallel-size {tp} does not divide the world size {world_size} "
            f"(number of processes)"
        )
    if num_attention_heads is not None and num_attention_heads % tp != 0:
        raise ParallelConfigError(
            f"--num-attention-heads {num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if hidden_size is not None and hidden_size % tp != 0:
        raise ParallelConfigError(
            f"--hidden-size {hidden_size} is not divisible by --tensor-model-parallel-size {tp}"
        )
