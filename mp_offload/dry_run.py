"""``pretrain_gpt.py --dry-run``: the planner's answer for a training command line,
with the hardware from the environment (``planner.cli.hardware_from_env``) and the
vocabulary from the run's tokenizer, allocating nothing.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from .config import Args
from .planner.cli import _fraction_line, describe_model, hardware_from_env, run_from_args
from .planner.memory import compare_modes, format_comparison, format_job, plan_job


def _vocabulary(args: Args) -> tuple[int, str]:
    """Training takes the vocabulary from the tokenizer: do the same when one is named.
    (vocabulary, where it came from)."""
    d, flag = args.data, args.model.vocab_size
    if d.mock_data or d.tokenizer_type == "NullTokenizer" or not d.tokenizer_model:
        return flag, f"vocabulary {flag} (--vocab-size)"
    if not os.path.exists(d.tokenizer_model):
        return flag, (
            f"vocabulary {flag} (--vocab-size; --tokenizer-model {d.tokenizer_model} not "
            f"found here)"
        )
    try:
        from .data.tokenizer import build_tokenizer

        vocab = build_tokenizer(d.tokenizer_type, d.tokenizer_model, vocab_size=flag).vocab_size
        return vocab, f"vocabulary {vocab} (from {d.tokenizer_model})"
    except Exception as e:  # noqa: BLE001 - a plan is still useful without it
        return flag, f"vocabulary {flag} (--vocab-size; tokenizer failed: {e})"


def dry_run(args: Args, world: int) -> None:
    """Plan a training command line without allocating anything, then return."""
    hw, notes = hardware_from_env(world)
    vocab, where = _vocabulary(args)
    args = dataclasses.replace(args, model=dataclasses.replace(args.model, vocab_size=vocab))
    print(f"dry run: world {world}; {where}; " + "; ".join(notes))
    print(describe_model(args, world))
    run = run_from_args(args, world)
    print(format_job(plan_job(run, hw, source="meta")))  # the real model, every TP rank
    if run.mode == "offload" and args.optim.optimizer_offload_fraction is None:
        print(_fraction_line(run, hw)[1])
    print("same model and layout, other modes:")
    print(format_comparison(compare_modes(run, hw)))
    sys.stdout.flush()
