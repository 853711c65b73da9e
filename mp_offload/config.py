"""Run configuration: one dataclass per concern, with argparse generated from them.

Field ``foo_bar`` becomes flag ``--foo-bar`` (Megatron's names); a bool that defaults
to False is a switch; ``help`` and ``choices`` live in the field metadata. Checks
that need several fields (and the world size) are in ``validate``, which runs on
every rank before any collective, so a bad config fails everywhere, never hangs.
Every problem is one line naming the flag (an unknown flag gets "did you mean");
argparse never prints its usage text.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field

from .help_format import DefaultsHelpFormatter
from .model.gpt import GPTConfig
from .model.layers import NORMALIZATIONS, POSITION_EMBEDDINGS
from .optimizer.base import DEFAULT_BUCKET_SIZE
from .parallel_state import ParallelConfigError, validate_parallel_sizes


class ConfigError(ValueError):
    """A bad flag value; the message names the flag (one line per problem)."""


def _f(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = _f(1, "ranks that split each layer (TP, innermost)")
    world_size: int | None = _f(None, "ranks to plan for with --dry-run; default WORLD_SIZE or 1")
    device: str | None = _f(
        None,
        "auto: cuda:LOCAL_RANK when CUDA is available, else the CPU "
        "(default: $MP_OFFLOAD_DEVICE, else auto)",
        choices=("auto", "cuda", "cpu"),
    )
    cpu_threads_per_rank: int | None = _f(
        None,
        "CPU threads for the CPU Adam and torch on each "
        "rank (default: the cores of its affinity mask / "
        "LOCAL_WORLD_SIZE; OMP_NUM_THREADS is ignored)",
    )
    distributed_timeout_minutes: float = _f(
        10.0, "a collective waiting longer than this ends the job with an error"
    )


@dataclass
class TrainingConfig:
    micro_batch_size: int = _f(4, "samples per rank per forward/backward")
    global_batch_size: int | None = _f(
        None, "samples per step over all DP ranks (default micro-batch x DP: no accumulation)"
    )
    train_iters: int | None = _f(None, "optimizer steps to run")
    train_samples: int | None = _f(None, "samples to train on (instead of --train-iters)")
    seed: int = _f(1234, "random seed (model init, data order, dropout)")
    fp16: bool = _f(False, "fp16 params and compute with dynamic loss scaling")
    bf16: bool = _f(False, "bf16 params and compute")
    eval_interval: int = _f(1000, "iterations between validation runs")
    eval_iters: int = _f(10, "batches per validation run")
    max_consecutive_skipped_steps: int = _f(
        100, "fp16: stop (without saving) after this many consecutive steps skipped for overflow"
    )
    exit_interval: int | None = _f(None, "stop after this iteration (for tests)")
    dry_run: bool = _f(False, "build the model on the meta device, print the plan, exit")


@dataclass
class OptimizerConfig:
    optimizer: str = _f(
        "adam",
        "adam: the ZeRO optimizer (partitioned over DP; on the CPU "
        "with --cpu-offload); torch-adamw: unpartitioned reference",
        choices=("adam", "torch-adamw"),
    )
    cpu_offload: bool = _f(False, "keep optimizer partitions on the CPU (ZeRO-Offload)")
    lr: float = _f(3e-4, "peak learning rate")
    min_lr: float = _f(0.0, "learning rate at the end of decay")
    lr_decay_style: str = _f(
        "cosine", "decay after warmup", choices=("constant", "linear", "cosine")
    )
    lr_warmup_iters: int = _f(0, "iterations of linear warmup")
    lr_decay_iters: int | None = _f(None, "iterations to decay over (default: train iters)")
    weight_decay: float = _f(0.01, "decoupled weight decay (not on biases or LayerNorm)")
    clip_grad: float = _f(1.0, "global gradient-norm clipping threshold (0 = off)")
    adam_beta1: float = _f(0.9, "Adam beta1")
    adam_beta2: float = _f(0.999, "Adam beta2")
    adam_eps: float = _f(1e-8, "Adam epsilon")
    initial_loss_scale: float = _f(2.0**16, "fp16: starting loss scale")
    min_loss_scale: float = _f(1.0, "fp16: lowest loss scale")
    loss_scale_window: int = _f(1000, "fp16: clean steps before the scale doubles")
    hysteresis: int = _f(2, "fp16: overflows tolerated before the scale halves")
    reduce_bucket_size: int = _f(
        DEFAULT_BUCKET_SIZE, "elements per gradient bucket (reduce-scatter)"
    )
    dpu_warmup_steps: int | None = _f(
        None, "enable the one-step delayed parameter update after this many synchronous steps"
    )
    accumulate_grads_on_device: bool = _f(
        False,
        "sum the micro-batches' gradients in one "
        "device buffer and reduce-scatter/copy down once "
        "per step (costs a full gradient on the device)",
    )
    accumulate_allreduce_grads_in_fp32: bool = _f(
        False, "reduce (and stage) gradients in fp32 in bf16/fp16 runs"
    )
    optimizer_offload_fraction: float | None = _f(
        None,
        "with --cpu-offload: the fraction of each rank's optimizer state offloaded to "
        "the CPU (Megatron-core's flag); the rest, the first buckets of its slice, stays on "
        "the device and is updated there by torch's fused AdamW, beside the CPU Adam. Split "
        "at the bucket boundary nearest 1-F; 0 = ZeRO-2 on the device (default 1: all on "
        "the CPU)",
    )
    exp_avg_dtype: str = _f(
        "fp32", "dtype of Adam's first moment (bf16 halves it)", choices=("fp32", "bf16")
    )
    exp_avg_sq_dtype: str = _f(
        "fp32", "dtype of Adam's second moment (bf16 halves it)", choices=("fp32", "bf16")
    )


@dataclass
class DataConfig:
    data_path: list[str] | None = _f(
        None,
        "prefix, or weight prefix weight prefix ... "  # noqa: RUF009
        "(default: the embedded stdlib corpus)",
    )
    split: str = _f("969,30,1", "train,valid,test proportions of the documents")
    tokenizer_type: str = _f(
        "SentencePieceTokenizer",
        "tokenizer class",
        choices=(
            "SentencePieceTokenizer",
            "HuggingFaceTokenizer",
            "GPT2BPETokenizer",
            "NullTokenizer",
        ),
    )
    tokenizer_model: str | None = _f(
        None,
        "SentencePiece model file; for HuggingFaceTokenizer "
        "a tokenizer.json or a directory holding one",
    )
    vocab_file: str | None = _f(None, "GPT2BPETokenizer: the GPT-2 vocab.json")
    merge_file: str | None = _f(None, "GPT2BPETokenizer: the GPT-2 merges.txt")
    mock_data: bool = _f(False, "train on a synthetic, learnable token stream")
    data_cache_dir: str | None = _f(None, "where index arrays / the default corpus are cached")


@dataclass
class LoggingConfig:
    log_interval: int = _f(10, "iterations between log lines")
    log_json: str | None = _f(None, "append one JSON object per iteration/evaluation here")
    tensorboard_dir: str | None = _f(None, "write TensorBoard scalars here (if installed)")
    sample_prompt: str | None = _f(
        None,
        "print a greedy continuation of this text at each "
        'evaluation and at the end ("": start a document)',
    )
    sample_tokens: int = _f(32, "tokens to generate for --sample-prompt")
    wandb_project: str | None = _f(
        None, "also log to this Weights & Biases project (if wandb is installed)"
    )


@dataclass
class CheckpointConfig:
    save: str | None = _f(None, "directory to save checkpoints to")
    load: str | None = _f(
        None,
        "directory to resume from (its latest checkpoint), or one "
        "iter_* directory (that iteration)",
    )
    save_interval: int | None = _f(None, "iterations between checkpoints (and one at the end)")
    keep_checkpoints: int | None = _f(None, "keep only the newest K checkpoints")
    finetune: bool = _f(False, "load weights only; start at iteration 0")
    no_load_optim: bool = _f(False, "do not load the optimizer state (weights only)")
    no_load_rng: bool = _f(False, "do not restore the RNG state")
    override_existing_checkpoints: bool = _f(
        False,
        "save even into a --save directory holding "
        "checkpoints this run did not resume from "
        "(they may be overwritten)",
    )


CONFIG_CLASSES = {
    "model": GPTConfig,
    "parallel": ParallelConfig,
    "train": TrainingConfig,
    "optim": OptimizerConfig,
    "data": DataConfig,
    "log": LoggingConfig,
    "ckpt": CheckpointConfig,
}

_MODEL_HELP = {
    "num_layers": "transformer layers",
    "hidden_size": "model width",
    "num_attention_heads": "attention heads",
    "ffn_hidden_size": "MLP width (default 4h)",
    "seq_length": "tokens per sample",
    "max_position_embeddings": "position table size",
    "vocab_size": "vocabulary size (mock data / NullTokenizer; else from the tokenizer)",
    "make_vocab_size_divisible_by": "pad the vocabulary to a multiple of this x TP",
    "hidden_dropout": "dropout on residual branches",
    "attention_dropout": "attention dropout",
    "layernorm_epsilon": "LayerNorm (and RMSNorm) epsilon",
    "init_method_std": "init std",
    "recompute_activations": "recompute each layer in backward (activation checkpointing)",
    "normalization": "LayerNorm (GPT-2's, the default) or RMSNorm (Llama)",
    "swiglu": "SwiGLU MLP: silu(gate) * up, gate and up fused in fc1 (2 x --ffn-hidden-size)",
    "position_embedding_type": "learned_absolute (a table of --max-position-embeddings; "
    "the default) or rope (rotary, rotate-half layout)",
    "rotary_base": "rope: the base of the rotation frequencies (default 10000; Llama 3: 500000)",
    "rotary_percent": "rope: the fraction of each head's channels that rotate (default 1)",
    "group_query_attention": "grouped-query attention: --num-query-groups key/value heads",
    "num_query_groups": "key/value heads with --group-query-attention (default 1); a "
    "multiple of --tensor-model-parallel-size",
    "untie_embeddings_and_output_weights": "an output layer of its own instead of the input "
    "embedding (output_layer.weight)",
    "disable_bias_linear": "no biases in the QKV, projection and MLP linear layers",
    "sequence_parallel": "keep norms, dropout and residuals as sequence shards over the TP "
    "ranks (Megatron-SP): activations between the layers divide by TP",
}
_MODEL_CHOICES = {"normalization": NORMALIZATIONS, "position_embedding_type": POSITION_EMBEDDINGS}


# Valid range of every numeric flag, checked with the others before any process group
# starts: "lo.." means >= lo, "lo<.." means > lo, "lo..hi)" means lo <= x < hi,
# "lo..hi]" means lo <= x <= hi.
RANGES = {
    "num_layers": "1..",
    "hidden_size": "1..",
    "num_attention_heads": "1..",
    "ffn_hidden_size": "1..",
    "seq_length": "1..",
    "max_position_embeddings": "1..",
    "vocab_size": "1..",
    "make_vocab_size_divisible_by": "1..",
    "hidden_dropout": "0..1)",
    "attention_dropout": "0..1)",
    "layernorm_epsilon": "0<..",
    "init_method_std": "0..",
    "tensor_model_parallel_size": "1..",
    "world_size": "1..",
    "cpu_threads_per_rank": "1..",
    "distributed_timeout_minutes": "0<..",
    "micro_batch_size": "1..",
    "global_batch_size": "1..",
    "train_iters": "0..",
    "train_samples": "0..",
    "eval_interval": "1..",
    "eval_iters": "0..",
    "max_consecutive_skipped_steps": "1..",
    "exit_interval": "1..",
    "lr": "0..",
    "min_lr": "0..",
    "lr_warmup_iters": "0..",
    "lr_decay_iters": "1..",
    "weight_decay": "0..",
    "clip_grad": "0..",
    "adam_beta1": "0..1)",
    "adam_beta2": "0..1)",
    "adam_eps": "0<..",
    "initial_loss_scale": "0<..",
    "min_loss_scale": "0<..",
    "loss_scale_window": "1..",
    "hysteresis": "1..",
    "reduce_bucket_size": "1..",
    "dpu_warmup_steps": "0..",
    "optimizer_offload_fraction": "0..1]",
    "log_interval": "1..",
    "save_interval": "1..",
    "keep_checkpoints": "1..",
    "rotary_base": "1..",
    "rotary_percent": "0<..1]",
    "num_query_groups": "1..",
    "sample_tokens": "1..",
}


def _range_problem(name: str, value, spec: str) -> str | None:
    lo_part, _, hi_part = spec.partition("..")
    strict = lo_part.endswith("<")
    lo = float(lo_part.rstrip("<"))
    hi = float(hi_part.rstrip(")]")) if hi_part else None
    closed = hi_part.endswith("]")
    ok = (value > lo if strict else value >= lo) and (
        hi is None or (value <= hi if closed else value < hi)
    )
    if ok:
        return None
    want = f"> {lo:g}" if strict else f">= {lo:g}"
    if hi is not None:
        want += f" and {'<=' if closed else '<'} {hi:g}"
    return f"--{name.replace('_', '-')} must be {want}, got {value}"


# Defaults computed from another flag: out of range only because that one is, unless given.
_DERIVED_FROM = {"ffn_hidden_size": "hidden_size", "max_position_embeddings": "seq_length"}


def _range_problems(args) -> list[str]:
    found = {}
    for group in vars(args).values():
        for f in dataclasses.fields(group):
            value = getattr(group, f.name)
            if f.name in RANGES and value is not None and not isinstance(value, bool):
                found[f.name] = _range_problem(f.name, value, RANGES[f.name])
    return [p for name, p in found.items() if p and not found.get(_DERIVED_FROM.get(name))]


@dataclass
class Args:
    model: GPTConfig
    parallel: ParallelConfig
    train: TrainingConfig
    optim: OptimizerConfig
    data: DataConfig
    log: LoggingConfig
    ckpt: CheckpointConfig


def _inner(tp):
    """Strip ``X | None`` to ``X``."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError (one line, no usage text) instead of exiting, and
    prints --help on one rank only."""

    def error(self, message):
        raise ConfigError(message)

    def print_help(self, file=None):
        from .distributed import is_reporting_rank

        if is_reporting_rank():
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
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            tp = _inner(hints[f.name])
            help_ = f.metadata.get("help", _MODEL_HELP.get(f.name, ""))
            choices = f.metadata.get("choices", _MODEL_CHOICES.get(f.name))
            dest = f"{group_name}.{f.name}"
            default = f.default
            if tp is bool:
                group.add_argument(flag, dest=dest, action="store_true", help=help_)
            elif typing.get_origin(tp) is list:
                group.add_argument(
                    flag, dest=dest, nargs="+", default=default, help=help_, metavar=f.name.upper()
                )
            else:
                group.add_argument(
                    flag,
                    dest=dest,
                    type=tp,
                    default=default,
                    help=help_,
                    choices=choices,
                    metavar=None if choices else f.name.upper(),
                )
    add_config_flag(parser)
    return parser


def parse_args(argv=None) -> Args:
    """The flags (over a ``--config`` file's values) as dataclasses; ConfigError, one line
    per problem, for unknown flags, values of the wrong type, choices not offered, or a
    bad --config file."""
    ns = vars(parse_with_config(build_parser(), argv))
    parts = {name: {} for name in CONFIG_CLASSES}
    for key, value in ns.items():
        if key == "config":
            continue
        group_name, fname = key.split(".", 1)
        parts[group_name][fname] = value
    return Args(**{name: CONFIG_CLASSES[name](**kw) for name, kw in parts.items()})


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


def parse_with_config(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``parser``'s flags with a ``--config`` file's values as the defaults, so the command
    line wins. A bad file (naming the key) or an unknown flag (with the closest known
    one) is a ConfigError, never argparse's usage text."""
    path = _config_path(argv)
    if path is not None:
        from .config_file import load_config_file  # deferred: it imports this module

        parser.set_defaults(**load_config_file(path))
    ns, extra = parser.parse_known_args(argv)
    if extra:
        raise ConfigError("\n".join(unknown_flag_problems(extra, parser)))
    return ns


def given_flags(argv=None) -> frozenset[str]:
    """Field names of the flags ``argv`` gives explicitly, on the command line or in its
    --config file (a default and the same value typed out differ here); for checks such
    as --eval-interval with --eval-iters 0."""
    parser = build_parser()
    for action in parser._actions:  # (set_defaults would put SUPPRESS in the namespace)
        action.default = argparse.SUPPRESS
    ns, _ = parser.parse_known_args(argv)
    given = {key.split(".", 1)[1] for key in vars(ns) if key != "config"}
    path = _config_path(argv)
    if path is not None:
        from .config_file import load_config_file

        given.update(key.split(".", 1)[1] for key in load_config_file(path))
    return frozenset(given)


def _model_problems(m: GPTConfig, tp: int):
    """The model's shape against itself and the TP size (heads against TP: parallel_state)."""
    if m.hidden_size % m.num_attention_heads:
        yield (
            f"--hidden-size {m.hidden_size} is not divisible by "
            f"--num-attention-heads {m.num_attention_heads}"
        )
    if m.ffn_hidden_size % tp:
        yield (
            f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if m.seq_length > m.max_position_embeddings:
        yield (
            f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
            f"{m.max_position_embeddings}"
        )
    if m.num_query_groups is not None and not m.group_query_attention:
        yield "--num-query-groups needs --group-query-attention"
    if m.group_query_attention:
        g = m.num_query_groups
        if m.num_attention_heads % g:
            yield (
                f"--num-attention-heads {m.num_attention_heads} is not divisible "
                f"by --num-query-groups {g}"
            )
        if g % tp:
            yield (
                f"--num-query-groups {g} is not divisible by "
                f"--tensor-model-parallel-size {tp}: key/value heads are split "
                f"across the TP ranks, never replicated"
            )
    if m.position_embedding_type == "rope":
        head_dim = m.hidden_size // m.num_attention_heads
        percent = m.rotary[1]
        rotated = int(head_dim * percent)
        if rotated < 2 or rotated % 2:
            yield (
                f"--rotary-percent {percent} rotates {rotated} of the "
                f"{head_dim} channels of a head: that must be an even number >= 2"
            )
    if m.sequence_parallel and m.seq_length % tp:
        yield (
            f"--seq-length {m.seq_length} is not divisible by "
            f"--tensor-model-parallel-size {tp} (--sequence-parallel splits "
            f"the sequence over the TP ranks)"
        )


def _data_path_problems(d: DataConfig):
    from .data.gpt_dataset import parse_data_path, parse_split

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
    from .data.gpt_dataset import parse_split

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
    yield from _model_problems(m, tp)


def _training_problems(args: Args, world_size: int, given: frozenset):
    t, o = args.train, args.optim
    dp = world_size // args.parallel.tensor_model_parallel_size
    gbs = t.micro_batch_size * dp if t.global_batch_size is None else t.global_batch_size
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
    if o.dpu_warmup_steps is not None and not o.cpu_offload:
        yield "--dpu-warmup-steps needs --cpu-offload"
    if o.optimizer_offload_fraction is not None and not o.cpu_offload:
        yield (
            f"--optimizer-offload-fraction {o.optimizer_offload_fraction:g} needs "
            f"--cpu-offload (without it the whole optimizer state is on the device)"
        )
    if o.dpu_warmup_steps is not None and o.optimizer_offload_fraction == 0:
        yield (
            "--dpu-warmup-steps needs a host share: --optimizer-offload-fraction 0 offloads nothing"
        )
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


def resolve(args: Args, world_size: int, given: frozenset = frozenset()) -> Args:
    """Check the flags, then fill in the values derived from others (the default global
    batch, iterations from --train-samples); raises ConfigError naming the flag.
    ``given``: the flags typed out (``given_flags``), for checks that need to know."""
    validate(args, world_size, given)
    t = args.train
    dp = world_size // args.parallel.tensor_model_parallel_size
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    if t.train_samples is not None:
        t.train_iters = t.train_samples // t.global_batch_size
    return args


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
    found = _range_problems(args)
    if not found:
        found = list(_parallel_problems(args, world_size))
    if not found:
        found = [
            *_training_problems(args, world_size, given),
            *_data_problems(args.data, args.train, given),
        ]
    return found


def validate(args: Args, world_size: int, given: frozenset = frozenset()) -> None:
    """Ranges and cross-field checks, changing nothing; raises ConfigError naming the flag
    (one line per problem)."""
    found = config_problems(args, world_size, given)
    if found:
        raise ConfigError("\n".join(found))
