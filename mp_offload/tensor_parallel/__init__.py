"""Megatron-style tensor parallelism: primitives, layers, loss, RNG."""

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    register_sequence_parallel_grad_hooks,
    sequence_parallel_linear,
)
from .mappings import (
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    gather_sequence_to_tp_region,
    reduce_from_tp_region,
    reduce_scatter_from_tp_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
)
from .random import checkpoint, get_rng_tracker, model_parallel_seed
from .utils import (
    merge_partitions,
    pad_vocab_size,
    set_tensor_model_parallel_attributes,
    split_for_rank,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "copy_to_tp_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "scatter_to_sequence_region",
    "gather_from_sequence_region",
    "reduce_scatter_from_tp_region",
    "gather_sequence_to_tp_region",
    "sequence_parallel_linear",
    "register_sequence_parallel_grad_hooks",
    "checkpoint",
    "get_rng_tracker",
    "model_parallel_seed",
    "merge_partitions",
    "pad_vocab_size",
    "set_tensor_model_parallel_attributes",
    "split_for_rank",
]
