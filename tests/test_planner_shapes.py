"""planner/shapes.py: the written-down per-rank parameter shapes equal the meta model's."""

import pytest
from planner_cases import SMALL

from mp_offload.model.gpt import GPTConfig, num_parameters
from mp_offload.planner import (
    check_spec,
    meta_named_params,
)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_written_shapes_equal_the_meta_model(tp):
    for cfg in (
        GPTConfig(**SMALL),
        GPTConfig(
            num_layers=2,
            hidden_size=256,
            num_attention_heads=8,
            ffn_hidden_size=512,
            vocab_size=1000,
            max_position_embeddings=77,
        ),
    ):
        for r in range(tp):
            check_spec(cfg, tp, r)
            named = meta_named_params(cfg, tp, r)
            assert all(p.is_meta for _, p in named)


LLAMA_OPTIONS = [
    dict(normalization="RMSNorm"),
    dict(swiglu=True),
    dict(position_embedding_type="rope"),
    dict(disable_bias_linear=True),
    dict(group_query_attention=True, num_query_groups=4),
    dict(untie_embeddings_and_output_weights=True),
    dict(sequence_parallel=True),
    dict(
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        group_query_attention=True,
        num_query_groups=4,
        untie_embeddings_and_output_weights=True,
        disable_bias_linear=True,
        sequence_parallel=True,
    ),
]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_written_shapes_equal_the_meta_model_with_llama_options(tp):
    """Names, shapes and split metadata (dim, stride) of every option at every rank."""
    for opts in LLAMA_OPTIONS:
        cfg = GPTConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=8,
            seq_length=32,
            ffn_hidden_size=96,
            vocab_size=200,
            **opts,
        )
        for r in range(tp):
            check_spec(cfg, tp, r)
        assert sum(p.numel() for _, p in meta_named_params(cfg, 1)) == num_parameters(cfg)
