"""Benchmark the fused CPU Adam (mp_offload.ops.cpu_adam) against torch and DeepSpeed.

One traffic class at a time (bench/cpu_adam_rows.py): its rows, the rows its checks
compare them with, torch's fused AdamW (the "vs fused" reference) and the class's
ceiling patterns are allocated, timed round-robin (one step of each per repeat, the
starting row rotating from repeat to repeat, so a noisy neighbour or a position in the
round hurts all alike) and freed before the next class: a run holds one class's
buffers, not every row's, and refuses (naming --sizes) before allocating what would not
fit in MemAvailable. ``--rows 12,14`` (numbers or names) runs a subset alone. Each row
is warmed up once (allocating lazy optimizer state), then timed per step; the table
shows the median (and the minimum, for noisy machines). Each timed step is the second of
two back to back (--cold: the first): on a VM the first touch of a page after a pause can
cost a fault on the host's side (the development host: +24 ms on a 32 ms step at 5e7
after 3 s idle, +240 ms at 2e8), so a row that followed another on the same buffers ran
faster than one that did not -- rows (1) and (6), the same work, read 60% and 86% of
the ceiling in one run, and 92% and 95% with the untimed step before each.

Memory freed in the process stays in it (glibc: no mmap for big blocks, no trim;
--release-memory for the defaults): on a VM with free page reporting (virtio-balloon;
this project's development host is one) memory given back to the kernel goes to the
host, and taking it again costs ~2 ms per MB in page faults; torch's foreach AdamW
allocates ~12 B per element each step, which made it and the row after it 10-100%
slower (docs/performance_journal.md, "1b, fourth look"). "faults" in the JSON counts the page
faults of each row's timed steps (0 expected for ours).

"GB/s eff." = bytes the step must move per element x elements / time:
  fp32 Adam step: read p, g, m, v + write p, m, v = 28 B; + bf16 copy out = 30 B;
  bf16/fp16 grads: 26 B; bf16 exp_avg and exp_avg_sq (fp32 grads): 20 B.
  A bf16 model's step (bf16 grads, bf16 copy out): 28 B, 20 B with bf16 moments; with
  the master as hi + lo halves (adam_step_remainder, no copy out): 26 B and 18 B.
  Block-wise 8-bit moments (1 B each + a scale per 256): 16 B for a bf16 model's step
  with an fp32 master (bf16 grads, bf16 copy out), 14 B with remainders. Out of place
  (adam_step's *_dst, rows 19-20): the in-place bytes (the sources read, the dsts written
  with streaming stores).

The ceiling does not use our kernel. For each traffic class (28/30/26/20 B, ...) it is the
best median of several access patterns that move exactly those bytes with trivial
work (bench/bench_host_ceiling.py: contiguous per-thread ranges, round-robin or
dynamic tiles, with and without non-temporal stores, one array at a time, torch's own
kernels), each timed round-robin with the rows; the table names the winning pattern.
"of ceil." = ceiling time for the row's traffic / row time and "vs fused" = torch
fused time / row time are paired: the median over repeats of the ratio within each
repeat (rows compared with each other run back to back). ``stream_probe`` (our
kernel's loads/stores with trivial math) is shown for reference only: it shares our
access pattern, so it says how well our pattern streams, not what the machine can do.

Buffers come from torch's allocator with transparent huge pages
(THP_MEM_ALLOC_ENABLE=1; --no-thp to turn off): with 4 KiB pages, TLB misses make
whichever buffers were allocated first 10-15% slower on some hosts (VMs), an
artefact of allocation order rather than of the optimizer.

  python bench/bench_cpu_adam.py [--sizes 10e6,100e6] [--repeats 7] [--threads N] [--rows 1,6,12]
                                [--json out.json]
"""

import argparse
import ctypes
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time


def _parse_args():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--sizes", default="10e6,100e6", help="comma-separated element counts (default 10e6,100e6)"
    )
    ap.add_argument("--repeats", type=int, default=7, help="timed steps per row (median reported)")
    ap.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="threads for ours, torch and DeepSpeed (default: all available cores)",
    )
    ap.add_argument("--simd", default="auto", help="scalar|avx2|avx512|auto")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeedCPUAdam row")
    ap.add_argument(
        "--no-thp", action="store_true", help="plain 4 KiB pages (no THP_MEM_ALLOC_ENABLE)"
    )
    ap.add_argument(
        "--rows",
        default="all",
        help="comma-separated rows by number or name (default all; see bench/cpu_adam_rows.py)",
    )
    ap.add_argument(
        "--release-memory",
        action="store_true",
        help="glibc's defaults: freed big blocks go back to the kernel (see above)",
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help="time each row's first step of a round (default: the second of two back to back)",
    )
    ap.add_argument("--json", metavar="FILE", help="also write results as JSON")
    return ap.parse_args()


def _keep_freed_memory():
    """glibc: big blocks from the heap (no mmap) and no trimming, so memory freed here is
    reused here and never handed back to the kernel (and from there to the host)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h; a threshold of -1 is SIZE_MAX
    return libc.mallopt(m_mmap_max, 0) == 1 and libc.mallopt(m_trim_threshold, -1) == 1


ARGS = _parse_args()
KEEP_MEMORY = not ARGS.release_memory and _keep_freed_memory()
# Before torch/DeepSpeed load libgomp: every OpenMP runtime in the process gets the same count.
os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
if not ARGS.no_thp:
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"  # read by torch's CPU allocator

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
# This checkout's package (and in-place extension), not whichever mp_offload is installed.
sys.path[:0] = [BENCH, os.path.dirname(BENCH)]
import bench_host_ceiling as hc
import cpu_adam_rows as cr

from device_proof.calibrate import host_memory_bytes
from mp_offload.ops import cpu_adam as ca

HP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}

# The traffic of a bf16 model's step, today's and with remainders (this process only):
# "param" is the fp32 master, or its bf16 hi half beside the lo half (2-byte elements
# are all alike to the ceiling: bf16 keeps torch-ops' in-place mul_ legal for lo too).
_RW, _R, _W = hc.READ_WRITE, hc.READ, hc.WRITE
_MASTER = [("param", "float32", _RW), ("grad", "bfloat16", _R)]
_HALVES = [("param", "bfloat16", _RW), ("param_lo", "bfloat16", _RW), ("grad", "bfloat16", _R)]
BF16_MODEL_TRAFFIC = {  # name -> (bytes/element, param and grad arrays, moment dtype)
    "bf16g+out": (28, _MASTER, "float32"),
    "rem": (26, _HALVES, "float32"),
    "bf16g+bf16mom+out": (20, _MASTER, "bfloat16"),
    "rem+bf16mom": (18, _HALVES, "bfloat16"),
}
for _name, (_nbytes, _arrays, _mom) in BF16_MODEL_TRAFFIC.items():
    _moments = [("exp_avg", _mom, _RW), ("exp_avg_sq", _mom, _RW)]
    _out = [("param_out", "bfloat16", _W)] if not _name.startswith("rem") else []
    _spec = _arrays + _moments + _out
    _moved = sum((2 if dt != "float32" else 4) * (2 if mode == _RW else 1) for _, dt, mode in _spec)
    assert _moved == _nbytes, f"{_name}: {_moved} B moved, {_nbytes} B claimed"
    hc.TRAFFIC.setdefault(_name, (_nbytes, _spec))

# With block-wise 8-bit moments: 1 B per moment element read and written, plus one fp32
# scale per 256 (0.06 B/element in all, left out of the count). The ceiling streams
# the two code arrays as one 2-byte array: the same bytes, one stream fewer (if
# anything a higher ceiling).
Q8_TRAFFIC = {  # name -> (bytes/element, arrays)
    "q8mom": (16, [*_MASTER, ("exp_avg", "bfloat16", _RW), ("param_out", "bfloat16", _W)]),
    "rem+q8mom": (14, [*_HALVES, ("exp_avg", "bfloat16", _RW)]),
}
for _name, (_nbytes, _spec) in Q8_TRAFFIC.items():
    _moved = sum((2 if dt != "float32" else 4) * (2 if mode == _RW else 1) for _, dt, mode in _spec)
    assert _moved == _nbytes, f"{_name}: {_moved} B moved, {_nbytes} B claimed"
    hc.TRAFFIC.setdefault(_name, (_nbytes, _spec))

DECAY_RUNS = 200  # runs of the decay_runs row (~ a GPT slice: matrices decayed, biases/norms not)


def _deepspeed_adam():
    """DeepSpeedCPUAdam class, or (None, why) -- a peer to compare with, never a dependency."""
    if ARGS.no_deepspeed:
        return None, "skipped (--no-deepspeed)"
    try:
        import logging

        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        probe = torch.nn.Parameter(torch.zeros(16))
        probe.grad = torch.zeros(16)
        DeepSpeedCPUAdam([probe], **HP, adamw_mode=True).step()  # JIT-builds the op the first time
        return DeepSpeedCPUAdam, ""
    except Exception as exc:  # noqa: BLE001 - any failure just drops the row
        return (
            None,
            f"unavailable ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:80] if str(exc) else ''})",
        )


def _decay_runs(n):
    """DECAY_RUNS decayed runs covering most of [0, n), small undecayed gaps between them."""
    step = max(1, n // DECAY_RUNS)
    gap = max(1, step // 100)
    return [(s, min(n, s + step - gap)) for s in range(0, n - 1, step)]


def _randn(P):
    return torch.randn(P.n, generator=P.gen)


def _zeros(P, dtype=torch.float32):
    return torch.zeros(P.n, dtype=dtype)


def _halves(P):
    hi, lo = ca.split_fp32(_randn(P))
    return hi, lo


def _q8(P):
    """Plausible 8-bit moments: codes of small values and of their squares."""
    m = _randn(P) * 1e-3
    return ca.quantize_8bit(m, "exp_avg"), ca.quantize_8bit(m * m, "exp_avg_sq")


def _torch_ref(P):
    tp = torch.nn.Parameter(_randn(P))
    tp.grad = _randn(P)
    fused = torch.optim.AdamW([tp], **HP, fused=True)
    fused.step()  # its lazy state now, beside its param
    return tp, fused


_BF = torch.bfloat16
# buffer name (cpu_adam_rows.BUFFERS) -> its maker
MAKERS = {
    "g32": _randn,
    "gbf": lambda P: _randn(P).to(_BF),
    "g16": lambda P: _randn(P).half(),
    "out": lambda P: torch.empty(P.n, dtype=_BF),
    "tout": lambda P: torch.empty(P.n, dtype=_BF),
    "state": lambda P: (_randn(P), _zeros(P), _zeros(P)),
    "state_bf16mom": lambda P: (_randn(P), _zeros(P, _BF), _zeros(P, _BF)),
    "state_q8": lambda P: (_randn(P), *_q8(P)),
    "rem": lambda P: (*_halves(P), _zeros(P), _zeros(P)),
    "rem_bf16mom": lambda P: (*_halves(P), _zeros(P, _BF), _zeros(P, _BF)),
    "rem_q8": lambda P: (*_halves(P), *_q8(P)),
    "dst": lambda P: {k: torch.empty(P.n) for k in ("param_dst", "exp_avg_dst", "exp_avg_sq_dst")},
    "rem_dst": lambda P: {
        "param_hi_dst": torch.empty(P.n, dtype=_BF),
        "param_lo_dst": torch.empty(P.n, dtype=torch.int16),
        "exp_avg_dst": torch.empty(P.n),
        "exp_avg_sq_dst": torch.empty(P.n),
    },
    "torch_ref": _torch_ref,
    "foreach": lambda P: torch.optim.AdamW([P["torch_ref"][0]], **HP, foreach=True),
    "deepspeed": lambda P: P.ds_cls([P["torch_ref"][0]], **HP, adamw_mode=True),
}


def _nbytes(obj):
    """Bytes of the tensors in ``obj`` (None when it holds something else: an optimizer)."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    parts = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, tuple) else None
    sizes = [_nbytes(x) for x in parts] if parts is not None else [None]
    return None if None in sizes else sum(sizes)


class Pool:
    """One round's buffers, made on first use by name (persistent ones by the parent
    pool); each tensor buffer held to its bytes in cpu_adam_rows.BUFFERS."""

    def __init__(self, n, ds_cls=None, parent=None):
        self.n, self.ds_cls, self.parent, self.made = n, ds_cls, parent, {}
        self.gen = torch.Generator().manual_seed(0)

    def __getitem__(self, name):
        if self.parent is not None and name in cr.PERSISTENT:
            return self.parent[name]
        if name not in self.made:
            obj = self.made[name] = MAKERS[name](self)
            got, want = _nbytes(obj), cr.BUFFERS[name] * self.n
            assert got is None or abs(got - want) <= 8, f"{name}: {got} B, {want:.0f} B declared"
        return self.made[name]


def _ours(grad, out=None, state="state", decay=False, dsts=None):
    def build(P, ctx):
        p, m, v = P[state]
        g, o, d = P[grad], P[out] if out else None, P[dsts] if dsts else {}
        runs = _decay_runs(P.n) if decay else None
        beta1, beta2 = HP["betas"]
        hp = dict(lr=HP["lr"], beta1=beta1, beta2=beta2, eps=HP["eps"])

        def run():
            ctx["step"] += 1
            wd = HP["weight_decay"]
            kw = dict(step=ctx["step"], weight_decay=wd, adamw=True, param_out=o, decay_runs=runs)
            ca.adam_step(p, g, m, v, **hp, **kw, **d)

        return run

    return build


def _ours_rem(state, dsts=None):
    def build(P, ctx):
        hi, lo, m, v = P[state]
        g, d = P["gbf"], P[dsts] if dsts else {}
        beta1, beta2 = HP["betas"]
        hp = dict(lr=HP["lr"], eps=HP["eps"], weight_decay=HP["weight_decay"])

        def run():
            ctx["step"] += 1
            ca.adam_step_remainder(
                hi, lo, g, m, v, step=ctx["step"], beta1=beta1, beta2=beta2, **hp, **d
            )

        return run

    return build


def _fused_copy(P, ctx):
    (tp, fused), tout = P["torch_ref"], P["tout"]

    def run():
        fused.step()
        tout.copy_(tp.detach())

    return run


def _stream_probe(P, ctx):
    s = ctx["scratch"]
    sp, sm, sv = (s[(name, "float32")] for name in ("param", "exp_avg", "exp_avg_sq"))
    g = P["g32"]
    return lambda: ca.stream_probe(sp, g, sm, sv)


BUILD = {  # row key (cpu_adam_rows.ROWS) -> (pool, ctx) -> the step to time
    "ours_fp32": _ours("g32"),
    "ours_fp32_bf16out": _ours("g32", "out"),
    "ours_bf16g": _ours("gbf"),
    "ours_fp16g": _ours("g16"),
    "ours_bf16mom": _ours("g32", state="state_bf16mom"),
    "ours_decay_runs": _ours("g32", decay=True),
    "torch_fused": lambda P, ctx: P["torch_ref"][1].step,
    "torch_fused_copy": _fused_copy,
    "torch_foreach": lambda P, ctx: P["foreach"].step,
    "deepspeed": lambda P, ctx: P["deepspeed"].step,
    "ours_bf16g_out": _ours("gbf", "out"),
    "ours_rem": _ours_rem("rem"),
    "ours_bf16g_bf16mom_out": _ours("gbf", "out", state="state_bf16mom"),
    "ours_rem_bf16mom": _ours_rem("rem_bf16mom"),
    cr.PROBE: _stream_probe,
    "ours_q8mom": _ours("gbf", "out", state="state_q8"),
    "ours_rem_q8mom": _ours_rem("rem_q8"),
    "ours_fp32_oop": _ours("g32", dsts="dst"),
    "ours_rem_oop": _ours_rem("rem", "rem_dst"),
}
assert set(BUILD) == set(cr.BY_KEY)


def ceiling_needs():
    """class -> (scratch bytes per element, the grad buffer the patterns share)."""
    out = {}
    for traffic, (_, spec) in hc.TRAFFIC.items():
        grad = "gbf" if dict((a, dt) for a, dt, _ in spec)["grad"] == "bfloat16" else "g32"
        size = sum(getattr(torch, dt).itemsize for a, dt, _ in spec if a != "grad")
        out[traffic] = (size, grad)
    return out


def _faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_round(traffic, members, P, lib, ctx):
    """Allocate the round's rows and ceiling patterns, warm up, time them round-robin.
    Returns ({key: [s]}, {key: [page faults]}, {pattern: key})."""
    grad = ceiling_needs()[traffic][1]
    ctx["scratch"] = scratch = {}
    ceiling = hc.HostCeiling(lib, torch, P.n, ARGS.threads, traffic, {"grad": P[grad]}, scratch)
    patterns = ceiling.patterns()
    pats = {pattern: f"ceil_{traffic}_{pattern}" for pattern, _ in patterns}
    order = [(r.key, BUILD[r.key](P, ctx)) for r in members]
    order += [(pats[pattern], fn) for pattern, fn in patterns]
    for _, fn in order:  # warm-up: lazy state, page faults, JIT
        fn()
    times = {key: [] for key, _ in order}
    faults = {key: [] for key, _ in order}
    for r in range(ARGS.repeats):
        k = r % len(order)
        for key, fn in order[k:] + order[:k]:  # rotate the starting row
            if not ARGS.cold:
                fn()  # untimed: the row's page translations and lines back (see above)
            f0 = _faults()
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
            faults[key].append(_faults() - f0)
    del ctx["scratch"]
    return times, faults, pats


def _paired(times, num, den):
    """Median over repeats of times[num] / times[den]: a ratio of steps taken side by side."""
    if num not in times or den not in times:
        return None
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def _result(n, key, label, nbytes, times, faults, ceil_key):
    t_all = times[key]
    t = statistics.median(t_all)
    return {
        "key": key,
        "label": label,
        "n": n,
        "bytes_per_elem": nbytes,
        "ms_median": t * 1e3,
        "ms_min": min(t_all) * 1e3,
        "times_ms": [round(x * 1e3, 2) for x in t_all],
        "faults": statistics.median(faults[key]),
        "params_per_s": n / t,
        "gbps": nbytes * n / t / 1e9,
        "frac_ceiling": _paired(times, ceil_key, key),
        "vs_torch_fused": _paired(times, cr.REFERENCE, key),
    }


def bench_size(n, rows, ds_cls, lib):
    """Every round of the rows chosen at n elements: (results, ceiling, checks)."""
    persist = Pool(n, ds_cls)
    for name in {b for r in rows for b in r.buffers} & set(cr.PERSISTENT):
        persist[name]  # first, below every round's buffers: a round frees into one gap
    ctx = {"step": 0}
    results, ceiling, round_of = {}, {}, {}
    for traffic, members in cr.rounds(rows, hc.TRAFFIC):
        times, faults, pats = time_round(traffic, members, Pool(n, ds_cls, persist), lib, ctx)
        gc.collect()  # torch's optimizers sit in reference cycles: free the round's now
        best, t = hc.best_of({p: times[k] for p, k in pats.items()})
        nbytes = hc.TRAFFIC[traffic][0]
        c = ceiling[traffic] = {
            "bytes_per_elem": nbytes,
            "best": best,
            "key": pats[best],
            "ms_median": t * 1e3,
            "patterns_ms": {p: statistics.median(times[k]) * 1e3 for p, k in pats.items()},
        }
        label = f"(15) ceiling {traffic} {nbytes} B: {best}"
        res = _result(n, c["key"], label, nbytes, times, faults, c["key"])
        res.update(key=f"ceiling_{traffic}", pattern=best)
        c["row"] = res
        for r in members:
            if r.traffic == traffic:
                label = f"({r.num}) {r.label}"
                results[r.key] = _result(n, r.key, label, r.nbytes, times, faults, c["key"])
                round_of[r.key] = (times, c["key"])
    checks = []
    for name, num, den, factor, target in cr.checks_for(rows):
        times, ceil_key = round_of[den]
        val = factor * _paired(times, ceil_key if num == cr.CEIL else num, den)
        checks.append({"name": name, "value": val, "target": target, "ok": val >= target})
    table = [results[r.key] for r in rows if r.key != cr.PROBE]
    table += [c.pop("row") for c in ceiling.values()]
    table += [results[cr.PROBE]] if cr.PROBE in results else []
    return table, ceiling, checks


def _ms(x, width):
    """Milliseconds with 1 decimal, 3 below 1 ms (tiny smoke-test sizes)."""
    return f"{x:{width}.{1 if x >= 1 else 3}f}"


def _pct(x, width):
    return f"{x:{width}.0%}" if x is not None else f"{'-':>{width}s}"


def print_table(n, results, ceiling, notes):
    print(
        f"\n=== n = {n:,} params ({n / 1e6:g}M), threads = {ARGS.threads}, "
        f"simd = {ca.simd_level()} ==="
    )
    hdr = (
        f"{'row':46s} {'ms/step':>9s} {'(min)':>8s} {'Mparams/s':>10s} {'GB/s eff.':>10s} "
        f"{'of ceil.':>9s} {'vs fused':>9s}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        vs = f"{r['vs_torch_fused']:8.2f}x" if r["vs_torch_fused"] is not None else f"{'-':>9s}"
        print(
            f"{r['label']:46s} {_ms(r['ms_median'], 9)} {_ms(r['ms_min'], 8)} "
            f"{r['params_per_s'] / 1e6:10.0f} "
            f"{r['gbps']:10.1f} {_pct(r['frac_ceiling'], 8)} {vs}"
        )
    for note in notes:
        print(note)
    print("ceiling patterns (median ms; * = best):")
    names = list(dict.fromkeys(k for c in ceiling.values() for k in c["patterns_ms"]))
    print(f"  {'traffic':24s}" + "".join(f"{k:>15s}" for k in names))
    for traffic, c in ceiling.items():
        cells = "".join(
            f"{_ms(c['patterns_ms'][k], 14)}{'*' if k == c['best'] else ' '}"
            if k in c["patterns_ms"]
            else f"{'-':>14s} "
            for k in names
        )
        print(f"  {traffic + ' ' + str(c['bytes_per_elem']) + ' B':24s}{cells}")
    faulted = [f"{r['label'].split()[0]} {r['faults']:g}" for r in results if r["faults"]]
    if faulted:
        print(f"page faults per timed step (median; 0 expected): {', '.join(faulted)}")


def _fail(msg):
    print(f"bench_cpu_adam: error: {msg}", file=sys.stderr)
    sys.exit(2)


def _choose_rows():
    """(rows, notes, DeepSpeed class): --rows, less DeepSpeed where it cannot run; exits
    with one line on a bad --rows."""
    try:
        rows = cr.select(ARGS.rows)
    except ValueError as e:
        _fail(str(e))
    ds_cls, notes = None, []
    if any(r.key == "deepspeed" for r in rows):
        ds_cls, ds_note = _deepspeed_adam()
        if ds_cls is None:
            rows = [r for r in rows if r.key != "deepspeed"]
            notes.append(f"{'(10) DeepSpeedCPUAdam':46s} {ds_note}")
    if not rows:
        _fail("--rows: no row left to run")
    return rows, notes, ds_cls


def _refuse_what_does_not_fit(rows, sizes):
    """Before any allocation: one line naming --sizes if the largest would not fit."""
    available = host_memory_bytes()
    for n in sizes:
        msg = cr.refusal(cr.bytes_needed(rows, n, ceiling_needs()), n, available)
        if msg:
            _fail(msg)


def main():
    sizes = [int(float(s)) for s in ARGS.sizes.split(",") if s.strip()]
    rows, notes, ds_cls = _choose_rows()
    _refuse_what_does_not_fit(rows, sizes)
    ca.set_simd_level(ARGS.simd)
    ca.set_num_threads(ARGS.threads)
    torch.set_num_threads(ARGS.threads)
    lib, why = hc.build_library()
    print(
        f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, load avg "
        f"{os.getloadavg()[0]:.2f}; torch {torch.__version__}; python {platform.python_version()}; "
        f"THP {'off' if ARGS.no_thp else 'on'}; freed memory "
        f"{'kept' if KEEP_MEMORY else 'released'}"
    )
    if lib is None:
        print(f"ceiling: C++ patterns unavailable ({why}); torch-ops only")
    report = {
        "meta": {
            "threads": ARGS.threads,
            "simd": ca.simd_level(),
            "repeats": ARGS.repeats,
            "torch": torch.__version__,
            "thp": not ARGS.no_thp,
            "keep_memory": KEEP_MEMORY,
            "rows": [r.key for r in rows],
            "argv": sys.argv[1:],
        },
        "sizes": {},
    }
    for n in sizes:
        results, ceiling, chk = bench_size(n, rows, ds_cls, lib)
        print_table(n, results, ceiling, notes)
        print("targets (paired: median over repeats of the per-repeat ratio):")
        for c in chk:
            print(
                f"  [{'PASS' if c['ok'] else 'MISS'}] {c['name']}: {c['value']:.2f} "
                f"(target >= {c['target']:.2f})"
            )
        report["sizes"][str(n)] = {"rows": results, "ceiling": ceiling, "checks": chk}
    report["meta"]["load_avg_end"] = os.getloadavg()[0]
    report["meta"]["max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {ARGS.json}")


if __name__ == "__main__":
    main()
