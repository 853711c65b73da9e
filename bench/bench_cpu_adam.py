"""Benchmark the fused CPU Adam (mp_offload.ops.cpu_adam) against torch and DeepSpeed.

All rows run side by side in one process on the same sizes, round-robin (one step of
every row per repeat; rows of the same traffic -- ours, its peers, that traffic's
ceiling patterns -- back to back; the starting row rotating from repeat to repeat), so
a noisy neighbour or a position in the round hurts all rows alike. Each row is warmed up once
(allocating lazy optimizer state), then timed per step; the table shows the median
(and the minimum, for noisy machines).

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

  python bench/bench_cpu_adam.py [--sizes 10e6,100e6] [--repeats 7] [--threads N] [--json out.json]
"""

import argparse
import json
import os
import platform
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
    ap.add_argument("--json", metavar="FILE", help="also write results as JSON")
    return ap.parse_args()


ARGS = _parse_args()
# Before torch/DeepSpeed load libgomp: every OpenMP runtime in the process gets the same count.
os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
if not ARGS.no_thp:
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"  # read by torch's CPU allocator

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
# This checkout's package (and in-place extension), not whichever mp_offload is installed.
sys.path[:0] = [BENCH, os.path.dirname(BENCH)]
import bench_host_ceiling as hc

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


def bench_size(n, ds_cls, ds_note, lib):
    gen = torch.Generator().manual_seed(0)
    # ours: one fp32 state set, grads in all three dtypes, a bf16 copy-out buffer
    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    g32 = torch.randn(n, generator=gen)
    g16, gbf = g32.half(), g32.bfloat16()
    out = torch.empty(n, dtype=torch.bfloat16)
    # ours with bf16 moments: its own param and bf16 exp_avg / exp_avg_sq
    pb, mb, vb = (
        torch.randn(n, generator=gen),
        torch.zeros(n, dtype=torch.bfloat16),
        torch.zeros(n, dtype=torch.bfloat16),
    )
    # ours with remainders: the halves of p's copy (fp32 moments) and of pb's (bf16 moments)
    rem = (*ca.split_fp32(p), m.clone(), v.clone())
    remb = (*ca.split_fp32(pb), mb.clone(), vb.clone())
    # ours with 8-bit moments (plausible ones): fp32 master, and remainders; bf16 grads
    pq, mq = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    q8 = (ca.quantize_8bit(mq, "exp_avg"), ca.quantize_8bit(mq * mq, "exp_avg_sq"))
    remq = (*ca.split_fp32(pq), *(ca.Blockwise8(q.codes.clone(), q.scales.clone()) for q in q8))
    # torch / DeepSpeed: one big param with an fp32 grad, each optimizer with its own state
    tp = torch.nn.Parameter(torch.randn(n, generator=gen))
    tp.grad = torch.randn(n, generator=gen)
    tout = torch.empty(n, dtype=torch.bfloat16)
    fused = torch.optim.AdamW([tp], **HP, fused=True)
    foreach = torch.optim.AdamW([tp], **HP, foreach=True)
    ds = ds_cls([tp], **HP, adamw_mode=True) if ds_cls else None

    step = [0]
    runs = _decay_runs(n)

    # out of place: row (1)'s and row (12)'s state read, the new state written into these
    dst = {
        "param_dst": torch.empty(n),
        "exp_avg_dst": torch.empty(n),
        "exp_avg_sq_dst": torch.empty(n),
    }
    rem_names = ("param_hi_dst", "param_lo_dst", "exp_avg_dst", "exp_avg_sq_dst")
    rem_dst = dict(zip(rem_names, (torch.empty_like(t) for t in rem)))

    def ours(grad, param_out=None, decay_runs=None, state=(p, m, v), dsts=None):
        def run():
            step[0] += 1
            ca.adam_step(
                state[0],
                grad,
                state[1],
                state[2],
                step=step[0],
                lr=HP["lr"],
                beta1=HP["betas"][0],
                beta2=HP["betas"][1],
                eps=HP["eps"],
                weight_decay=HP["weight_decay"],
                adamw=True,
                param_out=param_out,
                decay_runs=decay_runs,
                **(dsts or {}),
            )

        return run

    def ours_rem(state, dsts=None):
        def run():
            step[0] += 1
            beta1, beta2 = HP["betas"]
            hp = {"lr": HP["lr"], "eps": HP["eps"], "weight_decay": HP["weight_decay"]}
            hi, lo, m, v = state
            kw = dict(step=step[0], beta1=beta1, beta2=beta2, **hp, **(dsts or {}))
            ca.adam_step_remainder(hi, lo, gbf, m, v, **kw)

        return run

    def fused_copy():
        fused.step()
        tout.copy_(tp.detach())

    # (key, label, bytes/element, fn, traffic class for "of ceil.")
    rows = [
        ("ours_fp32", "(1) ours fp32 grads", 28, ours(g32), "fp32"),
        (
            "ours_fp32_bf16out",
            "(2) ours fp32 grads + bf16 param_out",
            30,
            ours(g32, out),
            "fp32+bf16out",
        ),
        ("ours_bf16g", "(3) ours bf16 grads", 26, ours(gbf), "bf16grad"),
        ("ours_fp16g", "(4) ours fp16 grads", 26, ours(g16), "bf16grad"),
        (
            "ours_bf16mom",
            "(5) ours bf16 exp_avg + exp_avg_sq",
            20,
            ours(g32, state=(pb, mb, vb)),
            "bf16mom",
        ),
        (
            "ours_decay_runs",
            f"(6) ours fp32, decay_runs ({len(runs)} runs)",
            28,
            ours(g32, decay_runs=runs),
            "fp32",
        ),
        ("torch_fused", "(7) torch AdamW(fused=True)", 28, fused.step, "fp32"),
        ("torch_fused_copy", "(8) torch fused + out.copy_(p) bf16", 30, fused_copy, "fp32+bf16out"),
        ("torch_foreach", "(9) torch AdamW(foreach=True)", 28, foreach.step, "fp32"),
    ]
    if ds is not None:
        rows.append(("deepspeed", "(10) DeepSpeedCPUAdam", 28, ds.step, "fp32"))
    rows += [  # a bf16 model's step: today's (fp32 master + bf16 copy) and with remainders
        (
            "ours_bf16g_out",
            "(11) ours bf16 grads + bf16 param_out",
            28,
            ours(gbf, out),
            "bf16g+out",
        ),
        ("ours_rem", "(12) ours remainders (hi + lo), bf16 grads", 26, ours_rem(rem), "rem"),
        (
            "ours_bf16g_bf16mom_out",
            "(13) ours bf16 grads + bf16 moments + param_out",
            20,
            ours(gbf, out, state=(pb, mb, vb)),
            "bf16g+bf16mom+out",
        ),
        (
            "ours_rem_bf16mom",
            "(14) ours remainders + bf16 moments",
            18,
            ours_rem(remb),
            "rem+bf16mom",
        ),
    ]
    rows += [  # block-wise 8-bit moments
        (
            "ours_q8mom",
            "(17) ours 8-bit moments, bf16 grads + param_out",
            16,
            ours(gbf, out, state=(pq, *q8)),
            "q8mom",
        ),
        ("ours_rem_q8mom", "(18) ours remainders + 8-bit moments", 14, ours_rem(remq), "rem+q8mom"),
    ]
    rows += [  # out of place (*_dst): the same bytes as in place, so the same time
        ("ours_fp32_oop", "(19) ours fp32 grads, out of place", 28, ours(g32, dsts=dst), "fp32"),
        ("ours_rem_oop", "(20) ours remainders, out of place", 26, ours_rem(rem, rem_dst), "rem"),
    ]
    # the ceiling: every pattern of every traffic class is a row of the round-robin too
    scratch = {}
    shared = {"grad": g32}
    ceil_rows = []  # (traffic, pattern, key)
    for traffic in hc.TRAFFIC:
        grad_dtype = next(dt for name, dt, _ in hc.TRAFFIC[traffic][1] if name == "grad")
        sh = dict(shared, grad=gbf) if grad_dtype == "bfloat16" else shared
        ceiling = hc.HostCeiling(lib, torch, n, ARGS.threads, traffic, shared=sh, scratch=scratch)
        for pattern, fn in ceiling.patterns():
            key = f"ceil_{traffic}_{pattern}"
            rows.append((key, None, ceiling.bytes_per_elem, fn, None))
            ceil_rows.append((traffic, pattern, key))
    sp, sm, sv = (
        scratch[("param", "float32")],
        scratch[("exp_avg", "float32")],
        scratch[("exp_avg_sq", "float32")],
    )
    rows.append(
        (
            "stream_probe",
            "(16) stream_probe (our pattern), 28 B",
            28,
            lambda: ca.stream_probe(sp, g32, sm, sv),
            "fp32",
        )
    )

    # Execution order: rows that are compared with each other run next to each other
    # (same traffic class: ours, its peers, that class's ceiling patterns), so paired
    # ratios compare steps taken moments apart; foreach (slow) runs last.
    by_traffic = {
        tr: [r for r in rows if r[4] == tr and r[0] != "torch_foreach"] for tr in hc.TRAFFIC
    }
    for tr, _pattern, key in ceil_rows:
        by_traffic[tr].append(next(r for r in rows if r[0] == key))
    order = [r for tr in hc.TRAFFIC for r in by_traffic[tr]] + [
        r for r in rows if r[0] == "torch_foreach"
    ]
    assert len(order) == len(rows)

    for _, _, _, fn, _ in order:  # warm-up: lazy state, page faults, JIT
        fn()
    times = {key: [] for key, *_ in order}
    for r in range(ARGS.repeats):
        k = r % len(order)
        for key, _, _, fn, _ in order[k:] + order[:k]:  # rotate the starting row
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)

    def paired(num, den):
        """Median over repeats of times[num] / times[den]: a ratio of steps taken side by side."""
        return statistics.median(a / b for a, b in zip(times[num], times[den]))

    ceiling = {}
    for traffic, (nbytes, _) in hc.TRAFFIC.items():
        pats = {pattern: times[key] for tr, pattern, key in ceil_rows if tr == traffic}
        best, t = hc.best_of(pats)
        ceiling[traffic] = {
            "bytes_per_elem": nbytes,
            "best": best,
            "key": f"ceil_{traffic}_{best}",
            "ms_median": t * 1e3,
            "patterns_ms": {k: statistics.median(v) * 1e3 for k, v in pats.items()},
        }
    results = []

    def row(key, label, nbytes, traffic, out_key=None):
        t_all = times[key]
        t = statistics.median(t_all)
        return {
            "key": out_key or key,
            "label": label,
            "n": n,
            "bytes_per_elem": nbytes,
            "ms_median": t * 1e3,
            "ms_min": min(t_all) * 1e3,
            "times_ms": [round(x * 1e3, 2) for x in t_all],
            "params_per_s": n / t,
            "gbps": nbytes * n / t / 1e9,
            "frac_ceiling": paired(ceiling[traffic]["key"], key),
            "vs_torch_fused": paired("torch_fused", key),
        }

    for key, label, nbytes, _, traffic in rows:
        if key.startswith("ceil_") or key == "stream_probe":
            continue
        results.append(row(key, label, nbytes, traffic))
        if key == "torch_foreach" and ds is None:
            results.append(
                {"key": "deepspeed", "label": "(10) DeepSpeedCPUAdam", "n": n, "skipped": ds_note}
            )
    for traffic, c in ceiling.items():
        r = row(
            c["key"],
            f"(15) ceiling {traffic} {c['bytes_per_elem']} B: {c['best']}",
            c["bytes_per_elem"],
            traffic,
            out_key=f"ceiling_{traffic}",
        )
        r["pattern"] = c["best"]
        results.append(r)
    results.append(row("stream_probe", rows[-1][1], 28, "fp32"))

    checks = [
        ("ours fp32 >= torch fused (speed ratio)", paired("torch_fused", "ours_fp32"), 1.0),
        (
            "ours + bf16 copy >= 1.15x torch fused + copy",
            paired("torch_fused_copy", "ours_fp32_bf16out"),
            1.15,
        ),
        (
            "bf16 grads within 10% of fp32 time (1.1 * t_fp32 / t_bf16)",
            1.10 * paired("ours_fp32", "ours_bf16g"),
            1.0,
        ),
        (
            "decay_runs within 3% of one decay (1.03 * t_fp32 / t_runs)",
            1.03 * paired("ours_fp32", "ours_decay_runs"),
            1.0,
        ),
        (
            "ours fp32 within 10% of ceiling (t_ceiling / t_ours)",
            paired(ceiling["fp32"]["key"], "ours_fp32"),
            0.90,
        ),
        (
            "ours + bf16 copy within 10% of ceiling",
            paired(ceiling["fp32+bf16out"]["key"], "ours_fp32_bf16out"),
            0.90,
        ),
        (
            "remainders within 10% of ceiling (26 B)",
            paired(ceiling["rem"]["key"], "ours_rem"),
            0.90,
        ),
        (
            "remainders + bf16 moments within 10% of ceiling (18 B)",
            paired(ceiling["rem+bf16mom"]["key"], "ours_rem_bf16mom"),
            0.90,
        ),
        (
            "remainders at <= 0.95x today's bf16 step (t_today / t_rem)",
            paired("ours_bf16g_out", "ours_rem"),
            1 / 0.95,
        ),
        (
            "remainders + bf16 moments at <= 0.95x today's (t_today / t_rem)",
            paired("ours_bf16g_bf16mom_out", "ours_rem_bf16mom"),
            1 / 0.95,
        ),
        (
            "out of place at the in-place speed (0.95 * t_in / t_out, fp32)",
            paired("ours_fp32", "ours_fp32_oop") / 0.95,
            1.0,
        ),
        (
            "out of place at the in-place speed (0.95 * t_in / t_out, remainders)",
            paired("ours_rem", "ours_rem_oop") / 0.95,
            1.0,
        ),
        (
            "8-bit moments within 10% of ceiling (16 B)",
            paired(ceiling["q8mom"]["key"], "ours_q8mom"),
            0.90,
        ),
        (
            "remainders + 8-bit moments within 10% of ceiling (14 B)",
            paired(ceiling["rem+q8mom"]["key"], "ours_rem_q8mom"),
            0.90,
        ),
    ]
    if ds is not None:
        checks.insert(
            1, ("ours fp32 >= DeepSpeed (speed ratio)", paired("deepspeed", "ours_fp32"), 1.0)
        )
    checks = [
        {"name": name, "value": val, "target": tgt, "ok": val >= tgt} for name, val, tgt in checks
    ]
    return results, ceiling, checks


def _ms(x, width):
    """Milliseconds with 1 decimal, 3 below 1 ms (tiny smoke-test sizes)."""
    return f"{x:{width}.{1 if x >= 1 else 3}f}"


def print_table(n, results, ceiling):
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
        if "skipped" in r:
            print(f"{r['label']:46s} {r['skipped']}")
            continue
        print(
            f"{r['label']:46s} {_ms(r['ms_median'], 9)} {_ms(r['ms_min'], 8)} "
            f"{r['params_per_s'] / 1e6:10.0f} "
            f"{r['gbps']:10.1f} {r['frac_ceiling']:8.0%} {r['vs_torch_fused']:8.2f}x"
        )
    print("ceiling patterns (median ms; * = best):")
    names = list(next(iter(ceiling.values()))["patterns_ms"])
    print(f"  {'traffic':24s}" + "".join(f"{k:>15s}" for k in names))
    for traffic, c in ceiling.items():
        cells = "".join(
            f"{_ms(c['patterns_ms'][k], 14)}{'*' if k == c['best'] else ' '}" for k in names
        )
        print(f"  {traffic + ' ' + str(c['bytes_per_elem']) + ' B':24s}{cells}")


def main():
    sizes = [int(float(s)) for s in ARGS.sizes.split(",") if s.strip()]
    ca.set_simd_level(ARGS.simd)
    ca.set_num_threads(ARGS.threads)
    torch.set_num_threads(ARGS.threads)
    ds_cls, ds_note = _deepspeed_adam()
    lib, why = hc.build_library()
    print(
        f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, load avg "
        f"{os.getloadavg()[0]:.2f}; torch {torch.__version__}; python {platform.python_version()}; "
        f"THP {'off' if ARGS.no_thp else 'on'}"
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
            "argv": sys.argv[1:],
        },
        "sizes": {},
    }
    for n in sizes:
        results, ceiling, chk = bench_size(n, ds_cls, ds_note, lib)
        print_table(n, results, ceiling)
        print("targets (paired: median over repeats of the per-repeat ratio):")
        for c in chk:
            print(
                f"  [{'PASS' if c['ok'] else 'MISS'}] {c['name']}: {c['value']:.2f} "
                f"(target >= {c['target']:.2f})"
            )
        report["sizes"][str(n)] = {"rows": results, "ceiling": ceiling, "checks": chk}
    report["meta"]["load_avg_end"] = os.getloadavg()[0]
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {ARGS.json}")


if __name__ == "__main__":
    main()
