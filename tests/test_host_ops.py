"""The host's gradient accumulation and sum of squares (csrc/host_ops.cpp), on every SIMD path.

Accumulation is exact per element, so each path must give torch's bits for fp32 += (or =)
the converted source. The sum of squares has one documented order (pieces of PIECE from
each range's start, LANES double lanes, a fixed fold, pieces in order): every path and
thread count must give the bits of that order restated in torch below.
"""

import os
import subprocess
import sys

import pytest
import torch

from mp_offload import _host_ops as C
from mp_offload.ops import host_ops

LEVELS = ["scalar", "avx2", "avx512"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 2, 7, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 100, 255, 1000, 4095, 4096, 4099]


@pytest.fixture(params=LEVELS)
def level(request):
    if request.param not in host_ops.available_simd_levels():
        pytest.skip(f"CPU lacks {request.param}")
    before = host_ops.simd_level()
    host_ops.set_simd_level(request.param)
    yield request.param
    host_ops.set_simd_level(before)


@pytest.fixture
def threads():
    before = C.get_num_threads()
    yield C.set_num_threads
    C.set_num_threads(before)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The values' bits, signed zeros included. A NaN counts as one pattern: torch's own
    fp16 -> fp32 NaN payload is not F16C's (0x7fffffff against 0x7fc00000)."""
    return torch.where(t.isnan(), torch.tensor(0x7FC00000, dtype=torch.int32), t.view(torch.int32))


def source(n: int, dtype, seed: int = 0) -> torch.Tensor:
    """Random values plus the edge cases of the dtype: inf, -inf, NaN, a subnormal, -0."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(n, generator=g).to(dtype)
    tiny = {torch.float16: 1e-7, torch.bfloat16: 1e-40, torch.float32: 1e-40}[dtype]
    edge = torch.tensor([float("inf"), -float("inf"), float("nan"), tiny, -tiny, -0.0])
    k = min(n, len(edge))
    src[:k] = edge[:k].to(dtype)
    return src


def reference_sum_squares(x: torch.Tensor, ranges) -> float:
    """The kernel's documented summation order, in torch double ops."""
    piece, lanes_n = C.PIECE, C.LANES
    total = 0.0
    for a, z in ranges:
        for b in range(a, z, piece):
            d = x[b : min(z, b + piece)].double()
            sq = torch.zeros(-(-d.numel() // lanes_n) * lanes_n, dtype=torch.float64)
            sq[: d.numel()] = d * d  # zero padding adds nothing: squares are >= +0
            lanes = torch.zeros(lanes_n, dtype=torch.float64)
            for row in sq.view(-1, lanes_n):
                lanes = lanes + row
            w = lanes_n // 2
            while w >= 1:
                lanes[:w] = lanes[:w] + lanes[w : 2 * w]
                w //= 2
            total += float(lanes[0])
    return total


def views(n: int, dtype, off_dst: int, off_src: int):
    """dst fp32 and src at odd element offsets of larger buffers (unaligned addresses)."""
    base = torch.randn(n + off_dst)[off_dst:]
    src_buf = torch.empty(n + off_src, dtype=dtype)
    src = src_buf[off_src:]
    src.copy_(source(n, dtype))
    return base, src


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offsets", [(0, 0), (1, 3), (3, 0), (0, 7)])
def test_accumulate_equals_torch(level, dtype, offsets):
    for n in SIZES:
        base, src = views(n, dtype, *offsets)
        if n > 8:
            base[6:8] = torch.tensor([-0.0, 0.0])  # -0 + -0 = -0, but +0 + -0 = +0
        dst = base.clone()
        host_ops.accumulate_(dst, src, overwrite=False)
        assert torch.equal(bits(dst), bits(base + src.float())), (level, dtype, n, offsets)
        host_ops.accumulate_(dst, src, overwrite=True)
        assert torch.equal(bits(dst), bits(src.float())), (level, dtype, n, offsets)


def _range_sets(n: int):
    sets = [[], [(0, n)], [(0, n // 3), (n // 2, n)]]
    return sets + [[(1, n // 2), (n - n // 4, n)]] if n >= 8 else sets


@pytest.mark.parametrize("offset", [0, 5])
def test_sum_squares_follows_the_documented_order(level, offset):
    for n in SIZES:
        x = torch.randn(n + offset)[offset:] * 1e3
        for ranges in _range_sets(n):
            got = host_ops.sum_squares(x, ranges)
            assert got.dtype == torch.float64
            assert float(got) == reference_sum_squares(x, ranges), (level, n, ranges)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0, 3])
def test_sum_squares_of_half_precision_is_that_of_its_exact_widening(level, dtype, offset):
    """The reducer's norm of bf16/fp16 chunks on a CPU device: each element widened exactly,
    then the fp32 order, so bitwise the fp32 pass over ``x.float()`` (and the reference)."""
    for n in SIZES:
        x = (torch.randn(n + offset) * 1e2).to(dtype)[offset:]
        for ranges in _range_sets(n):
            got = float(host_ops.sum_squares(x, ranges))
            assert got == float(host_ops.sum_squares(x.float(), ranges)), (level, n, ranges)
            assert got == reference_sum_squares(x.float(), ranges), (level, n, ranges)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_norm_equals_sum_squares_of_the_result(level, dtype):
    for n in SIZES:
        for overwrite in (False, True):
            for ranges in _range_sets(n):
                base, src = views(n, dtype, 1, 2)
                src[: min(n, 6)] = 1.5  # no inf/NaN: the sums are compared as numbers
                dst = base.clone()
                got = host_ops.accumulate_(dst, src, overwrite=overwrite, norm_ranges=ranges)
                want = base.clone().copy_(src) if overwrite else base + src.float()
                assert torch.equal(bits(dst), bits(want))
                assert float(got) == reference_sum_squares(want, ranges), (level, n, ranges)
    dst = torch.zeros(4)
    assert host_ops.accumulate_(dst, torch.ones(4), overwrite=False) is None  # no ranges


def test_many_pieces_and_threads_are_bitwise_identical(level, threads):
    """Several pieces per range, ranges at odd starts, 1..3 threads: the same bits."""
    n = 3 * C.PIECE + 77
    ranges = [(3, C.PIECE + 5), (C.PIECE + 9, 3 * C.PIECE + 70)]
    base, src = views(n, torch.bfloat16, 0, 1)
    src[:6] = 0.25
    results = []
    for t in (1, 2, 3):
        threads(t)
        dst = base.clone()
        norm = host_ops.accumulate_(dst, src, overwrite=False, norm_ranges=ranges)
        results.append((bits(dst).clone(), float(norm), float(host_ops.sum_squares(dst, ranges))))
    want = base + src.float()
    ref = reference_sum_squares(want, ranges)
    for got, norm, alone in results:
        assert torch.equal(got, bits(want))
        assert norm == alone == ref


@pytest.mark.parametrize("offset", [0, 1, 16])
def test_large_overwrite_streams_and_stays_exact(level, threads, offset):
    """From STREAM_MIN elements an overwrite uses streaming stores where the vector is
    aligned (offset 0 and 16), ordinary ones elsewhere: the results do not change."""
    threads(2)
    n = C.STREAM_MIN + 37
    base, src = views(n, torch.bfloat16, offset, 0)
    ranges = [(0, 1000), (C.STREAM_MIN - 3, n)]
    src[:6] = -2.0
    dst = base.clone()
    norm = host_ops.accumulate_(dst, src, overwrite=True, norm_ranges=ranges)
    assert torch.equal(bits(dst), bits(src.float()))
    assert float(norm) == reference_sum_squares(dst, ranges)
    host_ops.accumulate_(dst, src, overwrite=False)
    assert torch.equal(bits(dst), bits(src.float() + src.float()))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="dst fp32"):
        host_ops.accumulate_(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4), False)
    with pytest.raises(ValueError, match="of one shape"):
        host_ops.accumulate_(torch.zeros(4), torch.zeros(5), False)
    for bad in ([(2, 9)], [(3, 1)], [(0, 3), (2, 4)], [(-1, 2)]):
        with pytest.raises(ValueError, match=r"sum_squares: range \("):
            host_ops.sum_squares(torch.zeros(4), bad)
        dst = torch.zeros(4)
        with pytest.raises(ValueError, match=r"accumulate_: range \("):
            host_ops.accumulate_(dst, torch.ones(4), False, norm_ranges=bad)
        assert not dst.any(), "a refused call must not touch dst"
    # the raw C++ entry points check what they are given, too
    x = torch.zeros(8)
    with pytest.raises(ValueError, match="norm range 1 = \\(2, 5\\)"):
        C.accumulate(x.data_ptr(), x.data_ptr(), 8, 0, False, [(0, 4), (2, 5)])
    with pytest.raises(ValueError, match="negative length -1"):
        C.accumulate(x.data_ptr(), x.data_ptr(), -1, 0, False)
    with pytest.raises(ValueError, match="src_dtype must be"):
        C.accumulate(x.data_ptr(), x.data_ptr(), 8, 7, False)
    with pytest.raises(ValueError, match="norm range 0 = \\(0, 9\\)"):
        C.sum_squares(x.data_ptr(), 8, [(0, 9)])
    with pytest.raises(ValueError, match="null address"):
        C.accumulate(0, x.data_ptr(), 8, 0, True)
    assert C.accumulate(0, 0, 0, 2, True) == 0.0  # empty: nothing read


def test_simd_level_controls(threads):
    avail = host_ops.available_simd_levels()
    assert avail[0] == "scalar" and host_ops.simd_level() in avail
    before = host_ops.simd_level()
    try:
        host_ops.set_simd_level("auto")
        assert host_ops.simd_level() == avail[-1]
        with pytest.raises(ValueError, match="unknown SIMD level 'sse9'"):
            host_ops.set_simd_level("sse9")
        for name in set(LEVELS) - set(avail):
            with pytest.raises(RuntimeError, match="not supported"):
                host_ops.set_simd_level(name)
    finally:
        host_ops.set_simd_level(before)
    with pytest.raises(ValueError, match="n must be >= 1"):
        threads(0)


@pytest.mark.slow
def test_env_var_forces_level_at_import():
    code = "from mp_offload import _host_ops as c; print(c.simd_level())"
    env = dict(os.environ, MP_OFFLOAD_HOST_OPS_SIMD="scalar")
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip() == "scalar"
    env["MP_OFFLOAD_HOST_OPS_SIMD"] = "bogus"
    bad = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode != 0 and "MP_OFFLOAD_HOST_OPS_SIMD" in bad.stderr
