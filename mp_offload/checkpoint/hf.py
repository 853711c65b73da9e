"""Hugging Face conversions by architecture: the checkpoint or config.json picks it.

Export: a model with rotary positions is a ``LlamaForCausalLM`` (``hf_llama``), any
other a ``GPT2LMHeadModel`` (``hf_gpt2``); each refuses, naming the flags, the options
its architecture cannot express. Import: config.json's ``model_type`` (or
``architectures``) says which.
"""

from __future__ import annotations

from . import hf_gpt2, hf_llama
from .errors import ConversionError
from .hf_common import read_hf_config
from .offline import FullTensors


def export_architecture(ckpt: str) -> str:
    """The HF class ``export_hf`` writes ``ckpt`` as."""
    rope = FullTensors(ckpt).config.position_embedding_type == "rope"
    return hf_llama.ARCH if rope else "GPT2LMHeadModel"


def export_hf(ckpt: str, out_dir: str, *args, **kwargs) -> str:
    """``hf_llama.export_hf`` or ``hf_gpt2.export_hf`` (same arguments) by the model."""
    module = hf_llama if export_architecture(ckpt) == hf_llama.ARCH else hf_gpt2
    return module.export_hf(ckpt, out_dir, *args, **kwargs)


def import_hf(hf_dir: str, save: str, tp: int = 1, **kwargs) -> str:
    """``hf_llama.import_hf`` or ``hf_gpt2.import_hf`` (same arguments) by config.json."""
    hf = read_hf_config(hf_dir)
    if hf_llama.is_llama(hf):
        return hf_llama.import_hf(hf_dir, save, tp, **kwargs)
    if hf.get("model_type") == "gpt2":
        return hf_gpt2.import_hf(hf_dir, save, tp, **kwargs)
    raise ConversionError(
        f"{hf_dir}/config.json: model_type {hf.get('model_type')!r} "
        f"(architectures {hf.get('architectures')}); GPT-2 and Llama "
        f"convert"
    )
