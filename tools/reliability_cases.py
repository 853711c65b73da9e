"""The cases of docs/RELIABILITY.md, by area: each a real command with the outcome due
(see tools/reliability_probe.py for how they are judged). The areas' cases are in
tools/reliability_cases_<area>.py; this module holds the fault cases (a stopped rank, a
full disk, ...) and all_cases().
"""

from __future__ import annotations

import os
import shlex

from reliability_cases_checkpoints import checkpoint_cases
from reliability_cases_config import configuration_cases
from reliability_cases_data import data_cases, data_flag_cases
from reliability_cases_runtime import runtime_cases
from reliability_cases_stops import stop_cases
from reliability_cases_tools import tool_cases
from reliability_runs import (
    TINY,
    Case,
    pretrain,
    tool,
    torchrun,
)


def _no_partial_save(d, rc, out, err):
    left = [n for n in os.listdir(f"{d}/ck-enospc") if n.startswith(".tmp_iter_")]
    return f"data lost: the partial save {left[0]} stayed (the disk stays full)" if left else None


def _sh(*cmd) -> list:
    """A shell line (set-up, then the command) as one case's argv."""
    return ["bash", "-c", " && ".join(cmd)]


def fault_cases() -> list:
    """The fault cases: a stopped rank, fp16 divergence, a full disk mid-save, stale
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
        + fault_cases()
        + stop_cases()
    )
