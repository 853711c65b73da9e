"""Checkpoints: exact resume and resharding (TP x DP, dtypes, Llama with sequence
parallelism, torch-adamw), and resuming from an iteration directory. Crash-safe saves,
damaged checkpoints and the guards around them: test_checkpoint_guards.py."""

import os

import pytest
import torch
from dist_helpers import ckpt_run, log_losses, log_records, pretrain_worker, run_distributed
from helpers import CKPT_RUN

from mp_offload.checkpoint import (
    read_latest,
)

pytestmark = pytest.mark.slow  # every test here spawns ranks


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """8 iterations at TP=2 x DP=2 without a break, fp32 and bf16."""
    d = tmp_path_factory.mktemp("unbroken")
    for dtype in DTYPE_FLAGS:
        ckpt_run(4, 2, "--log-json", str(d / f"{dtype}.jsonl"), *DTYPE_FLAGS[dtype])
    return d


# bf16-moments: Adam's moments stored in bf16 (and in the checkpoint, in their dtype)
DTYPE_FLAGS = {
    "fp32": [],
    "bf16": ["--bf16"],
    "bf16-moments": ["--bf16", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"],
}


@pytest.mark.parametrize("dtype", list(DTYPE_FLAGS))
def test_exact_resume_tp2_dp2_offload(unbroken, tmp_path, dtype):
    flags = DTYPE_FLAGS[dtype]
    log = str(tmp_path / "log.jsonl")
    ck = str(tmp_path / "ckpt")
    ckpt_run(4, 2, "--save", ck, "--exit-interval", "4", "--log-json", log, *flags)
    assert read_latest(ck) == 4
    ckpt_run(4, 2, "--load", ck, "--save", ck, "--log-json", log, *flags)
    if dtype == "bf16-moments":  # stored in their own dtype, not widened
        from mp_offload.checkpoint.on_disk import iter_dir, optim_file

        shard = torch.load(os.path.join(iter_dir(ck, 8), optim_file(1, 1)), weights_only=True)
        assert shard["exp_avg"].dtype == shard["exp_avg_sq"].dtype == torch.bfloat16
        assert shard["master"].dtype == torch.float32
    # Bitwise: losses, grad norms, lr and validation losses, iteration by iteration.
    drop = (
        "elapsed_ms",
        "optimizer_ms",
        "device_tail_ms",
        "tokens_per_sec",
        "tflops_per_device",
        "peak_device_gb",
        "peak_host_gb",
        "host_device_bytes_per_param",
    )

    def clean(rs):
        return [
            {k: v for k, v in r.items() if k not in drop and not k.startswith("phase_")} for r in rs
        ]

    got, want = clean(log_records(log)), clean(log_records(unbroken / f"{dtype}.jsonl"))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a == b, (a, b)


@pytest.mark.parametrize(
    "save_layout,load_layout", [((2, 4), (1, 4)), ((2, 4), (1, 1)), ((1, 2), (2, 2))]
)
def test_reshard_continues_like_unbroken(unbroken, tmp_path, save_layout, load_layout):
    """(TP, world): (2,2)->(1,4), (2,2)->(1,1), (1,2)->(2,1)."""
    (tp_a, w_a), (tp_b, w_b) = save_layout, load_layout
    ck = str(tmp_path / "ckpt")
    ckpt_run(w_a, tp_a, "--save", ck, "--exit-interval", "4")
    log = str(tmp_path / "log.jsonl")
    ckpt_run(w_b, tp_b, "--load", ck, "--log-json", log)
    want, got = log_losses(unbroken / "fp32.jsonl"), log_losses(log)
    assert sorted(got) == [5, 6, 7, 8]
    for it in got:  # fp32; only reduction order differs between layouts
        assert abs(got[it] - want[it]) <= 1e-4 * want[it], (it, got[it], want[it])


# Every Llama option on (two K/V groups: split over TP=2, whole at TP=1).
LLAMA = [
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
    "--ffn-hidden-size",
    "48",
]
_TIMING = (
    "elapsed_ms",
    "optimizer_ms",
    "device_tail_ms",
    "tokens_per_sec",
    "tflops_per_device",
    "peak_device_gb",
    "peak_host_gb",
    "host_device_bytes_per_param",
)


def _clean(rs):
    # phase_*_ms: the per-phase timers (mp_offload/runtime/phase_timer.py)
    return [
        {k: v for k, v in r.items() if k not in _TIMING and not k.startswith("phase_")} for r in rs
    ]


def test_llama_exact_resume_and_reshard_across_sequence_parallel(tmp_path):
    """A Llama at (TP, DP) = (2, 2) with --sequence-parallel: resumed at the same layout
    it repeats the unbroken run bitwise; resumed at (1, 4) (no sequence parallelism
    there) and saved at (1, 4) then resumed at (2, 2) with it, it continues like the
    unbroken run (fp32; only reduction order differs between layouts)."""
    sp = ["--sequence-parallel"]
    logs = {k: str(tmp_path / f"{k}.jsonl") for k in ("unbroken", "resumed", "to14", "to22")}
    cks = {k: str(tmp_path / k) for k in ("sp22", "plain14")}
    ckpt_run(4, 2, *LLAMA, *sp, "--log-json", logs["unbroken"])
    ckpt_run(
        4,
        2,
        *LLAMA,
        *sp,
        "--save",
        cks["sp22"],
        "--exit-interval",
        "4",
        "--log-json",
        logs["resumed"],
    )
    ckpt_run(4, 2, *LLAMA, *sp, "--load", cks["sp22"], "--log-json", logs["resumed"])
    got, want = _clean(log_records(logs["resumed"])), _clean(log_records(logs["unbroken"]))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a == b, (a, b)
    ckpt_run(4, 1, *LLAMA, "--load", cks["sp22"], "--log-json", logs["to14"])
    ckpt_run(4, 1, *LLAMA, "--save", cks["plain14"], "--exit-interval", "4")
    ckpt_run(4, 2, *LLAMA, *sp, "--load", cks["plain14"], "--log-json", logs["to22"])
    want = log_losses(logs["unbroken"])
    for name in ("to14", "to22"):
        got = log_losses(logs[name])
        assert sorted(got) == [5, 6, 7, 8], name
        for it in got:
            assert abs(got[it] - want[it]) <= 1e-4 * want[it], (name, it, got[it], want[it])


def test_torch_adamw_resumes_exactly(tmp_path):
    """The unpartitioned reference optimizer (TP=1, DP=2) resumes bitwise too."""
    argv = [a for a in CKPT_RUN if a != "--cpu-offload"] + ["--optimizer", "torch-adamw"]
    logs = {k: str(tmp_path / f"{k}.jsonl") for k in ("unbroken", "resumed")}
    ck = str(tmp_path / "ckpt")
    run_distributed(pretrain_worker, 2, argv + ["--log-json", logs["unbroken"]])
    run_distributed(
        pretrain_worker,
        2,
        argv + ["--save", ck, "--exit-interval", "4", "--log-json", logs["resumed"]],
    )
    run_distributed(pretrain_worker, 2, argv + ["--load", ck, "--log-json", logs["resumed"]])
    got, want = log_losses(logs["resumed"]), log_losses(logs["unbroken"])
    assert sorted(got) == list(range(1, 9))
    assert got == want


def test_resume_from_an_iteration_directory(tmp_path):
    """--load <root>/iter_0000004 continues from that iteration; into the same root only
    with --override-existing-checkpoints (iteration 8 is rewritten)."""
    ck = str(tmp_path / "ck")
    first, again = str(tmp_path / "first.jsonl"), str(tmp_path / "again.jsonl")
    ckpt_run(1, 1, "--save", ck, "--save-interval", "4", "--log-json", first)
    # (config.yaml: the run's resolved configuration, written once the run has started)
    assert sorted(os.listdir(ck)) == [
        "config.yaml",
        "iter_0000004",
        "iter_0000008",
        "latest_checkpointed_iteration.txt",
    ]
    ckpt_run(
        1,
        1,
        "--load",
        os.path.join(ck, "iter_0000004"),
        "--save",
        ck,
        "--override-existing-checkpoints",
        "--log-json",
        again,
    )
    got, want = log_losses(again), log_losses(first)
    assert sorted(got) == [5, 6, 7, 8]
    assert all(got[i] == want[i] for i in got), (got, want)
    assert read_latest(ck) == 8
