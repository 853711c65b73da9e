"""``python -m mp_offload.plan`` and ``pretrain_gpt.py --dry-run``.

The planner takes pretrain_gpt.py's own flags (the generated parser of config.py), so
a training command line can be planned by adding ``--dry-run`` (hardware from the
environment, see ``hardware_from_env``) or by handing it to ``python -m
mp_offload.plan`` with hardware flags.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from ..config import (
    CONFIG_CLASSES,
    Args,
    ConfigError,
    build_parser,
    parse_with_config,
    resolve,
)
from ..model.gpt import flops_per_token, num_parameters
from .memory import (
    ALL_MODES,
    EXACT,
    GiB,
    Hardware,
    Run,
    compare_modes,
    format_comparison,
    format_job,
    plan_job,
)
from .search import (
    FAMILIES,
    bytes_per_param_note,
    format_paper_table,
    max_model,
    paper_table,
)
from .throughput import (
    Machine,
    format_scaling,
    measure_adam_rate,
    plot_scaling,
    scaling,
    ten_b,
)


def run_from_args(args: Args, world: int, mode: str | None = None, cuda: bool = True) -> Run:
    """The plan's view of a training command line."""
    tp = args.parallel.tensor_model_parallel_size
    low = args.train.fp16 or args.train.bf16
    if mode is None:
        mode = ("pytorch" if args.optim.optimizer == "torch-adamw"
                else "offload" if args.optim.cpu_offload else "zero2")
    return Run(args.model, tp=tp, dp=world // tp, mode=mode, elem_bytes=2 if low else 4,
               micro_batch=args.train.micro_batch_size,
               bucket_size=args.optim.reduce_bucket_size,
               dpu=args.optim.dpu_warmup_steps is not None and mode == "offload", cuda=cuda)


def _host_memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    except (ValueError, OSError, AttributeError):
        return None


def hardware_from_env(world: int) -> tuple[Hardware, list[str]]:
    """Hardware for --dry-run: PLAN_DEVICE_MEMORY_GB / PLAN_HOST_MEMORY_GB /
    PLAN_DEVICES_PER_NODE win; else what a CUDA machine reports about itself; else
    defaults (an 80 GiB GPU, 256 GiB host, min(world, 8) per node). Returns the notes
    saying where each number came from."""
    import torch
    notes, hw = [], Hardware()
    cuda = torch.cuda.is_available()
    env = os.environ.get
    if env("PLAN_DEVICE_MEMORY_GB"):
        hw.device_memory_gb, src = float(env("PLAN_DEVICE_MEMORY_GB")), "PLAN_DEVICE_MEMORY_GB"
    elif cuda:
        hw.device_memory_gb = torch.cuda.get_device_properties(0).total_memory / GiB
        src = f"this machine's {torch.cuda.get_device_name(0)}"
    else:
        src = "default; set PLAN_DEVICE_MEMORY_GB"
    notes.append(f"device memory {hw.device_memory_gb:.1f} GiB ({src})")
    if env("PLAN_HOST_MEMORY_GB"):
        hw.host_memory_gb, src = float(env("PLAN_HOST_MEMORY_GB")), "PLAN_HOST_MEMORY_GB"
    elif cuda and _host_memory_gib():
        hw.host_memory_gb, src = _host_memory_gib(), "this machine"
    else:
        src = "default; set PLAN_HOST_MEMORY_GB"
    notes.append(f"host memory per node {hw.host_memory_gb:.1f} GiB ({src})")
    if env("PLAN_DEVICES_PER_NODE"):
        hw.devices_per_node, src = int(env("PLAN_DEVICES_PER_NODE")), "PLAN_DEVICES_PER_NODE"
    elif env("LOCAL_WORLD_SIZE"):
        hw.devices_per_node, src = int(env("LOCAL_WORLD_SIZE")), "LOCAL_WORLD_SIZE"
    else:
        hw.devices_per_node, src = min(world, 8), "default min(world, 8)"
    notes.append(f"{hw.devices_per_node} ranks per node ({src})")
    return hw, notes


def _vocab_from_tokenizer(args: Args) -> str:
    """Training takes the vocabulary from the tokenizer: do the same when one is named."""
    d = args.data
    if d.mock_data or d.tokenizer_type == "NullTokenizer" or not d.tokenizer_model:
        return f"vocabulary {args.model.vocab_size} (--vocab-size)"
    if not os.path.exists(d.tokenizer_model):
        return (f"vocabulary {args.model.vocab_size} (--vocab-size; --tokenizer-model "
                f"{d.tokenizer_model} not found here)")
    try:
        from ..data.tokenizer import build_tokenizer
        args.model.vocab_size = build_tokenizer(d.tokenizer_type, d.tokenizer_model,
                                                vocab_size=args.model.vocab_size).vocab_size
        return f"vocabulary {args.model.vocab_size} (from {d.tokenizer_model})"
    except Exception as e:  # noqa: BLE001 - a plan is still useful without it
        return f"vocabulary {args.model.vocab_size} (--vocab-size; tokenizer failed: {e})"


def describe_model(args: Args, world: int) -> str:
    m, tp = args.model, args.parallel.tensor_model_parallel_size
    rc = m.recompute_activations
    n = num_parameters(m, tp)
    f = flops_per_token(m, rc, tp)
    tokens = (args.train.global_batch_size or args.train.micro_batch_size * (world // tp)) \
        * m.seq_length
    return (f"GPT {m.num_layers} layers x hidden {m.hidden_size}, {m.num_attention_heads} heads,"
            f" ffn {m.ffn_hidden_size}, seq {m.seq_length}, padded vocabulary "
            f"{m.padded_vocab_size(tp)}\n"
            f"parameters {n:,} ({n / 1e9:.2f}B); training FLOPs per token {f / 1e9:.2f} G "
            f"({'with' if rc else 'without'} recomputation); per step "
            f"{tokens:,} tokens = {f * tokens / 1e15:.2f} PFLOP")


def dry_run(args: Args, world: int) -> None:
    """Plan a training command line without allocating anything, then return."""
    hw, notes = hardware_from_env(world)
    vocab = _vocab_from_tokenizer(args)
    print(f"dry run: world {world}; {vocab}; " + "; ".join(notes))
    print(describe_model(args, world))
    run = run_from_args(args, world)
    print(format_job(plan_job(run, hw, source="meta")))  # the real model, every TP rank
    print("same model and layout, other modes:")
    print(format_comparison(compare_modes(run, hw)))
    sys.stdout.flush()


# -------------------------------------------------------------- the plan CLI
def _planner_parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.description = "Plan memory (and throughput) of pretrain_gpt.py runs"
    g = p.add_argument_group("planner")

    def add(flag, **kw):
        g.add_argument(flag, dest="plan." + flag[2:].replace("-", "_"), **kw)
    add("--device-memory-gb", type=float, default=80.0, help="per device, GiB")
    add("--host-memory-gb", type=float, default=256.0, help="per node, GiB")
    add("--devices-per-node", type=int, default=8)
    add("--device-reserved-gb", type=float, default=1.0,
        help="CUDA context, library workspaces, allocator slack (GiB)")
    add("--host-process-gb", type=float, default=2.0, help="per-rank process overhead (GiB)")
    add("--mode", choices=ALL_MODES, default=None,
        help="plan this mode (default: what the optimizer flags say)")
    add("--plan-cpu", action="store_true", help="plan a CPU run (no CUDA gradient staging)")
    add("--json", action="store_true", help="print the plan as JSON")
    add("--max-model", action="store_true", help="largest GPT of --family that fits")
    add("--family", choices=FAMILIES, default="gpt3",
        help="gpt3: width and depth grow together (depth h/128..h/64); layers: only depth")
    add("--paper-table", action="store_true", help="the ZeRO-Offload paper's size claims")
    add("--throughput", action="store_true", help="step-time model, 10B model, 1..128 GPUs")
    add("--throughput-model", choices=("10b", "flags"), default="10b")
    add("--gpus", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    add("--batch-per-gpu", type=int, default=16, help="sequences per GPU per step")
    add("--device-tflops", type=float, default=Machine.device_tflops)
    add("--intra-node-gbs", type=float, default=Machine.intra_node_gbs)
    add("--inter-node-gbs", type=float, default=Machine.inter_node_gbs)
    add("--pcie-gbs", type=float, default=Machine.pcie_gbs)
    add("--cpu-cores-per-node", type=int, default=Machine.cpu_cores_per_node)
    add("--host-mem-gbs", type=float, default=Machine.host_mem_gbs)
    add("--adam-rate-per-core", type=float, default=None,
        help="elements/s (default: measured here, else 8e7)")
    add("--tp-devices-per-node", type=int, default=Machine.devices_per_node,
        help="devices per node for the throughput model")
    add("--plot", default=None, help="write the throughput PNG here (needs matplotlib)")
    return p


def parse(argv=None) -> tuple[Args, argparse.Namespace]:
    ns = vars(parse_with_config(_planner_parser(), argv))
    parts: dict[str, dict] = {name: {} for name in [*CONFIG_CLASSES, "plan"]}
    for key, value in ns.items():
        if key == "config":
            continue
        group, name = key.split(".", 1)
        parts[group][name] = value
    args = Args(**{n: cls(**parts[n]) for n, cls in CONFIG_CLASSES.items()})
    return args, argparse.Namespace(**parts["plan"])


def main(argv=None) -> int:
    args, opt = parse(argv)
    world = args.parallel.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    args.train.dry_run = True  # planning needs no --train-iters
    try:
        resolve(args, world)
    except ConfigError as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return 2
    hw = Hardware(opt.device_memory_gb, opt.host_memory_gb, opt.devices_per_node,
                  opt.device_reserved_gb, opt.host_process_gb)
    run = run_from_args(args, world, opt.mode, cuda=not opt.plan_cpu)
    if opt.paper_table:
        print("largest GPT that fits (family gpt3, seq 1024, micro-batch "
              f"{args.train.micro_batch_size}, recomputation on, fp16, GPT-2 vocabulary):")
        print(format_paper_table(paper_table(micro_batch=args.train.micro_batch_size)))
        print(bytes_per_param_note())
    if opt.throughput:
        _throughput(args, opt)
    if opt.max_model:
        found = max_model(run, hw, opt.family)
        if found.cfg is None:
            print(f"max model ({opt.family}): nothing fits")
            return 1
        c = found.cfg
        print(f"max model ({opt.family}): {found.params / 1e9:.2f}B = --num-layers "
              f"{c.num_layers} --hidden-size {c.hidden_size} --num-attention-heads "
              f"{c.num_attention_heads} (stopped by: {found.limit})")
        print(format_job(found.plan))
    if not (opt.paper_table or opt.throughput or opt.max_model):
        plan = plan_job(run, hw, source="meta")
        if opt.json:
            rp = plan.ranks[0]
            print(json.dumps(dict(mode=run.mode, tp=run.tp, dp=run.dp, device=rp.device,
                                  host=rp.host, device_total=plan.device_peak,
                                  host_node=plan.host_node_peak, fits=plan.fits,
                                  exact=list(EXACT), parameters=num_parameters(args.model,
                                                                               run.tp))))
        else:
            print(describe_model(args, world))
            print(format_job(plan))
            print("same model and layout, other modes:")
            print(format_comparison(compare_modes(run, hw)))
    return 0


def _throughput(args: Args, opt) -> None:
    measured = measure_adam_rate() if opt.adam_rate_per_core is None else None
    rate = opt.adam_rate_per_core or measured or Machine.adam_rate_per_core
    machine = Machine(opt.device_tflops, opt.tp_devices_per_node, opt.intra_node_gbs,
                      opt.inter_node_gbs, opt.pcie_gbs, opt.cpu_cores_per_node,
                      opt.host_mem_gbs, rate)
    cfg = ten_b() if opt.throughput_model == "10b" else args.model
    cfg = replace(cfg, recompute_activations=True) if opt.throughput_model == "10b" else cfg
    tp = 1 if opt.throughput_model == "10b" else args.parallel.tensor_model_parallel_size
    rows = scaling(cfg, machine, [g for g in opt.gpus if g % tp == 0], tp=tp,
                   batch_per_gpu=opt.batch_per_gpu, micro_batch=args.train.micro_batch_size)
    src = "measured here, 1 thread" if measured else "given" if opt.adam_rate_per_core \
        else "stated default"
    print(f"throughput model: {num_parameters(cfg, tp) / 1e9:.2f}B ({cfg.num_layers}x"
          f"{cfg.hidden_size}, seq {cfg.seq_length}), TP={tp}, {opt.batch_per_gpu} sequences "
          f"per GPU per step in micro-batches of {args.train.micro_batch_size}; device "
          f"{machine.device_tflops:g} TFLOPS sustained, DP link {machine.intra_node_gbs:g} GB/s "
          f"in a node / {machine.inter_node_gbs:g} GB/s per GPU across, PCIe "
          f"{machine.pcie_gbs:g} GB/s, host {machine.host_mem_gbs:g} GB/s and "
          f"{machine.cpu_cores_per_node} cores per {machine.devices_per_node}-GPU node, CPU Adam "
          f"{rate / 1e6:.0f} M elements/s per core ({src}); times in seconds per step")
    print(format_scaling(rows))
    if opt.plot:
        ok = plot_scaling(rows, opt.plot, f"{num_parameters(cfg, tp) / 1e9:.1f}B GPT, "
                          f"ZeRO-Offload DP, predicted vs the paper's claim")
        print(f"wrote {opt.plot}" if ok else "matplotlib is not installed: no plot written")
