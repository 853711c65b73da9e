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
    (["--optimizer-offload-fraction", "0.5"], 1,
     "--optimizer-offload-fraction 0.5 needs --cpu-offload"),
    (["--cpu-offload", "--dpu-warmup-steps", "2", "--optimizer-offload-fraction", "0"], 1,
     "--dpu-warmup-steps needs a host share"),
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
    ("--optimizer-offload-fraction", "1.5", "--optimizer-offload-fraction must be >= 0 and "
     "<= 1, got 1.5"),
    ("--optimizer-offload-fraction", "-0.1", "--optimizer-offload-fraction must be >= 0 and "
     "<= 1, got -0.1"),
])
def test_numbers_outside_their_range_name_the_flag(flag, value, needle):
    args = parse_args(["--train-iters", "1", flag, value])
    with pytest.raises(ConfigError, match=needle.replace("-", r"\-").replace(".", r"\.")):
        validate(args, 1)


def test_offload_fraction_accepted_in_range_with_cpu_offload():
    for value in ("0", "0.25", "1"):
        args = parse_args(["--train-iters", "1", "--cpu-offload",
                           "--optimizer-offload-fraction", value])
        validate(args, 1)
        assert args.optim.optimizer_offload_fraction == float(value)
    assert parse_args(["--cpu-offload"]).optim.optimizer_offload_fraction is None  # = 1


def test_validate_changes_nothing_and_resolve_fills_derived_values():
    from mp_offload.config import resolve
    args = parse_args(["--train-samples", "64", "--micro-batch-size", "2"])
    validate(args, 4)
    assert args.train.global_batch_size is None and args.train.train_iters is None
    resolve(args, 4)
    assert (args.train.global_batch_size, args.train.train_iters) == (8, 8)


# ------------------------------------------------------------ --config run.yaml
def _yaml(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_config_file_keys_and_flags_override_it(tmp_path):
    path = _yaml(tmp_path, "num-layers: 3\nhidden_size: 96\nnum-attention-heads: 6\n"
                 "lr: 3e-4\nbf16: true\ncpu_offload: true\ndata-path: 0.7 a 0.3 b\n"
                 "split: 98,1,1\ntrain-iters: '5'\nlr_decay_style: linear\nsave: null\n")
    args = parse_args(["--config", path, "--hidden-size", "128", "--num-attention-heads", "8"])
    assert (args.model.num_layers, args.model.hidden_size) == (3, 128)  # the flag wins
    assert args.model.num_attention_heads == 8 and args.model.ffn_hidden_size == 512
    assert args.optim.lr == 3e-4 and isinstance(args.optim.lr, float)  # YAML's "3e-4"
    assert args.train.bf16 and args.optim.cpu_offload and args.train.train_iters == 5
    assert args.data.data_path == ["0.7", "a", "0.3", "b"] and args.data.split == "98,1,1"
    assert args.optim.lr_decay_style == "linear" and args.ckpt.save is None
    assert parse_args(["--config", path, "--lr", "1e-3"]).optim.lr == 1e-3
    assert "--config YAML" in build_parser().format_help()


@pytest.mark.parametrize("text,needle", [
    ("num_layerz: 3\n", "unknown key 'num_layerz' (not a flag of pretrain_gpt.py; did you "
                        "mean 'num-layers'?)"),
    ("bogus-flag: 1\n", "unknown key 'bogus-flag'"),
    ("num-layers: three\n", "key 'num-layers' must be an int, got 'three'"),
    ("num-layers: 2.5\n", "key 'num-layers' must be an int, got 2.5"),
    ("bf16: 1\n", "key 'bf16' must be true or false, got 1"),
    ("lr-decay-style: cosin\n", "key 'lr-decay-style' must be one of constant, linear, cosine"),
    ("micro-batch-size: null\n", "key 'micro-batch-size' cannot be empty"),
    ("- num-layers\n", "expected a mapping of flag names to values, got a list"),
    ("a: [\n", "not valid YAML"),
])
def test_config_file_errors_name_the_key(tmp_path, capsys, text, needle):
    from mp_offload.config import ConfigError, load_config_file
    path = _yaml(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config_file(path)
    assert str(e.value).startswith(f"--config {path}: ") and needle in str(e.value)
    with pytest.raises(SystemExit) as e:  # pretrain_gpt.py: a usage error, exit 2
        parse_args(["--config", path, "--train-iters", "1"])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_missing_config_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "nope.yaml")])
    assert "nope.yaml: No such file or directory" in capsys.readouterr().err


def test_dumped_config_reads_back_as_the_same_run(tmp_path):
    from mp_offload.config import dump_config, resolve
    args = parse_args(["--num-layers", "3", "--lr", "2e-4", "--bf16", "--train-samples", "64",
                       "--data-path", "0.5", "x", "0.5", "y", "--sample-prompt", "def f(",
                       "--save", "ck"])
    resolve(args, 2)  # train_iters derived from train_samples: not written as both
    text = dump_config(args)
    assert text.startswith("# The configuration of this run") and "\n# model\n" in text
    again = parse_args(["--config", _yaml(tmp_path, text)])
    resolve(again, 2)
    assert again == args
    wider = parse_args(["--config", _yaml(tmp_path, text), "--hidden-size", "512"])
    assert wider.model.ffn_hidden_size == 2048  # derived values follow an override


def test_help_shows_defaults():
    text = " ".join(build_parser().format_help().split())  # argparse wraps lines
    assert "--num-layers NUM_LAYERS transformer layers (default: 4)" in text
    assert "--eval-interval EVAL_INTERVAL iterations between validation runs (default: 1000)" \
        in text
    assert "--lr-decay-style {constant,linear,cosine} decay after warmup (default: cosine)" \
        in text
    assert "(default: None)" not in text and "(default: False)" not in text
    # Help that already names its default is left alone.
    assert "(default micro- batch x DP: no accumulation) --train-iters" in text  # wrapped
