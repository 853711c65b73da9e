"""The commands that fine-tune an imported Hugging Face model (``convert_checkpoint.py
--hf-in`` prints them): tokenize with the model's own tokenizer, then train from the
imported weights with the flags the checkpoint needs repeated, one tokenizer throughout.

The learning rate is a suggestion: fine-tuning takes a rate far below pretraining's
(1/10 to 1/30 of it; 2e-5 for models of this kind), with a short warmup.
"""

from __future__ import annotations

import os
import shlex

from .model.gpt_config import GPTConfig, model_flags

FINETUNE_LR = "2e-5"
DATA_PREFIX = "data/finetune"


def _line(words: list[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)


def finetune_recipe(hf_dir: str, save: str, cfg: GPTConfig, tp: int) -> str:
    """Lines to print after importing ``hf_dir`` into ``save`` at TP size ``tp`` (``cfg``:
    the imported model's configuration)."""
    has_tokenizer = os.path.isfile(os.path.join(hf_dir, "tokenizer.json"))
    tok_dir = hf_dir if has_tokenizer else "TOKENIZER_DIR"
    tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok_dir]
    prep = ["python", "tools/preprocess_data.py", "--input", "data.jsonl"]
    prep += ["--output-prefix", DATA_PREFIX, *tok, "--append-eod", "--workers", "4"]
    run = ["python", "scripts/torchrun_quiet.py", "--standalone", "--nproc-per-node", str(tp)]
    run += ["pretrain_gpt.py", "--tensor-model-parallel-size", str(tp)]
    run += ["--load", save, "--finetune", *model_flags(cfg)]
    run += ["--seq-length", str(cfg.seq_length)]
    run += ["--make-vocab-size-divisible-by", str(cfg.make_vocab_size_divisible_by)]
    run += ["--data-path", f"{DATA_PREFIX}_text_document", *tok]
    run += ["--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "1000"]
    run += ["--lr", FINETUNE_LR, "--min-lr", "2e-6", "--lr-warmup-iters", "50"]
    run += ["--lr-decay-style", "cosine", "--bf16", "--cpu-offload"]
    run += ["--save", f"{save.rstrip(os.sep)}_finetuned", "--save-interval", "200"]
    where = (
        f"its own tokenizer ({hf_dir}/tokenizer.json, also copied into the checkpoint)"
        if has_tokenizer
        else f"the tokenizer it was trained with ({hf_dir} has no tokenizer.json: put its "
        f"directory for TOKENIZER_DIR in both commands)"
    )
    return "\n".join(
        [
            f'fine-tune it: 1. tokenize your text (JSONL, one {{"text": ...}} per line) with '
            f"{where}:",
            f"  {_line(prep)}",
            f"2. train from the imported weights (sequence length {cfg.seq_length}, the "
            f"import's; lr {FINETUNE_LR}, a fine-tuning rate; the model flags must stay):",
            f"  {_line(run)}",
        ]
    )
