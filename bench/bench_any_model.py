"""A Hugging Face model in a plain user loop: OffloadAdamW against torch.optim.AdamW(fused=True).

One process holds two copies of the same model (a ``LlamaForCausalLM`` built from a
config here, ~58M parameters by default; nothing is downloaded): one trained by
``torch.optim.AdamW(fused=True)`` (fp32 weights; under ``--bf16`` with bf16 autocast),
one by ``OffloadAdamW`` (``dtype=torch.bfloat16`` under ``--bf16``: bf16 weights, the
fp32 master and moments on the host). Both see the same batches in the same loop
(forward, ``loss.backward()``, ``opt.step()``, ``opt.zero_grad()``), alternated
iteration by iteration (ABBA...), so each pair of neighbouring iterations saw the same
machine; the report is the median of the per-pair time ratios after ``--warmup`` pairs.

Device bytes per parameter: torch's from its tensors (weights, ``.grad``, the two
moments: 16 in fp32), ours from ``opt.memory_report()["device"]`` (the weights in their
dtype plus the gradient buckets). On this CPU-only machine the "device" is the CPU too.

  python bench/bench_any_model.py [--hidden 512 --layers 8 --heads 8 --ffn 1376
      --vocab 32000 --seq 128 --micro-batch 2 --pairs 8 --warmup 2] [--no-bf16]
      [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = ap.add_argument
    a("--hidden", type=int, default=512)
    a("--layers", type=int, default=8)
    a("--heads", type=int, default=8)
    a("--ffn", type=int, default=1376)
    a("--vocab", type=int, default=32000)
    a("--seq", type=int, default=128)
    a("--micro-batch", type=int, default=2)
    a("--pairs", type=int, default=8, help="timed pairs (after the warm-up)")
    a("--warmup", type=int, default=2, help="pairs dropped first")
    a("--no-bf16", dest="bf16", action="store_false", help="fp32 on both sides")
    a("--threads", type=int, default=None, help="torch threads (default: the cores)")
    a("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    for name in ("hidden", "layers", "heads", "ffn", "vocab", "seq", "micro_batch", "pairs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


args = parse_args()
threads = args.threads or os.cpu_count() or 1
os.environ.setdefault("OMP_NUM_THREADS", str(threads))
sys.path.insert(0, ROOT)

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from mp_offload import OffloadAdamW


def build(seed: int = 0):
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads,
        intermediate_size=args.ffn, max_position_embeddings=args.seq,
        tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def torch_bytes(model, opt) -> dict:
    """Bytes by kind of what the torch side keeps for its parameters."""
    params = list(model.parameters())
    out = dict(params=sum(p.numel() * p.element_size() for p in params))
    out["grads"] = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = sum(s[key].numel() * s[key].element_size() for s in opt.state.values())
    return out


def batch(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g)


def timed_step(model, opt, tokens, autocast: bool, probe=None) -> tuple[float, float]:
    """One iteration of the user loop: (seconds, loss). ``probe()`` runs between backward
    and the step (where the torch side's gradients exist)."""
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    if probe is not None:
        probe()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0, loss.item()


def main():
    torch.set_num_threads(threads)
    load0 = os.getloadavg()[0]
    ref, ours = build(), build()
    n = sum(p.numel() for p in ref.parameters())
    hp = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref.parameters(), fused=True, **hp)
    opt_ours = OffloadAdamW(ours.parameters(), dtype=torch.bfloat16 if args.bf16 else None, **hp)
    sides = {"torch": (ref, opt_ref, args.bf16), "ours": (ours, opt_ours, False)}
    times = {k: [] for k in sides}
    losses = {}
    grads = {}
    probe = lambda: grads.update(torch_bytes(ref, opt_ref))  # noqa: E731
    for pair in range(args.warmup + args.pairs):
        order = ("torch", "ours") if pair % 2 == 0 else ("ours", "torch")
        for k in order:
            model, opt, autocast = sides[k]
            check = probe if (k, pair) == ("torch", 0) else None
            t, losses[k] = timed_step(model, opt, batch(pair), autocast, check)
            if pair >= args.warmup:
                times[k].append(t)
    ref_bytes = dict(torch_bytes(ref, opt_ref), grads=grads["grads"])  # moments exist now
    ratios = [a / b for a, b in zip(times["ours"], times["torch"])]
    ours_bytes = opt_ours.memory_report()
    report(n, times, ratios, ref_bytes, ours_bytes, losses, load0)


def _per_param(d: dict, n: int) -> str:
    return ", ".join(f"{k} {v / n:.2f}" for k, v in d.items() if v)


def report(n, times, ratios, ref_bytes, ours_bytes, losses, load0):
    dtype = "bf16" if args.bf16 else "fp32"
    dev_ref, dev_ours = sum(ref_bytes.values()) / n, sum(ours_bytes["device"].values()) / n
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ref_label = "torch.optim.AdamW(fused=True)" + (", bf16 autocast" if args.bf16 else "")
    ours_label = f"OffloadAdamW(dtype={'torch.bfloat16' if args.bf16 else 'None'})"
    print(f"model: LlamaForCausalLM {n / 1e6:.1f}M parameters (hidden {args.hidden}, "
          f"{args.layers} layers, ffn {args.ffn}, vocab {args.vocab}), seq {args.seq} x "
          f"micro-batch {args.micro_batch}, {dtype}")  # fmt: skip
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, {threads} torch threads, load "
          f"{load0:.2f} -> {os.getloadavg()[0]:.2f}; torch {torch.__version__}")  # fmt: skip
    print(f"{args.pairs} timed pairs after {args.warmup} warm-up pairs (ABBA order)\n")
    print("| optimizer | median ms/step | device B/param | of which |")
    print("|---|---:|---:|---|")
    print(f"| {ref_label} | {ms['torch']:.1f} | {dev_ref:.2f} | {_per_param(ref_bytes, n)} |")
    print(f"| {ours_label} | {ms['ours']:.1f} | {dev_ours:.2f} | "
          f"{_per_param(ours_bytes['device'], n)} |")  # fmt: skip
    host = sum(ours_bytes["host"].values()) / n
    print(f"\nOffloadAdamW host B/param: {host:.2f} ({_per_param(ours_bytes['host'], n)})")
    ratio = statistics.median(ratios)
    print(f"step-time ratio OffloadAdamW / AdamW(fused): median {ratio:.3f} over {len(ratios)} "
          f"pairs (min {min(ratios):.3f}, max {max(ratios):.3f})")  # fmt: skip
    print(f"device bytes per parameter: {dev_ours:.2f} against {dev_ref:.2f} "
          f"({dev_ref / dev_ours:.2f}x less)")  # fmt: skip
    print(f"last loss: torch {losses['torch']:.4f}, ours {losses['ours']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(params=n, dtype=dtype, ms_median=ms, ratio_median=ratio,
                           ratios=ratios, device_bytes_per_param=dict(torch=dev_ref, ours=dev_ours),
                           ours_bytes=ours_bytes, torch_bytes=ref_bytes, cpu=cpu_model(),
                           losses=losses), f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
