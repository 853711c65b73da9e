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

import dataclasses
import json
import os

import torch

from ..model.gpt import GPTConfig
from ..optimizer.base import DEFAULT_BUCKET_SIZE
from ..tensor_parallel.random import get_rng_tracker, model_parallel_seed
from .errors import ConversionError
from .format import fit_padding, rng_state
from .offline import FullTensors, write_checkpoint
from .safetensors_io import SafeTensorsFile, write_safetensors

# ------------------------------------------------------------------- GPT-2 names
_BLOCK = (("ln1", "ln_1", False), ("attn.qkv", "attn.c_attn", True),
          ("attn.proj", "attn.c_proj", True), ("ln2", "ln_2", False),
          ("mlp.fc1", "mlp.c_fc", True), ("mlp.fc2", "mlp.c_proj", True))


def gpt2_name_map(num_layers: int) -> dict[str, tuple[str, bool]]:
    """Our parameter name -> (HF GPT-2 name, stored transposed as a Conv1D weight)."""
    m = {"wte.weight": ("transformer.wte.weight", False),
         "wpe.weight": ("transformer.wpe.weight", False),
         "ln_f.weight": ("transformer.ln_f.weight", False),
         "ln_f.bias": ("transformer.ln_f.bias", False)}
    for i in range(num_layers):
        for ours, theirs, conv in _BLOCK:
            m[f"blocks.{i}.{ours}.weight"] = (f"transformer.h.{i}.{theirs}.weight", conv)
            m[f"blocks.{i}.{ours}.bias"] = (f"transformer.h.{i}.{theirs}.bias", False)
    return m


# GPTConfig fields that have a GPT-2 meaning (or none needed: seq length, padding, init,
# recompute). Any other field a future model grows (rotary, SwiGLU, untied head...) stops
# the export until this module learns it, rather than writing a wrong GPT-2.
_GPT2_FIELDS = {"num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                "seq_length", "max_position_embeddings", "vocab_size",
                "make_vocab_size_divisible_by", "hidden_dropout", "attention_dropout",
                "layernorm_epsilon", "init_method_std", "recompute_activations"}


def check_gpt2_compatible(model_config: dict, names) -> None:
    extra = {k: v for k, v in model_config.items() if k not in _GPT2_FIELDS and v}
    if extra:
        raise ConversionError("the model has options GPT-2 cannot express: " +
                              ", ".join(f"{k}={v!r}" for k, v in sorted(extra.items())))
    want = set(gpt2_name_map(model_config["num_layers"]))
    got = set(names)
    if got != want:
        diff = sorted(got - want)[:5] + [f"(missing) {n}" for n in sorted(want - got)[:5]]
        raise ConversionError("the parameters do not form a GPT-2 (tied head, learned "
                              "positions, biased linears, LayerNorm): " + ", ".join(diff))


def gpt2_config(cfg: GPTConfig, eod: int | None = None) -> dict:
    """config.json for ``GPT2LMHeadModel`` (vocab unpadded)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.max_position_embeddings,
            "n_ctx": cfg.max_position_embeddings, "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers, "n_head": cfg.num_attention_heads,
            "n_inner": cfg.ffn_hidden_size, "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.layernorm_epsilon, "resid_pdrop": cfg.hidden_dropout,
            "embd_pdrop": cfg.hidden_dropout, "attn_pdrop": cfg.attention_dropout,
            "initializer_range": cfg.init_method_std, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": True, "use_cache": True, "bos_token_id": eod,
            "eos_token_id": eod, "torch_dtype": "float32"}


def export_hf(ckpt: str, out_dir: str, dtype=torch.float32, eod: int | None = None,
              use_package: bool | None = None) -> str:
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

    os.makedirs(out_dir, exist_ok=True)
    config = gpt2_config(cfg, eod)
    config["torch_dtype"] = str(dtype).replace("torch.", "")
    write_safetensors(os.path.join(out_dir, "model.safetensors"), entries, produce,
                      metadata={"format": "pt"}, use_package=use_package)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


# ------------------------------------------------------------------- GPT-2 import
def _hf_weights(hf_dir: str):
    """name -> loader for the weights of a HF directory (safetensors, sharded or not, or
    pytorch_model.bin); names are returned without the ``transformer.`` prefix."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    single = os.path.join(hf_dir, "model.safetensors")
    binary = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.exists(single):
        files = {n: single for n in SafeTensorsFile(single).names}
    elif os.path.exists(index):
        with open(index) as f:
            files = {n: os.path.join(hf_dir, p) for n, p in json.load(f)["weight_map"].items()}
    elif os.path.exists(binary):
        state = torch.load(binary, map_location="cpu", weights_only=True, mmap=True)
        return {n.removeprefix("transformer."): (lambda n=n: state[n]) for n in state}
    else:
        raise ConversionError(f"{hf_dir}: no model.safetensors(.index.json) or "
                              f"pytorch_model.bin")
    opened = {}

    def load(name, path):
        if path not in opened:
            opened[path] = SafeTensorsFile(path)
        return opened[path].get(name)
    return {n.removeprefix("transformer."): (lambda n=n, p=p: load(n, p))
            for n, p in files.items()}


def config_from_hf(hf: dict, make_vocab_size_divisible_by: int = 128,
                   seq_length: int | None = None) -> GPTConfig:
    if hf.get("model_type") != "gpt2":
        raise ConversionError(f"model_type is {hf.get('model_type')!r}, only 'gpt2' converts")
    act = hf.get("activation_function", "gelu_new")
    checks = [(act in ("gelu_new", "gelu_pytorch_tanh"),
               f"activation_function {act!r} (our MLP uses GELU's tanh approximation)"),
              (hf.get("scale_attn_weights", True), "scale_attn_weights false"),
              (not hf.get("scale_attn_by_inverse_layer_idx", False),
               "scale_attn_by_inverse_layer_idx true"),
              (not hf.get("add_cross_attention", False), "add_cross_attention true"),
              (hf.get("tie_word_embeddings", True), "an untied LM head")]
    for ok, what in checks:
        if not ok:
            raise ConversionError(f"this GPT-2 has {what}, which GPTModel does not implement")
    missing = [k for k in ("n_layer", "n_embd", "n_head", "vocab_size") if k not in hf]
    if missing:
        raise ConversionError(f"config.json lacks {', '.join(missing)}")
    n_pos = hf.get("n_positions", hf.get("n_ctx", 1024))
    return GPTConfig(num_layers=hf["n_layer"], hidden_size=hf["n_embd"],
                     num_attention_heads=hf["n_head"],
                     ffn_hidden_size=hf.get("n_inner") or 4 * hf["n_embd"],
                     seq_length=seq_length or n_pos, max_position_embeddings=n_pos,
                     vocab_size=hf["vocab_size"],
                     make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                     hidden_dropout=hf.get("resid_pdrop", 0.1),
                     attention_dropout=hf.get("attn_pdrop", 0.1),
                     layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
                     init_method_std=hf.get("initializer_range", 0.02))


def _fresh_rng(seed: int):
    """RNG state per TP rank as a run seeded with ``seed`` would have it (for a resume
    without --finetune); the process's own generators are left as they were."""
    def rng(tp_rank: int) -> dict:
        tracker = get_rng_tracker()
        saved = (torch.get_rng_state(), tracker.get_states(), tracker.device)
        try:
            model_parallel_seed(seed, tp_rank, "cpu")
            return rng_state()
        finally:
            torch.set_rng_state(saved[0])
            tracker.set_states(saved[1])
            tracker.device = saved[2]
    return rng


def import_hf(hf_dir: str, save: str, tp: int = 1, *, make_vocab_size_divisible_by: int = 128,
              seq_length: int | None = None, bucket_size: int = DEFAULT_BUCKET_SIZE,
              dtype=torch.float32, seed: int = 1234) -> str:
    """Write a GPT-2 from ``hf_dir`` as an iteration-0 checkpoint at TP=``tp``, DP=1."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    cfg = config_from_hf(hf, make_vocab_size_divisible_by, seq_length)
    if cfg.num_attention_heads % tp or cfg.hidden_size % tp or cfg.ffn_hidden_size % tp:
        raise ConversionError(f"--tensor-model-parallel-size {tp} does not divide the heads "
                              f"({cfg.num_attention_heads}), hidden size or MLP width")
    weights = _hf_weights(hf_dir)
    # Some files store the tied head anyway: then it must equal the embedding.
    tied = "lm_head.weight" not in weights or \
        torch.equal(weights["lm_head.weight"](), weights["wte.weight"]())
    if not tied:
        raise ConversionError("lm_head.weight differs from wte.weight: an untied head")
    names = {ours: (theirs.removeprefix("transformer."), conv)
             for ours, (theirs, conv) in gpt2_name_map(cfg.num_layers).items()}
    missing = [t for t, _ in names.values() if t not in weights]
    if missing:
        raise ConversionError(f"{hf_dir}: missing GPT-2 tensors: {', '.join(missing[:5])}")
    unused = [n for n in weights if n not in {t for t, _ in names.values()} and
              n != "lm_head.weight" and not n.endswith((".attn.bias", ".attn.masked_bias"))]
    if unused:  # the causal-mask buffers of old files are not weights
        raise ConversionError(f"{hf_dir}: tensors GPTModel has no place for: "
                              f"{', '.join(unused[:5])}")

    def tensor(name, key, shape, dim):
        if key != "master":  # a starting point: Adam moments begin at zero
            return torch.zeros(shape)
        theirs, conv = names[name]
        t = weights[theirs]().float()
        t = t.t() if conv else t
        return fit_padding(t, shape, max(dim, 0))

    args = {"model": dataclasses.asdict(cfg), "source": {"hf_dir": os.path.abspath(hf_dir)}}
    return write_checkpoint(save, 0, 0, cfg, tp, tensor, dtype=dtype, rng=_fresh_rng(seed),
                            args=args, bucket_size=bucket_size)
