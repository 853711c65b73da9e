"""tools/finetune_hf.py's flags (Megatron's names where Megatron has the flag) and their
checks: every problem is one BadInput line naming the flag, found before any process
group starts, so every rank finds the same one."""

from __future__ import annotations

import argparse
import os

from ..config.help import DefaultsHelpFormatter
from . import BadInput

MOMENTS = ("fp32", "bf16", "8bit")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise BadInput(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="finetune_hf.py",
        description="Fine-tune a local Hugging Face causal LM with OffloadAdamW (data "
        "parallel under torchrun, the optimizer state on the CPU).",
        formatter_class=DefaultsHelpFormatter,
        allow_abbrev=False,
    )
    a = p.add_argument
    model = p.add_mutually_exclusive_group()
    model.add_argument("--hf-model", help="model directory: config, weights, tokenizer")
    model.add_argument("--from-config", help="model directory: config and tokenizer; random init")
    a("--tokenizer", help="tokenizer directory (default: the model's)")
    a("--data", help='JSONL: {"text"}, {"prompt","completion"} or {"messages"}')
    a("--train-iters", type=int, help="optimizer steps to train to")
    a("--micro-batch-size", type=int, default=1)
    a("--global-batch-size", type=int, help="default: micro batch x data-parallel size")
    a("--seq-length", type=int, default=512, help="longest example; text is packed to it")
    a("--lr", type=float, default=1e-5)
    a("--min-lr", type=float, default=0.0)
    a("--lr-warmup-iters", type=int, default=0)
    a("--lr-decay-iters", type=int, help="default: --train-iters")
    a("--lr-decay-style", default="cosine", choices=("constant", "linear", "cosine"))
    a("--weight-decay", type=float, default=0.01, help="on matrices (none on biases, norms)")
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.999)
    a("--adam-eps", type=float, default=1e-8)
    a("--clip-grad", type=float, default=1.0, help="global gradient norm; 0: none")
    prec = p.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_true", help="bf16 weights on the device")
    prec.add_argument("--fp16", action="store_true", help="fp16 weights, dynamic loss scale")
    a("--seed", type=int, default=1234)
    a("--save", help="checkpoint directory")
    a("--save-interval", type=int, help="iterations between checkpoints (and at the end)")
    a("--load", help="resume from this checkpoint directory (or one iter_* in it)")
    a("--hf-out", help="write the trained model here with save_pretrained")
    a("--log-interval", type=int, default=1, help="iterations between progress lines")
    a("--log-json", help="append one JSON record per iteration to this file (rank 0)")
    _offload_flags(p)
    return p


def _offload_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--optimizer-offload-fraction", type=float, default=1.0, help="state share on the CPU")
    a("--store-param-remainders", action="store_true", help="bf16: master = weight + remainder")
    a("--exp-avg-dtype", default="fp32", choices=MOMENTS)
    a("--exp-avg-sq-dtype", default="fp32", choices=MOMENTS)
    a("--overlap-cpu-optimizer", action="store_true", help="CPU Adam during backward")
    a("--dpu-warmup-steps", type=int, help="delayed parameter update after N steps")
    a("--accumulate-grads-on-device", action="store_true", help="sum micro-batches on device")


def _require(ok: bool, line: str) -> None:
    if not ok:
        raise BadInput(line)


def parse(argv, world: int) -> argparse.Namespace:
    """The checked flags for a job of ``world`` data-parallel ranks."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        from ..config import unknown_flag_problems

        raise BadInput(unknown_flag_problems(extra, parser)[0])
    # required here, not in argparse: an unknown flag (a misspelled required one) is named first
    _require(args.hf_model or args.from_config, "one of --hf-model or --from-config is required")
    for flag in ("--data", "--train-iters"):
        _require(getattr(args, flag[2:].replace("-", "_")) is not None, f"{flag} is required")
    flag, model_dir = (
        ("--hf-model", args.hf_model) if args.hf_model else ("--from-config", args.from_config)
    )
    args.model_dir = model_dir
    _require(os.path.isdir(model_dir), f"{flag} {model_dir}: no such directory")
    _require(
        os.path.isfile(os.path.join(model_dir, "config.json")),
        f"{flag} {model_dir}: no config.json in it",
    )
    args.tokenizer = args.tokenizer or model_dir
    _require(os.path.isdir(args.tokenizer), f"--tokenizer {args.tokenizer}: no such directory")
    _require(os.path.isfile(args.data), f"--data {args.data}: no such file")
    for name in ("train_iters", "micro_batch_size", "seq_length", "log_interval"):
        value = getattr(args, name)
        _require(value > 0, f"--{name.replace('_', '-')} {value}: must be positive")
    mbs = args.micro_batch_size
    args.global_batch_size = args.global_batch_size or mbs * world
    gbs = args.global_batch_size
    _require(
        gbs > 0 and gbs % (mbs * world) == 0,
        f"--global-batch-size {gbs}: must be a multiple of --micro-batch-size {mbs} x "
        f"{world} data-parallel ranks",
    )
    args.accumulation_steps = gbs // (mbs * world)
    _require(0.0 <= args.min_lr <= args.lr, f"--min-lr {args.min_lr}: must be in [0, --lr]")
    _require(
        0.0 <= args.optimizer_offload_fraction <= 1.0,
        f"--optimizer-offload-fraction {args.optimizer_offload_fraction}: must be in [0, 1]",
    )
    if args.save_interval is not None:
        _require(args.save, "--save-interval: needs --save")
        _require(args.save_interval > 0, f"--save-interval {args.save_interval}: must be positive")
    if args.save:
        _require(not os.path.isfile(args.save), f"--save {args.save}: is a file, not a directory")
    if args.load:
        from .run_state import find

        args.load_path = find(args.load)
    _check_modes(args)
    return args


def compute_dtype(args):
    import torch

    return torch.float16 if args.fp16 else (torch.bfloat16 if args.bf16 else torch.float32)


def _check_modes(args) -> None:
    """The offload modes against the optimizer's one table, in flag names."""
    from ..optimizer.options import MOMENT_DTYPES, OptimizerOptions, render

    fields = {k: v for k, v in optimizer_modes(args).items() if k != "gradient_accumulation_steps"}
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        fields[key] = MOMENT_DTYPES[fields[key]]
    options, broken = OptimizerOptions.checked(
        dtype=compute_dtype(args), micro_batches=args.accumulation_steps, **fields
    )
    if broken:
        raise BadInput(render(broken[0], options))


def optimizer_modes(args) -> dict:
    """OffloadAdamW's mode keywords for these flags (their combinations are checked by
    the optimizer's own table)."""
    modes = dict(
        gradient_accumulation_steps=args.accumulation_steps,
        offload_fraction=args.optimizer_offload_fraction,
        store_param_remainders=args.store_param_remainders,
        exp_avg_dtype=args.exp_avg_dtype,
        exp_avg_sq_dtype=args.exp_avg_sq_dtype,
        overlap_cpu_optimizer=args.overlap_cpu_optimizer,
        accumulate_on_device=args.accumulate_grads_on_device,
    )
    if args.dpu_warmup_steps is not None:
        modes["dpu_warmup_steps"] = args.dpu_warmup_steps
    return modes
