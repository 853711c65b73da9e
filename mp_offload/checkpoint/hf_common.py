"""What the Hugging Face conversions (``hf_gpt2``, ``hf_llama``) share.

Reading a HF directory's weights and config, the RNG state an imported checkpoint
stores, the check that refuses a model whose options the target architecture cannot
express (naming the flags). The model flags a run from an import needs are
``model.config.model_flags``.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from ..model.gpt_config import SHAPE_FIELDS
from ..tensor_parallel.random import get_rng_tracker, model_parallel_seed
from .errors import ConversionError
from .on_disk import rng_state
from .safetensors_io import SafeTensorsFile, write_safetensors

# GPTConfig fields that leave the weights' meaning alone (training-time choices): no
# architecture has to express them.
NEUTRAL_FIELDS = {
    "seq_length",
    "make_vocab_size_divisible_by",
    "hidden_dropout",
    "attention_dropout",
    "init_method_std",
    "recompute_activations",
    "sequence_parallel",
    "layernorm_epsilon",
}
ANY = None  # an option whose value an architecture takes whatever it is
# How an unset (None) option reads on the command line: its default.
_SHOWN_AS = {
    "normalization": "LayerNorm",
    "position_embedding_type": "learned_absolute",
    "rotary_base": 10000,
    "rotary_percent": 1.0,
}


def _flag(field: str, value) -> str:
    flag = "--" + field.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"no {flag}"
    return f"{flag} {_SHOWN_AS.get(field) if value is None else value}"


def check_options(model_config: dict, wanted: dict, arch: str) -> None:
    """Refuse options ``arch`` cannot express: ``wanted`` maps an option to the values it
    accepts (``ANY``: all); a field nobody knows (a newer option) must be unset."""
    bad = []
    for field, value in model_config.items():
        if field in SHAPE_FIELDS or field in NEUTRAL_FIELDS:
            continue
        if field in wanted:
            if wanted[field] is not ANY and value not in wanted[field]:
                bad.append(_flag(field, value))
        elif value:
            bad.append(_flag(field, value))
    if bad:
        raise ConversionError(f"the model has options {arch} cannot express: " + ", ".join(bad))


def check_names(names, want: set, what: str) -> None:
    """The checkpoint's parameters are exactly the ones the name map converts."""
    got = set(names)
    if got != want:
        diff = sorted(got - want)[:5] + [f"(missing) {n}" for n in sorted(want - got)[:5]]
        raise ConversionError(f"the parameters do not form a {what}: " + ", ".join(diff))


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConversionError(f"{path}: missing (not a Hugging Face model directory)") from None
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: not JSON ({e})") from None


def hf_weights(hf_dir: str, strip: str = ""):
    """name -> loader for the weights of a HF directory (safetensors, sharded or not, or
    pytorch_model.bin); names are returned without the prefix ``strip``."""
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
        return {n.removeprefix(strip): (lambda n=n: state[n]) for n in state}
    else:
        raise ConversionError(f"{hf_dir}: no model.safetensors(.index.json) or pytorch_model.bin")
    opened = {}

    def load(name, path):
        if path not in opened:
            opened[path] = SafeTensorsFile(path)
        return opened[path].get(name)

    return {n.removeprefix(strip): (lambda n=n, p=p: load(n, p)) for n, p in files.items()}


def import_args(cfg, hf_dir: str) -> dict:
    """The recorded args of an imported model: its shape, its source, and the source's
    tokenizer.json where it has one (copied into the checkpoint, so generation and export
    find it without flags)."""
    args = {"model": dataclasses.asdict(cfg), "source": {"hf_dir": os.path.abspath(hf_dir)}}
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        args["data"] = {
            "tokenizer_type": "HuggingFaceTokenizer",
            "tokenizer_model": os.path.abspath(hf_dir),
        }
    return args


def fresh_rng(seed: int):
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


def write_hf_dir(
    out_dir: str, config: dict, dtype: torch.dtype, entries, produce, use_package: bool
) -> str:
    """A Hugging Face model directory: model.safetensors (tensors made one at a time by
    ``produce``) and config.json with the dtype they were written in."""
    os.makedirs(out_dir, exist_ok=True)
    config = dict(config, torch_dtype=str(dtype).replace("torch.", ""))
    write_safetensors(
        os.path.join(out_dir, "model.safetensors"),
        entries,
        produce,
        metadata={"format": "pt"},
        use_package=use_package,
    )
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir
