"""The model's configuration: ``GPTConfig``, each field with its flag's help, choices and
range beside it (``fields.flag_field``), the model's own checks (``GPTConfig.problems``),
and the fields a checkpoint records (``SHAPE_FIELDS``, ``OPTION_FIELDS``) with the
flags that repeat them (``model_flags``). Imports nothing of the model itself, so the
layers, the planner, the checkpoints and the run's flags all read it from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.fields import field_problems, flag_field


def pad_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: pad to a multiple of make_vocab_size_divisible_by * tp."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")

# The shape a checkpoint's weights have; a run that loads it must repeat each.
SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "vocab_size",
    "max_position_embeddings",
)
# Model options that change names, shapes or meaning of the weights; a checkpoint written
# before they existed has none of them, which means the GPT-2 default.
OPTION_FIELDS = (
    "normalization",
    "swiglu",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "group_query_attention",
    "num_query_groups",
    "untie_embeddings_and_output_weights",
    "disable_bias_linear",
    "layernorm_epsilon",
)

_f = flag_field


@dataclass
class GPTConfig:
    num_layers: int = _f(4, "transformer layers", range="1..")
    hidden_size: int = _f(256, "model width", range="1..")
    num_attention_heads: int = _f(4, "attention heads", range="1..")
    ffn_hidden_size: int | None = _f(
        None, "MLP width (default 4h)", range="1..", derived_from="hidden_size"
    )
    seq_length: int = _f(256, "tokens per sample", range="1..")
    max_position_embeddings: int | None = _f(
        None, "position table size", range="1..", derived_from="seq_length"
    )
    vocab_size: int = _f(
        4096, "vocabulary size (mock data / NullTokenizer; else from the tokenizer)", range="1.."
    )
    make_vocab_size_divisible_by: int = _f(
        128, "pad the vocabulary to a multiple of this x TP", range="1.."
    )
    hidden_dropout: float = _f(0.1, "dropout on residual branches", range="0..1)")
    attention_dropout: float = _f(0.1, "attention dropout", range="0..1)")
    layernorm_epsilon: float = _f(1e-5, "LayerNorm (and RMSNorm) epsilon", range="0<..")
    init_method_std: float = _f(0.02, "init std", range="0..")
    recompute_activations: bool = _f(
        False, "recompute each layer in backward (activation checkpointing)"
    )
    normalization: str | None = _f(
        None, "LayerNorm (GPT-2's, the default) or RMSNorm (Llama)", choices=NORMALIZATIONS
    )
    swiglu: bool = _f(
        False, "SwiGLU MLP: silu(gate) * up, gate and up fused in fc1 (2 x --ffn-hidden-size)"
    )
    position_embedding_type: str | None = _f(
        None,
        "learned_absolute (a table of --max-position-embeddings; the default) or rope "
        "(rotary, rotate-half layout)",
        choices=POSITION_EMBEDDINGS,
    )
    rotary_base: int | None = _f(
        None,
        "rope: the base of the rotation frequencies (default 10000; Llama 3: 500000)",
        range="1..",
    )
    rotary_percent: float | None = _f(
        None, "rope: the fraction of each head's channels that rotate (default 1)", range="0<..1]"
    )
    group_query_attention: bool = _f(
        False, "grouped-query attention: --num-query-groups key/value heads"
    )
    num_query_groups: int | None = _f(
        None,
        "key/value heads with --group-query-attention (default 1); a multiple of "
        "--tensor-model-parallel-size",
        range="1..",
    )
    untie_embeddings_and_output_weights: bool = _f(
        False, "an output layer of its own instead of the input embedding (output_layer.weight)"
    )
    disable_bias_linear: bool = _f(False, "no biases in the QKV, projection and MLP linear layers")
    sequence_parallel: bool = _f(
        False,
        "keep norms, dropout and residuals as sequence shards over the TP ranks "
        "(Megatron-SP): activations between the layers divide by TP",
    )

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.group_query_attention and self.num_query_groups is None:
            self.num_query_groups = 1
        # GPT-2's own choices are recorded as None, so a plain GPT-2 names no option in its
        # checkpoint (the GPT-2 export refuses any unknown option that is set).
        if self.normalization == "LayerNorm":
            self.normalization = None
        if self.position_embedding_type == "learned_absolute":
            self.position_embedding_type = None

    @property
    def kv_groups(self) -> int:
        """Key/value heads: the query groups with GQA, else one per attention head."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def rms_norm(self) -> bool:
        return self.normalization == "RMSNorm"

    @property
    def learned_positions(self) -> bool:
        return self.position_embedding_type is None

    @property
    def rotary(self) -> tuple[int, float]:
        """(base, fraction of each head's channels rotated), rope's defaults filled in."""
        return (
            10000 if self.rotary_base is None else self.rotary_base,
            1.0 if self.rotary_percent is None else self.rotary_percent,
        )

    def padded_vocab_size(self, tp: int) -> int:
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    def problems(self, tp: int = 1) -> list[str]:
        """Every problem of the model against itself and the TP size, one line each naming
        the flag: ranges and choices first, then (when those pass) the shape."""
        return field_problems(self) or list(_shape_problems(self, tp))


def _shape_problems(m: GPTConfig, tp: int):
    if m.hidden_size % m.num_attention_heads:
        yield (
            f"--hidden-size {m.hidden_size} is not divisible by "
            f"--num-attention-heads {m.num_attention_heads}"
        )
    if m.ffn_hidden_size % tp:
        yield (
            f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if m.seq_length > m.max_position_embeddings:
        yield (
            f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
            f"{m.max_position_embeddings}"
        )
    yield from _attention_problems(m, tp)
    if m.sequence_parallel and m.seq_length % tp:
        yield (
            f"--seq-length {m.seq_length} is not divisible by "
            f"--tensor-model-parallel-size {tp} (--sequence-parallel splits "
            f"the sequence over the TP ranks)"
        )


def _attention_problems(m: GPTConfig, tp: int):
    if m.num_query_groups is not None and not m.group_query_attention:
        yield "--num-query-groups needs --group-query-attention"
    if m.group_query_attention:
        g = m.num_query_groups
        if m.num_attention_heads % g:
            yield (
                f"--num-attention-heads {m.num_attention_heads} is not divisible "
                f"by --num-query-groups {g}"
            )
        if g % tp:
            yield (
                f"--num-query-groups {g} is not divisible by "
                f"--tensor-model-parallel-size {tp}: key/value heads are split "
                f"across the TP ranks, never replicated"
            )
    if m.position_embedding_type == "rope":
        problem = rotary_problem(m.hidden_size // m.num_attention_heads, m.rotary[1])
        if problem:
            yield problem


def rotary_problem(head_dim: int, percent: float) -> str | None:
    """Rope rotates channel pairs: ``percent`` of a head must be an even count >= 2."""
    rotated = int(head_dim * percent)
    if rotated < 2 or rotated % 2:
        return (
            f"--rotary-percent {percent} rotates {rotated} of the "
            f"{head_dim} channels of a head: that must be an even number >= 2"
        )
    return None


def model_flags(cfg: GPTConfig, fields=SHAPE_FIELDS + OPTION_FIELDS) -> list[str]:
    """pretrain_gpt.py flags of ``cfg``'s shape and options (what a run that loads the
    checkpoint must repeat; the checkpoint refuses a run whose flags differ); options at
    their defaults are left out."""
    flags = []
    default = type(cfg)()
    for field in fields:
        value = getattr(cfg, field)
        if field == "vocab_size" or value is None or value is False:
            continue  # the vocabulary comes from the run's tokenizer
        if field in OPTION_FIELDS and value == getattr(default, field):
            continue
        flag = "--" + field.replace("_", "-")
        flags += (
            [flag]
            if value is True
            else [flag, f"{value:g}" if isinstance(value, float) else str(value)]
        )
    return flags
