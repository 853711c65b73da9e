"""--optimizer-offload-fraction F: the device share of a partially offloaded slice.

F = 0.5 against F = 1 (today's offload) and F = 0 (ZeRO-2 on the device) at TP=2 x DP=2,
plain, with micro-batches and with DPU; F = 1 and F = 0 are today's paths exactly; the
split, the buffers and the traffic; the fused device Adam against the torch restatement;
the planner's choice of F and its buffers against the real ones.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from dist_helpers import pretrain_worker, run_distributed
from helpers import ADAM_HP as HP
from helpers import CKPT_RUN, micro_batches, tiny_gpt_config
from zero_helpers import build_zero, flat_params, live, tiny_zero, tokens, train

from mp_offload import parallel_state as ps
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.optimizer.adam_math import (
    fused_adam_step,
    fused_adamw_available,
    torch_adam_step,
)
from mp_offload.optimizer.options import OptimizerOptions
from mp_offload.optimizer.split import actual_fraction, split_buckets
from mp_offload.planner import (
    EXACT,
    Hardware,
    Run,
    plan_job,
    plan_rank,
    rank_shapes,
    spec_named_params,
)
from mp_offload.planner.fraction import fraction_for, pick_offload_fraction
from mp_offload.tensor_parallel import merge_partitions
from mp_offload.training import train_step

CFG = tiny_gpt_config()
# The multi-step comparisons run without linear biases: the key bias's exact gradient is
# zero (softmax ignores a shift of the keys), so Adam turns its rounding noise into
# lr-sized steps that differ with any change of summation order (measured: 1.8e-4 of the
# tensor's largest element there, below 1.5e-6 everywhere else).
NO_BIAS = tiny_gpt_config(disable_bias_linear=True)
GBS = 8


def _batch(step):
    t = tokens(step, GBS)
    return t[:, :-1], t[:, 1:]


def test_split_rounds_to_the_nearest_bucket_boundary():
    # The device keeps the last buckets (their gradients arrive last in backward): counted
    # from the end, the kept share can be 0, 500, 600, 900 or 1000 of 1000.
    chunks = [100, 300, 100, 500]
    assert split_buckets(chunks, 1.0) == 0 and split_buckets(chunks, 0.0) == 4
    assert split_buckets(chunks, 0.5) == 1  # 1-F = 500: a boundary exactly
    assert split_buckets(chunks, 0.3) == 2  # 700 -> 600 (nearer than 900)
    assert split_buckets(chunks, 0.25) == 2  # 750: between 600 and 900, a tie -> the host
    assert split_buckets(chunks, 0.2) == 3
    assert actual_fraction(chunks, 2) == pytest.approx(0.4)
    for j in range(5):  # the planner's F for a boundary rounds back to it
        assert split_buckets(chunks, fraction_for(chunks, j)) == j
    with pytest.raises(ValueError, match="--optimizer-offload-fraction"):
        split_buckets(chunks, 1.5)


def test_fraction_one_is_todays_offload_and_zero_is_zero2():
    """Bitwise: F = 1 builds no device share; F = 0 is offload off, buffers and all."""
    base = tiny_zero()
    one = tiny_zero(offload_fraction=1.0)
    assert one[1].device_side is None and one[1].memory_bytes() == base[1].memory_bytes()
    assert train(*base, 4) == train(*one, 4)
    assert torch.equal(flat_params(base[0]), flat_params(one[0]))
    off = tiny_zero(cpu_offload=False)
    zero = tiny_zero(offload_fraction=0.0)
    assert not zero[1].placement.offloaded and zero[1].host_side is None
    assert zero[1].memory_bytes() == off[1].memory_bytes()
    assert train(*off, 4) == train(*zero, 4)
    assert torch.equal(flat_params(off[0]), flat_params(zero[0]))


def test_device_share_holds_the_last_buckets_and_only_the_rest_crosses():
    """The device keeps the buckets whose gradients arrive last in backward (the end of
    the slice): the first ones' host step hides behind the rest of backward."""
    model, opt = tiny_zero(offload_fraction=0.5, dtype=torch.bfloat16)
    n, split = opt.layout.slice_numel, opt.placement.share_numel
    kept = opt.placement.device_buckets
    assert 0 < kept < len(opt.layout.buckets)
    assert split == sum(b.chunk for b in opt.layout.buckets[-kept:])
    assert opt.device_side.offset == n - split and opt.host_side.offset == 0
    assert opt.placement.actual_offload_fraction == pytest.approx(1 - split / n)
    assert (
        abs(opt.placement.actual_offload_fraction - 0.5)
        < max(b.chunk for b in opt.layout.buckets) / n
    )
    rep = opt.memory_bytes()
    assert {k: rep["device"][k] for k in ("master", "exp_avg", "exp_avg_sq", "grads")} == {
        k: 4 * split for k in ("master", "exp_avg", "exp_avg_sq", "grads")
    }
    assert rep["host"]["master"] == 4 * (n - split)
    assert rep["host"]["staging"] == 2 * (n - split) * 2  # bf16 params up, grads down
    # The checkpoint holds the live parts in slice order (host part, device share): no copy.
    state = opt.state_dict()
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert state[key][1] is getattr(opt.device_side, key)
        assert state[key][0] is live(opt).form(key).saved()
    losses = train(model, opt, 2)
    assert losses[1] < losses[0]
    # Traffic: 2 B down and 2 B up per host-part element, none for the device share.
    moved = opt.stats()["host_device_bytes_per_param"]
    assert moved == pytest.approx(4.0 * (n - split) / n)
    assert "offload fraction" in opt.memory_report()


@pytest.mark.skipif(not fused_adamw_available("cpu"), reason="torch has no CPU fused AdamW")
def test_fused_device_adam_equals_the_torch_restatement():
    """The share's fused AdamW (the CUDA code path, run here on the CPU) against
    adam_math.torch_adam_step over the same runs: decay on some, clipping scale, 5 steps."""
    torch.manual_seed(0)
    runs = [(0, 300, True), (300, 310, False), (310, 1000, True), (1000, 1024, False)]
    p0 = torch.randn(1024)
    share = {k: torch.zeros(1024) for k in ("master", "exp_avg", "exp_avg_sq")}
    share["master"].copy_(p0)
    p, m, v = p0.clone(), torch.zeros(1024), torch.zeros(1024)
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    decay = [(a, z) for a, z, d in runs if d]
    for step in range(1, 6):
        g = torch.randn(1024)
        fused_adam_step(share["master"], g.clone(), share["exp_avg"], share["exp_avg_sq"],
                        step=step, grad_scale=0.25, decay_runs=decay, **hp)  # fmt: skip
        torch_adam_step(p, g, m, v, step=step, grad_scale=0.25, decay_runs=decay, **hp)
    assert (share["master"] - p).abs().max() < 1e-6
    share = type("Share", (), share)
    assert (share.exp_avg - m).abs().max() < 1e-6 and (share.exp_avg_sq - v).abs().max() < 1e-6


def test_fp16_overflow_skips_both_parts():
    scale = dict(initial=2.0**120, min=1.0, window=1000, hysteresis=1)
    model, opt = tiny_zero(offload_fraction=0.5, dtype=torch.float16, loss_scale=scale)
    before = (opt.device_side.master.clone(), live(opt).master.clone())
    x, y = _batch(0)
    opt.zero_grad()
    opt.backward(model(x, y).mean())
    assert opt.step(HP["lr"]).skipped
    assert torch.equal(opt.device_side.master, before[0])
    assert torch.equal(live(opt).master, before[1])


# ------------------------------------------------------- TP=2 x DP=2, several steps
def _ours(steps, fraction, *, micro=None, dpu=None):
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = GBS // dp
    micro = micro or per_rank
    torch.manual_seed(42)
    model = GPTModel(GPTConfig(**NO_BIAS))
    opt = build_zero(
        model,
        **HP,
        dp=ps.get_data_parallel_group(),
        tp=ps.get_tensor_model_parallel_group(),
        device="cpu",
        cpu_offload=True,
        bucket_size=500,
        dpu_warmup_steps=dpu,
        micro_batches=per_rank // micro,
        offload_fraction=fraction,
    )
    losses, norms = [], []
    for step in range(steps):
        rows = tokens(step, GBS)[dp_rank * per_rank :][:per_rank]
        out = train_step(
            model, opt, micro_batches(rows, micro), per_rank // micro, HP["lr"],
            ps.get_data_parallel_group(), torch.device("cpu"),
        )  # fmt: skip
        norms.append(out.result.grad_norm)
        losses.append(out.loss)
    opt.flush()
    return losses, norms, _merged(model), opt


def _merged(model):
    group = ps.get_tensor_model_parallel_group()
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if p.tensor_model_parallel:
            parts = [torch.empty_like(t) for _ in range(group.size)]
            dist.all_gather(parts, t.contiguous(), group=group.torch_group())
            t = merge_partitions(parts, p.partition_dim, p.partition_stride)
        out[name] = t
    return out


def _close(a, b, what):
    for i, (x, y) in enumerate(zip(a[0], b[0])):
        assert abs(x - y) <= 1e-5 * abs(y), f"{what}: step {i} loss {x} vs {y}"
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        assert abs(x - y) <= 1e-5 * y, f"{what}: step {i} grad norm {x} vs {y}"
    for name in a[2]:
        err = float((a[2][name] - b[2][name]).abs().max() / b[2][name].abs().max())
        assert err <= 1e-5, f"{what}: {name} differs by {err:.2e} of its largest element"


def _fractions_worker(rank, world):
    ps.initialize_model_parallel(2)  # TP=2 x DP=2
    steps = 6
    half, one, zero = (_ours(steps, f) for f in (0.5, 1.0, 0.0))
    opt = half[3]
    assert 0 < opt.placement.device_buckets < len(opt.layout.buckets), "F=0.5 must split the slice"
    assert one[3].device_side is None and zero[3].host_side is None
    assert half[1][0] > HP["clip_grad"], "the test must exercise clipping"
    assert half[0][-1] < half[0][0]
    _close(half, one, "F=0.5 vs F=1")
    _close(half, zero, "F=0.5 vs F=0")
    # Micro-batches summed in the share's fp32 gradient; DPU delays the share's publish too.
    _close(_ours(4, 0.5, micro=1), _ours(4, 1.0, micro=1), "k=4: F=0.5 vs F=1")
    dpu_half, dpu_one = _ours(steps, 0.5, dpu=2), _ours(steps, 1.0, dpu=2)
    _close(dpu_half, dpu_one, "DPU: F=0.5 vs F=1")
    assert dpu_one[0][3] != one[0][3], "DPU must run on one-step-stale parameters"


@pytest.mark.slow
def test_tp2_dp2_fraction_half_equals_one_and_zero_fp32():
    run_distributed(_fractions_worker, 4)


@pytest.mark.cuda
def test_cuda_device_share_runs_fused_beside_the_cpu_adam():
    """On a GPU: the share is on the device and steps with the fused kernel; F=0.5 tracks
    F=1 in fp32 within 1e-5 (bf16 params: the publish rounds both sides alike)."""

    def run(fraction, dtype):
        torch.manual_seed(0)
        model = GPTModel(GPTConfig(**NO_BIAS), tp_group=ps.ParallelGroup.single())
        opt = build_zero(
            model,
            **HP,
            dp=ps.ParallelGroup.single(),
            tp=ps.ParallelGroup.single(),
            device="cuda",
            dtype=dtype,
            cpu_offload=True,
            bucket_size=2000,
            offload_fraction=fraction,
        )
        losses = []
        for step in range(4):
            x, y = (t.cuda() for t in _batch(step))
            opt.zero_grad()
            loss = model(x, y).mean()
            opt.backward(loss)
            opt.step(HP["lr"])
            losses.append(loss.item())
        opt.flush()
        return losses, opt

    half, opt = run(0.5, torch.float32)
    assert opt.device_side.adam is fused_adam_step and opt.device_side.master.is_cuda
    assert not live(opt).master.is_cuda
    one, _ = run(1.0, torch.float32)
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(half, one)), (half, one)
    low, _ = run(0.5, torch.bfloat16)
    assert low[-1] < low[0]


# ------------------------------------------------------------------ the planner
def test_plan_equals_real_buffers_with_a_device_share():
    cfg = GPTConfig(**CFG)
    for dtype, k, dpu in (
        (torch.bfloat16, 1, False),
        (torch.float32, 2, False),
        (torch.bfloat16, 1, True),
    ):
        model, opt = tiny_zero(
            offload_fraction=0.5, dtype=dtype, bucket_size=3000, micro_batches=k,
            dpu_warmup_steps=0 if dpu else None,
        )  # fmt: skip
        assert opt.device_side is not None
        real = opt.memory_bytes()
        options = OptimizerOptions(
            dtype=dtype,
            bucket_size=3000,
            micro_batches=k,
            dpu_warmup_steps=0 if dpu else None,
            offload_fraction=0.5,
        )
        run = Run(cfg, mode="offload", options=options, cuda=False)
        shapes = rank_shapes(spec_named_params(cfg, 1), 1, 3000)
        device, host, _ = plan_rank(run, shapes, Hardware())
        assert {k2: v for k2, v in host.items() if k2 in EXACT} == real["host"]
        planned = {k2: v for k2, v in device.items() if k2 in EXACT and k2 != "grad_buckets"}
        assert planned == {k2: v for k2, v in real["device"].items() if k2 != "grad_buckets"}


def test_planner_picks_the_largest_device_share_that_fits():
    """A 1.3B-class GPT on one 24 GiB device: all of the state does not fit there, none of
    it is not needed; the picked F fits and one more bucket on the device does not."""
    cfg = GPTConfig(
        num_layers=24,
        hidden_size=2048,
        num_attention_heads=16,
        seq_length=1024,
        vocab_size=50257,
        recompute_activations=True,
    )
    hw = Hardware(device_memory_gb=24, host_memory_gb=256, devices_per_node=1)
    run = Run(cfg, micro_batch=1).with_options(bucket_size=20_000_000)
    f, plan = pick_offload_fraction(run, hw)
    assert 0 < f < 1 and plan.fits and plan.run.options.offload_fraction == f
    chunks = plan.ranks[0].shapes.chunks
    j = split_buckets(chunks, f)
    more = plan_job(run.at_fraction(fraction_for(chunks, j + 1)), hw)
    assert not more.fits_device
    assert plan_job(run.at_fraction(1.0), hw).device_peak < plan.device_peak <= 24 * 2**30
    assert not plan_job(dataclasses.replace(run, mode="zero2"), hw).fits_device


def test_plan_cli_prints_the_fraction_it_would_use(capsys):
    from mp_offload.plan import main

    argv = ["--model", "llama3-8b", "--device-memory-gb", "141", "--adam-rate-per-core", "8e7"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("offload fraction:"))
    f = float(line.split("--optimizer-offload-fraction ")[1].split()[0])
    assert 0 < f < 1
    assert f"--cpu-offload --optimizer-offload-fraction {f:g}" in out  # in the launch command
    assert "beside device Adam" in out  # the throughput model's gain line
    import json

    assert main([*argv, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["offload_fraction"] == f and rec["fits"]
    assert rec["device"]["master"] > 0 and rec["host"]["master"] > 0


# ------------------------------------------------------------------ checkpoints


def _run(world, tp, fraction, *extra):
    run_distributed(
        pretrain_worker,
        world,
        [
            *CKPT_RUN,
            "--tensor-model-parallel-size",
            str(tp),
            "--optimizer-offload-fraction",
            fraction,
            *extra,
        ],
    )


def _records(path):
    """The numbers of each record that must continue: losses, grad norms, lr."""
    import json

    keep = ("iteration", "loss", "grad_norm", "lr", "valid_loss", "test_loss")
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if k in keep} for line in f]


@pytest.mark.slow
def test_checkpoint_saved_at_one_fraction_loads_at_another(tmp_path, capfd):
    """Saved at F=0.5 (TP=2 x DP=2): resumed at F=0.5 bitwise like the unbroken run, at
    F=1 and F=0 within 1e-5 (another Adam updates the device share), resharded to TP=1 x
    DP=2 within 1e-4 (reduction order, as for any reshard)."""
    import os

    from mp_offload.checkpoint import FullTensors, read_latest
    from mp_offload.checkpoint.on_disk import iter_dir, model_file, optim_file

    unbroken, ck = str(tmp_path / "unbroken.jsonl"), str(tmp_path / "ckpt")
    _run(4, 2, "0.5", "--log-json", unbroken)
    report = [ln for ln in capfd.readouterr().out.splitlines() if "offload fraction" in ln]
    actual = float(report[0].split("offload fraction ")[1].split()[0])
    assert 0 < actual < 1, report[0]  # the slice really is split
    _run(4, 2, "0.5", "--save", ck, "--exit-interval", "4")
    assert read_latest(ck) == 4
    shard = torch.load(os.path.join(iter_dir(ck, 4), optim_file(1, 1)), weights_only=True)
    assert set(shard) == {
        "master",
        "exp_avg",
        "exp_avg_sq",
        "step",
        "scaler",
        "layout",
        "rng",
        "param_steps",
    }
    # The parts as the run held them (device share, host part), read back on the CPU.
    assert [p.device.type for p in shard["master"]] == ["cpu", "cpu"]
    assert sum(p.numel() for p in shard["master"]) == shard["layout"]["host_numel"]
    # fp32: the offline reader's merged master is the saved weights (device share included)
    full = FullTensors(iter_dir(ck, 4))
    w0 = torch.load(os.path.join(iter_dir(ck, 4), model_file(0)), weights_only=True)
    assert torch.equal(full.get("ln_f.weight"), w0["ln_f.weight"])
    want = [r for r in _records(unbroken) if r["iteration"] > 4]
    for fraction, world, tp, tol in (
        ("0.5", 4, 2, 0.0),
        ("1", 4, 2, 1e-5),
        ("0", 4, 2, 1e-5),
        ("0.5", 2, 1, 1e-4),
    ):
        log = str(tmp_path / f"resumed_{fraction}_{tp}.jsonl")
        _run(world, tp, fraction, "--load", ck, "--log-json", log)
        got = _records(log)
        assert [sorted(r) for r in got] == [sorted(r) for r in want]
        assert [r["iteration"] for r in got if "loss" in r] == [5, 6, 7, 8]
        for r, w in zip(got, want):
            for key in r:
                assert abs(r[key] - w[key]) <= tol * abs(w[key]), (fraction, tp, key, r, w)


@pytest.mark.parametrize(
    "flags,note",
    [
        ([], ""),
        (["--cpu-offload"], " (cpu offload)"),
        (["--cpu-offload", "--optimizer-offload-fraction", "1"], " (cpu offload)"),
        (
            ["--cpu-offload", "--optimizer-offload-fraction", "0.5"],
            " (cpu offload of 0.5 of the optimizer state)",
        ),
        (
            ["--cpu-offload", "--optimizer-offload-fraction", "0"],
            " (offload fraction 0: all optimizer state on the device, ZeRO-2)",
        ),
    ],
)
def test_the_start_up_line_says_where_the_optimizer_state_lives(flags, note):
    from mp_offload.config import parse_args
    from mp_offload.training import offload_note

    assert offload_note(parse_args(["--mock-data", *flags]).optim) == note
