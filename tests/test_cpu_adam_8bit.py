"""CPU Adam with block-wise 8-bit moments (Blockwise8): the codes against their formulas,
the encode against a torch reference written here (the canonical pair of codes around x
from a searchsorted on the fp32 decoded values, then the dithered or nearest choice),
idempotence (quantize(dequantize(q)) == q for any q the kernel writes), and the step bit
for bit: an 8-bit step == the fp32-moment kernel run on the decoded moments, its new
codes/scales == the reference encode of that step's new moments at that step -- on every
SIMD path, grad dtype, out code (incl. remainders), awkward sizes (partial last block),
decay runs cut inside blocks, threads, special values and bad input. What the code is for
(the freeze, the loss cost): tests/test_cpu_adam_8bit_accuracy.py."""

import math

import pytest
import torch
from cpu_adam_ref import (
    CONFIGS,
    GRAD_DTYPES,
    HYPER,
    _bits_equal,
    level_fixture,  # noqa: F401 (pytest fixture)
    threads_fixture,  # noqa: F401 (pytest fixture)
)

from mp_offload import _cpu_adam as _C
from mp_offload.ops import cpu_adam as ca

B = ca.Q8_BLOCK
SIZES = [0, 1, 17, 255, 256, 257, 1000, 4099]
KINDS = ["exp_avg", "exp_avg_sq"]
STEP = 2 ** (1 / 8)  # code ratio


# ------------------------------------------------------------------ reference
def ref_table(moment):
    """The codes' values from their formulas (q8_codes.h), in float64 rounded once."""
    k = torch.arange(128 if moment == "exp_avg" else 256, dtype=torch.float64)
    mag = torch.where(k == 0, 0.0, torch.exp2((k - (k.numel() - 1)) / 8)).float()
    return torch.cat([mag, -mag]) if moment == "exp_avg" else mag


def _mags(moment):
    return ref_table(moment)[: 128 if moment == "exp_avg" else 256]


def _blocks(x):
    """x -> (blocks, B) zero-padded (zeros change no block's absmax)."""
    pad = (-x.numel()) % B
    return torch.cat([x, x.new_zeros(pad)]).view(-1, B)


def ref_dither(nblocks, moment, step):
    """u per element (q8_codes.h, THE FREEZE): 1/2 without a step."""
    if step is None:
        return torch.full((nblocks, B), 0.5)
    j = torch.arange(B)
    h = (j * 49471 + step * 37345 + (1 if moment == "exp_avg" else 0)) & 0xFFFF
    return ((h | 1).float() * 2.0**-16).expand(nblocks, B)


def _f32(x):
    return torch.tensor(x, dtype=torch.float32)


def _tiny(moment):
    """The smallest scale with value_1 * scale normal."""
    v1, least = _mags(moment)[1], _f32(2.0**-126)
    tiny = least / v1
    return tiny if tiny * v1 >= least else torch.nextafter(tiny, _f32(1.0))


def _fast_blocks(amax, moment):
    """Blocks of the fast rule: value_1 * scale and 1 / scale normal (q8_codes.h)."""
    return (amax >= _tiny(moment)) & (amax < 2.0**126)


def _fast_codes(a, amax, u, moment):
    """The fast rule in y = RN(|x| * RN(1 / scale)): c = the code below y from its float
    bits, code c + 1 iff z - M_j > RN(G_j * u) (z: y's significand, M_j: c's), and below
    code 1: code 1 iff y > RN(value_1 * u) (exp_avg_sq: iff y > 0)."""
    mags = _mags(moment)
    y = a * (1 / torch.where(amax == 0, 1.0, amax))[:, None]
    yb = y.view(torch.int32).long()
    m_j = torch.exp2(torch.arange(9, dtype=torch.float64) / 8).float()
    m_j[8] = 2.0
    thr = torch.cat([(m_j[1:8].view(torch.int32).long() & 0x7FFFFF) - 1, torch.tensor([0x7FFFFF])])
    k = (yb >> 20) + ((yb & 0x7FFFFF) > thr[(yb >> 20) & 7]).long() + mags.numel() - 1 - 127 * 8
    j = (k + 1) & 7
    z = ((yb & 0x7FFFFF) | 0x3F800000).int().view(torch.float32)
    up = (z - m_j[j]) > (m_j[j + 1] - m_j[j]) * u
    low = y > (mags[1] * u if moment == "exp_avg" else 0.0)  # a v > 0 is never 0
    return torch.where(k < 1, low.long(), k + up.long())


def _exact_codes(a, amax, u, moment):
    """The rule on decoded values D = RN(value * scale) by search: c = the smallest code
    of the largest D <= |x|, n = the smallest code of the next larger D; code n iff
    |x| - D[c] > RN((D[n] - D[c]) * u) (exp_avg_sq: or D[c] = 0 < |x|)."""
    mags = _mags(moment)
    d = mags[None, :] * amax[:, None]  # fp32 products: RN
    top = mags.numel() - 1
    c = torch.searchsorted(d, a, right=True) - 1  # the largest code with D <= a
    nxt = (c + 1).clamp(max=top)
    c = torch.searchsorted(d, d.gather(1, c).contiguous(), right=False)  # smallest code of it
    d0, d1 = d.gather(1, c), d.gather(1, nxt)
    up = (a - d0) > (d1 - d0) * u
    if moment == "exp_avg_sq":  # a v > 0 is never 0
        up |= (d0 == 0) & (a > 0)
    return torch.where(up & (nxt > c), nxt, c)


def ref_encode(x, moment, step=None):
    """Scale = absmax per block (NaN if it holds an inf or NaN; codes 0 then and for an
    all-zero block); the fast or the exact rule per block (q8_codes.h, THE RULE); bit 7 =
    sign for exp_avg on a non-zero magnitude."""
    n, xb = x.numel(), _blocks(x)
    amax = xb.abs().amax(1) if xb.numel() else xb.new_zeros(0)
    bad = ~xb.isfinite().all(1)
    amax_ok = torch.where(bad, 0.0, amax)
    a, u = xb.abs().nan_to_num(0.0, 0.0).contiguous(), ref_dither(xb.shape[0], moment, step)
    fast = _fast_blocks(amax_ok, moment)[:, None]
    k = torch.where(fast, _fast_codes(a, amax_ok, u, moment), _exact_codes(a, amax_ok, u, moment))
    if moment == "exp_avg":
        k = k | (((xb < 0) & (k > 0)).long() << 7)
    k[bad | (amax == 0)] = 0
    scales = torch.where(bad, torch.nan, amax)
    return k.to(torch.uint8).flatten()[:n].clone(), scales  # own storage: ends at n


def ref_decode(q, moment):
    n = q.codes.numel()
    s = q.scales.repeat_interleave(B)[:n]
    return ref_table(moment)[q.codes.long()] * s


def _q8(x, moment):
    return ca.Blockwise8(*ref_encode(x, moment))


def _moments(n, gen):
    """Plausible moments: m ~ N(0, 1e-2) with a spread of magnitudes, v ~ m^2 / 0.1 + tiny."""
    m = torch.randn(n, generator=gen) * 0.01 * torch.exp2(torch.randn(n, generator=gen) * 3)
    v = m * m * 10 + torch.rand(n, generator=gen) * 1e-6
    return m, v


def _same_q(q, codes, scales):
    return torch.equal(q.codes, codes) and _bits_equal(q.scales, scales)


# ------------------------------------------------------------------ the codes
@pytest.mark.parametrize("moment", KINDS)
def test_tables_follow_their_formulas(moment):
    t = ca.q8_table(moment)
    assert t.dtype == torch.float32 and t.numel() == 256
    assert _bits_equal(t, ref_table(moment))
    mag = t[:128] if moment == "exp_avg" else t
    assert mag[0] == 0 and mag[-1] == 1 and (mag[1:] > mag[:-1]).all()
    ratios = (mag[2:].double() / mag[1:-1].double()).sub(STEP).abs()
    assert ratios.max() < 1e-6
    lowest = 2 ** (-126 / 8) if moment == "exp_avg" else 2 ** (-254 / 8)
    assert math.isclose(mag[1].item(), lowest, rel_tol=1e-6)


STEPS = [None, 1, 2, 999, 65536 + 3]


@pytest.mark.parametrize("moment", KINDS)
def test_encode_at_codes_midpoints_and_their_neighbours(level, moment):
    """The rule at its edges: every code value (comes back as itself for every dither),
    the fp32 midpoints between neighbours and their float neighbours (nearest: a tie goes
    down), 0, -0 and tiny values, in blocks whose absmax is 1 or 3.7 (one more rounding)."""
    mags = _mags(moment)
    mids = ((mags[:-1].double() + mags[1:].double()) / 2).float()
    vals = torch.cat(
        [
            mags,
            mids,
            torch.nextafter(mids, torch.tensor(2.0)),
            torch.nextafter(mids, torch.tensor(0.0)),
            torch.nextafter(mags, torch.tensor(2.0)),
            torch.nextafter(mags, torch.tensor(0.0)),
            torch.tensor([0.0, -0.0, 1e-30, 2.0**-40, 2.0**-17, 2.0**-33]),
        ]
    ).clamp(max=1.0)
    vals = torch.cat([vals, -vals]) if moment == "exp_avg" else vals.abs()
    for scale in (1.0, 3.7):
        one = torch.full((1,), scale)
        x = torch.cat([torch.cat([one, c * scale]) for c in vals.split(B - 1)])
        for step in STEPS:
            q = ca.quantize_8bit(x, moment, step=step)
            assert _same_q(q, *ref_encode(x, moment, step)), (scale, step)
            assert (q.scales == scale).all()
    x = torch.cat([torch.cat([torch.ones(1), c]) for c in mags.split(B - 1)])
    for step in STEPS:  # a code value is its own code
        got = ca.quantize_8bit(x, moment, step=step).codes.long()
        i = torch.arange(mags.numel())
        assert torch.equal(got[i + i // (B - 1) + 1], i)
    x = torch.cat([torch.cat([torch.ones(1), c]) for c in vals.split(B - 1)])
    mag = ca.quantize_8bit(x, moment).codes.long() & (0x7F if moment == "exp_avg" else 0xFF)
    dist = (x.abs().double()[:, None] - mags.double()[None, :]).abs()
    want = dist.argmin(1)  # nearest: the exact distances, a tie goes down
    if moment == "exp_avg_sq":  # ... but a v > 0 keeps code 1
        want = torch.where(x > 0, want.clamp(min=1), want)
    assert torch.equal(mag, want)


@pytest.mark.parametrize("moment", KINDS)
@pytest.mark.parametrize("n", SIZES)
def test_quantize_dequantize_against_reference(level, moment, n):
    gen = torch.Generator().manual_seed(n + 7)
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randn(n, generator=gen) * 6)
    if moment == "exp_avg_sq":
        x = x.abs()
    for step in STEPS:
        q = ca.quantize_8bit(x, moment, step=step)
        assert _same_q(q, *ref_encode(x, moment, step))
        back = ca.dequantize_8bit(q, moment)
        assert _bits_equal(back, ref_decode(q, moment))
        if n:  # inside the code's range: within half a step (nearest), one step (dithered)
            s = q.scales.repeat_interleave(B)[:n]
            lowest = (2 ** (-126 / 8) if moment == "exp_avg" else 2 ** (-254 / 8)) * s
            inside = x.abs() >= lowest
            rel = ((back - x).abs() / x.abs())[inside]
            bound = (STEP - 1) / (STEP + 1) if step is None else STEP - 1
            assert rel.max() <= bound + 1e-6


def _awkward_moments(moment):
    """Blocks of every kind the kernel meets: ordinary, all zero, with an inf / a NaN,
    scales so small that decoded values underflow (subnormal, equal ones), huge scales,
    the fast rule's smallest scale and the float below it, lone non-zeros among zeros,
    and a partial last block."""
    gen = torch.Generator().manual_seed(17)
    n = 14 * B + 77
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randn(n, generator=gen) * 5)
    blk = x[: 14 * B].view(14, B)
    blk[1] = 0.0
    blk[2, 5] = torch.inf
    blk[3, 9] = torch.nan
    tiny = _tiny(moment)
    scales = [1e-30, 1e-38, 2.0**-140, 3e38, 2.0**126, tiny, torch.nextafter(tiny, _f32(0.0))]
    for row, scale in enumerate(scales, start=4):
        blk[row] = blk[row] / blk[row].abs().max() * scale
    blk[11] = 0.0
    blk[11, 7] = -1e-3
    blk[12] = torch.randn(B, generator=gen) * 1e-20  # underflows a little below the floor
    if moment == "exp_avg_sq":
        x = x.abs()
    return x


@pytest.mark.parametrize("moment", KINDS)
def test_exact_rule_for_tiny_and_huge_scales(level, moment):
    """Blocks whose decoded values underflow (or whose 1 / scale would) take the exact
    search: still the reference's codes, the smallest code of equal decoded values."""
    x = _awkward_moments(moment)
    for step in STEPS:
        q = ca.quantize_8bit(x, moment, step=step)
        assert _same_q(q, *ref_encode(x, moment, step))


@pytest.mark.parametrize("moment", KINDS)
def test_quantize_of_dequantize_is_identity(level, moment):
    """Idempotence for checkpoints that store fp32 moments: any q the encode writes (any
    dither, any block kind) decodes to values that encode back to q, codes and scales,
    with any dither too."""
    x = _awkward_moments(moment)
    gen = torch.Generator().manual_seed(3)
    for n in SIZES + [x.numel()]:
        xs = x[:n].clone() if n == x.numel() else _moments(n, gen)[moment == "exp_avg_sq"]
        for step in STEPS:
            q = ca.quantize_8bit(xs, moment, step=step)
            back = ca.dequantize_8bit(q, moment)
            for again in (None, 5):
                assert _same_q(ca.quantize_8bit(back, moment, step=again), q.codes, q.scales)


@pytest.mark.parametrize("moment", KINDS)
def test_every_code_at_any_scale_decodes_to_itself(level, moment):
    """Idempotence code by code: 3000 blocks, scales log-uniform over the whole float range
    (fast and exact rule alike), each block holding every code (the top one first, so the
    scale is the block's absmax): decode, encode with several dithers -> the same codes
    wherever the decoded values differ (equal ones collapse to their smallest code)."""
    gen = torch.Generator().manual_seed(23)
    nb, mags = 3000, _mags(moment)
    scales = torch.exp2(torch.rand(nb, generator=gen) * 254 - 127).clamp(max=3.4e38)
    perm = torch.argsort(torch.rand(nb, B, generator=gen), dim=1)
    codes = perm % mags.numel()
    codes[:, 0] = mags.numel() - 1  # the top code: absmax = scale
    if moment == "exp_avg":
        codes |= (torch.rand(nb, B, generator=gen) < 0.5).long() << 7
        codes[(codes & 0x7F) == 0] = 0  # no sign on a zero magnitude, as the encode writes
    q = ca.Blockwise8(codes.to(torch.uint8).flatten(), scales)
    back = ca.dequantize_8bit(q, moment)
    d = mags[None, :] * scales[:, None]
    want = torch.searchsorted(
        d, d.gather(1, codes & 0x7F if moment == "exp_avg" else codes).contiguous()
    )
    if moment == "exp_avg":
        want = want | (codes & 0x80) * (want > 0)
    else:  # a v > 0 keeps code 1 even where code 1 underflows to the value of code 0
        want = torch.where(back.view(nb, B) > 0, want, 0)
    for step in STEPS:
        got = ca.quantize_8bit(back, moment, step=step)
        assert _bits_equal(got.scales, scales)
        assert torch.equal(got.codes.view(nb, B).long(), want), step


def test_a_positive_v_is_never_coded_zero(level):
    """v far below its block's range (1e-12 .. 1e-30 of the absmax, where nearest rounding
    gives 0) keeps code 1 on every dither: a v of 0 under a non-zero m would make that
    element's step m / eps. m that small may become 0 (a zero step)."""
    v = torch.cat([torch.ones(1), torch.logspace(-12, -30, B - 1)])
    for step in STEPS:
        q = ca.quantize_8bit(v, "exp_avg_sq", step=step)
        assert (q.codes[1:] >= 1).all() and (ca.dequantize_8bit(q, "exp_avg_sq") > 0).all()
    tiny = torch.cat([torch.full((1,), 1e-36), torch.full((B - 1,), 1e-44)])  # exact rule
    assert (ca.quantize_8bit(tiny, "exp_avg_sq", step=3).codes >= 1).all()


def test_special_blocks_quantize(level):
    """inf or NaN -> that block's scale NaN (decodes to NaN); zero block -> scale 0."""
    x = torch.ones(4 * B + 3)
    x[B + 5] = torch.inf
    x[2 * B + 7] = torch.nan
    x[3 * B : 4 * B] = 0.0
    x[4 * B] = -0.0
    for moment in KINDS:
        q = ca.quantize_8bit(x, moment)
        assert q.scales[0] == 1 and q.scales[1].isnan() and q.scales[2].isnan()
        assert q.scales[3] == 0 and q.scales[4] == 1
        assert (q.codes[B : 3 * B] == 0).all() and (q.codes[3 * B : 4 * B] == 0).all()
        assert q.codes[4 * B] == 0  # -0: no sign bit on a zero magnitude
        back = ca.dequantize_8bit(q, moment)
        assert back[B : 3 * B].isnan().all() and (back[3 * B : 4 * B] == 0).all()
        assert _bits_equal(back[:B], x[:B]) and back[4 * B] == 0


# ---------------------------------------------------------------- the kernel
MOMENTS = [("q8", "q8"), ("q8", torch.float32), (torch.bfloat16, "q8")]


def _make(kind, x, moment):
    return _q8(x, moment) if kind == "q8" else x.to(kind)


def _fp32_view(t, moment):
    return ref_decode(t, moment) if isinstance(t, ca.Blockwise8) else t.clone()


def _step_both(p0, g, m0, v0, out_dtype=None, runs=None, remainder=False, **kw):
    """The 8-bit step and the fp32-moment step on the decoded moments; asserts they
    agree bit for bit (param/out, the non-8-bit moment, and the 8-bit codes/scales)."""
    mq = (
        ca.Blockwise8(m0.codes.clone(), m0.scales.clone())
        if isinstance(m0, ca.Blockwise8)
        else m0.clone()
    )
    vq = (
        ca.Blockwise8(v0.codes.clone(), v0.scales.clone())
        if isinstance(v0, ca.Blockwise8)
        else v0.clone()
    )
    mf, vf = _fp32_view(m0, "exp_avg"), _fp32_view(v0, "exp_avg_sq")
    mf_dtype, vf_dtype = mf.dtype, vf.dtype
    mf, vf = mf.float(), vf.float()
    n = p0.numel()
    if remainder:
        hi, lo = ca.split_fp32(p0)
        rh, rl = hi.clone(), lo.clone()
        ca.adam_step_remainder(hi, lo, g, mq, vq, decay_runs=runs, **kw)
        ca.adam_step_remainder(rh, rl, g, mf, vf, decay_runs=runs, **kw)
        assert _bits_equal(hi, rh) and _bits_equal(lo, rl)
    else:
        p, pf = p0.clone(), p0.clone()
        out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
        outf = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
        ca.adam_step(p, g, mq, vq, param_out=out, decay_runs=runs, **kw)
        ca.adam_step(pf, g, mf, vf, param_out=outf, decay_runs=runs, **kw)
        assert _bits_equal(p, pf) and (out is None or _bits_equal(out, outf))
    for q, f, dt, moment in ((mq, mf, mf_dtype, "exp_avg"), (vq, vf, vf_dtype, "exp_avg_sq")):
        if isinstance(q, ca.Blockwise8):
            codes, scales = ref_encode(f, moment, kw["step"])
            assert torch.equal(q.codes, codes) and _bits_equal(q.scales, scales)
        else:  # the kernel ran that moment in fp32 here only because bf16 widens exactly
            assert _bits_equal(q, f.to(dt))
    return mq, vq


@pytest.mark.parametrize("moments", MOMENTS, ids=["q8_q8", "q8_f32", "bf16_q8"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["g_fp32", "g_fp16", "g_bf16"])
def test_8bit_step_equals_fp32_step_on_decoded(level, grad_dtype, moments):
    gen = torch.Generator().manual_seed(21)
    for n in SIZES:
        for adamw, wd, bc in CONFIGS:
            p = torch.randn(n, generator=gen)
            g = (torch.randn(n, generator=gen) * 0.1).to(grad_dtype)
            m, v = _moments(n, gen)
            m0, v0 = _make(moments[0], m, "exp_avg"), _make(moments[1], v, "exp_avg_sq")
            for step in (1, 7):
                kw = dict(step=step, weight_decay=wd, adamw=adamw, bias_correction=bc, **HYPER)
                _step_both(p, g, m0, v0, **kw)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, "remainder"])
def test_8bit_with_param_out_and_remainders(level, out_dtype):
    gen = torch.Generator().manual_seed(5)
    for n in SIZES:
        p = torch.randn(n, generator=gen)
        g = torch.randn(n, generator=gen).to(torch.bfloat16)
        m, v = _moments(n, gen)
        kw = dict(step=3, weight_decay=0.1, grad_scale=0.5, **HYPER)
        m0, v0 = _q8(m, "exp_avg"), _q8(v, "exp_avg_sq")
        if out_dtype == "remainder":
            _step_both(p, g, m0, v0, remainder=True, **kw)
        else:
            _step_both(p, g, m0, v0, out_dtype=out_dtype, **kw)


def test_decay_runs_cut_inside_blocks(level):
    """Runs starting and ending inside blocks and across the kernel's groups of 8 blocks
    (run_range's base offset)."""
    n = 19 * B + 77
    gen = torch.Generator().manual_seed(9)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = _moments(n, gen)
    runs = [(3, 100), (100, 200), (B + 1, 3 * B - 1), (4 * B + 10, 8 * B + 5), (15 * B, n)]
    kw = dict(step=2, weight_decay=0.1, **HYPER)
    _step_both(p, g, _q8(m, "exp_avg"), _q8(v, "exp_avg_sq"), runs=runs, **kw)


def test_threads_give_the_same_bits(level, threads):
    n = 4 * 8192 + 300  # several threads' chunks and a partial last block
    gen = torch.Generator().manual_seed(3)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = _moments(n, gen)
    res = []
    for t in (1, 3):
        ca.set_num_threads(t)
        pp, mq, vq = p.clone(), _q8(m, "exp_avg"), _q8(v, "exp_avg_sq")
        ca.adam_step(pp, g, mq, vq, step=4, weight_decay=0.1, **HYPER)
        assert ca.last_num_threads() == t
        res.append((pp, mq, vq))
    (p1, m1, v1), (p3, m3, v3) = res
    assert (
        _bits_equal(p1, p3) and torch.equal(m1.codes, m3.codes) and torch.equal(v1.codes, v3.codes)
    )
    assert _bits_equal(m1.scales, m3.scales) and _bits_equal(v1.scales, v3.scales)


def test_views_on_block_boundaries(level):
    """A slice stepped as two calls on block-aligned views == one call on the whole."""
    n = 3 * B + 40
    gen = torch.Generator().manual_seed(11)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = _moments(n, gen)
    whole = (p.clone(), _q8(m, "exp_avg"), _q8(v, "exp_avg_sq"))
    parts = (p.clone(), _q8(m, "exp_avg"), _q8(v, "exp_avg_sq"))
    kw = dict(step=2, weight_decay=0.1, **HYPER)
    ca.adam_step(whole[0], g, whole[1], whole[2], **kw)
    pp, mq, vq = parts
    for a, b in ((0, 2 * B), (2 * B, n)):
        sub = [ca.Blockwise8(q.codes[a:b], q.scales[a // B : -(-b // B)]) for q in (mq, vq)]
        ca.adam_step(pp[a:b], g[a:b], sub[0], sub[1], **kw)
    assert _bits_equal(whole[0], pp)
    assert torch.equal(whole[1].codes, mq.codes) and torch.equal(whole[2].codes, vq.codes)


def test_special_values_poison_their_block_only(level):
    """A NaN / inf grad makes its block's scales NaN (the whole block's moments NaN next
    step, as fp32 moments would spread it through the param anyway); other blocks
    step as usual; the kernel still equals the fp32 step on the decoded moments."""
    n = 3 * B
    gen = torch.Generator().manual_seed(13)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    g[B + 3], g[2 * B + 9] = torch.nan, torch.inf
    m, v = _moments(n, gen)
    m[:B] = 0.0  # an all-zero block of m: scale 0 in, the grads make it non-zero
    kw = dict(step=1, weight_decay=0.0, **HYPER)
    mq, vq = _step_both(p, g, _q8(m, "exp_avg"), _q8(v, "exp_avg_sq"), **kw)
    assert mq.scales[0] > 0 and mq.scales[1:].isnan().all() and vq.scales[1:].isnan().all()
    zero = torch.zeros(n)
    mq, vq = _step_both(p, zero, _q8(zero, "exp_avg"), _q8(zero, "exp_avg_sq"), **kw)
    assert (mq.scales == 0).all() and (vq.scales == 0).all()


# ---------------------------------------------------------------- bad input
def _bufs(n=300):
    return torch.zeros(n), torch.zeros(n), ca.Blockwise8.zeros(n), ca.Blockwise8.zeros(n)


KW = dict(step=1, weight_decay=0.0, **HYPER)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (
            lambda q: ca.Blockwise8(q.codes.to(torch.int8), q.scales),
            r"exp_avg\.codes must be uint8",
        ),
        (lambda q: ca.Blockwise8(q.codes, q.scales[:1]), r"exp_avg\.scales has 1 elements"),
        (lambda q: ca.Blockwise8(q.codes, q.scales.double()), r"exp_avg\.scales must be float32"),
        (lambda q: ca.Blockwise8(q.codes[:100], q.scales[:1]), r"exp_avg\.codes has 100 elements"),
    ],
)
def test_bad_blockwise_moment(mutate, match):
    p, g, m, v = _bufs()
    with pytest.raises((TypeError, ValueError), match=match):
        ca.adam_step(p, g, mutate(m), v, **KW)


def test_views_that_split_a_block():
    codes, scales = torch.zeros(3 * B, dtype=torch.uint8), torch.zeros(3)
    p, g, _, v = _bufs(B)
    with pytest.raises(ValueError, match=r"exp_avg\.codes starts at element 10 of its storage"):
        ca.adam_step(p, g, ca.Blockwise8(codes[10 : 10 + B], scales[:1]), v, **KW)
    p, g, m, _ = _bufs(100)
    with pytest.raises(ValueError, match=r"exp_avg_sq\.codes ends inside a block of 256"):
        ca.adam_step(p, g, m, ca.Blockwise8(codes[:100], scales[:1]), **KW)


def test_overlaps_and_other_entry_points():
    p, g, m, v = _bufs()
    shared = ca.Blockwise8(m.codes, v.scales)
    with pytest.raises(ValueError, match=r"exp_avg\.scales and exp_avg_sq\.scales overlap"):
        ca.adam_step(p, g, ca.Blockwise8(m.codes, v.scales), ca.Blockwise8(v.codes, v.scales), **KW)
    with pytest.raises(ValueError, match=r"exp_avg\.codes and exp_avg_sq\.codes overlap"):
        ca.adam_step(p, g, shared, ca.Blockwise8(m.codes, m.scales), **KW)
    with pytest.raises(TypeError, match=r"stream_probe: 8-bit"):
        ca.stream_probe(p, g, m, v)
    with pytest.raises(ValueError, match=r"moment must be 'exp_avg' or 'exp_avg_sq'"):
        ca.quantize_8bit(p, "exp_avg_sqq")
    with pytest.raises(TypeError, match=r"dequantize_8bit: q must be a Blockwise8"):
        ca.dequantize_8bit(p, "exp_avg")
    hi, lo = ca.split_fp32(p)
    with pytest.raises(ValueError, match=r"adam_step_remainder: exp_avg\.scales has 1 elements"):
        ca.adam_step_remainder(hi, lo, g, ca.Blockwise8(m.codes, m.scales[:1]), v, **KW)


def test_raw_entry_point_checks_codes_and_scales():
    p, g, m, v = _bufs()
    args = (p.data_ptr(), g.data_ptr(), 0, m.codes.data_ptr(), v.codes.data_ptr(), 0, 0, 300, 1)
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1.0)
    with pytest.raises(ValueError, match="null exp_avg_scale/exp_avg_sq_scale address"):
        _C.adam_step(*args, *hyper, _C.DTYPE_Q8, _C.DTYPE_Q8, None, 0, m.scales.data_ptr(), 0)
    with pytest.raises(
        ValueError, match=r"exp_avg_dtype must be 0 \(fp32\), 2 \(bf16\) or 5 \(8-bit\), got 6"
    ):
        _C.adam_step(*args, *hyper, 6, 0, None, 0)
    with pytest.raises(
        ValueError, match=r"exp_avg_sq_dtype must be 0 \(fp32\) or 2 \(bf16\), got 5"
    ):
        _C.stream_probe(*args[:8], 0, _C.DTYPE_Q8)
