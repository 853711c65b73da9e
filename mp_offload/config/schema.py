"""The run's flags as dataclasses, one per concern (``Args`` holds them), with each
flag's help, choices and range on its field (``fields.flag_field``). Field ``foo_bar``
is flag ``--foo-bar`` (Megatron's names); a bool that defaults to False is a switch.
The parser and the checks are in ``flags.py``; the ``--config`` file reader and
writer in ``file.py``. A field marked ``derived`` is no flag: ``resolve`` fills
it in from the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.gpt_config import GPTConfig
from .fields import derived_field, flag_field

# Elements per gradient bucket: optimizer.base.DEFAULT_BUCKET_SIZE, the same number (a test
# holds them equal), written here so the flags are read without importing torch.
DEFAULT_BUCKET_SIZE = 5_000_000

_f = flag_field


class ConfigError(ValueError):
    """A bad flag value; the message names the flag (one line per problem)."""


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = _f(
        1, "ranks that split each layer (TP, innermost)", range="1.."
    )
    world_size: int | None = _f(
        None, "ranks to plan for with --dry-run; default WORLD_SIZE or 1", range="1.."
    )
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
        range="1..",
    )
    distributed_timeout_minutes: float = _f(
        10.0, "a collective waiting longer than this ends the job with an error", range="0<.."
    )


@dataclass
class TrainingConfig:
    micro_batch_size: int = _f(4, "samples per rank per forward/backward", range="1..")
    global_batch_size: int | None = _f(
        None,
        "samples per step over all DP ranks (default micro-batch x DP: no accumulation)",
        range="1..",
    )
    train_iters: int | None = _f(None, "optimizer steps to run", range="0..")
    train_samples: int | None = _f(
        None, "samples to train on (instead of --train-iters)", range="0.."
    )
    seed: int = _f(1234, "random seed (model init, data order, dropout)")
    fp16: bool = _f(False, "fp16 params and compute with dynamic loss scaling")
    bf16: bool = _f(False, "bf16 params and compute")
    eval_interval: int = _f(1000, "iterations between validation runs", range="1..")
    eval_iters: int = _f(10, "batches per validation run", range="0..")
    max_consecutive_skipped_steps: int = _f(
        100,
        "fp16: stop (without saving) after this many consecutive steps skipped for overflow",
        range="1..",
    )
    exit_interval: int | None = _f(None, "stop after this iteration (for tests)", range="1..")
    dry_run: bool = _f(False, "build the model on the meta device, print the plan, exit")
    skip_memory_check: bool = _f(
        False,
        "start even when the planner's memory figures for this run (as --dry-run prints "
        "them) exceed what this machine has free: MemAvailable or the cgroup limit per "
        "node, CUDA free memory per GPU",
    )
    num_micro_batches: int | None = derived_field(
        "forward/backward passes per step on each rank: global batch / (micro-batch x DP)"
    )


@dataclass
class OptimizerConfig:
    optimizer: str = _f(
        "adam",
        "adam: the ZeRO optimizer (partitioned over DP; on the CPU "
        "with --cpu-offload); torch-adamw: unpartitioned reference",
        choices=("adam", "torch-adamw"),
    )
    cpu_offload: bool = _f(False, "keep optimizer partitions on the CPU (ZeRO-Offload)")
    lr: float = _f(3e-4, "peak learning rate", range="0..")
    min_lr: float = _f(0.0, "learning rate at the end of decay", range="0..")
    lr_decay_style: str = _f(
        "cosine", "decay after warmup", choices=("constant", "linear", "cosine")
    )
    lr_warmup_iters: int = _f(0, "iterations of linear warmup", range="0..")
    lr_decay_iters: int | None = _f(
        None, "iterations to decay over (default: train iters)", range="1.."
    )
    weight_decay: float = _f(
        0.01, "decoupled weight decay (not on biases or LayerNorm)", range="0.."
    )
    clip_grad: float = _f(1.0, "global gradient-norm clipping threshold (0 = off)", range="0..")
    adam_beta1: float = _f(0.9, "Adam beta1", range="0..1)")
    adam_beta2: float = _f(0.999, "Adam beta2", range="0..1)")
    adam_eps: float = _f(1e-8, "Adam epsilon", range="0<..")
    initial_loss_scale: float = _f(2.0**16, "fp16: starting loss scale", range="0<..")
    min_loss_scale: float = _f(1.0, "fp16: lowest loss scale", range="0<..")
    loss_scale_window: int = _f(1000, "fp16: clean steps before the scale doubles", range="1..")
    hysteresis: int = _f(2, "fp16: overflows tolerated before the scale halves", range="1..")
    reduce_bucket_size: int = _f(
        DEFAULT_BUCKET_SIZE, "elements per gradient bucket (reduce-scatter)", range="1.."
    )
    dpu_warmup_steps: int | None = _f(
        None,
        "enable the one-step delayed parameter update after this many synchronous steps",
        range="0..",
    )
    overlap_cpu_optimizer: bool = _f(
        False,
        "with --cpu-offload: run the CPU Adam on each gradient chunk during backward, as "
        "it becomes final, assuming no clipping and no overflow, into a second copy of the "
        "state (+12 B/param); the step commits it, or recomputes it when clipping applies "
        "(bitwise the synchronous step)",
    )
    accumulate_grads_on_device: bool = _f(
        False,
        "sum the micro-batches' gradients in one fp32 "
        "device buffer and reduce-scatter/copy down once "
        "per step (costs a full fp32 gradient on the device)",
    )
    accumulate_allreduce_grads_in_fp32: bool = _f(
        False, "reduce (and stage) gradients in fp32 in bf16/fp16 runs"
    )
    optimizer_offload_fraction: float | None = _f(
        None,
        "with --cpu-offload: the fraction of each rank's optimizer state offloaded to "
        "the CPU (Megatron-core's flag); the rest, the last buckets of its slice (whose gradients "
        "arrive last in backward), stays on "
        "the device and is updated there by torch's fused AdamW, beside the CPU Adam. Split "
        "at the bucket boundary nearest 1-F; 0 = ZeRO-2 on the device (default 1: all on "
        "the CPU)",
        range="0..1]",
    )
    exp_avg_dtype: str = _f(
        "fp32",
        "dtype of Adam's first moment (bf16 halves it; 8bit, with --cpu-offload and all of "
        "the state on the host: block-wise 8-bit codes with a scale per 256, ~1 B)",
        choices=("fp32", "bf16", "8bit"),
    )
    exp_avg_sq_dtype: str = _f(
        "fp32",
        "dtype of Adam's second moment (bf16 halves it; 8bit as for --exp-avg-dtype)",
        choices=("fp32", "bf16", "8bit"),
    )
    store_param_remainders: bool = _f(
        False,
        "with --bf16 and --cpu-offload: keep the host's fp32 master as the bf16 parameter "
        "(the one that goes up) plus a 16-bit remainder, exactly: saves 2 B/param of host "
        "memory and of the Adam step's traffic",
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
    log_interval: int = _f(10, "iterations between log lines", range="1..")
    log_json: str | None = _f(None, "append one JSON object per iteration/evaluation here")
    tensorboard_dir: str | None = _f(None, "write TensorBoard scalars here (if installed)")
    sample_prompt: str | None = _f(
        None,
        "print a greedy continuation of this text at each "
        'evaluation and at the end ("": start a document)',
    )
    sample_tokens: int = _f(32, "tokens to generate for --sample-prompt", range="1..")
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
    save_interval: int | None = _f(
        None, "iterations between checkpoints (and one at the end)", range="1.."
    )
    keep_checkpoints: int | None = _f(None, "keep only the newest K checkpoints", range="1..")
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


@dataclass
class Args:
    model: GPTConfig
    parallel: ParallelConfig
    train: TrainingConfig
    optim: OptimizerConfig
    data: DataConfig
    log: LoggingConfig
    ckpt: CheckpointConfig
