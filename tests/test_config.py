"""Flags generated from the config dataclasses, and cross-field validation."""

import pytest

from mp_offload.config import ConfigError, build_parser, given_flags, parse_args, validate


def test_megatron_flag_names_map_to_dataclasses():
    args = parse_args(
        [
            "--num-layers",
            "3",
            "--hidden-size",
            "96",
            "--num-attention-heads",
            "6",
            "--tensor-model-parallel-size",
            "2",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "8",
            "--train-iters",
            "5",
            "--bf16",
            "--cpu-offload",
            "--lr-decay-style",
            "linear",
            "--data-path",
            "0.7",
            "a",
            "0.3",
            "b",
            "--tokenizer-model",
            "t.model",
            "--save",
            "ck",
        ]
    )
    assert (args.model.num_layers, args.model.ffn_hidden_size) == (3, 384)
    assert args.parallel.tensor_model_parallel_size == 2 and args.train.bf16
    assert args.optim.cpu_offload and args.optim.lr_decay_style == "linear"
    assert args.data.data_path == ["0.7", "a", "0.3", "b"] and args.ckpt.save == "ck"
    validate(args, world_size=4)
    help_text = build_parser().format_help()
    assert "--num-layers NUM_LAYERS" in help_text and "--dpu-warmup-steps" in help_text


@pytest.mark.parametrize(
    "argv,world,needle",
    [
        (["--fp16", "--bf16"], 1, "--fp16 and --bf16"),
        (["--optimizer", "torch-adamw", "--cpu-offload"], 1, "need --optimizer adam"),
        (["--dpu-warmup-steps", "3"], 1, "--dpu-warmup-steps needs --cpu-offload"),
        (["--seq-length", "512", "--max-position-embeddings", "256"], 1, "--seq-length 512"),
        (["--data-path", "0.5", "a", "b"], 1, "--data-path takes one prefix"),
        (["--micro-batch-size", "3", "--global-batch-size", "8"], 2, "--global-batch-size 8"),
        (
            ["--optimizer-offload-fraction", "0.5"],
            1,
            "--optimizer-offload-fraction 0.5 needs --cpu-offload",
        ),
        (
            ["--cpu-offload", "--dpu-warmup-steps", "2", "--optimizer-offload-fraction", "0"],
            1,
            "--dpu-warmup-steps needs a host share",
        ),
    ],
)
def test_bad_combinations_name_the_flag(argv, world, needle):
    args = parse_args(["--train-iters", "1", *argv])
    with pytest.raises(ConfigError, match=needle.replace("-", r"\-")):
        validate(args, world)


@pytest.mark.parametrize(
    "flag,value,needle",
    [
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
        (
            "--optimizer-offload-fraction",
            "1.5",
            "--optimizer-offload-fraction must be >= 0 and <= 1, got 1.5",
        ),
        (
            "--optimizer-offload-fraction",
            "-0.1",
            "--optimizer-offload-fraction must be >= 0 and <= 1, got -0.1",
        ),
    ],
)
def test_numbers_outside_their_range_name_the_flag(flag, value, needle):
    args = parse_args(["--train-iters", "1", flag, value])
    with pytest.raises(ConfigError, match=needle.replace("-", r"\-").replace(".", r"\.")):
        validate(args, 1)


def test_offload_fraction_accepted_in_range_with_cpu_offload():
    for value in ("0", "0.25", "1"):
        args = parse_args(
            ["--train-iters", "1", "--cpu-offload", "--optimizer-offload-fraction", value]
        )
        validate(args, 1)
        assert args.optim.optimizer_offload_fraction == float(value)
    assert parse_args(["--cpu-offload"]).optim.optimizer_offload_fraction is None  # = 1


def test_validate_changes_nothing_and_resolve_fills_derived_values():
    import copy

    from mp_offload.config import resolve

    args = parse_args(["--train-samples", "64", "--micro-batch-size", "2"])
    before = copy.deepcopy(args)
    validate(args, 4)
    assert args == before and args.train.train_iters is None
    final = resolve(args, 4)
    assert args == before  # the parsed flags stay as they were; resolve returns new Args
    t = final.train
    assert (t.global_batch_size, t.train_iters, t.num_micro_batches) == (8, 8, 1)
    t = resolve(parse_args(["--train-iters", "3", "--global-batch-size", "48"]), 4).train
    assert (t.global_batch_size, t.num_micro_batches) == (48, 3)  # 48 / (4 x DP 4)


# ------------------------------------------------------------ --config run.yaml
def _yaml(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_config_file_keys_and_flags_override_it(tmp_path):
    path = _yaml(
        tmp_path,
        "num-layers: 3\nhidden_size: 96\nnum-attention-heads: 6\n"
        "lr: 3e-4\nbf16: true\ncpu_offload: true\ndata-path: 0.7 a 0.3 b\n"
        "split: 98,1,1\ntrain-iters: '5'\nlr_decay_style: linear\nsave: null\n",
    )
    args = parse_args(["--config", path, "--hidden-size", "128", "--num-attention-heads", "8"])
    assert (args.model.num_layers, args.model.hidden_size) == (3, 128)  # the flag wins
    assert args.model.num_attention_heads == 8 and args.model.ffn_hidden_size == 512
    assert args.optim.lr == 3e-4 and isinstance(args.optim.lr, float)  # YAML's "3e-4"
    assert args.train.bf16 and args.optim.cpu_offload and args.train.train_iters == 5
    assert args.data.data_path == ["0.7", "a", "0.3", "b"] and args.data.split == "98,1,1"
    assert args.optim.lr_decay_style == "linear" and args.ckpt.save is None
    assert parse_args(["--config", path, "--lr", "1e-3"]).optim.lr == 1e-3
    assert "--config YAML" in build_parser().format_help()


@pytest.mark.parametrize(
    "text,needle",
    [
        (
            "num_layerz: 3\n",
            "unknown key 'num_layerz' (not a flag of pretrain_gpt.py; did you mean 'num-layers'?)",
        ),
        ("bogus-flag: 1\n", "unknown key 'bogus-flag'"),
        ("num-layers: three\n", "key 'num-layers' must be an int, got 'three'"),
        ("num-layers: 2.5\n", "key 'num-layers' must be an int, got 2.5"),
        ("bf16: 1\n", "key 'bf16' must be true or false, got 1"),
        ("lr-decay-style: cosin\n", "key 'lr-decay-style' must be one of constant, linear, cosine"),
        ("micro-batch-size: null\n", "key 'micro-batch-size' cannot be empty"),
        ("- num-layers\n", "expected a mapping of flag names to values, got a list"),
        ("a: [\n", "not valid YAML"),
    ],
)
def test_config_file_errors_name_the_key(tmp_path, capsys, text, needle):
    from mp_offload.config.file import load_config_file

    path = _yaml(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config_file(path)
    assert str(e.value).startswith(f"--config {path}: ") and needle in str(e.value)
    with pytest.raises(ConfigError) as e:  # pretrain_gpt.py: one line, exit 2 (fail)
        parse_args(["--config", path, "--train-iters", "1"])
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert capsys.readouterr() == ("", "")  # no usage text


def test_missing_config_file(tmp_path, capsys):
    with pytest.raises(ConfigError, match="nope.yaml: No such file or directory"):
        parse_args(["--config", str(tmp_path / "nope.yaml")])
    with pytest.raises(ConfigError, match="^argument --config: expected one argument$"):
        parse_args(["--train-iters", "1", "--config"])
    assert capsys.readouterr() == ("", "")


def test_flag_mistakes_with_a_config_file_are_one_line(tmp_path, capsys):
    path = _yaml(tmp_path, "num-layers: 3\ntrain-iters: 5\n")
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", path, "--hiden-size", "64"])
    assert str(e.value) == "unrecognized argument --hiden-size: did you mean --hidden-size?"
    with pytest.raises(
        ConfigError, match="^unrecognized argument --confg: did you mean --config\\?$"
    ):
        parse_args(["--confg", path])
    assert capsys.readouterr() == ("", "")


def test_flags_given_in_a_config_file_count_as_given(tmp_path):
    path = _yaml(tmp_path, "eval-interval: 5\neval_iters: 0\n")
    argv = ["--config", path, "--train-iters", "10"]
    assert {"eval_interval", "eval_iters", "train_iters"} <= given_flags(argv)
    with pytest.raises(ConfigError, match="--eval-interval 5 with --eval-iters 0 evaluates"):
        validate(parse_args(argv), 1, given_flags(argv))


def test_parse_reads_argv_and_the_config_file_once(tmp_path, monkeypatch):
    from mp_offload.config import flags as config

    path = _yaml(tmp_path, "eval-interval: 5\nlr: 1e-3\n")
    reads = []
    real = config.load_config_file
    monkeypatch.setattr(config, "load_config_file", lambda p: reads.append(p) or real(p))
    args, given = config.parse(["--config", path, "--train-iters", "10", "--lr", "2e-3"])
    assert reads == [path]
    assert (args.train.eval_interval, args.optim.lr, args.train.train_iters) == (5, 2e-3, 10)
    assert given == {"eval_interval", "lr", "train_iters"}  # defaults are not given


def test_dumped_config_reads_back_as_the_same_run(tmp_path):
    from mp_offload.config import resolve
    from mp_offload.config.file import dump_config

    args = parse_args(
        [
            "--num-layers",
            "3",
            "--lr",
            "2e-4",
            "--bf16",
            "--train-samples",
            "64",
            "--data-path",
            "0.5",
            "x",
            "0.5",
            "y",
            "--tokenizer-model",
            "t.model",
            "--sample-prompt",
            "def f(",
            "--save",
            "ck",
        ]
    )
    args = resolve(args, 2)  # train_iters derived from train_samples: not written as both
    text = dump_config(args)
    assert text.startswith("# The configuration of this run") and "\n# model\n" in text
    again = parse_args(["--config", _yaml(tmp_path, text)])
    assert "num_micro_batches" not in text  # derived, no flag
    assert resolve(again, 2) == args
    wider = parse_args(["--config", _yaml(tmp_path, text), "--hidden-size", "512"])
    assert wider.model.ffn_hidden_size == 2048  # derived values follow an override


def test_help_shows_defaults():
    text = " ".join(build_parser().format_help().split())  # argparse wraps lines
    assert "--num-layers NUM_LAYERS transformer layers (default: 4)" in text
    assert (
        "--eval-interval EVAL_INTERVAL iterations between validation runs (default: 1000)" in text
    )
    assert "--lr-decay-style {constant,linear,cosine} decay after warmup (default: cosine)" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    # Help that already names its default is left alone.
    assert "(default micro- batch x DP: no accumulation) --train-iters" in text  # wrapped


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--hiden-size", "64"], "unrecognized argument --hiden-size: did you mean --hidden-size?"),
        (
            ["--tensor-parallel-size=2"],
            "unrecognized argument --tensor-parallel-size: "
            "did you mean --tensor-model-parallel-size?",
        ),
        (["--hidden-size", "abc"], "argument --hidden-size: invalid int value: 'abc'"),
        (["--lr-decay-style", "cosin"], "argument --lr-decay-style: invalid choice: 'cosin'"),
        (["--train-iters", "5", "6"], "unexpected value '6': no flag takes it"),
    ],
)
def test_flag_mistakes_are_one_line_without_usage(argv, needle, capsys):
    with pytest.raises(ConfigError) as e:
        parse_args(["--train-iters", "1", *argv])
    assert str(e.value) == needle or str(e.value).startswith(needle), str(e.value)
    assert "\n" not in str(e.value)
    assert capsys.readouterr() == ("", "")  # no usage text on any stream


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--split", "0,0,0"], "--split 0,0,0: the parts sum to 0"),
        (["--split", "90,-5,5"], "--split 90,-5,5: part '-5' must be a finite number >= 0"),
        (["--split", "90,x,5"], "--split 90,x,5: part 'x' is not a number"),
        (["--split", "1,2,3,4"], "--split 1,2,3,4: 4 parts, at most 3"),
        (["--split", "0,50,50"], "--split 0,50,50: the train part is 0"),
        (["--data-path", "a", "b"], "--data-path a b: weight 'a' is not a number"),
        (["--data-path", "-1", "a", "2", "b"], "weight '-1' must be a finite number >= 0"),
        (["--data-path", "0", "a", "0", "b"], "the weights sum to 0"),
        (
            ["--lr-warmup-iters", "8", "--lr-decay-iters", "5"],
            "--lr-warmup-iters 8 exceeds --lr-decay-iters 5",
        ),
        (["--min-lr", "1e-3", "--lr", "1e-4"], "--min-lr 0.001 exceeds --lr 0.0001"),
        (
            ["--eval-iters", "0", "--eval-interval", "5"],
            "--eval-interval 5 with --eval-iters 0 evaluates nothing",
        ),
        (["--eval-interval", "5", "--split", "100,0,0"], "the valid part is 0"),
        (["--mock-data", "--data-path", "x"], "--mock-data and --data-path exclude each other"),
        (["--data-path", "x"], "--data-path needs --tokenizer-model"),
        (["--tokenizer-model", "t.model"], "--tokenizer-model t.model without --data-path"),
        (["--tokenizer-type", "NullTokenizer"], "--tokenizer-type NullTokenizer needs --data-path"),
        (
            ["--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"],
            "--min-loss-scale 8 exceeds --initial-loss-scale 4",
        ),
        (["--max-consecutive-skipped-steps", "0"], "--max-consecutive-skipped-steps must be >= 1"),
    ],
)
def test_nonsense_values_name_the_flag(argv, needle):
    base = ["--train-iters", "10"]
    if "--data-path" in argv and "--mock-data" not in argv and "x" not in argv:
        base += ["--tokenizer-model", "t.model"]
    argv = base + argv
    args = parse_args(argv)
    with pytest.raises(
        ConfigError, match=needle.replace("-", r"\-").replace("(", r"\(").replace(")", r"\)")
    ):
        validate(args, 1, given_flags(argv))


def test_a_run_shorter_than_its_warmup_is_allowed_with_a_warning():
    from mp_offload.config import config_warnings, resolve

    args = resolve(parse_args(["--train-iters", "10", "--lr-warmup-iters", "50"]), 1)
    assert config_warnings(args) == [
        "warning: --lr-warmup-iters 50 is longer than the run "
        "(--train-iters 10): the learning rate never reaches "
        "--lr 0.0003"
    ]


def test_sensible_values_pass_and_every_problem_is_a_line():
    ok = [
        "--train-iters",
        "10",
        "--lr-warmup-iters",
        "10",
        "--eval-iters",
        "0",
        "--split",
        "98,2",
        "--data-path",
        "0.5",
        "a",
        "0.5",
        "b",
        "--tokenizer-model",
        "t",
    ]
    validate(parse_args(ok), 1, given_flags(ok))
    bad = ["--train-iters", "10", "--fp16", "--bf16", "--min-lr", "1", "--split", "a"]
    with pytest.raises(ConfigError) as e:
        validate(parse_args(bad), 1, given_flags(bad))
    assert len(str(e.value).splitlines()) == 3, str(e.value)
    with pytest.raises(ConfigError) as e:  # not also --ffn-hidden-size, its default 4x
        validate(parse_args(["--train-iters", "1", "--hidden-size", "-64"]), 1)
    assert str(e.value) == "--hidden-size must be >= 1, got -64"
