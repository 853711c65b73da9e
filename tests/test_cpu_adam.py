"""Fused CPU Adam (mp_offload.ops.cpu_adam) against torch, on every SIMD path.

Two references:
  * ``_ref_step``: torch's single-tensor Adam/AdamW (torch/optim/adam.py)
    written out op by op in exact float32 arithmetic, with FMAs where torch's
    vectorised kernels use them (lerp_, addcmul_, add(alpha=)) and a correctly
    rounded sqrt. The kernel must match it BIT FOR BIT on every path, size,
    grad dtype and option (incl. bias_correction=False, which torch.optim
    lacks, beta1 < 0.5, and grad_scale).
  * torch.optim.AdamW / Adam themselves. torch's vectorised float sqrt is off by
    one ulp on ~0.7% of inputs, which now and then flips the last bit of the
    param (and, through Adam's L2 term, of exp_avg). Measured: here 150 of ~1.9e5
    params differ, by <= 6e-8; on 10^5-element, 5-step runs over several seeds
    |diff| <= 4.8e-7 (1 ulp at |p| >= 4) and |diff| - 1e-6*|ref| <= 7e-9.
    Hence RTOL = 1e-6 (~8 ulp) and ATOL = 1e-8, for param/exp_avg/exp_avg_sq.
    If torch's kernels run without FMA (ATen CPU capability DEFAULT), its lerp/
    addcmul round twice and exp_avg drifts by a few ulp per step (measured
    |diff| <= 6.7e-8 over 5 steps): RTOL = 1e-5, ATOL = 1e-7 then.
"""

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from mp_offload import _cpu_adam as _C
from mp_offload.ops import cpu_adam as ca

RTOL, ATOL = (1e-6, 1e-8) if torch.backends.cpu.get_cpu_capability() != "DEFAULT" else (1e-5, 1e-7)
LEVELS = ["scalar", "avx2", "avx512"]
SIZES = [0, 1, 7, 15, 17, 33, 1000, 4099]
GRAD_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OUT_DTYPES = [None, torch.float16, torch.bfloat16]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
# (adamw, weight_decay, bias_correction)
CONFIGS = [
    (True, 0.0, True),
    (True, 0.1, True),
    (False, 0.0, True),
    (False, 0.1, True),
    (True, 0.1, False),
    (False, 0.1, False),
]


@pytest.fixture(params=LEVELS)
def level(request):
    if request.param not in ca.available_simd_levels():
        pytest.skip(f"CPU lacks {request.param}")
    before = ca.simd_level()
    ca.set_simd_level(request.param)
    assert ca.simd_level() == request.param
    yield request.param
    ca.set_simd_level(before)


@pytest.fixture
def threads():
    before = ca.get_num_threads()
    yield
    ca.set_num_threads(before)


def _f32(x):
    """A Python float rounded to float32, as torch does with scalar operands."""
    return torch.tensor(x, dtype=torch.float32).item()


def _op(x):
    """float64 -> float32. +, -, *, / and sqrt done in float64 and rounded once
    are exactly IEEE float32 (53 >= 2*24 + 2 bits: double rounding is harmless)."""
    return x.float()


def _fma(a, b, c):
    """float32 fma(a, b, c): a*b is exact in float64, then one rounding of the
    sum before float32 (double rounding could differ only on ~2^-29 of inputs)."""
    return _op(torch.as_tensor(a, dtype=torch.float64) * b.double() + c.double())


def _ref_step(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction):
    """torch/optim/adam.py _single_tensor_adam, op by op in exact float32
    arithmetic. torch's vectorised CPU kernels fuse add(alpha=), lerp_ and
    addcmul_ into FMAs, emulated here; everything else is a plain rounded op."""
    d = torch.Tensor.double
    if weight_decay != 0:
        if adamw:  # param.mul_(1 - lr * wd)
            p.copy_(_op(d(p) * _f32(1 - lr * weight_decay)))
        else:  # grad = grad.add(param, alpha=wd)
            g = _fma(_f32(weight_decay), p, g)
    w = _f32(1 - beta1)  # exp_avg.lerp_(grad, 1 - beta1): torch switches formula at |w| >= 0.5
    diff = _op(d(g) - d(m))
    m.copy_(_fma(w, diff, m) if abs(w) < 0.5 else _fma(_f32(w - 1), diff, g))
    # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    v.copy_(_fma(_op(d(g) * _f32(1 - beta2)), g, _op(d(v) * _f32(beta2))))
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    # denom = (exp_avg_sq.sqrt() / bc2 ** 0.5).add_(eps)
    # param.addcdiv_(exp_avg, denom, value=-lr / bc1)
    denom = _op(d(_op(d(_op(d(v).sqrt())) / _f32(bc2**0.5))) + _f32(eps))
    p.copy_(_op(d(p) + d(_op(d(_op(d(m) * _f32(-(lr / bc1)))) / d(denom)))))


def _bits_equal(a, b):
    return a.dtype == b.dtype and torch.equal(
        a.view(torch.int16 if a.element_size() == 2 else torch.int32),
        b.view(torch.int16 if b.element_size() == 2 else torch.int32),
    )


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


# ---------------------------------------------------------- bf16 moments
# (exp_avg dtype, exp_avg_sq dtype): each moment may be bf16 on its own
MOMENTS = [
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16),
]
MOMENT_IDS = ["m_bf16", "v_bf16", "mv_bf16"]


def _round_moments(rm, rv, mt, vt):
    """The restatement's fp32 moments as the kernel stores them: .to(bf16) (round to
    nearest even) where the moment is bf16. Returns the stored tensors and reloads
    rm/rv from them, as the next step will read them."""
    sm, sv = rm.to(mt), rv.to(vt)
    rm.copy_(sm.float())
    rv.copy_(sv.float())
    return sm, sv


@pytest.mark.parametrize("moments", MOMENTS, ids=MOMENT_IDS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=["noout", "out_fp16", "out_bf16"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["g_fp32", "g_fp16", "g_bf16"])
def test_bf16_moments_match_reference(level, grad_dtype, out_dtype, moments):
    """bf16 moments: widened, the fp32 step of _ref_step (the param update sees the
    unrounded moments), then stored rounded to bf16 -- bit for bit."""
    mt, vt = moments
    gen = torch.Generator().manual_seed(4321)
    for n in SIZES:
        for adamw, wd, bc in CONFIGS:
            p0 = torch.randn(n, generator=gen)
            m = (torch.randn(n, generator=gen) * 0.1).to(mt)  # non-trivial starting moments
            v = (torch.rand(n, generator=gen) * 0.01).to(vt)
            p, rp, rm, rv = p0.clone(), p0.clone(), m.float().clone(), v.float().clone()
            out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
            for step in range(1, 5):
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
                sm, sv = _round_moments(rm, rv, mt, vt)
                ctx = f"{level} n={n} adamw={adamw} wd={wd} bc={bc} step={step}"
                assert m.dtype == mt and v.dtype == vt, ctx
                assert _bits_equal(p, rp) and _bits_equal(m, sm) and _bits_equal(v, sv), ctx
                if out is not None:
                    assert _bits_equal(out, p.to(out_dtype)), ctx


def test_bf16_moments_round_ties_to_even(level):
    """Enough elements that some fp32 moments land exactly halfway between two
    bf16 values (low 16 bits 0x8000): those must go to the even neighbour."""
    n, gen = 1 << 18, torch.Generator().manual_seed(99)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m0 = (torch.randn(n, generator=gen) * 0.1).bfloat16()
    v0 = (torch.rand(n, generator=gen) * 0.01).bfloat16()
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    ca.adam_step(p, g, m, v, step=3, weight_decay=0.1, **HYPER)
    rp, rm, rv = p0.clone(), m0.float(), v0.float()
    _ref_step(rp, g, rm, rv, step=3, weight_decay=0.1, adamw=True, bias_correction=True, **HYPER)
    for got, exact in ((m, rm), (v, rv)):
        ties = (exact.view(torch.int32) & 0xFFFF) == 0x8000
        assert ties.sum() > 0, "no ties in the sample: grow n"
        assert _bits_equal(got, exact.to(torch.bfloat16))
        assert ((got[ties].view(torch.int16) & 1) == 0).all()  # even mantissa
    assert _bits_equal(p, rp)


def test_bf16_moments_optimizer():
    """CPUAdam keeps its moments in the dtypes asked for, also after load_state_dict
    (which casts state to the param's fp32)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    kw = {"lr": 1e-2, "weight_decay": 0.01}
    opt = ca.CPUAdam(model.parameters(), exp_avg_dtype=torch.bfloat16, **kw)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 8)).square().sum().backward()
        opt.step()
    for st in opt.state.values():
        assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.float32
    opt2 = ca.CPUAdam(model.parameters(), exp_avg_dtype=torch.bfloat16, **kw)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt2.zero_grad()
    model(torch.randn(5, 8)).square().sum().backward()
    opt2.step()
    for st in opt2.state.values():
        assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.float32
    with pytest.raises(TypeError, match="exp_avg_sq_dtype must be torch.float32 or torch.bfloat16"):
        ca.CPUAdam(model.parameters(), exp_avg_sq_dtype=torch.float16)


# ------------------------------------------------------------ decay runs
def _random_runs(n, gen, count):
    """count sorted, disjoint runs in [0, n) with random gaps (some empty, some adjacent)."""
    cuts = sorted(torch.randint(0, n + 1, (2 * count,), generator=gen).tolist())
    return [(cuts[2 * k], cuts[2 * k + 1]) for k in range(count)]


def _segments(n, runs):
    """[(start, end, decayed)] covering [0, n): the runs and the gaps between them."""
    segs, pos = [], 0
    for s, e in runs:
        if s > pos:
            segs.append((pos, s, False))
        if e > s:
            segs.append((s, e, True))
        pos = max(pos, e)
    if pos < n:
        segs.append((pos, n, False))
    return segs


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize(
    "moments", [(torch.float32, torch.float32), MOMENTS[2]], ids=["mv_fp32", "mv_bf16"]
)
def test_decay_runs_match_per_run_calls(level, threads, moments, adamw):
    """One call with decay_runs == one call per run (weight_decay there, 0 in the
    gaps), bit for bit, on 1 and 2 threads and with a bf16 param_out."""
    mt, vt = moments
    gen = torch.Generator().manual_seed(21)
    n = 3 * _C.TILE + 77  # both threads get work
    run_sets = [
        _random_runs(n, gen, 40),
        [(0, n)],
        [],
        [(5, 5)],
        [(0, 1), (1, 2), (n - 1, n)],
        [(k, k + 3) for k in range(0, n - 3, 7)],  # many runs shorter than a vector
        [(17, 12345), (12345, 20000), (24000, n - 1)],
    ]
    for runs in run_sets:
        for t in (1, 2):
            ca.set_num_threads(t)
            p0 = torch.randn(n, generator=gen)
            g = torch.randn(n, generator=gen).bfloat16()
            a = [
                p0.clone(),
                torch.zeros(n, dtype=mt),
                torch.zeros(n, dtype=vt),
                torch.empty(n, dtype=torch.bfloat16),
            ]
            b = [x.clone() for x in a]
            for step in (1, 2, 3):
                kw = {"step": step, "adamw": adamw, **HYPER}
                ca.adam_step(
                    a[0], g, a[1], a[2], weight_decay=0.1, param_out=a[3], decay_runs=runs, **kw
                )
                for s, e, dec in _segments(n, runs):
                    ca.adam_step(
                        b[0][s:e],
                        g[s:e],
                        b[1][s:e],
                        b[2][s:e],
                        weight_decay=0.1 if dec else 0.0,
                        param_out=b[3][s:e],
                        **kw,
                    )
            assert all(_bits_equal(x, y) for x, y in zip(a, b)), f"{level} t={t} runs={runs[:4]}"


def test_decay_runs_extremes():
    """All of [0, n) decayed == no runs; no runs at all == weight_decay 0; a tensor works."""
    n, gen = 1000, torch.Generator().manual_seed(5)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    results = []
    for runs, wd in (
        ([(0, n)], 0.1),
        (None, 0.1),
        ([], 0.1),
        (None, 0.0),
        (torch.tensor([[0, n]]), 0.1),
    ):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        ca.adam_step(p, g, m, v, step=1, weight_decay=wd, decay_runs=runs, **HYPER)
        results.append(p)
    assert _bits_equal(results[0], results[1]) and _bits_equal(results[2], results[3])
    assert _bits_equal(results[0], results[4]) and not torch.equal(results[0], results[2])


@pytest.mark.parametrize(
    "runs, exc, match",
    [
        (
            [(4, 8), (0, 3)],
            ValueError,
            r"decay_runs\[1\] = \(0, 3\) is unsorted: it starts before decay_runs\[0\]",
        ),
        (
            [(0, 6), (4, 8)],
            ValueError,
            r"decay_runs\[1\] = \(4, 8\) overlaps decay_runs\[0\] = \(0, 6\)",
        ),
        ([(0, 13)], ValueError, r"decay_runs\[0\] = \(0, 13\) is out of range \[0, 12\]"),
        ([(-1, 3)], ValueError, "is out of range"),
        ([(5, 2)], ValueError, r"decay_runs\[0\] = \(5, 2\) has start > end"),
        ([(0, 2, 3)], TypeError, r"decay_runs\[0\] must be a \(start, end\) pair"),
        ([(0.0, 2)], TypeError, "must hold two integers"),
        (5, TypeError, "decay_runs must be a sequence"),
    ],
)
def test_bad_decay_runs_raise_and_touch_nothing(runs, exc, match):
    bufs = _bufs()
    bufs["param"].fill_(1.0)
    bufs["grad"].fill_(0.5)
    before = {k: v.clone() for k, v in bufs.items()}
    with pytest.raises(exc, match=match):
        _call(bufs, weight_decay=0.1, decay_runs=runs)
    assert all(torch.equal(bufs[k], v) for k, v in before.items())


def test_raw_decay_runs_checked_in_cpp():
    t = torch.zeros(8)
    args = (
        t.data_ptr(),
        t.data_ptr(),
        0,
        t.data_ptr(),
        t.data_ptr(),
        0,
        0,
        8,
        1,
        1e-3,
        0.9,
        0.999,
        1e-8,
        0.1,
        True,
        True,
        1.0,
    )
    for runs, match in (
        ([(3, 9)], "out of range"),
        ([(2, 1)], "start > end"),
        ([(0, 4), (2, 6)], "overlaps"),
    ):
        with pytest.raises(ValueError, match=match):
            _C.adam_step(*args, decay_runs=runs)
    with pytest.raises(ValueError, match="exp_avg_dtype must be 0"):
        _C.adam_step(*args, exp_avg_dtype=1)
    with pytest.raises(ValueError, match="exp_avg_sq_dtype must be 0"):
        _C.adam_step(*args, exp_avg_sq_dtype=7)


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


def test_unaligned_views(level):
    """Buffers at odd offsets: unaligned loads and (for param_out) the plain-store
    path instead of streaming stores; aligned and unaligned results must agree."""
    n, gen = 3 * 1024 + 5, torch.Generator().manual_seed(5)
    p0, g0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    results = []
    for off in (0, 1, 3):
        p, m, v = (torch.zeros(n + off)[off:] for _ in range(3))
        g = torch.zeros(n + off, dtype=torch.float16)[off:]
        out = torch.zeros(n + off, dtype=torch.bfloat16)[off:]
        p.copy_(p0), g.copy_(g0)
        for step in (1, 2, 3):
            ca.adam_step(p, g, m, v, step=step, weight_decay=0.1, param_out=out, **HYPER)
        assert _bits_equal(out, p.to(torch.bfloat16))
        results.append((p.clone(), m.clone(), v.clone()))
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], r))


def test_threads_bitwise_identical(level, threads):
    n = 5 * _C.TILE + 13  # several tiles, ragged end
    gen = torch.Generator().manual_seed(11)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()
    results = []
    for t in (1, 2):
        ca.set_num_threads(t)
        assert ca.get_num_threads() == t
        p, m, v, out = (
            p0.clone(),
            torch.zeros(n),
            torch.zeros(n),
            torch.empty(n, dtype=torch.bfloat16),
        )
        for step in (1, 2):
            ca.adam_step(p, g, m, v, step=step, weight_decay=0.1, param_out=out, **HYPER)
        results.append((p, m, v, out))
    for a, b in zip(*results):
        assert _bits_equal(a, b)


def test_set_num_threads_is_used(threads):
    n = 4 * _C.TILE
    b = _bufs(n)
    for t in (1, 2, 3):
        ca.set_num_threads(t)
        _call(b)
        assert ca.get_num_threads() == t and ca.last_num_threads() == t
    _call(_bufs(_C.TILE))  # too small to be worth a second thread
    assert ca.last_num_threads() == 1


def test_threads_ignore_omp_num_threads():
    """torchrun sets OMP_NUM_THREADS=1 per worker: set_num_threads(2) must still
    give the kernel two threads (seen from inside its parallel region)."""
    code = (
        "import torch\n"
        "from mp_offload.ops import cpu_adam as ca\n"
        "from mp_offload import _cpu_adam as C\n"
        "before = ca.get_num_threads()\n"
        "ca.set_num_threads(2)\n"
        "n = 4 * C.TILE\n"
        "p, g = torch.zeros(n), torch.ones(n)\n"
        "m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n)\n"
        "ca.adam_step(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,\n"
        "             weight_decay=0.1,\n"
        "             decay_runs=[(0, 10)])\n"
        "print(before, ca.get_num_threads(), ca.last_num_threads())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    env.update(OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["1", "2", "2"]


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


# ------------------------------------------------------------- bad inputs
def _bufs(n=12, grad_n=None, grad_dtype=torch.float32):
    return dict(
        param=torch.zeros(n),
        grad=torch.zeros(n if grad_n is None else grad_n, dtype=grad_dtype),
        exp_avg=torch.zeros(n),
        exp_avg_sq=torch.zeros(n),
    )


def _call(bufs, **kw):
    args = dict(step=1, weight_decay=0.0, **HYPER)
    args.update(kw)
    ca.adam_step(bufs["param"], bufs["grad"], bufs["exp_avg"], bufs["exp_avg_sq"], **args)


@pytest.mark.parametrize(
    "make, kw, exc, match",
    [
        (lambda: _bufs(grad_n=10), {}, ValueError, "grad has 10 elements, param has 12"),
        (
            lambda: dict(_bufs(), exp_avg=torch.zeros(13)),
            {},
            ValueError,
            "exp_avg has 13 elements, param has 12",
        ),
        (
            lambda: _bufs(grad_dtype=torch.float64),
            {},
            TypeError,
            "grad must be float32/float16/bfloat16, got float64",
        ),
        (
            lambda: dict(_bufs(), param=torch.zeros(12, dtype=torch.float16)),
            {},
            TypeError,
            "param must be float32",
        ),
        (
            lambda: dict(_bufs(), exp_avg_sq=torch.zeros(12, dtype=torch.float16)),
            {},
            TypeError,
            "exp_avg_sq must be float32/bfloat16, got float16",
        ),
        (
            lambda: dict(_bufs(), exp_avg=torch.zeros(24)[::2]),
            {},
            ValueError,
            "exp_avg must be contiguous",
        ),
        (
            lambda: dict(_bufs(), exp_avg=torch.zeros(12, dtype=torch.float16)),
            {},
            TypeError,
            "exp_avg must be float32/bfloat16, got float16",
        ),
        (
            lambda: dict(_bufs(), exp_avg_sq=torch.zeros(12, dtype=torch.float64)),
            {},
            TypeError,
            "exp_avg_sq must be float32/bfloat16, got float64",
        ),
        (
            lambda: dict(_bufs(), exp_avg=torch.zeros(12, dtype=torch.int16)),
            {},
            TypeError,
            "exp_avg must be",
        ),
        (
            lambda: dict(
                _bufs(),
                param=torch.zeros(12, dtype=torch.bfloat16),
                exp_avg=torch.zeros(12, dtype=torch.bfloat16),
            ),
            {},
            TypeError,
            "param must be float32",
        ),
        (
            lambda: dict(_bufs(), exp_avg=torch.zeros(13, dtype=torch.bfloat16)),
            {},
            ValueError,
            "exp_avg has 13 elements, param has 12",
        ),
        (
            lambda: dict(_bufs(), exp_avg_sq=torch.zeros(11, dtype=torch.bfloat16)),
            {},
            ValueError,
            "exp_avg_sq has 11 elements, param has 12",
        ),
        (
            lambda: dict(_bufs(), exp_avg_sq=torch.zeros(24, dtype=torch.bfloat16)[::2]),
            {},
            ValueError,
            "exp_avg_sq must be contiguous",
        ),
        (
            lambda: dict(_bufs(), exp_avg=torch.zeros(12, dtype=torch.bfloat16, device="meta")),
            {},
            ValueError,
            "exp_avg must be a CPU tensor",
        ),
        (
            lambda: dict(_bufs(), grad=torch.zeros(4, 3).t()),
            {},
            ValueError,
            "grad must be contiguous",
        ),
        (
            lambda: dict(_bufs(), grad=torch.zeros(12, device="meta")),
            {},
            ValueError,
            "grad must be a CPU tensor",
        ),
        (
            lambda: dict(_bufs(), param=torch.zeros(12, device="meta")),
            {},
            ValueError,
            "param must be a CPU tensor",
        ),
        (lambda: dict(_bufs(), grad=torch.zeros(12).to_sparse()), {}, ValueError, "dense"),
        (lambda: dict(_bufs(), grad=[0.0] * 12), {}, TypeError, "grad must be a torch.Tensor"),
        (_bufs, dict(step=0), ValueError, "step must be >= 1, got 0"),
        (_bufs, dict(step=-3), ValueError, "step must be >= 1"),
        (_bufs, dict(step=1.5), ValueError, "step must be an integer"),
        (_bufs, dict(step=None), TypeError, "step must be an integer"),
        (
            _bufs,
            dict(param_out=torch.zeros(12)),
            TypeError,
            "param_out must be float16/bfloat16, got float32",
        ),
        (
            _bufs,
            dict(param_out=torch.zeros(11, dtype=torch.bfloat16)),
            ValueError,
            "param_out has 11 elements, param has 12",
        ),
        (
            _bufs,
            dict(param_out=torch.zeros(24, dtype=torch.float16)[::2]),
            ValueError,
            "param_out must be contiguous",
        ),
        (_bufs, dict(lr=-1.0), ValueError, "lr must be >= 0"),
        (_bufs, dict(beta1=1.0), ValueError, "beta1 must be in"),
        (_bufs, dict(beta2=-0.1), ValueError, "beta2 must be in"),
        (_bufs, dict(eps=float("nan")), ValueError, "eps must be a finite"),
        (_bufs, dict(weight_decay=-0.1), ValueError, "weight_decay must be >= 0"),
        (_bufs, dict(grad_scale=float("inf")), ValueError, "grad_scale must be a finite"),
    ],
)
def test_bad_inputs_raise_and_touch_nothing(make, kw, exc, match):
    bufs = make()
    before = {
        k: v.clone()
        for k, v in bufs.items()
        if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.layout == torch.strided
    }
    with pytest.raises(exc, match=match):
        _call(bufs, **kw)
    for k, v in before.items():
        assert torch.equal(bufs[k], v), f"{k} was modified"


def test_aliasing_rejected():
    b = _bufs()
    with pytest.raises(ValueError, match="param and exp_avg overlap"):
        ca.adam_step(
            b["param"], b["grad"], b["param"], b["exp_avg_sq"], step=1, weight_decay=0.0, **HYPER
        )
    big = torch.zeros(30)
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq overlap"):
        ca.adam_step(b["param"], b["grad"], big[:12], big[6:18], step=1, weight_decay=0.0, **HYPER)
    pout = b["param"].view(torch.bfloat16)  # 24 bf16 views of the same bytes
    with pytest.raises(ValueError, match="param and param_out overlap"):
        ca.adam_step(
            b["param"],
            b["grad"],
            b["exp_avg"],
            b["exp_avg_sq"],
            param_out=pout[:12],
            step=1,
            weight_decay=0.0,
            **HYPER,
        )


def test_bf16_moment_aliasing_rejected_and_touch_nothing():
    b = _bufs()
    b["grad"].fill_(1.0)
    pm = torch.ones(36, dtype=torch.bfloat16)  # bytes shared by two bf16 moments below
    out = torch.ones(12, dtype=torch.bfloat16)
    cases = [  # (exp_avg, exp_avg_sq, param_out, error)
        (b["param"].view(torch.bfloat16)[6:18], b["exp_avg_sq"], None, "param and exp_avg overlap"),
        (b["exp_avg"], b["grad"].view(torch.bfloat16)[:12], None, "grad and exp_avg_sq overlap"),
        (pm[:12], pm[11:23], None, "exp_avg and exp_avg_sq overlap"),
        (
            pm[:12],
            out.view(torch.int16).view(torch.bfloat16),
            out,
            "exp_avg_sq and param_out overlap",
        ),
    ]
    for m, v, o, match in cases:
        tensors = (b["param"], b["grad"], b["exp_avg"], b["exp_avg_sq"], pm, out)
        snap = [t.clone() for t in tensors]
        with pytest.raises(ValueError, match=match):
            ca.adam_step(
                b["param"], b["grad"], m, v, param_out=o, step=1, weight_decay=0.1, **HYPER
            )
        assert all(torch.equal(x, y) for x, y in zip(snap, tensors)), match


def test_empty_is_noop_and_raw_codes_checked():
    ca.adam_step(
        torch.zeros(0),
        torch.zeros(0),
        torch.zeros(0),
        torch.zeros(0),
        step=1,
        weight_decay=0.0,
        param_out=torch.zeros(0, dtype=torch.bfloat16),
        **HYPER,
    )
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="grad_dtype"):
        _C.adam_step(
            t.data_ptr(),
            t.data_ptr(),
            7,
            t.data_ptr(),
            t.data_ptr(),
            0,
            0,
            4,
            1,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.0,
            True,
            True,
            1.0,
        )
    with pytest.raises(ValueError, match="out_dtype"):
        _C.adam_step(
            t.data_ptr(),
            t.data_ptr(),
            0,
            t.data_ptr(),
            t.data_ptr(),
            t.data_ptr(),
            0,
            4,
            1,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.0,
            True,
            True,
            1.0,
        )
    with pytest.raises(ValueError, match="step must be >= 1"):
        _C.adam_step(
            t.data_ptr(),
            t.data_ptr(),
            0,
            t.data_ptr(),
            t.data_ptr(),
            0,
            0,
            4,
            0,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.0,
            True,
            True,
            1.0,
        )


# ----------------------------------------------------------- controls
def test_simd_level_controls():
    avail = ca.available_simd_levels()
    assert avail[0] == "scalar" and ca.simd_level() in avail
    before = ca.simd_level()
    try:
        ca.set_simd_level("auto")
        assert ca.simd_level() == avail[-1]
        with pytest.raises(ValueError, match="unknown SIMD level 'sse9'"):
            ca.set_simd_level("sse9")
        for name in set(LEVELS) - set(avail):
            with pytest.raises(RuntimeError, match="not supported"):
                ca.set_simd_level(name)
    finally:
        ca.set_simd_level(before)
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        ca.set_num_threads(0)


def test_env_var_forces_level_at_import():
    code = "from mp_offload import _cpu_adam as c; print(c.simd_level())"
    env = dict(os.environ, MP_OFFLOAD_CPU_ADAM_SIMD="scalar")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "scalar"
    env["MP_OFFLOAD_CPU_ADAM_SIMD"] = "bogus"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "MP_OFFLOAD_CPU_ADAM_SIMD" in bad.stderr


def test_default_num_threads(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert ca.default_num_threads() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 4))
    assert ca.default_num_threads() == 1  # never below one
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ca.default_num_threads() == max(1, cores // 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert ca.default_num_threads() == 3


def test_stream_probe_runs(level):
    n = 3 * _C.TILE + 5
    b = _bufs(n, grad_dtype=torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    secs = ca.stream_probe(b["param"], b["grad"], b["exp_avg"], b["exp_avg_sq"], param_out=out)
    assert secs > 0.0
    assert ca.stream_probe(torch.zeros(0), torch.zeros(0), torch.zeros(0), torch.zeros(0)) == 0.0
    with pytest.raises(ValueError, match="stream_probe: grad has 3 elements"):
        ca.stream_probe(b["param"], torch.zeros(3), b["exp_avg"], b["exp_avg_sq"])
