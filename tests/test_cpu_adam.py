"""Fused CPU Adam (mp_offload.ops.cpu_adam) against torch, on every SIMD path: bit
for bit against the op-by-op restatement of torch's Adam/AdamW (tests/cpu_adam_ref.py,
which also says why torch.optim itself is compared within RTOL/ATOL), the fp32 ->
fp16/bf16 param_out rounding, and the CPUAdam optimizer against torch.optim.

Also: test_cpu_adam_bf16_moments.py, test_cpu_adam_paths.py (how the work is split:
decay runs, alignment, threads; the SIMD level controls), test_cpu_adam_bad_inputs.py."""

import copy

import pytest
import torch
from cpu_adam_ref import (
    ATOL,
    CONFIGS,
    GRAD_DTYPES,
    HYPER,
    OUT_DTYPES,
    RTOL,
    SIZES,
    _bits_equal,
    _ref_step,
    level_fixture,  # noqa: F401 (pytest fixture)
)
from torch import nn

from mp_offload.ops import cpu_adam as ca


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=["noout", "out_fp16", "out_bf16"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["g_fp32", "g_fp16", "g_bf16"])
def test_matches_torch(level, grad_dtype, out_dtype):
    gen = torch.Generator().manual_seed(1234)
    for n in SIZES:
        for adamw, wd, bc in CONFIGS:
            p0 = torch.randn(n, generator=gen)
            p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
            rp, rm, rv = p0.clone(), torch.zeros(n), torch.zeros(n)
            out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
            tp = p0.clone().requires_grad_()
            opt = (torch.optim.AdamW if adamw else torch.optim.Adam)(
                [tp],
                lr=HYPER["lr"],
                betas=(HYPER["beta1"], HYPER["beta2"]),
                eps=HYPER["eps"],
                weight_decay=wd,
            )
            for step in range(1, 6):
                g = torch.randn(n, generator=gen).to(grad_dtype)
                ca.adam_step(
                    p,
                    g,
                    m,
                    v,
                    step=step,
                    weight_decay=wd,
                    adamw=adamw,
                    bias_correction=bc,
                    param_out=out,
                    **HYPER,
                )
                _ref_step(
                    rp,
                    g.float(),
                    rm,
                    rv,
                    step=step,
                    weight_decay=wd,
                    adamw=adamw,
                    bias_correction=bc,
                    **HYPER,
                )
                ctx = f"{level} n={n} adamw={adamw} wd={wd} bc={bc} step={step}"
                assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv), ctx
                if out is not None:
                    assert _bits_equal(out, p.to(out_dtype)), ctx
                if bc:
                    tp.grad = g.float()
                    opt.step()
            if bc and n:
                st = opt.state[tp]
                torch.testing.assert_close(p, tp.detach(), rtol=RTOL, atol=ATOL)
                torch.testing.assert_close(m, st["exp_avg"], rtol=RTOL, atol=ATOL)
                torch.testing.assert_close(v, st["exp_avg_sq"], rtol=RTOL, atol=ATOL)


def test_lerp_large_weight_and_grad_scale(level):
    """beta1 < 0.5 takes torch's other lerp formula; grad_scale == running on grad*scale."""
    gen = torch.Generator().manual_seed(7)
    n = 4099
    for grad_dtype in GRAD_DTYPES:
        for beta1, scale in ((0.3, 1.0), (0.9, 0.37), (0.9, 1 / 1024)):
            hyper = dict(HYPER, beta1=beta1)
            p0 = torch.randn(n, generator=gen)
            p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
            rp, rm, rv = p0.clone(), torch.zeros(n), torch.zeros(n)
            tp = p0.clone().requires_grad_()
            opt = torch.optim.AdamW(
                [tp],
                lr=hyper["lr"],
                betas=(beta1, hyper["beta2"]),
                eps=hyper["eps"],
                weight_decay=0.01,
            )
            for step in range(1, 4):
                g = (torch.randn(n, generator=gen) * 100).to(grad_dtype)
                ca.adam_step(p, g, m, v, step=step, weight_decay=0.01, grad_scale=scale, **hyper)
                _ref_step(
                    rp,
                    g.float() * scale,
                    rm,
                    rv,
                    step=step,
                    weight_decay=0.01,
                    adamw=True,
                    bias_correction=True,
                    **hyper,
                )
                assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv)
                tp.grad = g.float() * scale
                opt.step()
            torch.testing.assert_close(p, tp.detach(), rtol=RTOL, atol=ATOL)


def test_bias_correction_divide_extremes(level):
    """sqrt(v) / sqrt(bc2) is computed without a divide on the SIMD paths (csrc/
    adam_kernels.h, DIV_BC2): exp_avg_sq over ~75 binades (subnormal to 1e30), zeros, +inf and NaN,
    with the smallest bias corrections a double beta2 < 1 allows."""
    gen = torch.Generator().manual_seed(17)
    n = 4099
    for beta2 in (0.999, 1 - 1e-12, 1 - 2**-52, 0.5, 0.0):
        for step in (1, 2, 7):
            hyper = dict(HYPER, beta2=beta2)
            v0 = torch.pow(
                10.0, torch.rand(n, generator=gen, dtype=torch.float64) * 75 - 45
            ).float()
            v0[::97] = 0.0
            v0[5::101] = float("inf")
            v0[7::103] = float("nan")
            p0, m0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
            g = torch.randn(n, generator=gen) * torch.pow(
                10.0, torch.randint(-20, 3, (n,), generator=gen)
            )
            p, m, v = p0.clone(), m0.clone(), v0.clone()
            ca.adam_step(p, g, m, v, step=step, weight_decay=0.0, **hyper)
            rp, rm, rv = p0.clone(), m0.clone(), v0.clone()
            _ref_step(
                rp,
                g,
                rm,
                rv,
                step=step,
                weight_decay=0.0,
                adamw=True,
                bias_correction=True,
                **hyper,
            )
            for got, ref in ((p, rp), (m, rm), (v, rv)):
                nan = torch.isnan(ref)
                assert torch.equal(torch.isnan(got), nan), f"{level} beta2={beta2} step={step}"
                assert _bits_equal(got[~nan], ref[~nan]), f"{level} beta2={beta2} step={step}"


def _from_bits(bits):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _roundtrip(values, out_dtype):
    """lr=0, wd=0, zero grad: the param is left unchanged, so param_out shows
    the kernel's fp32 -> fp16/bf16 conversion of arbitrary hand-built values."""
    values = values.repeat(3)  # 3x: lands in the vector body and in the tail
    p, g, m, v = (
        values.clone(),
        torch.zeros_like(values),
        torch.zeros_like(values),
        torch.zeros_like(values),
    )
    out = torch.empty(values.numel(), dtype=out_dtype)
    ca.adam_step(
        p,
        g,
        m,
        v,
        step=1,
        lr=0.0,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        param_out=out,
    )
    nan = torch.isnan(values)  # arithmetic quiets signalling NaNs; other bits stay put
    assert (
        torch.equal(p[~nan].view(torch.int32), values[~nan].view(torch.int32))
        and torch.isnan(p[nan]).all()
    )
    return values, out


def test_bf16_rounding(level):
    one = 0x3F800000
    bits = [
        one,
        one + 0x8000,
        one + 0x8001,
        one + 0x7FFF,
        one + 0x18000,
        one + 0x10000,  # ties / near ties
        0xBF808000,
        0xBF818000,
        0x7F7FFFFF,
        0xFF7FFFFF,
        0x7F7F7FFF,
        0x00000001,
        0x80008000,
        0x00018000,
        0x00000000,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x7FC00000,
        0xFFC00000,
        0x7F800001,
        0x7FBFFFFF,
        0x3EAAAAAB,
        0x40490FDB,
    ]
    values, out = _roundtrip(_from_bits(bits), torch.bfloat16)
    nan = torch.isnan(values)
    assert torch.isnan(out[nan].float()).all(), "NaN must stay NaN"
    assert _bits_equal(out[~nan], values[~nan].to(torch.bfloat16))
    expect = {
        0: 0x3F80,
        1: 0x3F80,
        2: 0x3F81,
        3: 0x3F80,
        4: 0x3F82,
        5: 0x3F81,
        6: 0xBF80,
        7: 0xBF82,
        8: 0x7F80,
        9: 0xFF80,
    }  # ties go to the even mantissa; max float rounds up to inf
    got = out.view(torch.int16).to(torch.int32) & 0xFFFF
    for i, b in expect.items():
        assert got[i].item() == b, f"value {hex(bits[i])}: got {hex(got[i].item())}, want {hex(b)}"
    gen = torch.Generator().manual_seed(3)
    values, out = _roundtrip(torch.randn(4099, generator=gen) * 1e3, torch.bfloat16)
    assert _bits_equal(out, values.to(torch.bfloat16))


def test_fp16_rounding(level):
    bits = [
        0x3F801000,
        0x3F803000,
        0x3F801001,
        0x477FE000,
        0x477FEFFF,
        0x477FF000,
        0x47800000,  # ties, overflow
        0x38800000,
        0x387FC000,
        0x33800000,
        0x33000000,
        0x33000001,
        0x33C00000,
        0x34400000,
        0x387FF000,
        0x00000001,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x7FC00000,
        0xFFC12345,
        0xC7800000,
        0x3DCCCCCD,
    ]
    values, out = _roundtrip(_from_bits(bits), torch.float16)
    nan = torch.isnan(values)
    assert torch.isnan(out[nan].float()).all()
    assert _bits_equal(out[~nan], values[~nan].to(torch.float16))
    gen = torch.Generator().manual_seed(4)
    for scale in (1.0, 1e-5, 3e4, 1e5):  # normals, subnormals, near/over the max
        values, out = _roundtrip(torch.randn(4099, generator=gen) * scale, torch.float16)
        assert _bits_equal(out, values.to(torch.float16)), scale


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam_l2"])
def test_optimizer_matches_torch(adamw):
    torch.manual_seed(0)
    ours, ref = nn.Linear(32, 16), nn.Linear(32, 16)
    ref.load_state_dict(ours.state_dict())
    kw = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    opt = ca.CPUAdam(ours.parameters(), adamw=adamw, **kw)
    ropt = (torch.optim.AdamW if adamw else torch.optim.Adam)(ref.parameters(), **kw)
    for _ in range(10):
        x, y = torch.randn(8, 32), torch.randn(8, 16)
        for model, o in ((ours, opt), (ref, ropt)):
            o.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            o.step()
        for a, b in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    sd, rsd = opt.state_dict(), ropt.state_dict()
    assert sd["state"].keys() == rsd["state"].keys()
    for k, st in sd["state"].items():
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
        assert st["step"].item() == rsd["state"][k]["step"].item() == 10
        torch.testing.assert_close(st["exp_avg"], rsd["state"][k]["exp_avg"], rtol=RTOL, atol=ATOL)
    # state_dict round trip: a fresh optimizer continues identically
    clone = nn.Linear(32, 16)
    clone.load_state_dict(ours.state_dict())
    opt2 = ca.CPUAdam(clone.parameters(), adamw=adamw, **kw)
    opt2.load_state_dict(copy.deepcopy(sd))  # state_dict() hands out the live tensors
    x, y = torch.randn(8, 32), torch.randn(8, 16)
    for model, o in ((ours, opt), (clone, opt2)):
        o.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        o.step()
    for a, b in zip(ours.parameters(), clone.parameters()):
        assert torch.equal(a, b)


def test_optimizer_closure_and_bad_params():
    w = nn.Parameter(torch.ones(3))
    opt = ca.CPUAdam([w], lr=0.1)
    assert opt.step() is None  # no grads: nothing happens
    loss = opt.step(lambda: (w.sum() * 2).backward() or torch.tensor(1.5))
    assert loss.item() == 1.5 and not torch.equal(w.detach(), torch.ones(3))
    with pytest.raises(TypeError, match="param must be float32"):
        ca.CPUAdam([nn.Parameter(torch.ones(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="beta1"):
        ca.CPUAdam([w], betas=(1.0, 0.999))
