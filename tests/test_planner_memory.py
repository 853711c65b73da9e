"""planner/memory.py: the per-rank plan against the real buffers, the modes' formulas,
and the device reserve."""

import dataclasses

import pytest
import torch
from dist_helpers import run_distributed
from planner_cases import BUCKETS, HP, SMALL, TEN_B

from mp_offload import parallel_state as ps
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.optimizer.options import OptimizerOptions
from mp_offload.optimizer.zero import ZeroOptimizer
from mp_offload.planner import (
    EXACT,
    GiB,
    Hardware,
    Run,
    meta_named_params,
    plan_job,
    plan_rank,
    rank_shapes,
    spec_named_params,
)


def _one_step(opt, model, dp_rank=0, dp=1):
    torch.manual_seed(7)
    x = torch.randint(0, SMALL["vocab_size"], (2 * dp, SMALL["seq_length"] + 1))[dp_rank::dp]
    opt.zero_grad()
    opt.backward(model(x[:, :-1], x[:, 1:]).mean())
    opt.step(1e-3)
    opt.flush()


def _check_against_optimizer(opt, cfg, tp, dp, tp_rank, bucket, offload, dpu, dtype):
    """Every exact category of the plan equals ZeroOptimizer.memory_bytes()."""
    real = opt.memory_bytes()
    # The planner's default count of gradient bucket buffers must be what the optimizer made.
    options = OptimizerOptions(
        dtype=dtype, cpu_offload=offload, bucket_size=bucket, dpu_warmup_steps=0 if dpu else None
    )
    mode = "offload" if offload else "zero2"
    run = Run(cfg, tp=tp, dp=dp, mode=mode, options=options, cuda=False)
    for source in ("meta", "spec"):
        named = (
            meta_named_params(cfg, tp, tp_rank) if source == "meta" else spec_named_params(cfg, tp)
        )
        shapes = rank_shapes(named, dp, bucket, tp_rank=tp_rank)
        assert shapes.flat_numel == opt.flat.numel()
        assert shapes.slice_numel == opt.layout.slice_numel == opt.master.numel()
        assert shapes.max_bucket == opt.reducer.max_bucket
        device, host, _ = plan_rank(run, shapes, Hardware())
        for place, plan in (("device", device), ("host", host)):
            exact = {k: v for k, v in plan.items() if k in EXACT}
            assert exact == real[place], (source, place, exact, real[place])


@pytest.mark.parametrize("bucket", BUCKETS)
def test_plan_equals_real_buffers_tp1_dp1(bucket):
    cfg = GPTConfig(**SMALL)
    for offload, dpu, dtype in (
        (True, False, torch.bfloat16),
        (False, False, torch.bfloat16),
        (True, True, torch.bfloat16),
        (True, False, torch.float32),
    ):
        torch.manual_seed(0)
        model = GPTModel(cfg, tp_group=ps.ParallelGroup.single())
        opt = ZeroOptimizer(
            model,
            **HP,
            dp=ps.ParallelGroup.single(),
            tp=ps.ParallelGroup.single(),
            device="cpu",
            dtype=dtype,
            cpu_offload=offload,
            bucket_size=bucket,
            dpu_warmup_steps=0 if dpu else None,
        )
        _one_step(opt, model)
        _check_against_optimizer(opt, cfg, 1, 1, 0, bucket, offload, dpu, dtype)
    # bf16 and 8-bit moments, remainders, gradient accumulation on the host or the device
    for k, on_device, m, rem in (
        (1, False, (2, 2), False),
        (4, False, (4, 2), False),
        (4, True, (2, 4), False),
        (1, False, (1, 1), True),
        (4, False, (4, 1), True),
        (4, True, (1, 2), False),
    ):
        torch.manual_seed(0)
        model = GPTModel(cfg, tp_group=ps.ParallelGroup.single())
        mdt = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}
        opt = ZeroOptimizer(
            model,
            **HP,
            dp=ps.ParallelGroup.single(),
            tp=ps.ParallelGroup.single(),
            device="cpu",
            dtype=torch.bfloat16,
            cpu_offload=True,
            bucket_size=bucket,
            micro_batches=k,
            accumulate_on_device=on_device,
            exp_avg_dtype=mdt[m[0]],
            exp_avg_sq_dtype=mdt[m[1]],
            store_param_remainders=rem,
        )
        real = opt.memory_bytes()
        options = OptimizerOptions(
            dtype=torch.bfloat16,
            bucket_size=bucket,
            micro_batches=k,
            accumulate_on_device=on_device,
            exp_avg_dtype=mdt[m[0]],
            exp_avg_sq_dtype=mdt[m[1]],
            store_param_remainders=rem,
        )
        run = Run(cfg, mode="offload", options=options, cuda=False)
        shapes = rank_shapes(spec_named_params(cfg, 1), 1, bucket)
        device, host, _ = plan_rank(run, shapes, Hardware())
        assert {k2: v for k2, v in host.items() if k2 in EXACT} == real["host"]
        planned = {k2: v for k2, v in device.items() if k2 in EXACT}
        assert {k2: v for k2, v in planned.items() if k2 != "grad_buckets"} == {
            k2: v for k2, v in real["device"].items() if k2 != "grad_buckets"
        }


def _tp2_dp2_worker(rank, world):
    ps.initialize_model_parallel(2)
    cfg = GPTConfig(**SMALL)
    tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    for bucket in BUCKETS:
        torch.manual_seed(0)
        model = GPTModel(cfg)
        opt = ZeroOptimizer(
            model,
            **HP,
            dp=ps.get_data_parallel_group(),
            tp=ps.get_tensor_model_parallel_group(),
            device="cpu",
            dtype=torch.bfloat16,
            cpu_offload=True,
            bucket_size=bucket,
        )
        _one_step(opt, model, dp_rank, 2)
        _check_against_optimizer(opt, cfg, 2, 2, tp_rank, bucket, True, False, torch.bfloat16)


@pytest.mark.slow
def test_plan_equals_real_buffers_tp2_dp2():
    run_distributed(_tp2_dp2_worker, 4)


def test_host_falls_as_one_over_tp_dp_and_device_params_as_one_over_tp():
    # Vocabulary a multiple of 128*8, so padding does not change with TP.
    cfg = GPTConfig(
        num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=50176
    )
    base = plan_job(Run(cfg, mode="offload"), Hardware()).ranks[0]
    for tp in (1, 2, 4, 8):
        for dp in (1, 2, 4, 8):
            rp = plan_job(Run(cfg, tp=tp, dp=dp, mode="offload"), Hardware()).ranks[0]
            s = rp.shapes
            assert s.sharded * tp == base.shapes.sharded  # exactly 1/TP ...
            assert s.replicated == base.shapes.replicated  # ... beyond the replicated params
            padding = s.num_buckets * dp * 64  # FlatLayout pads each bucket to dp*ALIGN
            assert 0 <= s.flat_numel - s.params < padding
            assert rp.device["params"] == 2 * s.flat_numel
            # host state: 12 bytes per element of a 1/(TP*DP) slice at one micro-batch (Adam
            # reads the bf16 gradients as they came down), 16 with an fp32 gradient sum for
            # gradient accumulation; the replicated params are held by each TP rank's DP
            # group, so they divide by DP only
            per_elem = base.shapes.sharded / (tp * dp) + base.shapes.replicated / dp
            state = sum(rp.host[k] for k in ("master", "exp_avg", "exp_avg_sq", "grads"))
            assert 0 <= state - 12 * per_elem <= 12 * padding / dp, (tp, dp)
            acc = plan_job(
                Run(cfg, tp=tp, dp=dp, mode="offload").with_options(micro_batches=4), Hardware()
            ).ranks[0]
            state = sum(acc.host[k] for k in ("master", "exp_avg", "exp_avg_sq", "grads"))
            assert 0 <= state - 16 * per_elem <= 16 * padding / dp, (tp, dp)


def test_modes_follow_the_design_formulas():
    cfg = GPTConfig(num_layers=4, hidden_size=512, num_attention_heads=8, vocab_size=32768)
    hw = Hardware()
    for tp, dp in ((1, 1), (2, 4)):
        plans = {
            m: plan_job(Run(cfg, tp=tp, dp=dp, mode=m), hw).ranks[0]
            for m in ("offload", "zero2", "pytorch")
        }
        s = plans["offload"].shapes
        assert (
            plans["pytorch"].device["params"]
            + plans["pytorch"].device["grads"]
            + sum(plans["pytorch"].device[k] for k in ("master", "exp_avg", "exp_avg_sq"))
            == 16 * s.params
        )
        z = plans["zero2"].device
        assert z["master"] + z["exp_avg"] + z["exp_avg_sq"] + z["grads"] == 16 * s.slice_numel
        assert "master" not in plans["offload"].device
        assert plans["offload"].host["staging"] == 4 * s.slice_numel  # 2 up + 2 down (CUDA)


def test_device_reserve_keeps_the_10b_plan_off_the_last_gib(capsys):
    """10B on the lent H200 (139 GiB, 128 GiB host): the picked offload fraction leaves the
    default reserve (the larger of 5% and 2 GiB) free, the plan says so; the flag sets it,
    and 0 gives back the old fill (99.7%)."""
    from mp_offload.plan import main
    from mp_offload.planner.fraction import pick_offload_fraction
    from mp_offload.planner.search import paper_base

    cfg = dataclasses.replace(
        paper_base(), num_layers=50, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=16384
    )
    run = Run(cfg, mode="offload", micro_batch=4)
    hw = Hardware(device_memory_gb=139, host_memory_gb=128, devices_per_node=1)
    assert hw.device_reserve_gb == pytest.approx(0.05 * 139)
    assert Hardware(device_memory_gb=32).device_reserve_gb == 2.0
    f, plan = pick_offload_fraction(run, hw)
    assert 0 < f < 1 and plan.fits
    assert plan.device_peak <= 0.95 * 139 * GiB
    full = dataclasses.replace(hw, device_memory_reserve_gb=0.0)
    assert pick_offload_fraction(run, full)[1].device_peak > 0.99 * 139 * GiB
    argv = [*TEN_B, "--device-memory-gb", "139", "--host-memory-gb", "128"]
    assert main([*argv, "--devices-per-node", "1"]) == 0
    out = capsys.readouterr().out
    assert "(132.1 usable, 7.0 GiB reserve) -> fits" in out, out
    assert main([*argv, "--devices-per-node", "1", "--device-memory-reserve-gb", "20"]) == 0
    assert "(119.0 usable, 20.0 GiB reserve)" in capsys.readouterr().out
