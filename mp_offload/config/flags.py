"""The run's flags: argparse generated from the dataclasses of ``schema.py``, the
checks that need several fields (and the world size), and ``resolve``, which fills in
every derived value. After ``resolve`` the ``Args`` are final: nothing changes them.

``validate`` runs on every rank before any collective, so a bad config fails everywhere,
never hangs. Every problem is one line naming the flag (an unknown flag gets "did you
mean"); argparse never prints its usage text.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
import typing

from ..model.gpt_config import GPTConfig
from ..parallel_sizes import ParallelConfigError, validate_parallel_sizes
from ..runtime.early_exit import reporting_rank
from .fields import field_problems, flag_fields, unwrap_optional
from .file import load_config_file
from .help import DefaultsHelpFormatter
from .schema import (
    CONFIG_CLASSES,
    Args,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
)

__all__ = [  # the schema's names too: callers import the run's flags from here
    "CONFIG_CLASSES",
    "Args",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "GPTConfig",
    "LoggingConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "TrainingConfig",
    "build_parser",
    "checked",
    "config_problems",
    "config_warnings",
    "given_flags",
    "parse",
    "parse_args",
    "parse_with_config",
    "resolve",
    "validate",
]


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError (one line, no usage text) instead of exiting, and
    prints --help on one rank only."""

    def error(self, message):
        raise ConfigError(message)

    def print_help(self, file=None):
        if reporting_rank():  # parsing precedes the process group
            super().print_help(file)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def unknown_flag_problems(extra: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """One line per unknown flag in argparse's leftovers (with the closest flag ``parser``
    knows), or one for a value no flag takes."""
    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    out, after_flag = [], False
    for token in extra:
        if token.startswith("-") and not _is_number(token):
            name = token.split("=", 1)[0]
            close = difflib.get_close_matches(name, known, n=1)
            hint = f": did you mean {close[0]}?" if close else " (--help lists the flags)"
            out.append(f"unrecognized argument {name}{hint}")
            after_flag = True
        elif not after_flag:
            out.append(
                f"unexpected value {token!r}: no flag takes it (every flag but "
                f"--data-path takes one value)"
            )
            after_flag = True
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        allow_abbrev=False,  # --num-layer must not silently mean --num-layers (Megatron too)
        description="Pretrain a GPT with TP x ZeRO-Offload DP",
        formatter_class=DefaultsHelpFormatter,
    )
    for group_name, cls in CONFIG_CLASSES.items():
        group = parser.add_argument_group(group_name)
        hints = typing.get_type_hints(cls)
        for f in flag_fields(cls):
            flag = "--" + f.name.replace("_", "-")
            tp = unwrap_optional(hints[f.name])
            help_, choices = f.metadata["help"], f.metadata.get("choices")
            dest = f"{group_name}.{f.name}"
            if tp is bool:
                group.add_argument(flag, dest=dest, action="store_true", help=help_)
            elif typing.get_origin(tp) is list:
                group.add_argument(
                    flag,
                    dest=dest,
                    nargs="+",
                    default=f.default,
                    help=help_,
                    metavar=f.name.upper(),
                )
            else:
                group.add_argument(
                    flag,
                    dest=dest,
                    type=tp,
                    default=f.default,
                    help=help_,
                    choices=choices,
                    metavar=None if choices else f.name.upper(),
                )
    add_config_flag(parser)
    return parser


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="YAML",
        default=None,
        help="read flag values from this YAML file; keys are flag names "
        "without the dashes (num-layers) or field names (num_layers); flags "
        "given on the command line override it",
    )


def _config_path(argv) -> str | None:
    pre = _Parser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    return pre.parse_known_args(argv)[0].config


_UNSET = object()  # a flag neither typed out nor in the --config file


def parse_namespace(
    parser: argparse.ArgumentParser, argv=None
) -> tuple[argparse.Namespace, frozenset[str]]:
    """``parser``'s flags over a ``--config`` file's values (the command line wins), and
    the field names given explicitly in either (a default and the same value typed out
    differ there; for checks such as --eval-interval with --eval-iters 0). argv is
    parsed and the file read once. A bad file (naming the key) or an unknown flag (with
    the closest known one) is a ConfigError, never argparse's usage text."""
    argv = list(sys.argv[1:] if argv is None else argv)
    path = _config_path(argv)
    from_file = load_config_file(path) if path is not None else {}
    parser.set_defaults(**from_file)  # (--help then shows the file's values)
    # argparse leaves alone what the namespace already holds: _UNSET marks the defaults.
    dests = [a.dest for a in parser._actions if a.dest not in ("help", "config")]
    ns = argparse.Namespace(**{d: from_file.get(d, _UNSET) for d in dests})
    ns, extra = parser.parse_known_args(argv, namespace=ns)
    if extra:
        raise ConfigError("\n".join(unknown_flag_problems(extra, parser)))
    given = set()
    for action in parser._actions:
        if getattr(ns, action.dest, None) is _UNSET:
            setattr(ns, action.dest, action.default)
        elif action.dest in dests:
            given.add(action.dest.split(".", 1)[-1])
    return ns, frozenset(given)


def parse_with_config(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``parse_namespace`` without the given flags."""
    return parse_namespace(parser, argv)[0]


def args_from_namespace(ns: argparse.Namespace) -> Args:
    """The "group.field" values of a namespace as the dataclasses (other keys ignored)."""
    parts = {name: {} for name in CONFIG_CLASSES}
    for key, value in vars(ns).items():
        group_name, _, fname = key.partition(".")
        if group_name in parts:
            parts[group_name][fname] = value
    return Args(**{name: CONFIG_CLASSES[name](**kw) for name, kw in parts.items()})


def parse(argv=None) -> tuple[Args, frozenset[str]]:
    """pretrain_gpt.py's flags (over a ``--config`` file's values) as dataclasses, and the
    field names given explicitly; ConfigError, one line per problem, for unknown flags,
    values of the wrong type, choices not offered, or a bad --config file."""
    ns, given = parse_namespace(build_parser(), argv)
    return args_from_namespace(ns), given


def parse_args(argv=None) -> Args:
    """``parse`` without the given flags."""
    return parse(argv)[0]


def given_flags(argv=None) -> frozenset[str]:
    """``parse``'s given flags alone."""
    return parse(argv)[1]


def _data_path_problems(d: DataConfig):
    from ..data.data_path import parse_data_path, parse_split

    if d.data_path is not None and len(d.data_path) > 1:
        if len(d.data_path) % 2:
            yield (
                "--data-path takes one prefix or weight/prefix pairs, got "
                f"{len(d.data_path)} values"
            )
        else:
            try:
                parse_data_path(d.data_path)
            except ValueError as e:
                yield (
                    f"--data-path {' '.join(d.data_path)}: {e} (give one prefix, or weight "
                    f"prefix pairs: --data-path 0.7 a_text_document 0.3 b_text_document)"
                )
    try:
        parse_split(d.split)
    except ValueError as e:
        yield (f"--split {d.split}: {e} (give up to 3 proportions train,valid,test, e.g. 969,30,1)")


def _tokenizer_problems(d: DataConfig):
    if (d.vocab_file is None) != (d.merge_file is None):
        given, missing = (
            ("--vocab-file", "--merge-file")
            if d.merge_file is None
            else ("--merge-file", "--vocab-file")
        )
        yield f"{given} needs {missing} too (GPT2BPETokenizer takes both)"
    if d.vocab_file is not None and d.tokenizer_type != "GPT2BPETokenizer":
        yield (
            f"--vocab-file/--merge-file are for --tokenizer-type GPT2BPETokenizer, "
            f"not {d.tokenizer_type}"
        )
    if d.mock_data:
        return
    if d.tokenizer_type == "GPT2BPETokenizer" and d.vocab_file is None:
        yield "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"
    if d.tokenizer_type == "HuggingFaceTokenizer" and d.tokenizer_model is None:
        yield (
            "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model "
            "(a tokenizer.json or a directory holding one)"
        )
    if d.tokenizer_type != "SentencePieceTokenizer" and d.data_path is None:
        yield (
            f"--tokenizer-type {d.tokenizer_type} needs --data-path (the default "
            "corpus is tokenized with its own SentencePiece model)"
        )
    if d.tokenizer_type == "SentencePieceTokenizer":
        if d.data_path is not None and d.tokenizer_model is None:
            yield (
                "--data-path needs --tokenizer-model: the SentencePiece .model the data "
                "was made with (tools/preprocess_data.py --tokenizer-model)"
            )
        if d.data_path is None and d.tokenizer_model is not None:
            yield (
                f"--tokenizer-model {d.tokenizer_model} without --data-path: the default "
                "corpus brings its own tokenizer; give the --data-path made with this one"
            )


def _data_problems(d: DataConfig, t: TrainingConfig, given: frozenset):
    if d.mock_data and d.data_path is not None:
        yield "--mock-data and --data-path exclude each other (mock data reads no files)"
    yield from _data_path_problems(d)
    yield from _tokenizer_problems(d)
    if d.mock_data:
        return
    from ..data.data_path import parse_split

    try:
        train, valid, _ = parse_split(d.split)
    except ValueError:
        return  # said above
    if train == 0 and (t.train_iters or t.train_samples):
        yield f"--split {d.split}: the train part is 0, so there is nothing to train on"
    if valid == 0 and "eval_interval" in given and t.eval_iters:
        yield (
            f"--eval-interval {t.eval_interval} with --split {d.split}: the valid part is 0, "
            "so there is nothing to evaluate"
        )


def _parallel_problems(args: Args, world_size: int):
    m, tp = args.model, args.parallel.tensor_model_parallel_size
    try:
        validate_parallel_sizes(
            world_size, tp, num_attention_heads=m.num_attention_heads, hidden_size=m.hidden_size
        )
    except ParallelConfigError as e:
        yield str(e)
    yield from m.problems(tp)


def _training_problems(args: Args, world_size: int, given: frozenset):
    t, o = args.train, args.optim
    gbs, dp = _global_batch(args, world_size)
    if gbs % (t.micro_batch_size * dp):
        yield (
            f"--global-batch-size {gbs} is not a multiple of "
            f"--micro-batch-size {t.micro_batch_size} x data-parallel size {dp}"
        )
    if t.fp16 and t.bf16:
        yield "--fp16 and --bf16 are mutually exclusive"
    if o.optimizer == "torch-adamw" and t.fp16:
        yield "--fp16 needs loss scaling: use --optimizer adam"
    if o.optimizer == "torch-adamw" and (o.cpu_offload or o.dpu_warmup_steps is not None):
        yield "--cpu-offload/--dpu-warmup-steps need --optimizer adam"
    if o.optimizer == "torch-adamw" and o.overlap_cpu_optimizer:
        yield "--overlap-cpu-optimizer needs --optimizer adam (the ZeRO optimizer)"
    if o.min_loss_scale > o.initial_loss_scale:
        yield (
            f"--min-loss-scale {o.min_loss_scale:g} exceeds --initial-loss-scale "
            f"{o.initial_loss_scale:g}"
        )
    if t.train_iters is None and t.train_samples is None and not t.dry_run:
        yield "give --train-iters or --train-samples"
    if t.train_iters is not None and t.train_samples is not None:
        yield "--train-iters and --train-samples are mutually exclusive"
    if t.train_samples is not None and t.train_samples // gbs < 1:
        yield (f"--train-samples {t.train_samples} is less than one global batch ({gbs} samples)")
    yield from _schedule_problems(args, gbs, given)


def _mode_problems(args: Args) -> list[str]:
    """The ZeRO optimizer's mode combinations: its own table (``optimizer.options.RULES``),
    in flag names. Asked only when a mode flag is on: the table's dtypes need torch, which
    a plain command line's flag errors come before."""
    o = args.optim
    modes = (
        o.store_param_remainders,
        o.overlap_cpu_optimizer,
        o.dpu_warmup_steps is not None,
        o.optimizer_offload_fraction is not None,
        o.exp_avg_dtype != "fp32" or o.exp_avg_sq_dtype != "fp32",
    )
    if o.optimizer != "adam" or not any(modes):
        return []
    from ..optimizer.options import FLAGS, OptimizerOptions, option_fields, render

    options, broken = OptimizerOptions.checked(**option_fields(args))
    return [render(r, options, FLAGS) for r in broken]


def _schedule_problems(args: Args, gbs: int, given: frozenset):
    t, o = args.train, args.optim
    if o.min_lr > o.lr:
        yield f"--min-lr {o.min_lr:g} exceeds --lr {o.lr:g}"
    if o.lr_decay_iters is not None and o.lr_warmup_iters > o.lr_decay_iters:
        yield (
            f"--lr-warmup-iters {o.lr_warmup_iters} exceeds --lr-decay-iters "
            f"{o.lr_decay_iters}: the decay would end before the warmup does"
        )
    if t.eval_iters == 0 and "eval_interval" in given:
        yield (
            f"--eval-interval {t.eval_interval} with --eval-iters 0 evaluates nothing: "
            "give --eval-iters >= 1, or leave out --eval-interval"
        )


def _global_batch(args: Args, world_size: int) -> tuple[int, int]:
    """(global batch, data-parallel size): --global-batch-size, default micro-batch x DP."""
    t = args.train
    dp = world_size // args.parallel.tensor_model_parallel_size
    return (t.micro_batch_size * dp if t.global_batch_size is None else t.global_batch_size), dp


def resolve(args: Args, world_size: int, given: frozenset = frozenset()) -> Args:
    """Check the flags, then the final ``Args`` with every value derived from others filled
    in (the global batch, iterations from --train-samples, micro-batches per step);
    ``args`` itself is left as it was. Raises ConfigError naming the flag. ``given``: the
    flags typed out (``parse``), for checks that need to know."""
    validate(args, world_size, given)
    t = args.train
    gbs, dp = _global_batch(args, world_size)
    train = dataclasses.replace(
        t,
        global_batch_size=gbs,
        train_iters=t.train_iters if t.train_samples is None else t.train_samples // gbs,
        num_micro_batches=gbs // (t.micro_batch_size * dp),
    )
    return dataclasses.replace(args, train=train)


def checked(argv=None) -> tuple[Args, int]:
    """pretrain_gpt.py's final flags (``resolve``d) and the world size they are for
    (``WORLD_SIZE``, or --world-size on a dry run); ConfigError naming the flag. No torch:
    pretrain_gpt.py calls it before importing torch, then the run again on every rank."""
    args, given = parse(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.parallel.world_size is not None:  # a dry run plans for any size; a real run
        if not args.train.dry_run and args.parallel.world_size != world:  # must agree
            raise ConfigError(
                f"--world-size {args.parallel.world_size} disagrees with the launcher's "
                f"WORLD_SIZE {world} (--world-size is for --dry-run)"
            )
        world = args.parallel.world_size
    return resolve(args, world, given), world


def config_warnings(args: Args) -> list[str]:
    """Legal but probably unintended settings, worth a line in the log (after ``resolve``).

    A run shorter than its warmup is allowed (a smoke test, the first part of a longer
    run), but its learning rate never reaches --lr."""
    t, o = args.train, args.optim
    if t.train_iters and o.lr_warmup_iters > t.train_iters and o.lr_decay_style != "constant":
        return [
            f"warning: --lr-warmup-iters {o.lr_warmup_iters} is longer than the run "
            f"(--train-iters {t.train_iters}): the learning rate never reaches --lr "
            f"{o.lr:g}"
        ]
    return []


def config_problems(args: Args, world_size: int, given: frozenset = frozenset()) -> list[str]:
    """Every problem of the flags, one line each, changing nothing. In stages: ranges,
    then the parallel layout, then the rest (a later stage assumes the earlier passed)."""
    found = [p for group in vars(args).values() for p in field_problems(group)]
    if not found:
        found = list(_parallel_problems(args, world_size))
    if not found:
        found = [
            *_training_problems(args, world_size, given),
            *_mode_problems(args),
            *_data_problems(args.data, args.train, given),
        ]
    return found


def validate(args: Args, world_size: int, given: frozenset = frozenset()) -> None:
    """Ranges and cross-field checks, changing nothing; raises ConfigError naming the flag
    (one line per problem)."""
    found = config_problems(args, world_size, given)
    if found:
        raise ConfigError("\n".join(found))
