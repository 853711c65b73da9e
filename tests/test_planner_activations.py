"""planner/activations.py: the activation estimate's terms against hand counts."""

import pytest

from mp_offload.model.gpt import GPTConfig


@pytest.mark.parametrize("elem_bytes,tp", [(2, 1), (2, 2), (4, 1)])
def test_loss_forward_term_is_a_hand_count_of_the_cross_entropy(elem_bytes, tp):
    """At the subtraction in vocab_parallel_cross_entropy the rank holds the logits (compute
    dtype), their fp32 copy (none for fp32 logits) and the fp32 shifted logits; padding is
    masked in place, so no masked clone. Vocabulary 1000 pads to 1024 (divisible by 128)."""
    from mp_offload.planner.activations import estimate_activations

    cfg = GPTConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        vocab_size=1000,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    s, b, V = 32, 3, cfg.padded_vocab_size(tp)
    est = estimate_activations(cfg, tp, b, elem_bytes, recompute=False)
    logits = elem_bytes * s * b * V // tp
    fp32_copy = 4 * s * b * V // tp if elem_bytes < 4 else 0
    shifted = 4 * s * b * V // tp
    at_loss = est.phases["end of forward (loss)"] - est.kept - est.outside
    assert at_loss == logits + fp32_copy + shifted
