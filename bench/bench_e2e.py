"""End-to-end training throughput on the CPU: ours (ZeRO-Offload) beside plain PyTorch DDP.

Every configuration trains the same GPT (``GPTModel`` built from the same seed) on the
same synthetic batches (``--mock-data``), with the same number of processes (2), the
same threads per rank (``OMP_NUM_THREADS``), the same micro- and global batch.

Part 1, launches: each run is one ``torchrun`` launch of ``pretrain_gpt.py`` (ours,
unmodified) or of this file's DDP loop; the runs are interleaved in rounds (order
reversed every other round) so a noisy neighbour slows every configuration alike.
Per run the first ``--warmup`` iterations are dropped; the table shows the median
ms/iteration over all kept iterations, the spread of the per-run medians, and the
throughput ratio to the DDP baseline (median over rounds of the same round's ratio).

  (b) ddp          torch.nn.parallel.DistributedDataParallel + torch.optim.AdamW(fused=True),
                   the loop in ``worker_ddp`` below, TP1 x DP2   <- the baseline
  (a) offload      pretrain_gpt.py --optimizer adam --cpu-offload, TP1 x DP2
  (d) dpu          (a) + --dpu-warmup-steps (one-step delayed update)
  (c) tp2          (a) with --tensor-model-parallel-size 2: TP2 x DP1 (2 micro-batches/step)
  (e) torch-adamw  pretrain_gpt.py --optimizer torch-adamw (our unpartitioned reference)

Part 2, paired (unless ``--no-pair``): one launch holds both (b) and (a) -- two copies of
the model, each with its own optimizer, its own data iterator over the same samples
and its own RNG streams -- and alternates them iteration by iteration (ABBA...), so
each pair of neighbouring iterations saw the same machine. It reports the median of
the per-pair ratios and where the time goes: timers wrapped around the ZeRO
optimizer's pieces (bucket copy, reduce-scatter, host accumulate, norm, Adam,
publish, all-gather) and around DDP's forward/backward/clip/step (exclusive times,
per-iteration medians; the timers cost well under 0.1 ms per iteration).

  python bench/bench_e2e.py [--hidden 256 --layers 4 --seq 256 --micro-batch 4]
      [--iters 12 --warmup 3 --repeats 3 --pair-iters 16]
      [--configs ddp,offload,dpu,tp2,torch-adamw] [--bf16] [--threads 1]
      [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_workers import _split_worker_argv, worker_ddp, worker_pair  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NPROC = 2

# key -> (label, tp, extra pretrain flags); table order = this order
CONFIGS = {
    "ddp": ("(b) PyTorch DDP + AdamW(fused=True)", 1, []),
    "offload": (
        "(a) ours ZeRO-Offload (adam --cpu-offload)",
        1,
        ["--optimizer", "adam", "--cpu-offload"],
    ),
    "dpu": ("(d) ours ZeRO-Offload + DPU", 1, ["--optimizer", "adam", "--cpu-offload"]),
    "tp2": (
        "(c) ours ZeRO-Offload, TP=2",
        2,
        ["--optimizer", "adam", "--cpu-offload", "--tensor-model-parallel-size", "2"],
    ),
    "torch-adamw": ("(e) ours --optimizer torch-adamw", 1, ["--optimizer", "torch-adamw"]),
}


def _parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--iters", type=int, default=12, help="iterations per run")
    ap.add_argument(
        "--warmup", type=int, default=3, help="iterations dropped at the start of a run"
    )
    ap.add_argument("--repeats", type=int, default=3, help="rounds: one run of every config each")
    ap.add_argument(
        "--pair-iters",
        type=int,
        default=16,
        help="iterations of each of (b) and (a) in the paired run",
    )
    ap.add_argument("--no-pair", action="store_true", help="skip part 2 (paired run + phases)")
    ap.add_argument("--dpu-warmup-steps", type=int, default=2)
    ap.add_argument(
        "--threads",
        type=int,
        default=max(1, len(os.sched_getaffinity(0)) // NPROC),
        help="OMP_NUM_THREADS per rank (default: cores // 2)",
    )
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 (ours: bf16 params, fp32 master; DDP: fp32 params + autocast)",
    )
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--plot", metavar="PNG", help="tokens/s bar chart (needs matplotlib)")
    a = ap.parse_args(argv)
    a.configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in a.configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown config(s) {bad}; choose from {list(CONFIGS)}")
    if "ddp" not in a.configs:
        a.configs.insert(0, "ddp")  # everything is reported relative to it
    if a.warmup >= min(a.iters, a.pair_iters):
        ap.error("--warmup must be smaller than --iters and --pair-iters")
    return a


def pretrain_flags(a, key, log_json, iters=None):
    _, tp, extra = CONFIGS[key]
    flags = [
        "--num-layers",
        a.layers,
        "--hidden-size",
        a.hidden,
        "--num-attention-heads",
        a.heads,
        "--seq-length",
        a.seq,
        "--max-position-embeddings",
        a.seq,
        "--vocab-size",
        a.vocab,
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--micro-batch-size",
        a.micro_batch,
        "--global-batch-size",
        a.micro_batch * NPROC,  # same for TP2 x DP1: 2 micro-batches
        "--train-iters",
        iters or a.iters,
        "--lr",
        "1e-4",
        "--log-interval",
        10**6,
        "--eval-interval",
        10**6,
        "--eval-iters",
        1,
        "--log-json",
        log_json,
        *extra,
    ]
    if key == "dpu":
        flags += ["--dpu-warmup-steps", a.dpu_warmup_steps]
    if a.bf16:
        flags.append("--bf16")
    return [str(f) for f in flags]


def _torchrun(a, script_and_flags, what):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={NPROC}",
        *script_and_flags,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout)
    if res.returncode != 0:
        raise RuntimeError(
            f"{what} failed (rc {res.returncode}):\n{' '.join(cmd)}\n"
            f"{res.stdout[-1500:]}\n{res.stderr[-3000:]}"
        )


def launch(a, key, workdir, tag):
    """Part 1: one torchrun run of ``key``; returns rank 0's per-iteration records."""
    log = os.path.join(workdir, f"{key}_{tag}.jsonl")
    flags = pretrain_flags(a, key, log)
    if key == "ddp":
        script = [os.path.abspath(__file__), "--worker", "ddp", "--"]
    else:
        script = [os.path.join(ROOT, "pretrain_gpt.py")]
    _torchrun(a, [*script, *flags], f"{key} run")
    with open(log) as f:
        return [json.loads(line) for line in f if '"elapsed_ms"' in line]


def launch_pair(a, workdir):
    out = os.path.join(workdir, "pair.json")
    flags = pretrain_flags(a, "offload", os.path.join(workdir, "pair.jsonl"), a.pair_iters)
    _torchrun(
        a, [os.path.abspath(__file__), "--worker", "pair", "--out", out, "--", *flags], "paired run"
    )
    with open(out) as f:
        return json.load(f)


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return dict(
        cpu=cpu,
        cores=len(os.sched_getaffinity(0)),
        memory_gib=round(mem, 1),
        gpu=gpu,
        torch=torch.__version__,
        python=platform.python_version(),
        date=time.strftime("%Y-%m-%d %H:%M %Z"),
    )


def summarize(a, runs):
    """runs[key] = list over rounds of per-iteration ms (warm-up dropped)."""
    tokens_per_iter = a.micro_batch * NPROC * a.seq
    out = {}
    base = runs["ddp"]
    for key in a.configs:
        per_run = [statistics.median(r) for r in runs[key]]
        med = statistics.median([x for r in runs[key] for x in r])
        # side by side: this round's DDP run against this round's run of key
        ratios = [statistics.median(b) / statistics.median(r) for b, r in zip(base, runs[key])]
        out[key] = dict(
            label=CONFIGS[key][0],
            tp=CONFIGS[key][1],
            dp=NPROC // CONFIGS[key][1],
            ms_median=med,
            ms_run_medians=per_run,
            tokens_per_sec=tokens_per_iter / med * 1e3,
            vs_ddp=statistics.median(ratios),
            vs_ddp_per_round=ratios,
            samples_ms=[[round(x, 2) for x in r] for r in runs[key]],
        )
    return out


def summarize_pair(a, records):
    kept = [r for r in records if r["iteration"] > a.warmup]
    ms = {who: [r["elapsed_ms"] for r in kept if r["who"] == who] for who in ("ddp", "offload")}
    ratios = [b / o for b, o in zip(ms["ddp"], ms["offload"])]  # iteration i of each
    phases = {}
    for who in ms:
        recs = [r for r in kept if r["who"] == who]
        names = list(dict.fromkeys(n for r in recs for n in r["phases_ms"]))
        med = {n: statistics.median(r["phases_ms"].get(n, 0.0) for r in recs) for n in names}
        med["loop: data, lr, loss all-reduce, untimed"] = statistics.median(
            r["elapsed_ms"] - sum(r["phases_ms"].values()) for r in recs
        )
        phases[who] = med
    final = {who: [r["loss"] for r in records if r["who"] == who][-1] for who in ms}
    return dict(
        ms_median={w: statistics.median(v) for w, v in ms.items()},
        tokens_per_sec={
            w: a.micro_batch * NPROC * a.seq / statistics.median(v) * 1e3 for w, v in ms.items()
        },
        ratio_median=statistics.median(ratios),
        ratio_quartiles=statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios,
        pairs=len(ratios),
        phases_ms=phases,
        final_loss=final,
    )


def print_table(a, summary, final_loss):
    print(
        f"\n=== part 1: end-to-end, CPU, {NPROC} ranks x {a.threads} thread(s); GPT "
        f"{a.layers}x{a.hidden}, {a.heads} heads, seq {a.seq}, vocab {a.vocab}; micro-batch "
        f"{a.micro_batch}, global {a.micro_batch * NPROC}; {'bf16' if a.bf16 else 'fp32'}; "
        f"{a.repeats} rounds x {a.iters - a.warmup} timed iterations ==="
    )
    hdr = (
        f"{'config':44s} {'TPxDP':>5s} {'ms/iter':>8s} {'run medians (min..max)':>23s} "
        f"{'tokens/s':>9s} {'vs DDP':>7s} {'final loss':>10s}"
    )
    print(hdr)
    print("-" * len(hdr))
    for key in a.configs:
        s = summary[key]
        lo, hi = min(s["ms_run_medians"]), max(s["ms_run_medians"])
        print(
            f"{s['label']:44s} {s['tp']}x{s['dp']:<3d} {s['ms_median']:8.1f} "
            f"{f'{lo:.1f}..{hi:.1f}':>23s} {s['tokens_per_sec']:9.0f} {s['vs_ddp']:6.3f}x "
            f"{final_loss.get(key, float('nan')):10.4f}"
        )
    if "offload" in summary:
        _verdict("part 1", summary["offload"]["vs_ddp"])


def _verdict(what, ratio):
    cost = (1 / ratio - 1) * 100
    print(
        f"{what}: (a)/(b) tokens/s = {ratio:.3f} -> ZeRO-Offload costs {cost:+.1f}% time per "
        f"iteration vs DDP (target <= +5%): {'PASS' if cost <= 5 else 'MISS'}"
    )


def print_pair(a, p):
    q = p["ratio_quartiles"]
    print(
        f"\n=== part 2: paired run, (b) and (a) alternating per iteration in one launch, "
        f"{p['pairs']} timed pairs ==="
    )
    for who, label in (("ddp", CONFIGS["ddp"][0]), ("offload", CONFIGS["offload"][0])):
        print(
            f"{label:44s} {p['ms_median'][who]:8.1f} ms/iter {p['tokens_per_sec'][who]:9.0f} "
            f"tokens/s  final loss {p['final_loss'][who]:.4f}"
        )
    print(
        f"per-pair ratio (b) ms / (a) ms: median {p['ratio_median']:.3f} "
        f"(quartiles {q[0]:.3f}..{q[-1]:.3f})"
    )
    _verdict("part 2", p["ratio_median"])
    print("\nwhere the time goes (median ms per iteration, rank 0, exclusive times):")
    for who, label in (("offload", "(a) ours ZeRO-Offload"), ("ddp", "(b) DDP + fused AdamW")):
        total = p["ms_median"][who]
        print(f"  {label}: {total:.1f} ms/iter")
        for name, v in sorted(p["phases_ms"][who].items(), key=lambda kv: -kv[1]):
            print(f"    {name:44s} {v:8.2f}  {v / total:6.1%}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        opts, rest = _split_worker_argv(argv)
        kind = opts["--worker"]
        if kind == "ddp":
            return worker_ddp(rest)
        if kind == "pair":
            return worker_pair(rest, opts["--out"])
        raise SystemExit(f"unknown worker {kind}")
    a = _parse_args(argv)
    meta = machine_info()
    meta.update(
        load_avg_start=os.getloadavg()[0], threads_per_rank=a.threads, nproc=NPROC, argv=argv
    )
    print(
        f"CPU: {meta['cpu']}, {meta['cores']} cores, {meta['memory_gib']} GiB, GPU "
        f"{meta['gpu']}; torch {meta['torch']}; load avg {meta['load_avg_start']:.2f}; "
        f"{meta['date']}"
    )
    runs = {k: [] for k in a.configs}
    final_loss = {}
    t_start = time.perf_counter()
    pair = None
    with tempfile.TemporaryDirectory(prefix="bench_e2e_") as work:
        for r in range(a.repeats):
            order = a.configs if r % 2 == 0 else a.configs[::-1]
            for key in order:
                recs = launch(a, key, work, f"r{r}")
                kept = [x["elapsed_ms"] for x in recs if x["iteration"] > a.warmup]
                runs[key].append(kept)
                final_loss[key] = recs[-1]["loss"]
                print(
                    f"  round {r + 1}/{a.repeats} {key:12s} median "
                    f"{statistics.median(kept):8.1f} ms/iter  "
                    f"({time.perf_counter() - t_start:4.0f} s)",
                    flush=True,
                )
        summary = summarize(a, runs)
        print_table(a, summary, final_loss)
        if not a.no_pair:
            pair = summarize_pair(a, launch_pair(a, work))
            print_pair(a, pair)
    meta["load_avg_end"] = os.getloadavg()[0]
    meta["wall_s"] = time.perf_counter() - t_start
    print(
        f"\nwall {meta['wall_s']:.0f} s; load avg {meta['load_avg_start']:.2f} -> "
        f"{meta['load_avg_end']:.2f}"
    )
    report = dict(
        meta=meta,
        model=dict(
            layers=a.layers,
            hidden=a.hidden,
            heads=a.heads,
            seq=a.seq,
            vocab=a.vocab,
            micro_batch=a.micro_batch,
            global_batch=a.micro_batch * NPROC,
            precision="bf16" if a.bf16 else "fp32",
            iters=a.iters,
            warmup=a.warmup,
            repeats=a.repeats,
            pair_iters=a.pair_iters,
        ),
        configs=summary,
        final_loss=final_loss,
        pair=pair,
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {a.json}")
    if a.plot:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from plot_results import plot_e2e

        if plot_e2e(report, a.plot):
            print(f"wrote {a.plot}")
    return report


if __name__ == "__main__":
    main()
