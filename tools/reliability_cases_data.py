"""The reliability probe's data cases: the data flags (judged as configuration)
and the datasets they name (see tools/reliability_cases.py).
"""

from __future__ import annotations

from reliability_runs import (
    DATA,
    MODEL,
    Case,
    pretrain,
    torchrun,
)


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
