"""Benchmark the fused CPU Adam (mp_offload.ops.cpu_adam) against torch and DeepSpeed.

All rows run side by side in one process on the same sizes, round-robin (one
step of every row per repeat), so a noisy neighbour hurts all rows alike. Each
row is warmed up once (allocating lazy optimizer state), then timed per step;
the median is reported (the minimum too, for noisy machines).

"GB/s eff." = bytes the job must move per element x elements / time:
  fp32 Adam step: read p, g, m, v + write p, m, v = 28 B; + bf16 copy out = 30 B;
  bf16/fp16 grads: 26 B. The ceiling is ``stream_probe``: the same loads/stores,
  threads, tiles and SIMD path as our kernel with trivial math; "of ceil." is
  probe-time-for-the-same-traffic / row-time.

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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10e6,100e6", help="comma-separated element counts (default 10e6,100e6)")
    ap.add_argument("--repeats", type=int, default=7, help="timed steps per row (median reported)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads for ours, torch and DeepSpeed (default: all available cores)")
    ap.add_argument("--simd", default="auto", help="scalar|avx2|avx512|auto")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeedCPUAdam row")
    ap.add_argument("--json", metavar="FILE", help="also write results as JSON")
    return ap.parse_args()


ARGS = _parse_args()
# Before torch/DeepSpeed load libgomp: every OpenMP runtime in the process gets the same count.
os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)

import torch  # noqa: E402

from mp_offload.ops import cpu_adam as ca  # noqa: E402

HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


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
        return None, f"unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''})"


def bench_size(n, ds_cls, ds_note):
    gen = torch.Generator().manual_seed(0)
    # ours: one fp32 state set, grads in all three dtypes, a bf16 copy-out buffer
    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    g32 = torch.randn(n, generator=gen)
    g16, gbf = g32.half(), g32.bfloat16()
    out = torch.empty(n, dtype=torch.bfloat16)
    # stream_probe overwrites its buffers: separate scratch
    sp, sm, sv = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    sout = torch.empty(n, dtype=torch.bfloat16)
    # torch / DeepSpeed: one big param with an fp32 grad, each optimizer with its own state
    tp = torch.nn.Parameter(torch.randn(n, generator=gen))
    tp.grad = torch.randn(n, generator=gen)
    tout = torch.empty(n, dtype=torch.bfloat16)
    fused = torch.optim.AdamW([tp], **HP, fused=True)
    foreach = torch.optim.AdamW([tp], **HP, foreach=True)
    ds = ds_cls([tp], **HP, adamw_mode=True) if ds_cls else None

    step = [0]

    def ours(grad, param_out=None):
        def run():
            step[0] += 1
            ca.adam_step(p, grad, m, v, step=step[0], lr=HP["lr"], beta1=HP["betas"][0], beta2=HP["betas"][1],
                         eps=HP["eps"], weight_decay=HP["weight_decay"], adamw=True, param_out=param_out)
        return run

    def fused_copy():
        fused.step()
        tout.copy_(tp.detach())

    # (key, label, bytes/element, fn, probe key for "of ceil.")
    rows = [
        ("ours_fp32", "(1) ours fp32 grads", 28, ours(g32), "probe_fp32"),
        ("ours_fp32_bf16out", "(2) ours fp32 grads + bf16 param_out", 30, ours(g32, out), "probe_bf16out"),
        ("ours_bf16g", "(3) ours bf16 grads", 26, ours(gbf), "probe_bf16g"),
        ("ours_fp16g", "(4) ours fp16 grads", 26, ours(g16), "probe_bf16g"),
        ("torch_fused", "(5) torch AdamW(fused=True)", 28, fused.step, "probe_fp32"),
        ("torch_fused_copy", "(6) torch fused + out.copy_(p) bf16", 30, fused_copy, "probe_bf16out"),
        ("torch_foreach", "(7) torch AdamW(foreach=True)", 28, foreach.step, "probe_fp32"),
    ]
    if ds is not None:
        rows.append(("deepspeed", "(8) DeepSpeedCPUAdam", 28, ds.step, "probe_fp32"))
    rows += [
        ("probe_fp32", "(9) stream_probe ceiling, 28 B", 28, lambda: ca.stream_probe(sp, g32, sm, sv), None),
        ("probe_bf16out", "(9) stream_probe + bf16 out, 30 B", 30,
         lambda: ca.stream_probe(sp, g32, sm, sv, param_out=sout), None),
        ("probe_bf16g", "(9) stream_probe bf16 grads, 26 B", 26, lambda: ca.stream_probe(sp, gbf, sm, sv), None),
    ]
    for _, _, _, fn, _ in rows:  # warm-up: lazy state, page faults, JIT
        fn()
    times = {key: [] for key, *_ in rows}
    for _ in range(ARGS.repeats):
        for key, _, _, fn, _ in rows:
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)

    med = {k: statistics.median(t) for k, t in times.items()}
    results = []
    for key, label, nbytes, _, probe in rows:
        t = med[key]
        results.append(dict(
            key=key, label=label, n=n, bytes_per_elem=nbytes, ms_median=t * 1e3, ms_min=min(times[key]) * 1e3,
            times_ms=[round(x * 1e3, 2) for x in times[key]], params_per_s=n / t, gbps=nbytes * n / t / 1e9,
            frac_ceiling=(med[probe] / t) if probe else 1.0, vs_torch_fused=med["torch_fused"] / t,
        ))
    if ds is None:  # keep the table in row order
        at = next(i for i, r in enumerate(results) if r["key"] == "torch_foreach") + 1
        results.insert(at, dict(key="deepspeed", label="(8) DeepSpeedCPUAdam", n=n, skipped=ds_note))
    return results


def print_table(n, results):
    print(f"\n=== n = {n:,} params ({n / 1e6:g}M), threads = {ARGS.threads}, simd = {ca.simd_level()} ===")
    hdr = (f"{'row':40s} {'ms/step':>9s} {'(min)':>8s} {'Mparams/s':>10s} {'GB/s eff.':>10s} "
           f"{'of ceil.':>9s} {'vs fused':>9s}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        if "skipped" in r:
            print(f"{r['label']:40s} {r['skipped']}")
            continue
        print(f"{r['label']:40s} {r['ms_median']:9.1f} {r['ms_min']:8.1f} {r['params_per_s'] / 1e6:10.0f} "
              f"{r['gbps']:10.1f} {r['frac_ceiling']:8.0%} {r['vs_torch_fused']:8.2f}x")


def checks(results):
    t = {r["key"]: r["ms_median"] for r in results if "skipped" not in r}
    out = [
        ("ours fp32 >= torch fused (speed ratio)", t["torch_fused"] / t["ours_fp32"], 1.0),
        ("ours + bf16 copy >= 1.15x torch fused + copy", t["torch_fused_copy"] / t["ours_fp32_bf16out"], 1.15),
        ("bf16 grads within 10% of fp32 time (1.1 * t_fp32 / t_bf16)", t["ours_fp32"] * 1.10 / t["ours_bf16g"], 1.0),
        ("ours fp32 within 10% of ceiling (t_probe / t_ours)", t["probe_fp32"] / t["ours_fp32"], 0.90),
        ("ours + bf16 copy within 10% of ceiling", t["probe_bf16out"] / t["ours_fp32_bf16out"], 0.90),
    ]
    return [dict(name=name, value=val, target=tgt, ok=val >= tgt) for name, val, tgt in out]


def main():
    sizes = [int(float(s)) for s in ARGS.sizes.split(",") if s.strip()]
    ca.set_simd_level(ARGS.simd)
    ca.set_num_threads(ARGS.threads)
    torch.set_num_threads(ARGS.threads)
    ds_cls, ds_note = _deepspeed_adam()
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, load avg "
          f"{os.getloadavg()[0]:.2f}; torch {torch.__version__}; python {platform.python_version()}")
    report = dict(meta=dict(threads=ARGS.threads, simd=ca.simd_level(), repeats=ARGS.repeats,
                            torch=torch.__version__, argv=sys.argv[1:]), sizes={})
    for n in sizes:
        results = bench_size(n, ds_cls, ds_note)
        print_table(n, results)
        chk = checks(results)
        print("targets (medians):")
        for c in chk:
            print(f"  [{'PASS' if c['ok'] else 'MISS'}] {c['name']}: {c['value']:.2f} (target >= {c['target']:.2f})")
        report["sizes"][str(n)] = dict(rows=results, checks=chk)
    report["meta"]["load_avg_end"] = os.getloadavg()[0]
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {ARGS.json}")


if __name__ == "__main__":
    main()
