"""CPU Adam out of place (adam_step's param_dst / exp_avg_dst / exp_avg_sq_dst,
adam_step_remainder's four *_dst): bit for bit copying the sources into the dst tensors
and stepping those in place, the sources untouched bit for bit -- on every SIMD path, grad
dtype, moment dtype, param_out code, awkward sizes, aligned (streamed stores) and
misaligned dst buffers, decay runs, threads and special values; and bad input (one clear
error naming the arguments, nothing touched)."""

import pytest
import torch
from cpu_adam_ref import (
    CONFIGS,
    GRAD_DTYPES,
    HYPER,
    _bits_equal,
    level_fixture,  # noqa: F401 (pytest fixture)
    special_floats,
    threads_fixture,  # noqa: F401 (pytest fixture)
)

from mp_offload import _cpu_adam as _C
from mp_offload.ops import cpu_adam as ca

SIZES = [0, 1, 15, 16, 17, 31, 33, 255, 257, 4099]
MOMENTS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]
MOMENT_IDS = ["mv_fp32", "mv_bf16"]
OUTS = [(None, "nearest_even"), (torch.bfloat16, "nearest_even"), (torch.bfloat16, "split")]
OUTS += [(torch.float16, "nearest_even")]
OUT_IDS = ["no_out", "out_bf16", "out_split", "out_fp16"]


def _dst_like(t, off):
    """A NaN-filled (every bit must be written) tensor like t, `off` elements into its
    storage: off = 0 keeps the allocator's alignment (the kernel streams its stores),
    off = 1 puts every vector across a line (plain stores)."""
    d = torch.empty(t.numel() + off, dtype=t.dtype)[off:]
    d.view(torch.int16 if t.element_size() == 2 else torch.int32).fill_(-1)
    return d


def _snap(ts):
    return [t.clone() for t in ts]


def _all_equal(a, b):
    return all(_bits_equal(x, y) for x, y in zip(a, b))


def _check_adam(p, g, m, v, off=0, out_dtype=None, rounding="nearest_even", **kw):
    """One step out of place and one on copies in place: dst == in-place result, the
    sources untouched, the param_out copies equal."""
    srcs = _snap((p, m, v))
    dsts = [_dst_like(t, off) for t in (p, m, v)]
    outs = [None if out_dtype is None else torch.empty(p.numel(), dtype=out_dtype) for _ in "ab"]
    ca.adam_step(
        p, g, m, v, param_out=outs[0], bf16_rounding=rounding, **kw,
        param_dst=dsts[0], exp_avg_dst=dsts[1], exp_avg_sq_dst=dsts[2],
    )  # fmt: skip
    ref = _snap(srcs)
    ca.adam_step(*ref[:1], g, *ref[1:], param_out=outs[1], bf16_rounding=rounding, **kw)
    assert _all_equal((p, m, v), srcs), "a source changed"
    assert _all_equal(dsts, ref), "out of place != copy + in place"
    if out_dtype is not None:
        assert _bits_equal(outs[0], outs[1])
    return dsts


def _check_remainder(hi, lo, g, m, v, off=0, **kw):
    srcs = _snap((hi, lo, m, v))
    dsts = [_dst_like(t, off) for t in srcs]
    names = ("param_hi_dst", "param_lo_dst", "exp_avg_dst", "exp_avg_sq_dst")
    ca.adam_step_remainder(hi, lo, g, m, v, **kw, **dict(zip(names, dsts)))
    ref = _snap(srcs)
    ca.adam_step_remainder(ref[0], ref[1], g, ref[2], ref[3], **kw)
    assert _all_equal((hi, lo, m, v), srcs), "a source changed"
    assert _all_equal(dsts, ref), "out of place != copy + in place"
    return dsts


def _state(n, gen, mt, vt):
    p = torch.randn(n, generator=gen)
    m = (torch.randn(n, generator=gen) * 0.1).to(mt)
    v = (torch.rand(n, generator=gen) * 0.01).to(vt)
    return p, m, v


# ------------------------------------------------------------------ adam_step
@pytest.mark.parametrize("out", OUTS, ids=OUT_IDS)
@pytest.mark.parametrize("moments", MOMENTS, ids=MOMENT_IDS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["g_fp32", "g_fp16", "g_bf16"])
def test_adam_step_out_of_place(level, grad_dtype, moments, out):
    gen = torch.Generator().manual_seed(5)
    for n in SIZES:
        for k, (adamw, wd, bc) in enumerate(CONFIGS):
            p, m, v = _state(n, gen, *moments)
            g = torch.randn(n, generator=gen).to(grad_dtype)
            kw = dict(step=k + 1, weight_decay=wd, adamw=adamw, bias_correction=bc, **HYPER)
            _check_adam(p, g, m, v, off=k % 2, out_dtype=out[0], rounding=out[1], **kw)


def test_adam_step_ping_pong_steps(level):
    """Steps alternating between two state copies (the overlap's ping-pong) give the
    bits of the same steps in place."""
    gen = torch.Generator().manual_seed(6)
    n = 1000
    a = list(_state(n, gen, torch.float32, torch.bfloat16))
    b = [torch.empty_like(t) for t in a]
    ref = _snap(a)
    for step in range(1, 6):
        g = torch.randn(n, generator=gen).bfloat16()
        kw = dict(step=step, weight_decay=0.1, **HYPER)
        ca.adam_step(
            a[0], g, a[1], a[2], param_dst=b[0], exp_avg_dst=b[1], exp_avg_sq_dst=b[2], **kw
        )
        ca.adam_step(ref[0], g, ref[1], ref[2], **kw)
        assert _all_equal(b, ref), step
        a, b = b, a


# ------------------------------------------------------------------ remainders
@pytest.mark.parametrize("moments", MOMENTS, ids=MOMENT_IDS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["g_fp32", "g_fp16", "g_bf16"])
def test_remainder_out_of_place(level, grad_dtype, moments):
    gen = torch.Generator().manual_seed(7)
    for n in SIZES:
        for k, (adamw, wd, bc) in enumerate(CONFIGS):
            p, m, v = _state(n, gen, *moments)
            g = torch.randn(n, generator=gen).to(grad_dtype)
            kw = dict(step=k + 1, weight_decay=wd, adamw=adamw, bias_correction=bc, **HYPER)
            _check_remainder(*ca.split_fp32(p), g, m, v, off=k % 2, **kw)


# ------------------------------------------------ special values, runs, threads
@pytest.mark.parametrize("lr", [0.0, 1e-2], ids=["lr0", "lr1e-2"])
def test_special_values_out_of_place(level, lr):
    x = special_floats()
    p = torch.cat([x, x[:11]])  # 59: vector bodies and a ragged tail on every level
    k = p.numel()
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(k, generator=gen)
    g[::7] = torch.tensor([float("nan"), float("inf"), 0.0, -0.0, 1e-45, 3e38, -3e38, 1.0, 2.0])
    m, v = x[torch.randperm(k, generator=gen) % x.numel()], torch.rand(k, generator=gen)
    for adamw, wd, bc in CONFIGS:
        kw = dict(step=2, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd)
        kw.update(adamw=adamw, bias_correction=bc)
        _check_adam(p, g, m, v, out_dtype=torch.bfloat16, **kw)
        _check_remainder(*ca.split_fp32(p), g.bfloat16(), m.bfloat16(), v.bfloat16(), **kw)


@pytest.mark.parametrize("off", [0, 3])
def test_runs_and_threads_out_of_place(level, threads, off):
    """decay_runs, two threads (chunks handed out on demand) and dst buffers aligned or
    not: out of place == in place on one thread."""
    n = 3 * _C.TILE + 77
    gen = torch.Generator().manual_seed(8)
    p, m, v = _state(n, gen, torch.float32, torch.float32)
    g = torch.randn(n, generator=gen).bfloat16()
    kw = dict(step=2, weight_decay=0.1, decay_runs=[(5, 5000), (5001, 9000), (20000, n - 3)])
    kw.update(HYPER)
    for t in (1, 2):
        ca.set_num_threads(t)
        _check_adam(p, g, m, v, off=off, out_dtype=torch.bfloat16, **kw)
        _check_remainder(*ca.split_fp32(p), g, m.bfloat16(), v, off=off, **kw)
        assert ca.last_num_threads() == t


# ------------------------------------------------------------------ bad input
def _bufs(n=12):
    grad = torch.ones(n + 8)[:n]  # room for a dst overlapping its tail
    return dict(param=torch.zeros(n), grad=grad, exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))


def _dsts(n=12):
    return dict(param_dst=torch.zeros(n), exp_avg_dst=torch.zeros(n), exp_avg_sq_dst=torch.zeros(n))


def _bad_adam():
    b, d = _bufs(), _dsts()
    q8 = ca.Blockwise8.zeros(12)
    return (
        [
            (
                dict(exp_avg_dst=None),
                ValueError,
                "param_dst, exp_avg_dst, exp_avg_sq_dst go together",
            ),
            (
                {"param_dst": None, "exp_avg_dst": None},
                ValueError,
                "without param_dst, exp_avg_dst$",
            ),
            (
                dict(param_dst=torch.zeros(12).bfloat16()),
                TypeError,
                "param_dst must be float32, got bf",
            ),
            (
                dict(exp_avg_sq_dst=torch.zeros(13)),
                ValueError,
                "exp_avg_sq_dst has 13 elements, exp_avg_sq has 12",
            ),
            (dict(exp_avg_dst=torch.zeros(24)[::2]), ValueError, "exp_avg_dst must be contiguous"),
            (dict(param_dst=b["param"]), ValueError, "param and param_dst overlap"),
            (
                dict(exp_avg_dst=b["grad"].as_strided((12,), (1,), 4)),
                ValueError,
                "grad and exp_avg_dst overlap",
            ),
            (dict(exp_avg_sq_dst=b["exp_avg"]), ValueError, "exp_avg and exp_avg_sq_dst overlap"),
            (
                dict(exp_avg_sq_dst=d["param_dst"]),
                ValueError,
                "param_dst and exp_avg_sq_dst overlap",
            ),
            (dict(exp_avg=q8), TypeError, "exp_avg_dst needs an fp32/bf16 exp_avg: an 8-bit"),
            (dict(exp_avg_sq=q8), TypeError, "exp_avg_sq_dst needs an fp32/bf16 exp_avg_sq"),
        ],
        b,
        d,
    )


def test_bad_adam_step_dsts_raise_and_touch_nothing():
    cases, b, d = _bad_adam()
    for change, exc, match in cases:
        bufs = dict(b, **{k: x for k, x in change.items() if k in b})
        dsts = dict(d, **{k: x for k, x in change.items() if k in d})
        snap = {k: t.clone() for k, t in {**b, **d}.items()}
        with pytest.raises(exc, match=match):
            ca.adam_step(*bufs.values(), step=1, weight_decay=0.0, **HYPER, **dsts)
        assert all(torch.equal({**b, **d}[k], t) for k, t in snap.items()), match
    out = d["param_dst"].view(torch.bfloat16)[:12]
    with pytest.raises(ValueError, match="param_out and param_dst overlap"):
        ca.adam_step(*b.values(), step=1, weight_decay=0.0, **HYPER, param_out=out, **d)


def test_bad_remainder_dsts():
    n = 12
    hi, lo = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.int16)
    g, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n)
    d = dict(
        param_hi_dst=torch.zeros(n, dtype=torch.bfloat16),
        param_lo_dst=torch.zeros(n, dtype=torch.int16),
        exp_avg_dst=torch.zeros(n),
        exp_avg_sq_dst=torch.zeros(n),
    )
    names = "param_hi_dst, param_lo_dst, exp_avg_dst, exp_avg_sq_dst go together"
    for change, exc, match in (
        (dict(param_lo_dst=None), ValueError, names + r".*without param_lo_dst$"),
        (
            dict(param_lo_dst=torch.zeros(n, dtype=torch.bfloat16)),
            TypeError,
            "param_lo_dst must be int16",
        ),
        (dict(param_hi_dst=hi), ValueError, "param_hi and param_hi_dst overlap"),
        (dict(param_lo_dst=hi.view(torch.int16)), ValueError, "param_hi and param_lo_dst overlap"),
    ):
        snap = [t.clone() for t in (hi, lo, m, v)]
        with pytest.raises(exc, match=match):
            ca.adam_step_remainder(
                hi, lo, g, m, v, step=1, weight_decay=0.0, **HYPER, **dict(d, **change)
            )
        assert _all_equal((hi, lo, m, v), snap)
    with pytest.raises(TypeError, match="exp_avg_sq_dst needs an fp32/bf16 exp_avg_sq"):
        ca.adam_step_remainder(
            hi, lo, g, m, ca.Blockwise8.zeros(n), step=1, weight_decay=0.0, **HYPER, **d
        )


def test_raw_dst_pointers_checked_in_cpp():
    """The C++ face on its own: all or none, no 8-bit moments out of place."""
    b, d = _bufs(4), _dsts(4)
    ptrs = [t.data_ptr() for t in b.values()]
    args = (
        ptrs[0],
        ptrs[1],
        0,
        ptrs[2],
        ptrs[3],
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
    with pytest.raises(ValueError, match="param_dst/exp_avg_dst/exp_avg_sq_dst: all or none"):
        _C.adam_step(*args, param_dst_ptr=d["param_dst"].data_ptr())
    with pytest.raises(ValueError, match="need fp32/bf16 moments: 8-bit ones step in place only"):
        dp = {f"{k}_ptr": t.data_ptr() for k, t in d.items()}
        _C.adam_step(*args, exp_avg_dtype=5, exp_avg_scale_ptr=ptrs[1], **dp)
    with pytest.raises(
        ValueError, match="param_hi_dst/param_lo_dst/exp_avg_dst/exp_avg_sq_dst: all or none"
    ):
        rem = (
            ptrs[0],
            ptrs[0] + 8,
            ptrs[1],
            0,
            ptrs[2],
            ptrs[3],
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
        _C.adam_step_remainder(*rem, hi_dst_ptr=d["param_dst"].data_ptr())
