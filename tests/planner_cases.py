"""Model shapes and settings the planner tests share (tests/test_planner_*.py)."""

from helpers import tiny_gpt_config

SMALL = tiny_gpt_config(
    num_layers=3, hidden_size=64, seq_length=32, vocab_size=200, make_vocab_size_divisible_by=None
)
HP = dict(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8, clip_grad=1.0)
BUCKETS = (1000, 12000)
TEN_B = [
    "--num-layers",
    "50",
    "--hidden-size",
    "4096",
    "--num-attention-heads",
    "32",
    "--seq-length",
    "1024",
    "--vocab-size",
    "50257",
    "--bf16",
    "--cpu-offload",
    "--recompute-activations",
    "--micro-batch-size",
    "4",
]


RATE = ["--adam-rate-per-core", "8e7"]  # the rate the tests' own counts use


def plan_out(capsys, monkeypatch, *argv):
    from mp_offload.plan import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main([*RATE, *argv])
    return code, capsys.readouterr().out
