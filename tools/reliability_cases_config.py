"""The reliability probe's configuration cases: pretrain_gpt.py's flags, the
Llama flags and --config files (see tools/reliability_cases.py).
"""

from __future__ import annotations

from reliability_runs import (
    MODEL,
    TINY,
    Case,
    pretrain,
)


def configuration_cases() -> list:
    c = lambda name, args, needle, **kw: Case(
        "configuration", name, pretrain(*TINY, *args), needle, **kw
    )
    ranges = [
        ("--num-layers", "0"),
        ("--hidden-size", "-64"),
        ("--num-attention-heads", "0"),
        ("--seq-length", "0"),
        ("--micro-batch-size", "0"),
        ("--global-batch-size", "0"),
        ("--train-iters", "-1"),
        ("--lr", "-1"),
        ("--min-lr", "-1"),
        ("--clip-grad", "-1"),
        ("--weight-decay", "-0.1"),
        ("--adam-beta1", "1.0"),
        ("--adam-beta2", "-0.1"),
        ("--adam-eps", "0"),
        ("--hidden-dropout", "1.5"),
        ("--attention-dropout", "-0.1"),
        ("--eval-interval", "0"),
        ("--eval-iters", "-1"),
        ("--log-interval", "0"),
        ("--distributed-timeout-minutes", "0"),
        ("--loss-scale-window", "0"),
        ("--hysteresis", "0"),
        ("--initial-loss-scale", "0"),
        ("--reduce-bucket-size", "0"),
        ("--cpu-threads-per-rank", "0"),
        ("--max-consecutive-skipped-steps", "0"),
        ("--layernorm-epsilon", "0"),
        ("--make-vocab-size-divisible-by", "0"),
        ("--vocab-size", "0"),
        ("--init-method-std", "-0.02"),
        ("--dpu-warmup-steps", "-1"),
        ("--optimizer-offload-fraction", "1.5"),
    ]
    cases = [
        c("misspelled flag", ["--hiden-size", "64"], "did you mean --hidden-size?"),
        c(
            "Megatron-style flag name",
            ["--tensor-parallel-size", "2"],
            "did you mean --tensor-model-parallel-size?",
        ),
        c("misspelled flag (=value)", ["--trian-iters=5"], "did you mean --train-iters?"),
        c("flag that does not exist", ["--fp32"], "did you mean --fp16?"),
        c("two unknown flags", ["--foo", "--barr", "1"], "unrecognized argument --foo", lines=2),
        c("not an integer", ["--hidden-size", "abc"], "--hidden-size: invalid int value"),
        c("not a number", ["--lr", "1e-3x"], "--lr: invalid float value"),
        c("choice misspelled", ["--lr-decay-style", "cosin"], "invalid choice: 'cosin'"),
        c("unknown optimizer", ["--optimizer", "adamw"], "invalid choice: 'adamw'"),
        c("unknown tokenizer type", ["--tokenizer-type", "GPT2Tokenizer"], "invalid choice"),
        c("unknown device", ["--device", "gpu"], "invalid choice: 'gpu'"),
        c("one value too many", ["--train-iters", "5", "6"], "unexpected value '6'"),
        c("value missing", ["--hidden-size"], "--hidden-size: expected one argument"),
        c(
            "prefix of two flags",
            ["--hidden", "32"],
            "argument --hidden: did you mean --hidden-size?",
        ),
    ]
    cases += [c(f"{flag} {value}", [flag, value], f"{flag} must be") for flag, value in ranges]
    cases += [
        c("--fp16 with --bf16", ["--fp16", "--bf16"], "--fp16 and --bf16 are mutually"),
        c(
            "--fp16 with torch-adamw",
            ["--fp16", "--optimizer", "torch-adamw"],
            "--fp16 needs loss scaling",
        ),
        c(
            "--cpu-offload with torch-adamw",
            ["--cpu-offload", "--optimizer", "torch-adamw"],
            "need --optimizer adam",
        ),
        c(
            "--dpu-warmup-steps without offload",
            ["--dpu-warmup-steps", "2"],
            "--dpu-warmup-steps needs --cpu-offload",
        ),
        c(
            "--optimizer-offload-fraction without offload",
            ["--optimizer-offload-fraction", "0.5"],
            "needs --cpu-offload",
        ),
        c("hidden not divisible by heads", ["--hidden-size", "30"], "--hidden-size 30 is not"),
        c(
            "sequence beyond positions",
            ["--seq-length", "64", "--max-position-embeddings", "32"],
            "--seq-length 64 exceeds",
        ),
        c(
            "global batch not a multiple",
            ["--global-batch-size", "3"],
            "--global-batch-size 3 is not a multiple",
        ),
        Case(
            "configuration",
            "no --train-iters",
            pretrain(*MODEL, "--mock-data"),
            "give --train-iters or --train-samples",
        ),
        c("--train-iters with --train-samples", ["--train-samples", "8"], "mutually exclusive"),
        Case(
            "configuration",
            "--train-samples below one batch",
            pretrain(*MODEL, "--mock-data", "--train-samples", "1"),
            "less than one global batch",
        ),
        c("--min-lr above --lr", ["--min-lr", "1", "--lr", "0.1"], "--min-lr 1 exceeds --lr"),
        c(
            "warmup beyond decay",
            ["--lr-warmup-iters", "10", "--lr-decay-iters", "5"],
            "--lr-warmup-iters 10 exceeds --lr-decay-iters 5",
        ),
        c(
            "--eval-interval with --eval-iters 0",
            ["--eval-interval", "5", "--eval-iters", "0"],
            "evaluates nothing",
        ),
        c(
            "--min-loss-scale above initial",
            ["--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"],
            "exceeds",
        ),
        c("--world-size without --dry-run", ["--world-size", "4"], "disagrees with"),
        c("TP larger than the world", ["--tensor-model-parallel-size", "2"], "does not divide"),
        c(
            "--dry-run --world-size 0",
            ["--dry-run", "--world-size", "0"],
            "--world-size must be >= 1",
        ),
        c("--device cuda without a GPU", ["--device", "cuda"], "no CUDA device"),
    ]
    return cases + llama_cases() + config_file_cases()


def llama_cases() -> list:
    c = lambda name, args, needle, **kw: Case(
        "configuration", name, pretrain(*TINY, *args), needle, **kw
    )
    return [
        c(
            "--num-query-groups without GQA",
            ["--num-query-groups", "2"],
            "--num-query-groups needs --group-query-attention",
        ),
        c(
            "query groups not dividing the heads",
            ["--group-query-attention", "--num-query-groups", "3"],
            "--num-attention-heads 4 is not divisible by --num-query-groups 3",
        ),
        c(
            "--rotary-percent 1.5",
            ["--rotary-percent", "1.5"],
            "--rotary-percent must be > 0 and <= 1",
        ),
        c(
            "rope rotating no channel pair",
            ["--position-embedding-type", "rope", "--rotary-percent", "0.1"],
            "rotates 0 of the 8",
        ),
        c(
            "--normalization misspelled",
            ["--normalization", "RMSnorm"],
            "invalid choice: 'RMSnorm'",
        ),
        c("--sample-tokens 0", ["--sample-tokens", "0"], "--sample-tokens must be >= 1"),
    ]


def config_file_cases() -> list:
    """``--config run.yaml``: its mistakes, and the flags' mistakes next to it."""
    c = lambda name, args, needle, **kw: Case("configuration", name, pretrain(*args), needle, **kw)
    return [
        c(
            "--config, misspelled flag",
            ["--config", "$D/run.yaml", "--hiden-size", "64"],
            "did you mean --hidden-size?",
        ),
        c("--config misspelled", [*TINY, "--confg", "$D/run.yaml"], "did you mean --config?"),
        c(
            "--config without a file name",
            [*TINY, "--config"],
            "argument --config: expected one argument",
        ),
        c(
            "--config file missing",
            [*TINY, "--config", "$D/nope.yaml"],
            "--config $D/nope.yaml: No such file or directory",
        ),
        c("--config not YAML", [*TINY, "--config", "$D/notyaml.yaml"], "not valid YAML"),
        c(
            "--config key unknown",
            [*TINY, "--config", "$D/badkey.yaml"],
            "unknown key 'num_layerz' (not a flag of pretrain_gpt.py; did you mean 'num-layers'?)",
        ),
        c(
            "--config value not an int",
            [*TINY, "--config", "$D/badval.yaml"],
            "key 'num-layers' must be an int, got 'two'",
        ),
        c(
            "--config value out of range",
            ["--config", "$D/range.yaml", "--mock-data", "--train-iters", "2"],
            "--num-layers must be >= 1",
        ),
        c(
            "--config: --eval-interval with --eval-iters 0",
            ["--config", "$D/evalzero.yaml", "--mock-data", "--train-iters", "2"],
            "evaluates nothing",
        ),
        c("valid run from --config", ["--config", "$D/run.yaml"], "iteration 2/2 ", expect="ok"),
    ]
