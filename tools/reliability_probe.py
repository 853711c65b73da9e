#!/usr/bin/env python
"""Run the reliability cases of docs/RELIABILITY.md and print their table and counts.

    python tools/reliability_probe.py                 # every case, one at a time
    python tools/reliability_probe.py --only fp16 --markdown out.md --jobs 2

Each case is a real command (pretrain_gpt.py alone or under torchrun, or a tool) run
on tiny inputs built in a temporary directory, with a timeout. Its outcome is one of:

  named      the expected one-line error: the right exit code, the line holding the
             expected words, printed once, first on stderr, no traceback
  ok         a run that must succeed did, with what it must print or save
  traceback  a traceback from the project's processes (torchrun's own summary aside)
  hang       the timeout passed
  silent     exit 0, or a wrong result without an error, where an error was due
  data lost  a checkpoint or dataset that should exist (or survive) does not
  other      an error, but not as promised (unnamed, repeated, buried, wrong code)

Targets: 0 traceback, 0 hang, 0 silent, 0 data lost, 0 other. Needs a few minutes on 2
cores; no GPU (MP_OFFLOAD_DEVICE=cpu).
"""
from __future__ import annotations

import argparse
import collections
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--log-interval", "1", "--eval-interval", "1000",
         "--eval-iters", "1"]
TINY = MODEL + ["--mock-data", "--vocab-size", "96", "--train-iters", "2"]
DATA = MODEL + ["--train-iters", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                "96"]
TRACEBACK = re.compile(r'File "[^"]*(pretrain_gpt\.py|/mp_offload/|/tools/)')
ROOT_CAUSE = re.compile(r"Root Cause[\s\S]*?exitcode\s*:\s*(-?\d+)")
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_USE_AGENT_STORE", "GROUP_RANK", "ROLE_RANK")


@dataclass
class Case:
    area: str
    name: str
    cmd: list            # argv; "$D" stands for the fixture directory
    needle: str = ""     # words the error line (or, for "ok", the output) must hold
    code: int = 2        # the exit code of the failing process (torchrun: its root cause)
    expect: str = "error"
    prefix: str = "pretrain_gpt.py: error: "
    lines: int = 1       # error lines due (one per problem)
    first: bool = True   # the error must be the first line on stderr
    env: dict = field(default_factory=dict)
    timeout: float = 180.0
    runner: object = None  # a function(case, d) -> (rc, out, err, problem) for the odd ones
    check: object = None   # a function(d, rc, out, err) -> problem or None, after the run


def pretrain(*args) -> list:
    return [sys.executable, PRETRAIN, *args]


def torchrun(n: int, *args) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={n}", PRETRAIN, *args]


def tool(name: str, *args) -> list:
    return [sys.executable, os.path.join(ROOT, "tools", f"{name}.py"), *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    return dict(env, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MP_OFFLOAD_DEVICE="cpu",
                PYTHONPATH=ROOT, **extra)


def expand(cmd: list, d: str) -> list:
    return [a.replace("$D", d) for a in cmd]


# ------------------------------------------------------------------------ fixtures
def build_fixtures(d: str) -> None:
    """Tiny datasets and tokenizers under ``d`` (a few seconds)."""
    import numpy as np

    from mp_offload.data.indexed_dataset import IndexedDatasetBuilder
    from mp_offload.data.preprocess import preprocess
    from mp_offload.data.tokenizer import train_sentencepiece
    rng = np.random.default_rng(0)
    for name, vocab in (("small", 96), ("wide", 1000)):
        with open(f"{d}/{name}.jsonl", "w") as f:
            for _ in range(80):
                ids = rng.integers(0, min(vocab, 90) if name == "small" else vocab, 40)
                f.write(json.dumps({"text": " ".join(map(str, ids))}) + "\n")
        preprocess([f"{d}/{name}.jsonl"], f"{d}/{name}", "NullTokenizer", vocab_size=vocab,
                   append_eod=True, log=io.StringIO())
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    docs = [" ".join(words[(i * 7 + k * 3) % 10] for k in range(50)) for i in range(200)]
    with open(f"{d}/words.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in docs)
    train_sentencepiece(docs, f"{d}/sp", 300)
    preprocess([f"{d}/words.jsonl"], f"{d}/words", "SentencePieceTokenizer",
               tokenizer_model=f"{d}/sp.model", append_eod=True, log=io.StringIO())
    small = f"{d}/small_text_document"
    for suffix in (".bin", ".idx"):  # half pairs
        shutil.copy(small + suffix, f"{d}/only{suffix}")
    os.remove(f"{d}/only.bin")
    shutil.copy(f"{small}.bin", f"{d}/onlybin.bin")
    _damaged_copies(d, small)
    builder = IndexedDatasetBuilder(f"{d}/empty.bin", np.uint16)
    builder.finalize(f"{d}/empty.idx")
    os.makedirs(f"{d}/emptydir")
    os.makedirs(f"{d}/hfdir")
    with open(f"{d}/garbage.model", "wb") as f:
        f.write(b"this is not a sentencepiece model\n" * 10)
    with open(f"{d}/afile", "w") as f:
        f.write("x")
    with open(f"{d}/bad.jsonl", "w") as f:
        f.write('{"text": "1 2 3"}\n{not json\n')
    with open(f"{d}/blank.jsonl", "w") as f:
        f.write("\n")
    with open(f"{d}/words.txt", "w") as f:
        f.write("one two three\n")


def _damaged_copies(d: str, small: str) -> None:
    with open(f"{small}.bin", "rb") as f:
        data = f.read()
    with open(f"{small}.idx", "rb") as f:
        index = f.read()
    for name, b, i in (("truncbin", data[: len(data) // 2], index),
                       ("badmagic", data, b"XXXXXXXXX" + index[9:]),
                       ("truncidx", data, index[: len(index) - 16])):
        with open(f"{d}/{name}.bin", "wb") as f:
            f.write(b)
        with open(f"{d}/{name}.idx", "wb") as f:
            f.write(i)


# --------------------------------------------------------------------------- cases
def configuration_cases() -> list:
    c = lambda name, args, needle, **kw: Case("configuration", name, pretrain(*TINY, *args),
                                              needle, **kw)
    ranges = [("--num-layers", "0"), ("--hidden-size", "-64"), ("--num-attention-heads", "0"),
              ("--seq-length", "0"), ("--micro-batch-size", "0"), ("--global-batch-size", "0"),
              ("--train-iters", "-1"), ("--lr", "-1"), ("--min-lr", "-1"),
              ("--clip-grad", "-1"), ("--weight-decay", "-0.1"), ("--adam-beta1", "1.0"),
              ("--adam-beta2", "-0.1"), ("--adam-eps", "0"), ("--hidden-dropout", "1.5"),
              ("--attention-dropout", "-0.1"), ("--eval-interval", "0"),
              ("--eval-iters", "-1"), ("--log-interval", "0"),
              ("--distributed-timeout-minutes", "0"), ("--loss-scale-window", "0"),
              ("--hysteresis", "0"), ("--initial-loss-scale", "0"),
              ("--reduce-bucket-size", "0"), ("--cpu-threads-per-rank", "0"),
              ("--max-consecutive-skipped-steps", "0"), ("--layernorm-epsilon", "0"),
              ("--make-vocab-size-divisible-by", "0"), ("--vocab-size", "0"),
              ("--init-method-std", "-0.02"), ("--dpu-warmup-steps", "-1")]
    cases = [
        c("misspelled flag", ["--hiden-size", "64"], "did you mean --hidden-size?"),
        c("Megatron-style flag name", ["--tensor-parallel-size", "2"],
          "did you mean --tensor-model-parallel-size?"),
        c("misspelled flag (=value)", ["--trian-iters=5"], "did you mean --train-iters?"),
        c("flag that does not exist", ["--fp32"], "did you mean --fp16?"),
        c("two unknown flags", ["--foo", "--barr", "1"], "unrecognized argument --foo",
          lines=2),
        c("not an integer", ["--hidden-size", "abc"], "--hidden-size: invalid int value"),
        c("not a number", ["--lr", "1e-3x"], "--lr: invalid float value"),
        c("choice misspelled", ["--lr-decay-style", "cosin"], "invalid choice: 'cosin'"),
        c("unknown optimizer", ["--optimizer", "adamw"], "invalid choice: 'adamw'"),
        c("unknown tokenizer type", ["--tokenizer-type", "GPT2Tokenizer"], "invalid choice"),
        c("unknown device", ["--device", "gpu"], "invalid choice: 'gpu'"),
        c("one value too many", ["--train-iters", "5", "6"], "unexpected value '6'"),
        c("value missing", ["--hidden-size"], "--hidden-size: expected one argument"),
        c("ambiguous abbreviation", ["--hidden", "32"], "ambiguous option: --hidden"),
    ]
    cases += [c(f"{flag} {value}", [flag, value], f"{flag} must be") for flag, value in ranges]
    cases += [
        c("--fp16 with --bf16", ["--fp16", "--bf16"], "--fp16 and --bf16 are mutually"),
        c("--fp16 with torch-adamw", ["--fp16", "--optimizer", "torch-adamw"],
          "--fp16 needs loss scaling"),
        c("--cpu-offload with torch-adamw", ["--cpu-offload", "--optimizer", "torch-adamw"],
          "need --optimizer adam"),
        c("--dpu-warmup-steps without offload", ["--dpu-warmup-steps", "2"],
          "--dpu-warmup-steps needs --cpu-offload"),
        c("hidden not divisible by heads", ["--hidden-size", "30"], "--hidden-size 30 is not"),
        c("sequence beyond positions", ["--seq-length", "64", "--max-position-embeddings",
                                        "32"], "--seq-length 64 exceeds"),
        c("global batch not a multiple", ["--global-batch-size", "3"],
          "--global-batch-size 3 is not a multiple"),
        Case("configuration", "no --train-iters", pretrain(*MODEL, "--mock-data"),
             "give --train-iters or --train-samples"),
        c("--train-iters with --train-samples", ["--train-samples", "8"], "mutually exclusive"),
        Case("configuration", "--train-samples below one batch",
             pretrain(*MODEL, "--mock-data", "--train-samples", "1"),
             "less than one global batch"),
        c("--min-lr above --lr", ["--min-lr", "1", "--lr", "0.1"], "--min-lr 1 exceeds --lr"),
        c("warmup beyond decay", ["--lr-warmup-iters", "10", "--lr-decay-iters", "5"],
          "--lr-warmup-iters 10 exceeds --lr-decay-iters 5"),
        c("--eval-interval with --eval-iters 0", ["--eval-interval", "5", "--eval-iters", "0"],
          "evaluates nothing"),
        c("--min-loss-scale above initial", ["--fp16", "--min-loss-scale", "8",
                                             "--initial-loss-scale", "4"], "exceeds"),
        c("--world-size without --dry-run", ["--world-size", "4"], "disagrees with"),
        c("TP larger than the world", ["--tensor-model-parallel-size", "2"], "does not divide"),
        c("--dry-run --world-size 0", ["--dry-run", "--world-size", "0"],
          "--world-size must be >= 1"),
        c("--device cuda without a GPU", ["--device", "cuda"], "no CUDA device"),
    ]
    return cases


def data_flag_cases() -> list:
    c = lambda name, args, needle, **kw: Case("configuration", name,
                                              pretrain(*DATA, *args), needle, **kw)
    data = "$D/small_text_document"
    return [
        c("--split all zero", ["--data-path", data, "--split", "0,0,0"], "the parts sum to 0"),
        c("--split negative", ["--data-path", data, "--split", "90,-5,5"], "part '-5'"),
        c("--split not numbers", ["--data-path", data, "--split", "a,b"], "'a' is not a number"),
        c("--split four parts", ["--data-path", data, "--split", "1,2,3,4"], "at most 3"),
        c("--split empty part", ["--data-path", data, "--split", "90,,10"], "'' is not a number"),
        c("--split no train part", ["--data-path", data, "--split", "0,50,50"],
          "the train part is 0"),
        c("--eval-interval, no valid part", ["--data-path", data, "--split", "100,0,0",
                                             "--eval-interval", "5"], "valid part is 0"),
        c("--data-path weight not a number", ["--data-path", data, data],
          "is not a number"),
        c("--data-path weight negative", ["--data-path", "-1", data, "2", data],
          "weight '-1' must be"),
        c("--data-path weights sum to 0", ["--data-path", "0", data, "0", data],
          "the weights sum to 0"),
        c("--data-path weight inf", ["--data-path", "inf", data, "1", data], "weight 'inf'"),
        c("--data-path odd count", ["--data-path", "1", data, "2"],
          "one prefix or weight/prefix pairs"),
        c("--mock-data with --data-path", ["--mock-data", "--data-path", data],
          "--mock-data and --data-path exclude"),
        Case("configuration", "--data-path without --tokenizer-model",
             pretrain(*MODEL, "--train-iters", "2", "--data-path", data),
             "--data-path needs --tokenizer-model"),
        Case("configuration", "--tokenizer-model without --data-path",
             pretrain(*MODEL, "--train-iters", "2", "--tokenizer-model", "$D/sp.model"),
             "without --data-path"),
        c("NullTokenizer without --data-path", [], "NullTokenizer needs --data-path"),
        c("HF tokenizer without --tokenizer-model", ["--tokenizer-type", "HuggingFaceTokenizer",
                                                     "--data-path", data],
          "HuggingFaceTokenizer needs --tokenizer-model"),
        c("--vocab-file without --merge-file", ["--tokenizer-type", "GPT2BPETokenizer",
                                                "--vocab-file", "v.json", "--data-path", data],
          "--vocab-file needs --merge-file"),
        c("--vocab-file with another type", ["--vocab-file", "v", "--merge-file", "m",
                                             "--data-path", data], "are for --tokenizer-type"),
    ]


def data_cases() -> list:
    c = lambda name, args, needle, **kw: Case("data", name, pretrain(*DATA, *args), needle,
                                              **kw)
    small = "$D/small_text_document"
    return [
        c(".bin instead of the prefix", ["--data-path", f"{small}.bin"],
          f"give the prefix {small} (without .bin)"),
        c(".idx instead of the prefix", ["--data-path", f"{small}.idx"], "give the prefix"),
        c("a directory", ["--data-path", "$D"], "is a directory; give the prefix"),
        c("a directory without data", ["--data-path", "$D/emptydir"], "holds no .idx files"),
        c("prefix missing its suffix", ["--data-path", "$D/small"],
          f"did you mean {small}?"),
        c("prefix in no directory", ["--data-path", "$D/nodir/x"], "there is no directory"),
        c(".bin missing", ["--data-path", "$D/only"], "only.bin is missing"),
        c(".idx missing", ["--data-path", "$D/onlybin"], "onlybin.idx is missing"),
        c("truncated .bin", ["--data-path", "$D/truncbin"], "data file truncated"),
        c("not an index (magic)", ["--data-path", "$D/badmagic"], "bad magic"),
        c("truncated .idx", ["--data-path", "$D/truncidx"], "truncated or corrupt index"),
        c("dataset without tokens", ["--data-path", "$D/empty"], "holds no tokens"),
        c("ids beyond the vocabulary (TP=1)", ["--data-path", "$D/wide_text_document"],
          "token id 1000 is outside the vocabulary of 97 ids"),
        Case("data", "ids beyond the vocabulary (TP=2, torchrun)",
             torchrun(2, *DATA, "--data-path", "$D/wide_text_document",
                      "--tensor-model-parallel-size", "2"),
             "token id 1000 is outside the vocabulary of 97 ids"),
        c("one blended prefix missing", ["--data-path", "0.5", small, "0.5", "$D/nope"],
          "--data-path $D/nope: no"),
        Case("data", "ids of a 1000-id tokenizer, SentencePiece of 300", pretrain(
            *MODEL, "--train-iters", "2", "--data-path", "$D/wide_text_document",
            "--tokenizer-model", "$D/sp.model"), "is outside the vocabulary of 300 ids"),
        Case("data", "--tokenizer-model missing", pretrain(
            *MODEL, "--train-iters", "2", "--data-path", "$D/words_text_document",
            "--tokenizer-model", "$D/nope.model"), "--tokenizer-model $D/nope.model: no such"),
        Case("data", "--tokenizer-model is a directory", pretrain(
            *MODEL, "--train-iters", "2", "--data-path", "$D/words_text_document",
            "--tokenizer-model", "$D/emptydir"), "is not a file"),
        Case("data", "--tokenizer-model not a model", pretrain(
            *MODEL, "--train-iters", "2", "--data-path", "$D/words_text_document",
            "--tokenizer-model", "$D/garbage.model"), "cannot load it as a SentencePiece"),
        Case("data", "HF tokenizer directory without tokenizer.json", pretrain(
            *MODEL, "--train-iters", "2", "--data-path", "$D/words_text_document",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "$D/hfdir"),
             "hfdir/tokenizer.json: no such file"),
        Case("data", "GPT-2 vocab file missing", pretrain(
            *MODEL, "--train-iters", "2", "--data-path", "$D/words_text_document",
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "$D/v.json",
            "--merge-file", "$D/m.txt"), "--vocab-file $D/v.json: no such file", lines=2),
        c("--log-json under a file", ["--data-path", small, "--log-json", "$D/afile/l.json"],
          "is a file, not a directory"),
        c("--log-json is a directory", ["--data-path", small, "--log-json", "$D"],
          "is a directory; give a file name"),
        c("--tensorboard-dir is a file", ["--data-path", small, "--tensorboard-dir",
                                          "$D/afile"], "is a file, not a directory"),
        c("--data-cache-dir under a file", ["--data-path", small, "--data-cache-dir",
                                            "$D/afile/cache"], "is a file, not a directory"),
        Case("data", "three file problems at once", pretrain(
            *DATA, "--data-path", "1", f"{small}.bin", "1", "$D/only",
            "--log-json", "$D/afile/l.json"), "is a file, not a directory", lines=3),
    ]


def runtime_cases() -> list:
    port = str(free_port())
    lone = dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    c = lambda name, cmd, needle, **kw: Case("runtime", name, cmd, needle, **kw)
    return [
        c("fp16: every step overflows", pretrain(
            *TINY, "--train-iters", "8", "--fp16", "--initial-loss-scale", "1e30",
            "--min-loss-scale", "1e30", "--max-consecutive-skipped-steps", "3", "--save",
            "$D/ck-fp16"), "3 consecutive steps skipped", code=1, check=_no_checkpoint),
        c("fp32: the loss becomes NaN", pretrain(*TINY, "--train-iters", "20", "--lr", "1e30"),
          "loss is nan", code=1),
        c("WORLD_SIZE=2, rank 0 alone", pretrain(
            *TINY, "--distributed-timeout-minutes", "0.05"),
          f"waiting for 2 ranks at 127.0.0.1:{port} (1 of 2 joined", code=1, env=lone),
        c("WORLD_SIZE=2, rank 1 alone", pretrain(
            *TINY, "--distributed-timeout-minutes", "0.05"), "rank 0 never answered", code=1,
          env=dict(lone, RANK="1", MASTER_PORT=str(free_port()))),
        c("MASTER_PORT not a number", pretrain(*TINY), "MASTER_PORT 'abc' is not a port",
          code=1, env=dict(lone, MASTER_PORT="abc")),
        c("MASTER_PORT in use", pretrain(*TINY, "--distributed-timeout-minutes", "0.1"),
          "the port is in use", code=1, runner=_port_in_use),
        c("a rank stalls (torchrun 2)", torchrun(
            2, *TINY, "--train-iters", "10", "--distributed-timeout-minutes", "0.25"),
          "timed out after 15 s waiting for the other ranks during iteration 3", code=1,
          env={"MP_OFFLOAD_FAULT_STALL": "1:3:120"}, first=True),
        c("a rank is killed (torchrun 2)", torchrun(2, *TINY, "--train-iters", "10"),
          "lost contact with another rank during iteration 3", code=13,
          env={"MP_OFFLOAD_FAULT_ONCE": "$D/killed-once:3"}),
        c("disk full under --log-json (torchrun 2)", torchrun(
            2, *TINY, "--train-iters", "4", "--log-json", "/dev/full"),
          "--log-json /dev/full: No space left on device", code=1),
        c("SIGTERM to torchrun: step finished, saved", torchrun(2, *TINY), "stop requested",
          expect="ok", runner=_sigterm_torchrun),
        c("kill -9 of torchrun: workers stop and save", torchrun(2, *TINY), "stop requested",
          expect="ok", runner=_kill9_torchrun),
        c("valid run, mock data", pretrain(*TINY), "iteration        2", expect="ok"),
        c("valid run, NullTokenizer data", pretrain(*DATA, "--data-path",
                                                    "$D/small_text_document"),
          "iteration        2", expect="ok"),
        c("valid run, SentencePiece data, TP=2", torchrun(
            2, *MODEL, "--train-iters", "2", "--data-path", "$D/words_text_document",
            "--tokenizer-model", "$D/sp.model", "--tensor-model-parallel-size", "2"),
          "iteration        2", expect="ok"),
        c("run shorter than its warmup: a warning", pretrain(*TINY, "--lr-warmup-iters", "5"),
          "warning: --lr-warmup-iters 5 is longer than the run", expect="ok"),
        c("--help", pretrain("--help"), "usage:", expect="ok"),
        c("misspelled flag (torchrun 4)", torchrun(4, *TINY, "--hiden-size", "64"),
          "did you mean --hidden-size?"),
        c("missing tokenizer (torchrun 4)", torchrun(
            4, *MODEL, "--train-iters", "2", "--data-path", "$D/words_text_document",
            "--tokenizer-model", "$D/nope.model"), "no such file"),
        c(".bin as the prefix (torchrun 4)", torchrun(
            4, *DATA, "--data-path", "$D/small_text_document.bin"), "give the prefix"),
    ]


def tool_cases() -> list:
    pre = lambda *a: tool("preprocess_data", "--output-prefix", "$D/out", *a)
    gen = lambda *a: tool("generate", "--load", "$D/no-checkpoint", *a)
    # (the tools print warnings and argparse its usage before an error: no first-line rule)
    t = lambda name, cmd, needle, **kw: Case("tools", name, cmd, needle, **dict(
        dict(code=1, prefix="error: ", first=False), **kw))
    g = lambda name, flags, needle: t(name, gen(*flags), needle, prefix="generate: ")
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    return [
        t("preprocess: wrong --json-keys", pre("--input", "$D/small.jsonl", "--json-keys",
                                               "content", *null),
          "no documents in $D/small.jsonl under --json-keys content"),
        t("preprocess: empty input", pre("--input", "$D/blank.jsonl", *null),
          "(the input is empty); nothing written"),
        t("preprocess: input missing", pre("--input", "$D/nope.jsonl", *null),
          "input file not found"),
        t("preprocess: tokenizer model missing", pre("--input", "$D/small.jsonl",
                                                     "--tokenizer-model", "$D/nope.model"),
          "SentencePiece model not found"),
        t("preprocess: NullTokenizer without --vocab-size", pre(
            "--input", "$D/small.jsonl", "--tokenizer-type", "NullTokenizer"),
          "NullTokenizer needs --vocab-size"),
        t("preprocess: text is not ids (NullTokenizer)", pre("--input", "$D/words.jsonl",
                                                             *null), "no documents in"),
        t("preprocess: bad line with --on-bad-line fail", pre(
            "--input", "$D/bad.jsonl", "--on-bad-line", "fail", *null), "bad.jsonl:2: bad JSON"),
        t("preprocess: failure keeps the previous dataset", pre(
            "--input", "$D/small.jsonl", "--json-keys", "content", *null),
          "no documents", runner=_preprocess_keeps_old),
        t("preprocess: unknown tokenizer type", pre("--input", "$D/small.jsonl",
                                                    "--tokenizer-type", "Foo"),
          "invalid choice: 'Foo'", code=2, prefix="preprocess_data.py: error: "),
        g("generate: --top-p 0", ["--top-p", "0"], "--top-p must be > 0 and <= 1"),
        g("generate: --top-p 1.5", ["--top-p", "1.5"], "--top-p must be > 0 and <= 1"),
        g("generate: --top-p nan", ["--top-p", "nan"], "--top-p must be > 0 and <= 1"),
        g("generate: --top-k -1", ["--top-k", "-1"], "--top-k must be >= 0"),
        g("generate: --temperature 0", ["--temperature", "0"], "--temperature must be > 0"),
        g("generate: --temperature -1", ["--temperature", "-1"], "--temperature must be > 0"),
        g("generate: --max-new-tokens -1", ["--max-new-tokens", "-1"],
          "--max-new-tokens must be >= 0"),
        g("generate: --tensor-model-parallel-size 0", ["--tensor-model-parallel-size", "0"],
          "--tensor-model-parallel-size must be >= 1"),
        g("generate: --greedy with --top-p", ["--greedy", "--top-p", "0.9"], "exclude each"),
        g("generate: TP=2 without torchrun", ["--tensor-model-parallel-size", "2"],
          "needs torchrun"),
        g("generate: no checkpoint there", [], "no-checkpoint"),
        t("train_tokenizer: input missing", tool("train_tokenizer", "--input", "$D/nope.txt",
                                                 "--model-prefix", "$D/tok", "--vocab-size",
                                                 "100"), "input file not found"),
        t("plot_loss: log missing", tool("plot_loss", "--log-json", "$D/nope.jsonl", "--out",
                                         "$D/p.png"), "no such file", code=2,
          prefix="plot_loss.py: error: "),
    ]


def all_cases() -> list:
    return (configuration_cases() + data_flag_cases() + data_cases() + runtime_cases() +
            tool_cases())


# ------------------------------------------------------------------ special runners
def _no_checkpoint(d, rc, out, err):
    if os.path.exists(f"{d}/ck-fp16/latest_checkpointed_iteration.txt"):
        return "silent: saved a checkpoint of the diverged run"
    return None


def _port_in_use(case, d):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        env = dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(s.getsockname()[1]))
        return _run(case.cmd, d, env, case.timeout)


def _start_training(case, d, name):
    """torchrun 2 training 'forever' with --save; returns (process, log, checkpoint dir)."""
    log, ck = f"{d}/{name}.jsonl", f"{d}/ck-{name}"
    cmd = expand(case.cmd, d) + ["--train-iters", "100000", "--save", ck, "--log-json", log]
    proc = subprocess.Popen(cmd, env=environment({}), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + case.timeout
    while time.time() < deadline and (not os.path.exists(log) or
                                      sum(1 for _ in open(log)) < 3):
        time.sleep(0.5)
    return proc, log, ck


def _saved_last(log, ck):
    from mp_offload.checkpoint import read_latest
    last = [json.loads(ln)["iteration"] for ln in open(log) if '"loss"' in ln][-1]
    saved = read_latest(ck)
    return None if saved == last else f"data lost: trained to {last}, saved {saved}"


def _sigterm_torchrun(case, d):
    proc, log, ck = _start_training(case, d, "sigterm")
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return None, "", "", "hang"
    # torchrun itself exits non-zero on a signal; what counts is the workers' stop and save
    return 0, out, err, _saved_last(log, ck)


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _kill9_torchrun(case, d):
    proc, log, ck = _start_training(case, d, "kill9")
    workers = _children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    deadline = time.time() + 90
    while time.time() < deadline and not all(_gone(w) for w in workers):
        time.sleep(0.2)
    orphans = [w for w in workers if not _gone(w)]
    for w in orphans:
        os.kill(w, signal.SIGKILL)
    out, err = proc.communicate()
    if not workers:
        return 0, out, err, "other: no workers found"
    if orphans:
        return 0, out, err, "hang"
    return 0, out, err, _saved_last(log, ck)


def _preprocess_keeps_old(case, d):
    old = f"{d}/keep"
    _run(tool("preprocess_data", "--input", "$D/small.jsonl", "--output-prefix", old,
              "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"), d, {}, case.timeout)
    before = {s: open(f"{old}_text_document{s}", "rb").read() for s in (".bin", ".idx")}
    cmd = [a if a != "$D/out" else old for a in case.cmd]
    rc, out, err, _ = _run(cmd, d, {}, case.timeout)
    after = {s: open(f"{old}_text_document{s}", "rb").read()
             for s in (".bin", ".idx") if os.path.exists(f"{old}_text_document{s}")}
    return rc, out, err, None if after == before else "data lost: the old dataset changed"


# ----------------------------------------------------------------------- judging
def _run(cmd, d, env, timeout):
    try:
        res = subprocess.run(expand(cmd, d), env=environment({k: v.replace("$D", d)
                                                              for k, v in env.items()}),
                             cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return None, _text(e.stdout), _text(e.stderr), "hang"
    return res.returncode, res.stdout, res.stderr, None


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def judge(case: Case, d: str, rc, out: str, err: str, problem) -> str:
    if problem == "hang" or rc is None:
        return "hang"
    if TRACEBACK.search(out + err):
        return "traceback"
    if problem:
        return problem.split(":")[0]
    if case.check:
        found = case.check(d, rc, out, err)
        if found:
            return found.split(":")[0]
    needle = case.needle.replace("$D", d)
    errors = [ln for ln in err.splitlines() if ln.startswith(case.prefix)]
    if case.expect == "ok":
        return "ok" if rc == 0 and not errors and needle in out + err else "other"
    if rc == 0:
        return "silent"
    root = ROOT_CAUSE.search(err)
    code = int(root.group(1)) if root else rc
    if not errors or needle not in "\n".join(errors) or len(errors) != case.lines:
        return "other"
    shown = [ln for ln in err.splitlines() if not ln.startswith(("pretrain_gpt.py: waiting",
                                                                 "usage:", "   "))]
    if code != case.code or (case.first and shown[0] != errors[0]):
        return "other"
    return "named"


def run_case(case: Case, d: str) -> tuple:
    t0 = time.time()
    runner = case.runner or (lambda c, dd: _run(c.cmd, dd, c.env, c.timeout))
    rc, out, err, problem = runner(case, d)
    outcome = judge(case, d, rc, out, err, problem)
    if case.expect == "ok":  # the line that shows it ran as it should
        needle = case.needle.replace("$D", d)
        shown = next((ln for ln in (out + err).splitlines() if needle in ln), "")
    else:
        errors = [ln for ln in err.splitlines() if ln.startswith(case.prefix)]
        shown = errors[0] if errors else (err.strip().splitlines() or [""])[-1]
    return outcome, shown.strip().replace(d, "$D"), time.time() - t0


# ----------------------------------------------------------------------- output
def _command(case: Case) -> str:
    text = " ".join(case.cmd).replace(sys.executable, "python").replace(ROOT + "/", "")
    text = text.replace("-m torch.distributed.run --standalone", "-m torchrun")
    for name, flags in (("$TINY", TINY), ("$DATA", DATA), ("$MODEL", MODEL)):
        text = text.replace(" ".join(flags), name)
    env = " ".join(f"{k}={v}" for k, v in case.env.items())
    return f"{env} {text}".strip()


def table(cases, results) -> str:
    rows = ["| # | area | case | command | expected | outcome | first line printed |",
            "|---|---|---|---|---|---|---|"]
    for i, (case, (outcome, shown, _)) in enumerate(zip(cases, results), 1):
        want = "runs" if case.expect == "ok" else f"exit {case.code}, one line"
        cells = [str(i), case.area, case.name, f"`{_command(case)}`", want, outcome,
                 f"`{shown[:160]}`" if shown else ""]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def counts(cases, results) -> str:
    total = collections.Counter(outcome for outcome, _, _ in results)
    by_area = collections.defaultdict(collections.Counter)
    for case, (outcome, _, _) in zip(cases, results):
        by_area[case.area][outcome] += 1
    kinds = ["named", "ok", "traceback", "hang", "silent", "data lost", "other"]
    rows = ["| area | cases | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 2) + "|"]
    for area, ctr in list(by_area.items()) + [("all", total)]:
        rows.append(f"| {area} | {sum(ctr.values())} | " +
                    " | ".join(str(ctr[k]) for k in kinds) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="run the cases whose name or area holds this text")
    p.add_argument("--jobs", type=int, default=1, help="cases run at once (default 1)")
    p.add_argument("--markdown", help="also write the table and counts here")
    a = p.parse_args(argv)
    cases = [c for c in all_cases() if not a.only or a.only in c.name or a.only == c.area]
    d = tempfile.mkdtemp(prefix="mp_offload_probe_")
    try:
        build_fixtures(d)
        with ThreadPoolExecutor(max(1, a.jobs)) as pool:
            futures = [pool.submit(run_case, c, d) for c in cases]
            results = []
            for i, (case, fut) in enumerate(zip(cases, futures), 1):
                results.append(fut.result())
                print(f"[{i}/{len(cases)}] {results[-1][0]:9s} {case.area}: {case.name} "
                      f"({results[-1][2]:.0f}s)", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    report = f"{table(cases, results)}\n\n{counts(cases, results)}\n"
    print(report)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(report)
    bad = sum(1 for outcome, _, _ in results if outcome not in ("named", "ok"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
