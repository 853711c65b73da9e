"""pretrain_gpt.py under torchrun: bad configs fail fast on every rank; TP=1 == TP=2."""

import json
import os
import subprocess
import sys

import pytest
from helpers import HANG_TIMEOUT, ROOT, tiny_model_flags

MODEL = dict(hidden_size=64, seq_length=32, vocab_size=128, make_vocab_size_divisible_by=None)
RUN = [
    "--mock-data",
    "--micro-batch-size",
    "2",
    "--lr",
    "3e-3",
    "--log-interval",
    "5",
    "--eval-interval",
    "1000",
]
TINY = tiny_model_flags(**MODEL) + RUN
pytestmark = pytest.mark.slow  # every test runs pretrain_gpt.py under torchrun


def torchrun(nproc, *args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        os.path.join(ROOT, "pretrain_gpt.py"),
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A tiny NullTokenizer dataset (ids < 96)."""
    import io

    from mp_offload.data.preprocess import preprocess

    d = tmp_path_factory.mktemp("data")
    with open(d / "docs.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": " ".join(str((i * 7 + k) % 90) for k in range(40))}))
            f.write("\n")
    preprocess(
        [str(d / "docs.jsonl")], str(d / "x"), "NullTokenizer", vocab_size=96, log=io.StringIO()
    )
    return str(d / "x_text_document")


@pytest.mark.parametrize(
    "extra,line",
    [
        (["--hiden-size", "64"], "unrecognized argument --hiden-size: did you mean --hidden-size?"),
        (
            ["--data-path", "{data}", "--tokenizer-model", "{data}.model"],
            "--tokenizer-model {data}.model: no such file",
        ),
        (
            ["--tokenizer-type", "NullTokenizer", "--data-path", "{data}.bin"],
            "--data-path {data}.bin: give the prefix {data} (without .bin)",
        ),
        (
            ["--tensor-model-parallel-size", "3"],
            "--tensor-model-parallel-size 3 does not divide|--ffn-hidden-size 256 is not divisible",
        ),
        (
            [
                "--tensor-model-parallel-size",
                "4",
                "--num-attention-heads",
                "6",
                "--hidden-size",
                "96",
            ],
            "--num-attention-heads 6 is not divisible",
        ),
        (["--global-batch-size", "6"], "--global-batch-size 6 is not a multiple"),
        (
            ["--cpu-offload", "--optimizer-offload-fraction", "1.5"],
            "--optimizer-offload-fraction must be >= 0 and <= 1, got 1.5",
        ),
        (
            ["--config", "{cfg}", "--hiden-size", "64"],
            "unrecognized argument --hiden-size: did you mean --hidden-size?",
        ),
        (["--config", "{cfg}x"], "--config {cfg}x: No such file or directory"),
    ],
)
def test_bad_input_is_one_line_first_and_once(extra, line, dataset, tmp_path):
    """Under torchrun with 4 ranks a user mistake prints its reason as the first line, once
    (one line per problem, ``|`` above): no usage text, no traceback from any rank
    (torchrun's own summary follows)."""
    cfg = tmp_path / "run.yaml"  # --config: the flags' mistakes are caught next to it too
    cfg.write_text("eval-iters: 1\nlr: 3e-3\n")
    fill = lambda a: a.replace("{data}", dataset).replace("{cfg}", str(cfg))  # noqa: E731
    extra = [fill(a) for a in extra]
    want = ["pretrain_gpt.py: error: " + fill(w) for w in line.split("|")]
    args = [a for a in TINY if a != "--mock-data"] if "--data-path" in extra else TINY
    res = torchrun(4, *args, "--train-iters", "2", *extra, timeout=120)
    assert res.returncode != 0
    lines = res.stderr.splitlines()
    errors = [ln for ln in lines if ln.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == len(want), res.stderr[-3000:]
    assert all(ln.startswith(w) for ln, w in zip(lines, want)), res.stderr[-3000:]
    assert res.stdout == "" and "usage:" not in res.stderr, res.stderr[-3000:]
    assert 'pretrain_gpt.py", line' not in res.stderr  # torchrun's traceback is its own
    assert os.path.join(ROOT, "mp_offload") not in res.stderr, res.stderr[-3000:]


def _losses(path):
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f if '"loss"' in line]


def test_tp2_equals_tp1_and_loss_falls(tmp_path):
    runs = {}
    for tp, nproc in ((1, 2), (2, 4)):  # DP=2 in both
        log = tmp_path / f"tp{tp}.jsonl"
        res = torchrun(
            nproc,
            *TINY,
            "--train-iters",
            "20",
            "--cpu-offload",
            "--tensor-model-parallel-size",
            str(tp),
            "--log-json",
            str(log),
        )
        assert res.returncode == 0, res.stderr[-3000:]
        runs[tp] = _losses(log)
    assert len(runs[1]) == 20
    for i, (a, b) in enumerate(zip(runs[1], runs[2])):
        assert abs(a - b) <= 1e-5 * abs(a), f"iteration {i + 1}: TP=1 {a} vs TP=2 {b}"
    assert runs[2][-1] < runs[2][0] - 0.3, runs[2]  # 20 steps on 2 cores: ~0.5 drop


def test_recompute_with_dropout_matches_exactly(tmp_path):
    """Activation checkpointing under ZeRO-Offload replays dropout with the same RNG."""
    runs = []
    for extra in ([], ["--recompute-activations"]):
        log = tmp_path / f"run{len(runs)}.jsonl"
        # TINY without its "--*-dropout 0" flags: dropout stays on (0.1)
        args = tiny_model_flags(**MODEL, hidden_dropout=None, attention_dropout=None) + RUN
        res = torchrun(
            4,
            *args,
            "--train-iters",
            "5",
            "--cpu-offload",
            "--tensor-model-parallel-size",
            "2",
            "--log-json",
            str(log),
            *extra,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(_losses(log))
    assert runs[0] == runs[1]


LLAMA_FLAGS = [
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--rotary-base",
    "500000",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
]


@pytest.mark.slow
def test_llama_flags_tp2_sequence_parallel_equals_tp1(tmp_path):
    """pretrain_gpt.py with every Llama flag: TP=2 with --sequence-parallel (and a
    checkpoint saved) gives TP=1's losses, and they fall."""
    runs = {}
    for tp, extra in ((1, []), (2, ["--sequence-parallel", "--save", str(tmp_path / "ck")])):
        log = tmp_path / f"tp{tp}.jsonl"
        res = torchrun(
            tp,
            *TINY,
            *LLAMA_FLAGS,
            "--train-iters",
            "20",
            "--cpu-offload",
            "--tensor-model-parallel-size",
            str(tp),
            "--log-json",
            str(log),
            *extra,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        runs[tp] = _losses(log)
    assert len(runs[1]) == 20
    for i, (a, b) in enumerate(zip(runs[1], runs[2])):
        assert abs(a - b) <= 1e-5 * abs(a), f"iteration {i + 1}: TP=1 {a} vs TP=2+SP {b}"
    assert sum(runs[2][-5:]) / 5 < sum(runs[2][:5]) / 5 - 0.2, runs[2]  # 2 samples a step
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.parametrize(
    "flags,line",
    [
        (["--hidden-size", "30"], "--hidden-size 30 is not divisible by --num-attention-heads 4"),
        (["--num-layer", "2"], "did you mean --num-layers?"),
        (["--split", "1,x"], "--split 1,x: part 'x' is not a number"),
        (["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr 0.01 exceeds --lr 0.001"),
    ],
)
def test_a_flag_error_comes_before_torch_is_imported(flags, line):
    """A bad flag costs no torch import (seconds on a quiet machine, a minute on a busy
    one): the import log of the failing process has no torch in it."""
    res = subprocess.run(
        [sys.executable, "-X", "importtime", os.path.join(ROOT, "pretrain_gpt.py")]
        + ["--num-attention-heads", "4", "--mock-data", "--train-iters", "2", *flags],
        capture_output=True, text=True, timeout=HANG_TIMEOUT, cwd=ROOT,
    )  # fmt: skip
    ours = [x for x in res.stderr.splitlines() if not x.startswith("import time:")]
    assert res.returncode == 2 and len(ours) == 1, res.stderr[-3000:]
    assert ours[0].startswith("pretrain_gpt.py: error: ") and line in ours[0], ours
    imported = {x.rsplit("|", 1)[1].strip() for x in res.stderr.splitlines() if "|" in x}
    assert "torch" not in imported and "numpy" not in imported


def test_the_flags_bucket_default_is_the_optimizers():
    """config.schema holds the number without importing the optimizer (torch)."""
    from mp_offload.config.schema import DEFAULT_BUCKET_SIZE
    from mp_offload.optimizer.base import DEFAULT_BUCKET_SIZE as optimizer_default

    assert DEFAULT_BUCKET_SIZE == optimizer_default
