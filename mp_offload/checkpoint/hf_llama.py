"""Hugging Face Llama: export a Llama-shaped checkpoint as ``LlamaForCausalLM``, import one.

Owns the name map between our parameters and Llama's, the row rules that split our fused
weights into Llama's separate ones (and join them back), and the two configs. Like
``hf_gpt2`` it holds one full parameter of the source at a time.

Our layout (model/block.py) against Llama's (HF transformers' ``modeling_llama``):
- ``attn.qkv`` fuses q_proj, k_proj, v_proj along the output rows. With G query groups
  (--group-query-attention) the rows, viewed as [G, a/G + 2, d, ...] (a heads of d
  channels), hold q = [:, :-2], k = [:, -2], v = [:, -1]; without it they are
  [q; k; v], each a*d rows (G = a). Query head i uses K/V head i // (a/G) in both.
- ``mlp.fc1`` fuses [gate_proj; up_proj] (chunk(2) of the rows); fc2 is down_proj.
- ln1, ln2, ln_f are input_layernorm, post_attention_layernorm, model.norm (RMSNorm).
- our rotary is the rotate-half one of HF Llama: q and k need no permutation (the
  logits tests in tests/test_hf_llama.py show it).
- the embedding and the untied output layer carry vocabulary padding rows: cut on
  export, zero rows added on import. A tied head (no --untie-...) is
  ``tie_word_embeddings: true`` and no lm_head.weight.
- biases: all of our linears or none (--disable-bias-linear); Llama's are
  attention_bias (q, k, v, o) and mlp_bias (gate, up, down), so both or neither.
"""

from __future__ import annotations

import dataclasses

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

ARCH = "LlamaForCausalLM"
DEFAULT_THETA = 10000  # transformers' default rope_theta for Llama, and ours
# The options LlamaForCausalLM expresses, and the values it takes.
LLAMA_OPTIONS = {
    "normalization": ("RMSNorm",),
    "swiglu": (True,),
    "position_embedding_type": ("rope",),
    "rotary_percent": (None, 1.0),
    "rotary_base": ANY,
    "group_query_attention": ANY,
    "num_query_groups": ANY,
    "untie_embeddings_and_output_weights": ANY,
    "disable_bias_linear": ANY,
}


def is_llama(hf: dict) -> bool:
    return hf.get("model_type") == "llama" or ARCH in (hf.get("architectures") or ())


# --------------------------------------------------------------------- name map
def llama_name_map(cfg: GPTConfig) -> dict[str, tuple[str, list[str]]]:
    """Our parameter name -> (row rule, the HF names its rows become). Rules: "same",
    "vocab" (padding rows), "qkv" (q, k, v), "gate_up" (gate, up)."""
    m = {
        "wte.weight": ("vocab", ["model.embed_tokens.weight"]),
        "ln_f.weight": ("same", ["model.norm.weight"]),
    }
    kinds = ["weight"] if cfg.disable_bias_linear else ["weight", "bias"]
    for i in range(cfg.num_layers):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        m[ours + "ln1.weight"] = ("same", [hf + "input_layernorm.weight"])
        m[ours + "ln2.weight"] = ("same", [hf + "post_attention_layernorm.weight"])
        for k in kinds:
            m[ours + f"attn.qkv.{k}"] = ("qkv", [hf + f"self_attn.{p}_proj.{k}" for p in "qkv"])
            m[ours + f"attn.proj.{k}"] = ("same", [hf + f"self_attn.o_proj.{k}"])
            m[ours + f"mlp.fc1.{k}"] = (
                "gate_up",
                [hf + f"mlp.{p}_proj.{k}" for p in ("gate", "up")],
            )
            m[ours + f"mlp.fc2.{k}"] = ("same", [hf + f"mlp.down_proj.{k}"])
    if cfg.untie_embeddings_and_output_weights:
        m["output_layer.weight"] = ("vocab", ["lm_head.weight"])
    return m


def split_rows(rule: str, t: torch.Tensor, cfg: GPTConfig) -> list[torch.Tensor]:
    """Our full tensor (weight or bias) -> the HF tensors, in the name map's order."""
    if rule == "vocab":
        return [t[: cfg.vocab_size]]
    if rule == "gate_up":
        return list(t.chunk(2, dim=0))
    if rule == "same":
        return [t]
    a, g, rest = cfg.num_attention_heads, cfg.kv_groups, t.shape[1:]
    d = cfg.hidden_size // a
    if cfg.group_query_attention:
        v = t.reshape(g, a // g + 2, d, *rest)
        parts = v[:, :-2], v[:, -2], v[:, -1]
    else:
        parts = t.reshape(3, a, d, *rest).unbind(0)
    return [p.reshape(-1, *rest) for p in parts]


def join_rows(rule: str, parts: list[torch.Tensor], cfg: GPTConfig) -> torch.Tensor:
    """The inverse of ``split_rows`` (the vocabulary left unpadded)."""
    if rule != "qkv":
        return torch.cat(parts, dim=0)
    q, k, v = parts
    a, g, rest = cfg.num_attention_heads, cfg.kv_groups, q.shape[1:]
    d = cfg.hidden_size // a
    if not cfg.group_query_attention:
        return torch.cat(parts, dim=0)
    blocks = (q.reshape(g, a // g, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest))
    return torch.cat(blocks, dim=1).reshape(-1, *rest)


# ----------------------------------------------------------------------- export
def llama_config(cfg: GPTConfig, eod: int | None = None) -> dict:
    """config.json for ``LlamaForCausalLM`` (vocab unpadded). The rope base is written
    both ways: ``rope_parameters`` (transformers 5) and ``rope_theta`` (4.x)."""
    base = cfg.rotary[0]
    return {
        "architectures": [ARCH],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_groups,
        "head_dim": cfg.hidden_size // cfg.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.layernorm_epsilon,
        "initializer_range": cfg.init_method_std,
        "rope_theta": float(base),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(base)},
        "attention_bias": not cfg.disable_bias_linear,
        "mlp_bias": not cfg.disable_bias_linear,
        "attention_dropout": cfg.attention_dropout,
        "pretraining_tp": 1,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "use_cache": True,
        "bos_token_id": eod,
        "eos_token_id": eod,
        "torch_dtype": "float32",
    }


def check_llama_compatible(model_config: dict, names) -> None:
    check_options(model_config, LLAMA_OPTIONS, "LlamaForCausalLM")
    cfg = GPTConfig(
        **{
            k: v
            for k, v in model_config.items()
            if k in {f.name for f in dataclasses.fields(GPTConfig)}
        }
    )
    check_names(names, set(llama_name_map(cfg)), "Llama")


def export_hf(
    ckpt: str,
    out_dir: str,
    dtype=torch.float32,
    eod: int | None = None,
    use_package: bool | None = None,
) -> str:
    """Write ``config.json`` + ``model.safetensors`` of a Llama from checkpoint dir ``ckpt``."""
    full = FullTensors(ckpt)
    cfg = full.config
    check_llama_compatible(full.manifest["model_config"], full.names)
    names = llama_name_map(cfg)
    entries, source = [], {}
    for ours in full.names:  # model order, like HF's own files
        rule, theirs = names[ours]
        shape = full.manifest["params"][ours]["shape"]
        meta = split_rows(rule, torch.empty(shape, device="meta"), cfg)
        for i, (name, t) in enumerate(zip(theirs, meta)):
            entries.append((name, list(t.shape), dtype))
            source[name] = (ours, i)
    last = {}  # the fused parameter being split: read once for its two or three parts

    def produce(theirs):
        ours, i = source[theirs]
        if ours not in last:
            last.clear()
            last[ours] = split_rows(names[ours][0], full.get(ours), cfg)
        return last[ours][i]

    return write_hf_dir(out_dir, llama_config(cfg, eod), dtype, entries, produce, use_package)


# ----------------------------------------------------------------------- import
def _rope_base(hf: dict) -> int:
    """rope_theta from ``rope_parameters`` (transformers 5) or ``rope_theta`` /
    ``rope_scaling`` (4.x); only unscaled rotary converts, over whole heads."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ConversionError(
            f"config.json: rope_type {kind!r} (scaled rotary) is not "
            f"implemented; only 'default' converts"
        )
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConversionError(
            f"config.json: partial_rotary_factor {partial}: Llama rotates whole heads here"
        )
    theta = rope.get("rope_theta", hf.get("rope_theta", DEFAULT_THETA))
    if float(theta) != int(theta):
        raise ConversionError(
            f"config.json: rope_theta {theta} is not a whole number (--rotary-base takes one)"
        )
    return int(theta)


def _check_llama_hf(hf: dict) -> None:
    """What GPTModel cannot run: a one-line error naming the config.json key."""
    missing = [
        k
        for k in (
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
        if k not in hf
    ]
    if missing:
        raise ConversionError(f"config.json lacks {', '.join(missing)}")
    h, a = hf["hidden_size"], hf["num_attention_heads"]
    checks = [
        (
            hf.get("hidden_act", "silu") == "silu",
            f"hidden_act {hf.get('hidden_act')!r} (our SwiGLU uses silu)",
        ),
        (
            hf.get("head_dim") in (None, h // a) and h % a == 0,
            f"head_dim {hf.get('head_dim')} (ours is hidden_size / num_attention_heads)",
        ),
        (
            bool(hf.get("attention_bias", False)) == bool(hf.get("mlp_bias", False)),
            "attention_bias != mlp_bias (our linears have biases all or none)",
        ),
    ]
    for ok, what in checks:
        if not ok:
            raise ConversionError(f"config.json: {what}, which GPTModel does not implement")


def config_from_hf(
    hf: dict, make_vocab_size_divisible_by: int = 128, seq_length: int | None = None
) -> GPTConfig:
    if not is_llama(hf):
        raise ConversionError(f"model_type is {hf.get('model_type')!r}, not 'llama'")
    _check_llama_hf(hf)
    a = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or a
    base = _rope_base(hf)
    n_pos = hf.get("max_position_embeddings", 2048)
    # Defaults are stored as None, as a run without the flag records them (the
    # checkpoint compares them with the run's flags).
    return GPTConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=a,
        ffn_hidden_size=hf["intermediate_size"],
        seq_length=seq_length or n_pos,
        max_position_embeddings=n_pos,
        vocab_size=hf["vocab_size"],
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        hidden_dropout=0.0,
        attention_dropout=hf.get("attention_dropout", 0.0),
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        init_method_std=hf.get("initializer_range", 0.02),
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        rotary_base=None if base == DEFAULT_THETA else base,
        group_query_attention=groups != a,
        num_query_groups=groups if groups != a else None,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        disable_bias_linear=not hf.get("attention_bias", False),
    )


def _check_tp(cfg: GPTConfig, tp: int) -> None:
    for what, n in (
        ("--num-attention-heads", cfg.num_attention_heads),
        (
            "--num-query-groups" if cfg.group_query_attention else "--num-attention-heads",
            cfg.kv_groups,
        ),
        ("--ffn-hidden-size", cfg.ffn_hidden_size),
    ):
        if n % tp:
            raise ConversionError(f"--tensor-model-parallel-size {tp} does not divide {what} {n}")


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
    """Write a Llama from ``hf_dir`` as an iteration-0 checkpoint at TP=``tp``, DP=1."""
    cfg = config_from_hf(read_hf_config(hf_dir), make_vocab_size_divisible_by, seq_length)
    _check_tp(cfg, tp)
    weights = hf_weights(hf_dir)
    names = llama_name_map(cfg)
    wanted = {t for _, theirs in names.values() for t in theirs}
    missing = sorted(wanted - set(weights))
    if missing:
        raise ConversionError(f"{hf_dir}: missing Llama tensors: {', '.join(missing[:5])}")
    if not cfg.untie_embeddings_and_output_weights and "lm_head.weight" in weights:
        # Some files store the tied head anyway: then it must equal the embedding.
        if not torch.equal(weights["lm_head.weight"](), weights["model.embed_tokens.weight"]()):
            raise ConversionError(
                "tie_word_embeddings is true but lm_head.weight differs "
                "from model.embed_tokens.weight"
            )
        wanted.add("lm_head.weight")
    unused = [n for n in weights if n not in wanted and not n.endswith("rotary_emb.inv_freq")]
    if unused:  # old files keep the rotary tables as buffers: not weights
        raise ConversionError(
            f"{hf_dir}: tensors GPTModel has no place for: {', '.join(unused[:5])}"
        )

    def tensor(name, key, shape, dim):
        if key != "master":  # a starting point: Adam moments begin at zero
            return torch.zeros(shape)
        rule, theirs = names[name]
        t = join_rows(rule, [weights[n]().float() for n in theirs], cfg)
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
