"""Flags generated from the config dataclasses, and cross-field validation."""
import pytest

from mp_offload.config import ConfigError, build_parser, parse_args, validate


def test_megatron_flag_names_map_to_dataclasses():
    args = parse_args(["--num-layers", "3", "--hidden-size", "96", "--num-attention-heads", "6",
                       "--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
                       "--global-batch-size", "8", "--train-iters", "5", "--bf16",
                       "--cpu-offload", "--lr-decay-style", "linear",
                       "--data-path", "0.7", "a", "0.3", "b", "--save", "ck"])
    assert (args.model.num_layers, args.model.ffn_hidden_size) == (3, 384)
    assert args.parallel.tensor_model_parallel_size == 2 and args.train.bf16
    assert args.optim.cpu_offload and args.optim.lr_decay_style == "linear"
    assert args.data.data_path == ["0.7", "a", "0.3", "b"] and args.ckpt.save == "ck"
    validate(args, world_size=4)
    help_text = build_parser().format_help()
    assert "--num-layers NUM_LAYERS" in help_text and "--dpu-warmup-steps" in help_text


@pytest.mark.parametrize("argv,world,needle", [
    (["--fp16", "--bf16"], 1, "--fp16 and --bf16"),
    (["--optimizer", "torch-adamw", "--cpu-offload"], 1, "need --optimizer adam"),
    (["--dpu-warmup-steps", "3"], 1, "--dpu-warmup-steps needs --cpu-offload"),
    (["--seq-length", "512", "--max-position-embeddings", "256"], 1, "--seq-length 512"),
    (["--data-path", "0.5", "a", "b"], 1, "--data-path takes one prefix"),
    (["--micro-batch-size", "3", "--global-batch-size", "8"], 2, "--global-batch-size 8"),
])
def test_bad_combinations_name_the_flag(argv, world, needle):
    args = parse_args(["--train-iters", "1", *argv])
    with pytest.raises(ConfigError, match=needle.replace("-", r"\-")):
        validate(args, world)


@pytest.mark.parametrize("flag,value,needle", [
    ("--num-layers", "0", "--num-layers must be >= 1, got 0"),
    ("--hidden-size", "0", "--hidden-size must be >= 1, got 0"),
    ("--hidden-size", "-64", "--hidden-size must be >= 1, got -64"),
    ("--ffn-hidden-size", "0", "--ffn-hidden-size must be >= 1"),
    ("--global-batch-size", "0", "--global-batch-size must be >= 1"),
    ("--train-iters", "-5", "--train-iters must be >= 0, got -5"),
    ("--clip-grad", "-1", "--clip-grad must be >= 0"),
    ("--dpu-warmup-steps", "-1", "--dpu-warmup-steps must be >= 0"),
    ("--eval-interval", "0", "--eval-interval must be >= 1"),
    ("--reduce-bucket-size", "0", "--reduce-bucket-size must be >= 1"),
    ("--make-vocab-size-divisible-by", "0", "--make-vocab-size-divisible-by must be >= 1"),
    ("--hidden-dropout", "1.0", "--hidden-dropout must be >= 0 and < 1"),
    ("--adam-eps", "0", "--adam-eps must be > 0"),
    ("--distributed-timeout-minutes", "0", "--distributed-timeout-minutes must be > 0"),
    ("--cpu-threads-per-rank", "0", "--cpu-threads-per-rank must be >= 1"),
])
def test_numbers_outside_their_range_name_the_flag(flag, value, needle):
    args = parse_args(["--train-iters", "1", flag, value])
    with pytest.raises(ConfigError, match=needle.replace("-", r"\-")):
        validate(args, 1)


def test_validate_changes_nothing_and_resolve_fills_derived_values():
    from mp_offload.config import resolve
    args = parse_args(["--train-samples", "64", "--micro-batch-size", "2"])
    validate(args, 4)
    assert args.train.global_batch_size is None and args.train.train_iters is None
    resolve(args, 4)
    assert (args.train.global_batch_size, args.train.train_iters) == (8, 8)
