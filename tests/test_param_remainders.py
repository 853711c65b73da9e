"""--store-param-remainders: the host master kept as the bf16 param staging + an int16
remainder. The run is bitwise the run without it (one bf16 rounding rule on the host,
docs/DESIGN.md §7), checkpoints hold the fp32 master either way, and the host master
takes 2 B/element."""

import pytest
import torch
from dist_helpers import ckpt_run, stable_records
from zero_helpers import bf16_offload, host_tensor, state_cat, train

from mp_offload.config import config_problems, parse_args
from mp_offload.ops.cpu_adam import join_fp32

BF16 = torch.bfloat16


def _master(opt) -> torch.Tensor:
    """The host fp32 master, however it is kept."""
    if opt.options.store_param_remainders:
        return join_fp32(host_tensor(opt, "param_staging"), host_tensor(opt, "master"))
    return host_tensor(opt, "master")


CASES = {  # one rank: Adam writes the params in place, or a staging (DPU), ...
    "in place": {},
    "dpu": dict(dpu_warmup_steps=1),
    "fraction 0.5": dict(offload_fraction=0.5),
    "bf16 moments": dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16),
    "k=2 host sum": dict(micro_batches=2),
    "k=2 device sum": dict(micro_batches=2, accumulate_on_device=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_rank_bitwise_with_and_without(case):
    kw = CASES[case]
    k = kw.get("micro_batches", 1)
    (ma, a), (mb, b) = bf16_offload(False, **kw), bf16_offload(True, **kw)
    assert train(ma, a, 4, k=k) == train(mb, b, 4, k=k)
    assert torch.equal(a.flat, b.flat)
    assert torch.equal(host_tensor(a, "master"), _master(b))
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(host_tensor(a, key), host_tensor(b, key))
    assert host_tensor(b, "master").dtype == torch.int16
    assert host_tensor(b, "param_staging").dtype == BF16


def test_host_master_takes_two_bytes_and_the_memory_line_says_so():
    _, a = bf16_offload(False)
    _, b = bf16_offload(True)
    n = a.layout.slice_numel
    ha, hb = a.memory_bytes()["host"], b.memory_bytes()["host"]
    assert ha["master"] == 4 * n and hb["master"] == 2 * n
    assert {k: v for k, v in ha.items() if k != "master"} == {
        k: v for k, v in hb.items() if k != "master"
    }
    assert f"master {2 * n / 2**20:.1f} MiB" in b.memory_report()
    # the device share (F < 1) keeps its fp32 master on the device
    _, c = bf16_offload(True, offload_fraction=0.5)
    rep = c.memory_bytes()
    assert rep["device"]["master"] == 4 * c.placement.share_numel
    assert rep["host"]["master"] == 2 * (n - c.placement.share_numel)


@pytest.mark.parametrize("saved_with", [False, True])
def test_resume_across_the_flag_is_bitwise(saved_with):
    """A state dict holds the fp32 master either way: saved with or without the flag, it
    loads into the other and continues as the unbroken run (at F = 1 and F = 0.5; across
    F it loads too, but the device share's Adam and rounding are its own)."""
    for fraction in (1.0, 0.5):
        mu, unbroken = bf16_offload(False, offload_fraction=fraction)
        want = train(mu, unbroken, 4)
        ms, saver = bf16_offload(saved_with, offload_fraction=fraction)
        train(ms, saver, 2)
        state = saver.state_dict()
        parts = state["master"] if isinstance(state["master"], list) else [state["master"]]
        assert all(t.dtype == torch.float32 for t in parts)
        ml, loader = bf16_offload(not saved_with, offload_fraction=fraction)
        loader.load_state_dict(state)
        assert train(ml, loader, 2, first=2) == want[2:]
        assert torch.equal(loader.flat, unbroken.flat)
        assert torch.equal(state_cat(loader, "master"), state_cat(unbroken, "master"))


def test_the_flag_needs_bf16_and_a_host_share():
    for flags, words in (
        (["--cpu-offload"], "--store-param-remainders needs --bf16"),
        (["--cpu-offload", "--fp16"], "--store-param-remainders needs --bf16"),
        (["--bf16"], "--store-param-remainders needs --cpu-offload"),
        (
            ["--bf16", "--cpu-offload", "--optimizer-offload-fraction", "0"],
            "--store-param-remainders needs --cpu-offload",
        ),
    ):
        args = parse_args(["--train-iters", "1", "--store-param-remainders", *flags])
        problems = config_problems(args, 1)
        assert len(problems) == 1 and problems[0].startswith(words), problems
    for kw in (dict(dtype=torch.float16), dict(dtype=torch.float32), dict(cpu_offload=False)):
        with pytest.raises(ValueError, match="--store-param-remainders needs"):
            bf16_offload(True, **kw)
    args = parse_args(["--train-iters", "1", "--store-param-remainders", "--bf16", "--cpu-offload"])
    assert config_problems(args, 1) == []


# ------------------------------------------------------------ TP=2 x DP=2 runs
VARIANTS = {  # CKPT_RUN: TP=2 x DP=2, two micro-batches per step summed on the host
    "bf16": ["--bf16"],
    "fraction 0.5": ["--bf16", "--optimizer-offload-fraction", "0.5"],
    "device sum": ["--bf16", "--accumulate-grads-on-device"],
    "bf16 moments": ["--bf16", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"],
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_dp2_losses_bitwise_with_and_without(tmp_path, variant):
    flags = VARIANTS[variant]
    for name, extra in (("without", []), ("with", ["--store-param-remainders"])):
        ckpt_run(4, 2, "--log-json", str(tmp_path / f"{name}.jsonl"), *flags, *extra)
    got, want = stable_records(tmp_path / "with.jsonl"), stable_records(tmp_path / "without.jsonl")
    assert len(got) == len(want) > 8  # iterations, evaluations, the test loss
    assert got == want


@pytest.mark.slow
@pytest.mark.parametrize("saved_with", [False, True])
def test_tp2_dp2_resume_across_the_flag(tmp_path, saved_with):
    """Save at iteration 4 with (without) the flag, resume without (with) it: the records
    of iterations 5..8 are the unbroken run's, bit for bit."""
    flag = ["--store-param-remainders"]
    unbroken, log, ck = (str(tmp_path / f) for f in ("unbroken.jsonl", "log.jsonl", "ckpt"))
    ckpt_run(4, 2, "--log-json", unbroken, "--bf16")
    first, second = (flag, []) if saved_with else ([], flag)
    ckpt_run(4, 2, "--bf16", "--save", ck, "--exit-interval", "4", "--log-json", log, *first)
    ckpt_run(4, 2, "--bf16", "--load", ck, "--log-json", log, *second)
    assert stable_records(log, True) == stable_records(unbroken, True)
