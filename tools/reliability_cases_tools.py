"""The reliability probe's tool cases: preprocess_data, generate, plot_loss and the planner
(see tools/reliability_cases.py).
"""

from __future__ import annotations

import sys

from reliability_runs import (
    TINY,
    Case,
    preprocess_keeps_old,
    pretrain,
    tool,
)


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
    ] + planner_cases()


def planner_cases() -> list:
    """``python -m mp_offload.plan``: absurd hardware and models answered in one line."""
    plan = lambda *a: [sys.executable, "-m", "mp_offload.plan", *a]  # noqa: E731
    p = lambda name, cmd, needle, **kw: Case(  # noqa: E731
        "tools", name, cmd, needle, **dict(dict(prefix="plan: "), **kw)
    )
    huge = ["--num-layers", "100000", "--hidden-size", "1000000", "--num-attention-heads", "8"]
    return [
        p("planner: no GPUs per node", plan("--devices-per-node", "0"), "--devices-per-node must"),
        p("planner: negative host memory", plan("--host-memory-gb", "-5"), "--host-memory-gb must"),
        p(
            "planner: a 10^18-parameter model",
            plan("--machine", "hgx-h100", *huge),
            "nothing fits: 1,200,001,353,250,000,000 parameters",
            code=1,
        ),
        p("planner: bf16 on V100s", plan("--machine", "dgx2", "--bf16"), "have no bf16"),
        p(
            "planner: Llama-2-70B on a DGX-2",
            plan("--machine", "dgx2", "--model", "llama2-70b"),
            "turned on to fit: --micro-batch-size 1 --sequence-parallel",
            expect="ok",
        ),
        Case(
            "configuration",
            "planner: --dry-run with no ranks per node",
            pretrain(*TINY, "--dry-run", "--world-size", "2"),
            "PLAN_DEVICES_PER_NODE must be >= 1, got 0",
            env={"PLAN_DEVICES_PER_NODE": "0"},
        ),
    ]
