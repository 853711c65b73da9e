"""Hugging Face GPT-2: export a checkpoint as ``GPT2LMHeadModel``, import one as a checkpoint.

Owns the name map between our parameters and GPT-2's, and the two configs. Export reads
the native format one full parameter at a time (``offline.FullTensors``); import writes
it with ``offline.write_checkpoint`` (a TP=k, DP=1 checkpoint with the layout a real
run computes), so the source is never held whole.

GPT-2 facts used here (public, from the Hugging Face GPT-2 format): linear layers are
``Conv1D`` modules whose weight is [in, out] (ours are [out, in]); the fused attention
projection ``c_attn`` puts q, k, v side by side along the output, heads in order inside
each (the same [q; k; v] order as our ``attn.qkv``); the LM head is tied to ``wte`` and
usually absent from the file; the activation ``gelu_new`` is GELU's tanh approximation.
"""

from __future__ import annotations

import torch

from ..model.gpt import GPTConfig
from ..optimizer.base import DEFAULT_BUCKET_SIZE
from .errors import ConversionError
from .hf_common import (
    ANY,
    check_names,
    check_options,
    fresh_rng,
    hf_weights,
    import_args,
    read_hf_config,
    write_hf_dir,
)
from .offline import FullTensors, write_checkpoint
from .on_disk import fit_padding

# ------------------------------------------------------------------- GPT-2 names
_BLOCK = (
    ("ln1", "ln_1", False),
    ("attn.qkv", "attn.c_attn", True),
    ("attn.proj", "attn.c_proj", True),
    ("ln2", "ln_2", False),
    ("mlp.fc1", "mlp.c_fc", True),
    ("mlp.fc2", "mlp.c_proj", True),
)


def gpt2_name_map(num_layers: int) -> dict[str, tuple[str, bool]]:
    """Our parameter name -> (HF GPT-2 name, stored transposed as a Conv1D weight)."""
    m = {
        "wte.weight": ("transformer.wte.weight", False),
        "wpe.weight": ("transformer.wpe.weight", False),
        "ln_f.weight": ("transformer.ln_f.weight", False),
        "ln_f.bias": ("transformer.ln_f.bias", False),
    }
    for i in range(num_layers):
        for ours, theirs, conv in _BLOCK:
            m[f"blocks.{i}.{ours}.weight"] = (f"transformer.h.{i}.{theirs}.weight", conv)
            m[f"blocks.{i}.{ours}.bias"] = (f"transformer.h.{i}.{theirs}.bias", False)
    return m


# The options GPT-2 expresses, and the values it takes (hf_common.check_options refuses
# any other, and any option a future model grows, rather than writing a wrong GPT-2).
GPT2_OPTIONS = {
    "normalization": (None, "LayerNorm"),
    "swiglu": (False,),
    "position_embedding_type": (None, "learned_absolute"),
    "group_query_attention": (False,),
    "untie_embeddings_and_output_weights": (False,),
    "disable_bias_linear": (False,),
    "rotary_base": ANY,
    "rotary_percent": ANY,
    "num_query_groups": ANY,
}


def check_gpt2_compatible(model_config: dict, names) -> None:
    check_options(model_config, GPT2_OPTIONS, "GPT-2")
    check_names(
        names,
        set(gpt2_name_map(model_config["num_layers"])),
        "GPT-2 (tied head, learned positions, biased linears, LayerNorm)",
    )


def gpt2_config(cfg: GPTConfig, eod: int | None = None) -> dict:
    """config.json for ``GPT2LMHeadModel`` (vocab unpadded)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_position_embeddings,
        "n_ctx": cfg.max_position_embeddings,
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_attention_heads,
        "n_inner": cfg.ffn_hidden_size,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.layernorm_epsilon,
        "resid_pdrop": cfg.hidden_dropout,
        "embd_pdrop": cfg.hidden_dropout,
        "attn_pdrop": cfg.attention_dropout,
        "initializer_range": cfg.init_method_std,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": eod,
        "eos_token_id": eod,
        "torch_dtype": "float32",
    }


def export_hf(
    ckpt: str,
    out_dir: str,
    dtype=torch.float32,
    eod: int | None = None,
    use_package: bool | None = None,
) -> str:
    """Write ``config.json`` + ``model.safetensors`` of a GPT-2 from checkpoint dir ``ckpt``."""
    full = FullTensors(ckpt)
    cfg = full.config
    check_gpt2_compatible(full.manifest["model_config"], full.names)
    names = gpt2_name_map(cfg.num_layers)
    entries, source = [], {}
    for ours in full.names:  # model order, like HF's own files
        theirs, conv = names[ours]
        shape = list(full.manifest["params"][ours]["shape"])
        if ours == "wte.weight":
            shape[0] = cfg.vocab_size  # the padded rows are not part of the model
        entries.append((theirs, shape[::-1] if conv else shape, dtype))
        source[theirs] = (ours, conv, shape)

    def produce(theirs):
        ours, conv, shape = source[theirs]
        t = fit_padding(full.get(ours), shape, 0)
        return t.t() if conv else t

    return write_hf_dir(out_dir, gpt2_config(cfg, eod), dtype, entries, produce, use_package)


# ------------------------------------------------------------------- GPT-2 import
def config_from_hf(
    hf: dict, make_vocab_size_divisible_by: int = 128, seq_length: int | None = None
) -> GPTConfig:
    if hf.get("model_type") != "gpt2":
        raise ConversionError(f"model_type is {hf.get('model_type')!r}, only 'gpt2' converts")
    act = hf.get("activation_function", "gelu_new")
    checks = [
        (
            act in ("gelu_new", "gelu_pytorch_tanh"),
            f"activation_function {act!r} (our MLP uses GELU's tanh approximation)",
        ),
        (hf.get("scale_attn_weights", True), "scale_attn_weights false"),
        (
            not hf.get("scale_attn_by_inverse_layer_idx", False),
            "scale_attn_by_inverse_layer_idx true",
        ),
        (not hf.get("add_cross_attention", False), "add_cross_attention true"),
        (hf.get("tie_word_embeddings", True), "an untied LM head"),
    ]
    for ok, what in checks:
        if not ok:
            raise ConversionError(f"this GPT-2 has {what}, which GPTModel does not implement")
    missing = [k for k in ("n_layer", "n_embd", "n_head", "vocab_size") if k not in hf]
    if missing:
        raise ConversionError(f"config.json lacks {', '.join(missing)}")
    n_pos = hf.get("n_positions", hf.get("n_ctx", 1024))
    return GPTConfig(
        num_layers=hf["n_layer"],
        hidden_size=hf["n_embd"],
        num_attention_heads=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner") or 4 * hf["n_embd"],
        seq_length=seq_length or n_pos,
        max_position_embeddings=n_pos,
        vocab_size=hf["vocab_size"],
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        hidden_dropout=hf.get("resid_pdrop", 0.1),
        attention_dropout=hf.get("attn_pdrop", 0.1),
        layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        init_method_std=hf.get("initializer_range", 0.02),
    )


def import_hf(
    hf_dir: str,
    save: str,
    tp: int = 1,
    *,
    make_vocab_size_divisible_by: int = 128,
    seq_length: int | None = None,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    dtype=torch.float32,
    seed: int = 1234,
) -> str:
    """Write a GPT-2 from ``hf_dir`` as an iteration-0 checkpoint at TP=``tp``, DP=1."""
    hf = read_hf_config(hf_dir)
    cfg = config_from_hf(hf, make_vocab_size_divisible_by, seq_length)
    if cfg.num_attention_heads % tp or cfg.hidden_size % tp or cfg.ffn_hidden_size % tp:
        raise ConversionError(
            f"--tensor-model-parallel-size {tp} does not divide the heads "
            f"({cfg.num_attention_heads}), hidden size or MLP width"
        )
    weights = hf_weights(hf_dir, strip="transformer.")
    # Some files store the tied head anyway: then it must equal the embedding.
    tied = "lm_head.weight" not in weights or torch.equal(
        weights["lm_head.weight"](), weights["wte.weight"]()
    )
    if not tied:
        raise ConversionError("lm_head.weight differs from wte.weight: an untied head")
    names = {
        ours: (theirs.removeprefix("transformer."), conv)
        for ours, (theirs, conv) in gpt2_name_map(cfg.num_layers).items()
    }
    missing = [t for t, _ in names.values() if t not in weights]
    if missing:
        raise ConversionError(f"{hf_dir}: missing GPT-2 tensors: {', '.join(missing[:5])}")
    unused = [
        n
        for n in weights
        if n not in {t for t, _ in names.values()}
        and n != "lm_head.weight"
        and not n.endswith((".attn.bias", ".attn.masked_bias"))
    ]
    if unused:  # the causal-mask buffers of old files are not weights
        raise ConversionError(
            f"{hf_dir}: tensors GPTModel has no place for: {', '.join(unused[:5])}"
        )

    def tensor(name, key, shape, dim):
        if key != "master":  # a starting point: Adam moments begin at zero
            return torch.zeros(shape)
        theirs, conv = names[name]
        t = weights[theirs]().float()
        t = t.t() if conv else t
        return fit_padding(t, shape, max(dim, 0))

    args = import_args(cfg, hf_dir)
    return write_checkpoint(
        save,
        0,
        0,
        cfg,
        tp,
        tensor,
        dtype=dtype,
        rng=fresh_rng(seed),
        args=args,
        bucket_size=bucket_size,
    )
