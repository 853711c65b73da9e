"""The cases of docs/RELIABILITY.md, by area: each a real command with the outcome due
(see tools/reliability_probe.py for how they are judged).
"""

from __future__ import annotations

import os
import shlex

from reliability_runs import (
    DATA,
    MODEL,
    TINY,
    Case,
    base_untouched,
    free_port,
    kill9_torchrun,
    locked_save,
    no_checkpoint,
    port_in_use,
    preprocess_keeps_old,
    pretrain,
    save_survived_kill,
    sigterm_torchrun,
    tool,
    torchrun,
)


# --------------------------------------------------------------------------- cases
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


def checkpoint_cases() -> list:
    """--save and --load: what could overwrite, hide or misread a checkpoint. $D/ck-base
    holds iterations 2 and 4 of $TINY; the other ck-* directories are copies of it."""
    base = "$D/ck-base"
    c = lambda name, args, needle, **kw: Case(
        "checkpoints", name, pretrain(*TINY, *args), needle, **kw
    )
    held = "already holds checkpoints (iterations 2, 4)"
    return [
        c(
            "misspelled --load, --save holds checkpoints",
            ["--load", "$D/ck-bse", "--save", base],
            held,
            check=base_untouched,
        ),
        c(
            "no --load, --save holds checkpoints",
            ["--save", base],
            f"{held} this run would overwrite or hide (no --load)",
            check=base_untouched,
        ),
        c(
            "--load an older iteration of --save",
            ["--load", f"{base}/iter_0000002", "--save", base],
            "resumes iteration 2, not the newest",
            check=base_untouched,
        ),
        c(
            "--finetune into its own --save",
            ["--load", base, "--save", base, "--finetune"],
            "--finetune restarts at iteration 0",
            check=base_untouched,
        ),
        c("--save is a file", ["--save", "$D/afile"], "--save $D/afile: is a file"),
        c("--save under a file", ["--save", "$D/afile/ck"], "--save $D/afile/ck: not writable"),
        c(
            "--save in use by another job",
            ["--save", "$D/ck-locked"],
            "in use by another job",
            runner=locked_save,
        ),
        c(
            "a model flag differs from the checkpoint",
            ["--load", base, "--num-layers", "3", "--train-iters", "6"],
            "--num-layers is 3 here but 2 in the checkpoint",
            code=1,
            check=base_untouched,
        ),
        c(
            "hand-edited manifest (TP 1 -> 2)",
            ["--load", "$D/ck-edit", "--train-iters", "6"],
            "manifest.json: does not match",
            code=1,
        ),
        c(
            "truncated optimizer file",
            ["--load", "$D/ck-trunc", "--train-iters", "6"],
            "optim_dp000.pt",
            code=1,
        ),
        c(
            "--load not a checkpoint",
            ["--load", "$D/emptydir", "--save", "$D/ck-fresh"],
            "no checkpoint in $D/emptydir: starting from scratch",
            expect="ok",
        ),
        c(
            "--load an iter_* directory",
            ["--load", f"{base}/iter_0000002", "--save", "$D/ck-from2", "--train-iters", "4"],
            "at iteration 2",
            expect="ok",
            check=base_untouched,
        ),
        c(
            "--override-existing-checkpoints",
            [
                "--load",
                "$D/ck-over/iter_0000002",
                "--save",
                "$D/ck-over",
                "--override-existing-checkpoints",
                "--train-iters",
                "4",
            ],
            "--override-existing-checkpoints: $D/ck-over holds iterations 2, 4",
            expect="ok",
        ),
        c(
            "the lock of a job that is gone",
            ["--load", "$D/ck-stale", "--save", "$D/ck-stale", "--train-iters", "6"],
            "saved checkpoint $D/ck-stale/iter_0000006",
            expect="ok",
        ),
        Case(
            "checkpoints",
            "killed during a save (torchrun 2)",
            torchrun(
                2, *TINY, "--train-iters", "4", "--save", "$D/ck-killed", "--save-interval", "1"
            ),
            "lost contact with another rank during the checkpoint save at iteration 3",
            code=17,
            env={"MP_OFFLOAD_CKPT_FAULT": "before_rename:3"},
            check=save_survived_kill,
        ),
    ]


def data_flag_cases() -> list:
    c = lambda name, args, needle, **kw: Case(
        "configuration", name, pretrain(*DATA, *args), needle, **kw
    )
    data = "$D/small_text_document"
    return [
        c("--split all zero", ["--data-path", data, "--split", "0,0,0"], "the parts sum to 0"),
        c("--split negative", ["--data-path", data, "--split", "90,-5,5"], "part '-5'"),
        c("--split not numbers", ["--data-path", data, "--split", "a,b"], "'a' is not a number"),
        c("--split four parts", ["--data-path", data, "--split", "1,2,3,4"], "at most 3"),
        c("--split empty part", ["--data-path", data, "--split", "90,,10"], "'' is not a number"),
        c(
            "--split no train part",
            ["--data-path", data, "--split", "0,50,50"],
            "the train part is 0",
        ),
        c(
            "--eval-interval, no valid part",
            ["--data-path", data, "--split", "100,0,0", "--eval-interval", "5"],
            "valid part is 0",
        ),
        c("--data-path weight not a number", ["--data-path", data, data], "is not a number"),
        c(
            "--data-path weight negative",
            ["--data-path", "-1", data, "2", data],
            "weight '-1' must be",
        ),
        c(
            "--data-path weights sum to 0",
            ["--data-path", "0", data, "0", data],
            "the weights sum to 0",
        ),
        c("--data-path weight inf", ["--data-path", "inf", data, "1", data], "weight 'inf'"),
        c(
            "--data-path odd count",
            ["--data-path", "1", data, "2"],
            "one prefix or weight/prefix pairs",
        ),
        c(
            "--mock-data with --data-path",
            ["--mock-data", "--data-path", data],
            "--mock-data and --data-path exclude",
        ),
        Case(
            "configuration",
            "--data-path without --tokenizer-model",
            pretrain(*MODEL, "--train-iters", "2", "--data-path", data),
            "--data-path needs --tokenizer-model",
        ),
        Case(
            "configuration",
            "--tokenizer-model without --data-path",
            pretrain(*MODEL, "--train-iters", "2", "--tokenizer-model", "$D/sp.model"),
            "without --data-path",
        ),
        c("NullTokenizer without --data-path", [], "NullTokenizer needs --data-path"),
        c(
            "HF tokenizer without --tokenizer-model",
            ["--tokenizer-type", "HuggingFaceTokenizer", "--data-path", data],
            "HuggingFaceTokenizer needs --tokenizer-model",
        ),
        c(
            "--vocab-file without --merge-file",
            ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json", "--data-path", data],
            "--vocab-file needs --merge-file",
        ),
        c(
            "--vocab-file with another type",
            ["--vocab-file", "v", "--merge-file", "m", "--data-path", data],
            "are for --tokenizer-type",
        ),
    ]


def data_cases() -> list:
    c = lambda name, args, needle, **kw: Case("data", name, pretrain(*DATA, *args), needle, **kw)
    small = "$D/small_text_document"
    return [
        c(
            ".bin instead of the prefix",
            ["--data-path", f"{small}.bin"],
            f"give the prefix {small} (without .bin)",
        ),
        c(".idx instead of the prefix", ["--data-path", f"{small}.idx"], "give the prefix"),
        c("a directory", ["--data-path", "$D"], "is a directory; give the prefix"),
        c("a directory without data", ["--data-path", "$D/emptydir"], "holds no .idx files"),
        c("prefix missing its suffix", ["--data-path", "$D/small"], f"did you mean {small}?"),
        c("prefix in no directory", ["--data-path", "$D/nodir/x"], "there is no directory"),
        c(".bin missing", ["--data-path", "$D/only"], "only.bin is missing"),
        c(".idx missing", ["--data-path", "$D/onlybin"], "onlybin.idx is missing"),
        c("truncated .bin", ["--data-path", "$D/truncbin"], "data file truncated"),
        c("not an index (magic)", ["--data-path", "$D/badmagic"], "bad magic"),
        c("truncated .idx", ["--data-path", "$D/truncidx"], "truncated or corrupt index"),
        c("dataset without tokens", ["--data-path", "$D/empty"], "holds no tokens"),
        c(
            "ids beyond the vocabulary (TP=1)",
            ["--data-path", "$D/wide_text_document"],
            "token id 1000 is outside the vocabulary of 97 ids",
        ),
        Case(
            "data",
            "ids beyond the vocabulary (TP=2, torchrun)",
            torchrun(
                2,
                *DATA,
                "--data-path",
                "$D/wide_text_document",
                "--tensor-model-parallel-size",
                "2",
            ),
            "token id 1000 is outside the vocabulary of 97 ids",
        ),
        c(
            "one blended prefix missing",
            ["--data-path", "0.5", small, "0.5", "$D/nope"],
            "--data-path $D/nope: no",
        ),
        Case(
            "data",
            "ids of a 1000-id tokenizer, SentencePiece of 300",
            pretrain(
                *MODEL,
                "--train-iters",
                "2",
                "--data-path",
                "$D/wide_text_document",
                "--tokenizer-model",
                "$D/sp.model",
            ),
            "is outside the vocabulary of 300 ids",
        ),
        Case(
            "data",
            "--tokenizer-model missing",
            pretrain(
                *MODEL,
                "--train-iters",
                "2",
                "--data-path",
                "$D/words_text_document",
                "--tokenizer-model",
                "$D/nope.model",
            ),
            "--tokenizer-model $D/nope.model: no such",
        ),
        Case(
            "data",
            "--tokenizer-model is a directory",
            pretrain(
                *MODEL,
                "--train-iters",
                "2",
                "--data-path",
                "$D/words_text_document",
                "--tokenizer-model",
                "$D/emptydir",
            ),
            "is not a file",
        ),
        Case(
            "data",
            "--tokenizer-model not a model",
            pretrain(
                *MODEL,
                "--train-iters",
                "2",
                "--data-path",
                "$D/words_text_document",
                "--tokenizer-model",
                "$D/garbage.model",
            ),
            "cannot load it as a SentencePiece",
        ),
        Case(
            "data",
            "HF tokenizer directory without tokenizer.json",
            pretrain(
                *MODEL,
                "--train-iters",
                "2",
                "--data-path",
                "$D/words_text_document",
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--tokenizer-model",
                "$D/hfdir",
            ),
            "hfdir/tokenizer.json: no such file",
        ),
        Case(
            "data",
            "GPT-2 vocab file missing",
            pretrain(
                *MODEL,
                "--train-iters",
                "2",
                "--data-path",
                "$D/words_text_document",
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                "$D/v.json",
                "--merge-file",
                "$D/m.txt",
            ),
            "--vocab-file $D/v.json: no such file",
            lines=2,
        ),
        c(
            "--log-json under a file",
            ["--data-path", small, "--log-json", "$D/afile/l.json"],
            "is a file, not a directory",
        ),
        c(
            "--log-json is a directory",
            ["--data-path", small, "--log-json", "$D"],
            "is a directory; give a file name",
        ),
        c(
            "--tensorboard-dir is a file",
            ["--data-path", small, "--tensorboard-dir", "$D/afile"],
            "is a file, not a directory",
        ),
        c(
            "--data-cache-dir under a file",
            ["--data-path", small, "--data-cache-dir", "$D/afile/cache"],
            "is a file, not a directory",
        ),
        Case(
            "data",
            "three file problems at once",
            pretrain(
                *DATA,
                "--data-path",
                "1",
                f"{small}.bin",
                "1",
                "$D/only",
                "--log-json",
                "$D/afile/l.json",
            ),
            "is a file, not a directory",
            lines=3,
        ),
    ]


def runtime_cases() -> list:
    port = str(free_port())
    lone = dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    c = lambda name, cmd, needle, **kw: Case("runtime", name, cmd, needle, **kw)
    return [
        c(
            "fp16: every step overflows",
            pretrain(
                *TINY,
                "--train-iters",
                "8",
                "--fp16",
                "--initial-loss-scale",
                "1e30",
                "--min-loss-scale",
                "1e30",
                "--max-consecutive-skipped-steps",
                "3",
                "--save",
                "$D/ck-fp16",
            ),
            "3 consecutive steps skipped",
            code=1,
            check=no_checkpoint,
        ),
        c(
            "fp32: the loss becomes NaN",
            pretrain(*TINY, "--train-iters", "20", "--lr", "1e30"),
            "loss is nan",
            code=1,
        ),
        c(
            "WORLD_SIZE=2, rank 0 alone",
            pretrain(*TINY, "--distributed-timeout-minutes", "0.05"),
            f"waiting for 2 ranks at 127.0.0.1:{port} (1 of 2 joined",
            code=1,
            env=lone,
        ),
        c(
            "WORLD_SIZE=2, rank 1 alone",
            pretrain(*TINY, "--distributed-timeout-minutes", "0.05"),
            "rank 0 never answered",
            code=1,
            env=dict(lone, RANK="1", MASTER_PORT=str(free_port())),
        ),
        c(
            "MASTER_PORT not a number",
            pretrain(*TINY),
            "MASTER_PORT 'abc' is not a port",
            code=1,
            env=dict(lone, MASTER_PORT="abc"),
        ),
        c(
            "MASTER_PORT in use",
            pretrain(*TINY, "--distributed-timeout-minutes", "0.1"),
            "the port is in use",
            code=1,
            runner=port_in_use,
        ),
        c(
            "a rank stalls (torchrun 2)",
            torchrun(2, *TINY, "--train-iters", "10", "--distributed-timeout-minutes", "0.25"),
            "timed out after 15 s during iteration 3 waiting for rank 1, which did not reach it",
            code=1,
            env={"MP_OFFLOAD_FAULT_STALL": "1:3:120"},
            first=True,
        ),
        c(
            "a rank is killed (torchrun 2)",
            torchrun(2, *TINY, "--train-iters", "10"),
            "lost contact with another rank during iteration 3",
            code=13,
            env={"MP_OFFLOAD_FAULT_ONCE": "$D/killed-once:3"},
        ),
        c(
            "disk full under --log-json (torchrun 2)",
            torchrun(2, *TINY, "--train-iters", "4", "--log-json", "/dev/full"),
            "--log-json /dev/full: No space left on device",
            code=1,
        ),
        c(
            "SIGTERM to torchrun: step finished, saved",
            torchrun(2, *TINY),
            "stop requested",
            expect="ok",
            runner=sigterm_torchrun,
        ),
        c(
            "kill -9 of torchrun: workers stop and save",
            torchrun(2, *TINY),
            "stop requested",
            expect="ok",
            runner=kill9_torchrun,
        ),
        c("valid run, mock data", pretrain(*TINY), "iteration 2/2 ", expect="ok"),
        c(
            "valid run, NullTokenizer data",
            pretrain(*DATA, "--data-path", "$D/small_text_document"),
            "iteration 2/2 ",
            expect="ok",
        ),
        c(
            "valid run, SentencePiece data, TP=2",
            torchrun(
                2,
                *MODEL,
                "--train-iters",
                "2",
                "--data-path",
                "$D/words_text_document",
                "--tokenizer-model",
                "$D/sp.model",
                "--tensor-model-parallel-size",
                "2",
            ),
            "iteration 2/2 ",
            expect="ok",
        ),
        c(
            "run shorter than its warmup: a warning",
            pretrain(*TINY, "--lr-warmup-iters", "5"),
            "warning: --lr-warmup-iters 5 is longer than the run",
            expect="ok",
        ),
        c("--help", pretrain("--help"), "usage:", expect="ok"),
        c(
            "misspelled flag (torchrun 4)",
            torchrun(4, *TINY, "--hiden-size", "64"),
            "did you mean --hidden-size?",
        ),
        c(
            "misspelled flag with --config (torchrun 4)",
            torchrun(4, "--config", "$D/run.yaml", "--hiden-size", "64"),
            "did you mean --hidden-size?",
        ),
        c(
            "missing tokenizer (torchrun 4)",
            torchrun(
                4,
                *MODEL,
                "--train-iters",
                "2",
                "--data-path",
                "$D/words_text_document",
                "--tokenizer-model",
                "$D/nope.model",
            ),
            "no such file",
        ),
        c(
            ".bin as the prefix (torchrun 4)",
            torchrun(4, *DATA, "--data-path", "$D/small_text_document.bin"),
            "give the prefix",
        ),
    ]


def tool_cases() -> list:
    pre = lambda *a: tool("preprocess_data", "--output-prefix", "$D/out", *a)
    gen = lambda *a: tool("generate", "--load", "$D/no-checkpoint", *a)
    # (the tools print warnings and argparse its usage before an error: no first-line rule)
    t = lambda name, cmd, needle, **kw: Case(
        "tools", name, cmd, needle, **dict(dict(code=1, prefix="error: ", first=False), **kw)
    )
    g = lambda name, flags, needle: t(name, gen(*flags), needle, prefix="generate: ")
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    return [
        t(
            "preprocess: wrong --json-keys",
            pre("--input", "$D/small.jsonl", "--json-keys", "content", *null),
            "no documents in $D/small.jsonl under --json-keys content",
        ),
        t(
            "preprocess: empty input",
            pre("--input", "$D/blank.jsonl", *null),
            "(the input is empty); nothing written",
        ),
        t(
            "preprocess: input missing",
            pre("--input", "$D/nope.jsonl", *null),
            "input file not found",
        ),
        t(
            "preprocess: tokenizer model missing",
            pre("--input", "$D/small.jsonl", "--tokenizer-model", "$D/nope.model"),
            "SentencePiece model not found",
        ),
        t(
            "preprocess: NullTokenizer without --vocab-size",
            pre("--input", "$D/small.jsonl", "--tokenizer-type", "NullTokenizer"),
            "NullTokenizer needs --vocab-size",
        ),
        t(
            "preprocess: text is not ids (NullTokenizer)",
            pre("--input", "$D/words.jsonl", *null),
            "no documents in",
        ),
        t(
            "preprocess: bad line with --on-bad-line fail",
            pre("--input", "$D/bad.jsonl", "--on-bad-line", "fail", *null),
            "bad.jsonl:2: bad JSON",
        ),
        t(
            "preprocess: failure keeps the previous dataset",
            pre("--input", "$D/small.jsonl", "--json-keys", "content", *null),
            "no documents",
            runner=preprocess_keeps_old,
        ),
        t(
            "preprocess: unknown tokenizer type",
            pre("--input", "$D/small.jsonl", "--tokenizer-type", "Foo"),
            "invalid choice: 'Foo'",
            code=2,
            prefix="preprocess_data.py: error: ",
        ),
        g("generate: --top-p 0", ["--top-p", "0"], "--top-p must be > 0 and <= 1"),
        g("generate: --top-p 1.5", ["--top-p", "1.5"], "--top-p must be > 0 and <= 1"),
        g("generate: --top-p nan", ["--top-p", "nan"], "--top-p must be > 0 and <= 1"),
        g("generate: --top-k -1", ["--top-k", "-1"], "--top-k must be >= 0"),
        g("generate: --temperature 0", ["--temperature", "0"], "--temperature must be > 0"),
        g("generate: --temperature -1", ["--temperature", "-1"], "--temperature must be > 0"),
        g(
            "generate: --max-new-tokens -1",
            ["--max-new-tokens", "-1"],
            "--max-new-tokens must be >= 0",
        ),
        g(
            "generate: --tensor-model-parallel-size 0",
            ["--tensor-model-parallel-size", "0"],
            "--tensor-model-parallel-size must be >= 1",
        ),
        g("generate: --greedy with --top-p", ["--greedy", "--top-p", "0.9"], "exclude each"),
        g(
            "generate: TP=2 without torchrun",
            ["--tensor-model-parallel-size", "2"],
            "needs torchrun",
        ),
        g("generate: no checkpoint there", [], "no-checkpoint"),
        t(
            "train_tokenizer: input missing",
            tool(
                "train_tokenizer",
                "--input",
                "$D/nope.txt",
                "--model-prefix",
                "$D/tok",
                "--vocab-size",
                "100",
            ),
            "input file not found",
        ),
        t(
            "plot_loss: log missing",
            tool("plot_loss", "--log-json", "$D/nope.jsonl", "--out", "$D/p.png"),
            "no such file",
            code=2,
            prefix="plot_loss.py: error: ",
        ),
    ]


def _no_partial_save(d, rc, out, err):
    left = [n for n in os.listdir(f"{d}/ck-enospc") if n.startswith(".tmp_iter_")]
    return f"data lost: the partial save {left[0]} stayed (the disk stays full)" if left else None


def _sh(*cmd) -> list:
    """A shell line (set-up, then the command) as one case's argv."""
    return ["bash", "-c", " && ".join(cmd)]


def issue23_cases() -> list:
    """The cases of issue 23: a stopped rank, fp16 divergence, a full disk mid-save, stale
    locks, and what the probe found unclear or silent."""
    run = shlex.join(pretrain(*TINY))
    gen = lambda *a: tool("generate", "--load", "$D/ck-base", *a)
    c = Case
    return [
        c("configuration", "abbreviated flag", pretrain(*TINY, "--num-layer", "2"),
          "did you mean --num-layers?"),
        c("runtime", "a rank SIGSTOPped at TP=2 x DP=2 (torchrun 4)",
          torchrun(4, *TINY, "--train-iters", "10", "--tensor-model-parallel-size", "2",
                   "--distributed-timeout-minutes", "0.25"),
          "during iteration 3 waiting for rank 1, which did not reach it", code=1,
          env={"MP_OFFLOAD_FAULT_STOP": "1:3"}),
        c("runtime", "fp16: the loss becomes NaN",
          pretrain(*TINY, "--fp16", "--train-iters", "20", "--lr", "1e30"),
          "the run is diverging; stopping without saving", code=1),
        c("runtime", "fp16: every step of the run skipped",
          pretrain(*TINY, "--fp16", "--train-iters", "4", "--initial-loss-scale", "1e30",
                   "--min-loss-scale", "1e30"),
          "4 of the 4 steps of this run (iterations 1-4) were skipped", code=1),
        c("checkpoints", "the disk fills mid-save",
          pretrain(*TINY, "--save", "$D/ck-enospc"),
          "could not be written (No space left on device;", code=1,
          env={"MP_OFFLOAD_CKPT_ENOSPC": "before_manifest"}, check=_no_partial_save),
        c("checkpoints", "an empty lock left by a dead job",
          _sh("cp -r $D/ck-base $D/ck-empty-lock", ": > $D/ck-empty-lock/.lock",
              f"{run} --train-iters 6 --load $D/ck-empty-lock --save $D/ck-empty-lock"),
          "took over the stale lock", expect="ok"),
        c("checkpoints", "latest names a missing iteration",
          _sh("cp -r $D/ck-base $D/ck-latest",
              "echo 12 > $D/ck-latest/latest_checkpointed_iteration.txt",
              f"{run} --train-iters 6 --load $D/ck-latest --save $D/ck-latest"),
          "iter_0000012/manifest.json is missing"),
        c("checkpoints", "resume past the new --train-iters",
          pretrain(*TINY, "--load", "$D/ck-base", "--save", "$D/ck-short", "--train-iters", "1"),
          "--train-iters 1 is below iteration 4 of the checkpoint"),
        c("checkpoints", "--train-iters 0 writes no checkpoint",
          pretrain(*TINY, "--train-iters", "0", "--save", "$D/ck-zero"),
          "checkpoint  none written", expect="ok"),
        c("tools", "generate: prompt ids not numbers", gen("--prompt", "1 abc"),
          "'abc' is not a token id", code=1, prefix="generate: ", first=False),
        c("tools", "generate: --output-json in a missing directory",
          gen("--output-json", "$D/nodir/x.json"), "no directory $D/nodir", code=1,
          prefix="generate: ", first=False),
        c("tools", "generate: misspelled flag", gen("--max-new-token", "2"),
          "did you mean --max-new-tokens?", code=1, prefix="generate: ", first=False),
        c("tools", "preprocess: --output-prefix under a file",
          tool("preprocess_data", "--output-prefix", "$D/small.jsonl/out", "--input",
               "$D/small.jsonl", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"),
          "cannot make the directory", code=1, prefix="error: ", first=False),
    ]  # fmt: skip


def all_cases() -> list:
    return (
        configuration_cases()
        + data_flag_cases()
        + data_cases()
        + checkpoint_cases()
        + runtime_cases()
        + tool_cases()
        + issue23_cases()
    )
