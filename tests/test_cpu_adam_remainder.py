"""CPU Adam with the fp32 master kept as (hi, lo) halves (adam_step_remainder): bit for
bit the fp32-master step, on every SIMD path, awkward sizes, special values and bad
input; the split rule (split_fp32 / join_fp32) against a torch reference written here,
and its round trip over all 2^32 bit patterns."""

import pytest
import torch
from cpu_adam_ref import (
    CONFIGS,
    GRAD_DTYPES,
    HYPER,
    SIZES,
    _bits_equal,
    fp32_from_bits,
    level_fixture,  # noqa: F401 (pytest fixture)
    special_floats,
    threads_fixture,  # noqa: F401 (pytest fixture)
)

from mp_offload import _cpu_adam as _C
from mp_offload.ops import cpu_adam as ca

FINITE_TOP = 0x7F80  # top halves (sign cleared) of the finite floats: 0 .. 0x7F7F
MOMENTS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]


# ------------------------------------------------------------------ reference
def _u16(x):
    """int32 values in [0, 0xFFFF] -> int16 of the same bits."""
    return torch.where(x >= 0x8000, x - 0x10000, x).to(torch.int16)


def ref_split(x):
    """The split rule in torch integer ops, apart from the C++: lo = low half; hi = top
    half + [lo >= 0x8000], the finite magnitudes modulo 0x7F80; inf/NaN keep theirs."""
    u = x.view(torch.int32)
    sign, top, lo = (u >> 16) & 0x8000, (u >> 16) & 0x7FFF, u & 0xFFFF
    hi_top = torch.where(top < FINITE_TOP, (top + (lo >> 15)) % FINITE_TOP, top)
    return _u16(sign | hi_top).view(torch.bfloat16), _u16(lo)


def ref_join(hi, lo):
    h, low = hi.view(torch.int16).to(torch.int32) & 0xFFFF, lo.to(torch.int32) & 0xFFFF
    sign, top = h & 0x8000, h & 0x7FFF
    x_top = torch.where(top < FINITE_TOP, (top - (low >> 15)) % FINITE_TOP, top)  # floor-mod
    return ((_u16(sign | x_top).to(torch.int32) << 16) | low).view(torch.float32)


def _every_class(lows=(0, 1, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFE, 0xFFFF)):
    """Every top half (both signs) with low halves on both sides of 0x8000 (the rule
    depends on the top half and lo >= 0x8000 only; lo itself passes through)."""
    top = torch.arange(1 << 16, dtype=torch.int64)
    low = torch.tensor(lows, dtype=torch.int64)
    return fp32_from_bits(((top[:, None] << 16) | low[None, :]).flatten())


# ------------------------------------------------------------------ the rule
def test_split_rule_against_reference_and_rne(level):
    """C++ split/join == the torch reference on every (sign, top, lo >= 0x8000) class;
    hi == RNE(x) except at even ties, the would-be-inf floats and signalling NaNs;
    finite x -> finite hi, inf -> inf, NaN -> NaN (or inf for a low-half-only payload)."""
    x = _every_class()
    hi, lo = ca.split_fp32(x)
    rhi, rlo = ref_split(x)
    assert _bits_equal(hi, rhi) and _bits_equal(lo, rlo)
    assert _bits_equal(ca.join_fp32(hi, lo), x) and _bits_equal(ref_join(hi, lo), x)
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    a, low = u & 0x7FFFFFFF, u & 0xFFFF
    even_tie = (low == 0x8000) & (((u >> 16) & 1) == 0) & (a < 0x7F7F0000)
    wraps = (a >= 0x7F7F8000) & (a < 0x7F800000)
    snan = (a > 0x7F800000) & ((a & 0x00400000) == 0)
    same = ~(even_tie | wraps | snan | x.isnan())
    assert _bits_equal(hi[same], x[same].to(torch.bfloat16))
    h = hi.view(torch.int16).to(torch.int64) & 0xFFFF
    assert (h[even_tie] == (u[even_tie] >> 16) + 1).all()  # away from zero
    assert (hi[wraps] == 0).all() and hi.isfinite()[x.isfinite()].all()
    assert (hi[x.isinf()] == x[x.isinf()]).all()
    low_only = x.isnan() & ((a >> 16) == 0x7F80)
    assert hi[x.isnan() & ~low_only].isnan().all() and hi[low_only].isinf().all()


@pytest.mark.parametrize("n", [0, 1, 15, 17, 33, 4099])
def test_split_join_sizes_and_views(level, n):
    """Ragged tails (scalar rule) and vector bodies give the same bits as the reference."""
    gen = torch.Generator().manual_seed(n)
    x = fp32_from_bits(torch.randint(0, 2**32, (n,), generator=gen))
    hi, lo = ca.split_fp32(x)
    assert _bits_equal(hi, ref_split(x)[0]) and _bits_equal(lo, ref_split(x)[1])
    out = torch.zeros(n + 3)[3:]
    assert ca.join_fp32(hi, lo, out=out) is out and _bits_equal(out, x)


def test_round_trip_all_bit_patterns(level):
    """join_fp32(split_fp32(x)) == x for all 2^32 fp32 bit patterns (C++, this level;
    ~30 s for AVX-512 on the loaded 2-core test host, ~50-70 s for AVX2 / scalar)."""
    if level != ca.available_simd_levels()[-1]:
        pytest.skip("exhaustive on the best level only (the others: one chunk in 16, below)")
    _round_trip_everything()


def test_round_trip_every_16th_chunk_on_the_other_levels(level):
    """The other levels: one 2^24-pattern chunk in 16 (both signs, exponents 16 apart) keeps
    the suite's time; the class tests above cover every (sign, top, r) class on every level."""
    if level == ca.available_simd_levels()[-1]:
        pytest.skip("done by test_round_trip_all_bit_patterns")
    _round_trip_everything(every=16)


def _round_trip_everything(every: int = 1):
    chunk = 1 << 24
    hi = torch.empty(chunk, dtype=torch.bfloat16)
    lo, back = torch.empty(chunk, dtype=torch.int16), torch.empty(chunk)
    for start in range(-(2**31), 2**31, chunk * every):
        bits = torch.arange(start, start + chunk, dtype=torch.int32)
        ca.split_fp32(bits.view(torch.float32), hi, lo)
        ca.join_fp32(hi, lo, out=back)
        assert torch.equal(back.view(torch.int32), bits), f"chunk at {start:#x}"


# ---------------------------------------------------------------- the kernel
def _both_paths(p0, g, m0, v0, runs=None, **kw):
    """One step each way: fp32 master + split-rounded bf16 out, and the halves."""
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    out = torch.empty(p0.shape, dtype=torch.bfloat16)
    ca.adam_step(p, g, m, v, param_out=out, bf16_rounding="split", decay_runs=runs, **kw)
    hi, lo = ref_split(p0)
    rm, rv = m0.clone(), v0.clone()
    ca.adam_step_remainder(hi, lo, g, rm, rv, decay_runs=runs, **kw)
    return (p, out, m, v), (hi, lo, rm, rv)


def _assert_same(fp32, rem, ctx):
    p, out, m, v = fp32
    hi, lo, rm, rv = rem
    assert _bits_equal(ref_join(hi, lo), p), ctx  # the master, exactly
    assert _bits_equal(hi, out) and _bits_equal(hi, ref_split(p)[0]), ctx
    assert _bits_equal(rm, m) and _bits_equal(rv, v), ctx


@pytest.mark.parametrize("moments", MOMENTS, ids=["mv_fp32", "mv_bf16"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["g_fp32", "g_fp16", "g_bf16"])
def test_remainder_equals_fp32_path(level, grad_dtype, moments):
    mt, vt = moments
    gen = torch.Generator().manual_seed(77)
    for n in SIZES:
        for adamw, wd, bc in CONFIGS:
            p = torch.randn(n, generator=gen)
            m = (torch.randn(n, generator=gen) * 0.1).to(mt)
            v = (torch.rand(n, generator=gen) * 0.01).to(vt)
            for step in range(1, 4):
                g = torch.randn(n, generator=gen).to(grad_dtype)
                kw = dict(step=step, weight_decay=wd, adamw=adamw, bias_correction=bc, **HYPER)
                fp32, rem = _both_paths(p, g, m, v, grad_scale=0.5, **kw)
                _assert_same(fp32, rem, f"{level} n={n} adamw={adamw} wd={wd} bc={bc} s={step}")
                p, m, v = fp32[0], fp32[2], fp32[3]


@pytest.mark.parametrize("lr", [0.0, 1e-2], ids=["lr0", "lr1e-2"])
def test_special_values(level, lr):
    """Specials in the master, moments and grads (lr = 0 keeps most masters as they
    are, so the stored halves of each special are checked too); 33 lanes: vector
    bodies and tails."""
    x = special_floats()
    p = torch.cat([x, x[:11]])  # 59: vector bodies and a ragged tail on every level
    k = p.numel()
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(k, generator=gen)
    odd = torch.tensor([float("nan"), float("inf"), 0.0, -0.0, 1e-45, 3e38, -3e38])
    g[::7] = odd.repeat(2)[: g[::7].numel()]
    m, v = torch.zeros(k), torch.rand(k, generator=gen)
    for adamw, wd, bc in CONFIGS:
        kw = dict(step=2, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd)
        fp32, rem = _both_paths(p, g, m, v, adamw=adamw, bias_correction=bc, **kw)
        _assert_same(fp32, rem, f"{level} lr={lr} adamw={adamw} wd={wd}")
    kw = dict(step=1, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    hi, lo = ca.split_fp32(p)
    ca.adam_step_remainder(hi, lo, torch.zeros(k), torch.zeros(k), torch.zeros(k), **kw)
    same = ~p.isnan()  # p + (-0) == p except that a signalling NaN comes back quiet
    assert _bits_equal(ca.join_fp32(hi, lo)[same], p[same])
    assert ca.join_fp32(hi, lo)[~same].isnan().all()


def test_remainder_runs_threads_and_views(level, threads):
    """decay_runs, two threads and buffers at odd offsets: the same bits as the fp32
    path (and as one thread, aligned)."""
    n = 3 * _C.TILE + 77
    gen = torch.Generator().manual_seed(8)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()
    m, v = torch.zeros(n), torch.zeros(n)
    runs = [(5, 5000), (5001, 9000), (20000, n - 3)]
    results = []
    for t, off in ((1, 0), (2, 0), (2, 3)):
        ca.set_num_threads(t)
        hi = torch.empty(n + off, dtype=torch.bfloat16)[off:]
        lo = torch.empty(n + off, dtype=torch.int16)[off:]
        ca.split_fp32(p, hi, lo)
        rm, rv = m.clone(), v.clone()
        for step in (1, 2):
            kw = dict(step=step, weight_decay=0.1, decay_runs=runs, **HYPER)
            ca.adam_step_remainder(hi, lo, g, rm, rv, **kw)
        results.append((hi.clone(), lo.clone(), rm, rv))
    pp, pm, pv = p.clone(), m.clone(), v.clone()
    out = torch.empty(n, dtype=torch.bfloat16)
    for step in (1, 2):
        kw = dict(step=step, weight_decay=0.1, decay_runs=runs, **HYPER)
        ca.adam_step(pp, g, pm, pv, param_out=out, bf16_rounding="split", **kw)
    for r in results:
        _assert_same((pp, out, pm, pv), r, level)


def test_bf16_rounding_option(level):
    """'split' rounds even ties away from zero where 'nearest_even' (the default, as
    torch's .to) rounds them to even; everything else the same."""
    n = 1 << 12
    gen = torch.Generator().manual_seed(1)
    top = torch.randint(0x3000, 0x4800, (n,), generator=gen, dtype=torch.int64)
    p = fp32_from_bits((top << 16) | 0x8000)  # all ties, half under even tops
    outs = {}
    for mode in ("nearest_even", "split"):
        q, out = p.clone(), torch.empty(n, dtype=torch.bfloat16)
        z = torch.zeros(n)
        kw = dict(step=1, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        ca.adam_step(q, z, z.clone(), z.clone(), param_out=out, bf16_rounding=mode, **kw)
        outs[mode] = out
    assert _bits_equal(outs["nearest_even"], p.to(torch.bfloat16))
    assert _bits_equal(outs["split"], ref_split(p)[0])
    assert not torch.equal(outs["split"].view(torch.int16), outs["nearest_even"].view(torch.int16))


# ---------------------------------------------------------------- bad input
def _rem_bufs(n=12):
    return dict(
        param_hi=torch.zeros(n, dtype=torch.bfloat16),
        param_lo=torch.zeros(n, dtype=torch.int16),
        grad=torch.ones(n),
        exp_avg=torch.zeros(n),
        exp_avg_sq=torch.zeros(n),
    )


_BAD = [
    (dict(param_hi=torch.zeros(12)), TypeError, "param_hi must be bfloat16, got float32"),
    (
        dict(param_lo=torch.zeros(12, dtype=torch.bfloat16)),
        TypeError,
        "param_lo must be int16, got bfloat16",
    ),
    (
        dict(param_lo=torch.zeros(11, dtype=torch.int16)),
        ValueError,
        "param_lo has 11 elements, param_hi has 12",
    ),
    (dict(grad=torch.zeros(13)), ValueError, "grad has 13 elements, param_hi has 12"),
    (
        dict(exp_avg_sq=torch.zeros(12, dtype=torch.float16)),
        TypeError,
        "exp_avg_sq must be float32/bfloat16, got float16",
    ),
    (
        dict(param_lo=torch.zeros(24, dtype=torch.int16)[::2]),
        ValueError,
        "param_lo must be contiguous",
    ),
    (
        dict(param_hi=torch.zeros(12, dtype=torch.bfloat16, device="meta")),
        ValueError,
        "param_hi must be a CPU tensor",
    ),
]


@pytest.mark.parametrize("change, exc, match", _BAD)
def test_bad_remainder_inputs_raise_and_touch_nothing(change, exc, match):
    bufs = dict(_rem_bufs(), **change)
    snap = {k: t.clone() for k, t in bufs.items() if t.device.type == "cpu"}
    with pytest.raises(exc, match=match):
        ca.adam_step_remainder(*bufs.values(), step=1, weight_decay=0.0, **HYPER)
    assert all(torch.equal(bufs[k], t) for k, t in snap.items())


def test_bad_remainder_overlap_step_and_rounding():
    b = _rem_bufs()
    lo_on_hi = b["param_hi"].view(torch.int16)
    for kw, exc, match in (
        (dict(param_lo=lo_on_hi), ValueError, "param_hi and param_lo overlap"),
        (dict(exp_avg=b["grad"]), ValueError, "grad and exp_avg overlap"),
        (dict(step=0), ValueError, "adam_step_remainder: step must be >= 1, got 0"),
        (dict(lr=float("nan")), ValueError, "lr must be a finite"),
        (dict(decay_runs=[(0, 13)]), ValueError, r"decay_runs\[0\] = \(0, 13\) is out of range"),
    ):
        bufs = dict(b, **{k: x for k, x in kw.items() if isinstance(x, torch.Tensor)})
        args = dict(step=1, weight_decay=0.0, **HYPER)
        args.update({k: x for k, x in kw.items() if not isinstance(x, torch.Tensor)})
        with pytest.raises(exc, match=match):
            ca.adam_step_remainder(*bufs.values(), **args)
    p, z = torch.zeros(4), torch.zeros(4)
    kw = dict(step=1, weight_decay=0.0, **HYPER)
    with pytest.raises(ValueError, match="bf16_rounding must be 'nearest_even' or 'split'"):
        ca.adam_step(p, z, z.clone(), z.clone(), bf16_rounding="even", **kw)
    with pytest.raises(ValueError, match="'split' needs a bfloat16 param_out, got float16"):
        out = torch.zeros(4, dtype=torch.float16)
        ca.adam_step(p, z, z.clone(), z.clone(), param_out=out, bf16_rounding="split", **kw)
    with pytest.raises(ValueError, match="bf16_rounding 1 \\(split\\) needs a bf16 param_out"):
        t = torch.zeros(4)
        args = (t.data_ptr(), t.data_ptr(), 0, t.data_ptr(), t.data_ptr(), t.data_ptr(), 1, 4, 1)
        _C.adam_step(*args, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1.0, bf16_rounding=1)


def test_bad_split_join_inputs():
    x = torch.zeros(4)
    with pytest.raises(TypeError, match="split_fp32: x must be float32, got bfloat16"):
        ca.split_fp32(x.bfloat16())
    with pytest.raises(ValueError, match="split_fp32: lo has 3 elements, x has 4"):
        ca.split_fp32(x, lo=torch.zeros(3, dtype=torch.int16))
    with pytest.raises(ValueError, match="split_fp32: x and hi overlap"):
        ca.split_fp32(x, hi=x.view(torch.bfloat16)[:4])
    with pytest.raises(TypeError, match="join_fp32: lo must be int16, got float32"):
        ca.join_fp32(x.bfloat16(), x)
    with pytest.raises(ValueError, match="join_fp32: out has 5 elements, hi has 4"):
        ca.join_fp32(x.bfloat16(), x.short(), out=torch.zeros(5))
    hi, lo = ca.split_fp32(torch.zeros(0))
    assert hi.numel() == 0 and ca.join_fp32(hi, lo).numel() == 0


def test_raw_remainder_codes_and_addresses_checked_in_cpp():
    b = _rem_bufs(4)
    ptrs = [b[k].data_ptr() for k in ("param_hi", "param_lo", "grad")]
    args = (*ptrs, 0, b["exp_avg"].data_ptr(), b["exp_avg_sq"].data_ptr(), 4, 1)
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1.0)
    with pytest.raises(ValueError, match="exp_avg_dtype must be 0"):
        _C.adam_step_remainder(*args, *hyper, exp_avg_dtype=1)
    with pytest.raises(ValueError, match="grad_dtype must be"):
        _C.adam_step_remainder(*args[:3], 5, *args[4:], *hyper)
    with pytest.raises(ValueError, match="null param_hi/param_lo"):
        _C.adam_step_remainder(args[0], 0, *args[2:], *hyper)
    with pytest.raises(ValueError, match="null param_hi/param_lo"):
        _C.adam_step_remainder(0, *args[1:], *hyper)
    with pytest.raises(ValueError, match="step must be >= 1, got 0"):
        _C.adam_step_remainder(*args[:-1], 0, *hyper)
    with pytest.raises(ValueError, match="null x/hi/lo address"):
        _C.split_fp32(0, ptrs[0], ptrs[1], 4)
