"""CPU Adam: the same bits however the work is split (weight-decay runs, unaligned
views, 1 or 2 threads), and the SIMD level / thread controls."""

import os
import subprocess
import sys

import pytest
import torch
from cpu_adam_ref import (
    HYPER,
    LEVELS,
    MOMENTS,
    _bits_equal,
    _bufs,
    _call,
    level_fixture,  # noqa: F401 (pytest fixture)
    threads_fixture,  # noqa: F401 (pytest fixture)
)

from mp_offload import _cpu_adam as _C
from mp_offload.ops import cpu_adam as ca


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
        "print(before == ca.default_num_threads(), ca.get_num_threads(), ca.last_num_threads())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    env.update(OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    # the default is the run's rule, not OMP_NUM_THREADS; set_num_threads(2) gives two
    assert out.stdout.split() == ["True", "2", "2"]


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


def test_default_num_threads(monkeypatch, tmp_path):
    """The run's one rule (cpu_threads.py), OMP_NUM_THREADS ignored."""
    from mp_offload.runtime import cpu_threads

    monkeypatch.setattr(cpu_threads, "CGROUP", str(tmp_path))  # no quota
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert ca.default_num_threads() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 4))
    assert ca.default_num_threads() == 1  # never below one
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ca.default_num_threads() == max(1, cores // 2)


def test_stream_probe_runs(level):
    n = 3 * _C.TILE + 5
    b = _bufs(n, grad_dtype=torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    secs = ca.stream_probe(b["param"], b["grad"], b["exp_avg"], b["exp_avg_sq"], param_out=out)
    assert secs > 0.0
    assert ca.stream_probe(torch.zeros(0), torch.zeros(0), torch.zeros(0), torch.zeros(0)) == 0.0
    with pytest.raises(ValueError, match="stream_probe: grad has 3 elements"):
        ca.stream_probe(b["param"], torch.zeros(3), b["exp_avg"], b["exp_avg_sq"])


@pytest.mark.parametrize(
    "moments", [(torch.float32, torch.float32), MOMENTS[2]], ids=["mv_fp32", "mv_bf16"]
)
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16], ids=["noout", "out_bf16"])
def test_avx512_unroll_same_bits(moments, out_dtype):
    """The AVX-512 loops take 4 vectors a step on AMD, 1 elsewhere (picked at import):
    both give the same bits, so the default one, checked against the reference by
    the other tests, vouches for the one this CPU does not run."""
    if "avx512" not in ca.available_simd_levels():
        pytest.skip("CPU lacks avx512")
    gen = torch.Generator().manual_seed(5)
    n = 3 * 64 + 16 + 5  # whole 4-vector steps, a lone vector and a tail
    start = {
        "param": torch.randn(n, generator=gen),
        "grad": torch.randn(n, generator=gen).bfloat16(),
        "exp_avg": (torch.randn(n, generator=gen) * 0.1).to(moments[0]),
        "exp_avg_sq": torch.rand(n, generator=gen).to(moments[1]),
    }
    level, unroll = ca.simd_level(), _C.avx512_unroll()
    results = []
    try:
        ca.set_simd_level("avx512")
        for u in (1, 4):
            _C.set_avx512_unroll(u)
            b = {k: t.clone() for k, t in start.items()}
            out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
            _call(b, step=3, weight_decay=0.1, param_out=out)
            results.append((b, out))
    finally:
        ca.set_simd_level(level)
        _C.set_avx512_unroll(unroll)
    (b1, o1), (b4, o4) = results
    for k in ("param", "exp_avg", "exp_avg_sq"):
        assert _bits_equal(b1[k], b4[k]), k
    assert o1 is None or _bits_equal(o1, o4)
    with pytest.raises(ValueError, match="unroll must be 1 or 4, got 2"):
        _C.set_avx512_unroll(2)
