"""Convert mp_offload checkpoints: merge to TP=1, export to / import from Hugging Face
(GPT-2 and Llama).

The converter's command line (argparse and ``main``); ``tools/convert_checkpoint.py`` is a
thin wrapper over it, the conversions themselves live in ``offline``, ``hf_gpt2`` and
``hf_llama`` (``hf`` picks between the two).

    # one TP=1, DP=1 checkpoint (weights, fp32 master, Adam moments, step, RNG):
    python tools/convert_checkpoint.py --load ckpt --save-merged ckpt_tp1
    # a HF directory (config.json + model.safetensors): LlamaForCausalLM for a model
    # with rotary positions, else GPT2LMHeadModel:
    python tools/convert_checkpoint.py --load ckpt --hf-out hf_dir
    # a GPT-2 or Llama as the starting point of a run (pretrain_gpt.py --load out --finetune):
    python tools/convert_checkpoint.py --hf-in hf_dir --save out --tensor-model-parallel-size 2

--save-merged and --hf-out can be given together. Runs in one process on the CPU; it
holds one full parameter of the source at a time (plus, for --save-merged, the merged
optimizer state it writes: 12 bytes per parameter; for --hf-out with the safetensors
package, the exported weights; without the package they are streamed to the file).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ..finetune_recipe import finetune_recipe
from ..optimizer.base import DEFAULT_BUCKET_SIZE
from . import on_disk as fmt
from .errors import CheckpointError, ConversionError
from .hf import export_architecture, export_hf, import_hf
from .offline import FullTensors, merge_checkpoint, resolve_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("from an mp_offload checkpoint")
    src.add_argument("--load", help="checkpoint root (or one iter_* directory)")
    src.add_argument("--iteration", type=int, help="default: the latest checkpoint")
    src.add_argument("--save-merged", metavar="OUT", help="write a TP=1, DP=1 checkpoint here")
    src.add_argument(
        "--hf-out",
        metavar="HFDIR",
        help="write a Hugging Face model here "
        "(LlamaForCausalLM with rotary positions, else GPT2LMHeadModel)",
    )
    src.add_argument(
        "--hf-dtype", choices=DTYPES, default="float32", help="dtype of the exported weights"
    )
    src.add_argument(
        "--eod-id",
        type=int,
        help="bos/eos id for the HF config (default: the "
        "run's tokenizer end-of-document, when it can be found)",
    )
    hf = p.add_argument_group("from a Hugging Face GPT-2 or Llama")
    hf.add_argument("--hf-in", metavar="HFDIR", help="directory with config.json and weights")
    hf.add_argument("--save", metavar="OUT", help="write the imported checkpoint here")
    hf.add_argument("--tensor-model-parallel-size", type=int, default=1)
    hf.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    hf.add_argument("--seq-length", type=int, help="default: the model's maximum positions")
    hf.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="dtype of the model.pt weights (the fp32 master is always kept)",
    )
    hf.add_argument("--seed", type=int, default=1234, help="RNG state stored for a resume")
    p.add_argument(
        "--reduce-bucket-size",
        type=int,
        default=None,
        help="bucket size of the written optimizer layout (default: the "
        f"source's, or {DEFAULT_BUCKET_SIZE}); the run's flag should match "
        "for an exact resume, otherwise the slices are re-partitioned on load",
    )
    return p


def _eod_guess(ckpt: str) -> int | None:
    """The run's end-of-document id, if its tokenizer can be rebuilt (best effort)."""
    from ..data.tokenizer import tokenizer_for  # deferred: pulls in the tokenizers

    full = FullTensors(ckpt)
    try:
        saved = dict(full.common().get("args", {}), data=fmt.tokenizer_args(ckpt, full.common()))
        tok, stops = tokenizer_for(saved, full.config.vocab_size)
        return tok.eod if stops else None
    except Exception:  # noqa: BLE001 - no tokenizer file here: leave the ids unset
        return None


def _export_tokenizer(ckpt: str, out_dir: str) -> None:
    """The run's tokenizer beside the weights, so AutoTokenizer loads the export too."""
    from ..data.hf_tokenizer import export_tokenizer  # deferred: needs tokenizers

    full = FullTensors(ckpt)
    data = fmt.tokenizer_args(ckpt, full.common())
    try:
        files = export_tokenizer(
            data, out_dir, model_max_length=full.config.max_position_embeddings
        )
    except (ValueError, OSError, ImportError) as e:
        print(
            f"convert_checkpoint.py: warning: tokenizer not exported ({e}); "
            f"AutoTokenizer will not load {out_dir}",
            file=sys.stderr,
        )
        return
    if files:
        print(f"exported the run's tokenizer -> {', '.join(os.path.basename(f) for f in files)}")


def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.hf_in:
        if a.load or a.save_merged or a.hf_out:
            p.error("--hf-in goes with --save, not with --load/--save-merged/--hf-out")
        if not a.save:
            p.error("--hf-in needs --save OUT")
    elif not a.load or not (a.save_merged or a.hf_out):
        p.error(
            "give --load DIR with --save-merged OUT and/or --hf-out HFDIR, "
            "or --hf-in HFDIR with --save OUT"
        )
    try:
        if a.hf_in:
            out = import_hf(
                a.hf_in,
                a.save,
                a.tensor_model_parallel_size,
                make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
                seq_length=a.seq_length,
                bucket_size=a.reduce_bucket_size or DEFAULT_BUCKET_SIZE,
                dtype=DTYPES[a.dtype],
                seed=a.seed,
            )
            cfg, tp = FullTensors(out).config, a.tensor_model_parallel_size
            print(f"imported {a.hf_in} -> {out} (TP={tp})")
            print(finetune_recipe(a.hf_in, a.save, cfg, tp))
            return 0
        ckpt = resolve_checkpoint(a.load, a.iteration)
        if a.save_merged:
            out = merge_checkpoint(ckpt, a.save_merged, a.reduce_bucket_size)
            print(f"merged {ckpt} -> {out} (TP=1, DP=1)")
        if a.hf_out:
            eod = a.eod_id if a.eod_id is not None else _eod_guess(ckpt)
            export_hf(ckpt, a.hf_out, DTYPES[a.hf_dtype], eod=eod)
            print(f"exported {ckpt} -> {a.hf_out} ({export_architecture(ckpt)})")
            _export_tokenizer(ckpt, a.hf_out)
        return 0
    except (CheckpointError, ConversionError, OSError) as e:
        print(f"convert_checkpoint.py: error: {e}", file=sys.stderr)
        return 1
