"""``python -m mp_offload.plan`` (and the pieces ``pretrain_gpt.py --dry-run`` uses:
``mp_offload/dry_run.py``).

The planner takes pretrain_gpt.py's own flags (the generated parser of config.py), so
a training command line can be planned by adding ``--dry-run`` (hardware from the
environment, see ``hardware_from_env``) or by handing it to ``python -m
mp_offload.plan`` with hardware flags. The flags and presets are ``flags.py``'s, what
is printed is ``report.py``'s; this module decides what to answer.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import replace

from ..config import Args, ConfigError, resolve
from .flags import HEADROOM_FRACTION, _machine, parse, run_from_args
from .layout import format_layouts, search_layouts
from .memory import GiB, Hardware, Run, compare_modes, format_comparison, format_job, plan_job
from .report import (
    _answer_max_model,
    _fraction_line,
    _print_assumed,
    _print_json,
    _print_speed_and_launch,
    _throughput,
    describe_model,
    format_recipe_table,
)
from .search import bytes_per_param_note, format_paper_table, paper_table


def _host_memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    except (ValueError, OSError, AttributeError):
        return None


def hardware_from_env(world: int) -> tuple[Hardware, list[str]]:
    """Hardware for --dry-run: PLAN_DEVICE_MEMORY_GB / PLAN_DEVICE_MEMORY_RESERVE_GB /
    PLAN_HOST_MEMORY_GB / PLAN_DEVICES_PER_NODE / PLAN_HOST_HEADROOM_GB win; else what a
    CUDA machine reports about itself; else defaults (an 80 GiB GPU of which the larger of
    5% and 2 GiB is kept free, 256 GiB host of which 10% is, min(world, 8) per node).
    Returns the notes saying where each number came from."""
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
    if env("PLAN_DEVICE_MEMORY_RESERVE_GB"):
        hw.device_memory_reserve_gb = float(env("PLAN_DEVICE_MEMORY_RESERVE_GB"))
        src = "PLAN_DEVICE_MEMORY_RESERVE_GB"
    else:
        src = "default; set PLAN_DEVICE_MEMORY_RESERVE_GB"
    notes.append(f"of which {hw.device_reserve_gb:.1f} GiB kept free ({src})")
    if env("PLAN_HOST_MEMORY_GB"):
        hw.host_memory_gb, src = float(env("PLAN_HOST_MEMORY_GB")), "PLAN_HOST_MEMORY_GB"
    elif cuda and _host_memory_gib():
        hw.host_memory_gb, src = _host_memory_gib(), "this machine"
    else:
        src = "default; set PLAN_HOST_MEMORY_GB"
    notes.append(f"host memory per node {hw.host_memory_gb:.1f} GiB ({src})")
    if env("PLAN_HOST_HEADROOM_GB"):
        hw.host_headroom_gb = float(env("PLAN_HOST_HEADROOM_GB"))
        src = "PLAN_HOST_HEADROOM_GB"
    else:
        hw.host_headroom_gb = HEADROOM_FRACTION * hw.host_memory_gb
        src = f"default {HEADROOM_FRACTION * 100:g}%; set PLAN_HOST_HEADROOM_GB"
    notes.append(f"of which {hw.host_headroom_gb:.1f} GiB kept free ({src})")
    if env("PLAN_DEVICES_PER_NODE"):
        hw.devices_per_node, src = int(env("PLAN_DEVICES_PER_NODE")), "PLAN_DEVICES_PER_NODE"
    elif env("LOCAL_WORLD_SIZE"):
        hw.devices_per_node, src = int(env("LOCAL_WORLD_SIZE")), "LOCAL_WORLD_SIZE"
    else:
        hw.devices_per_node, src = min(world, 8), "default min(world, 8)"
    notes.append(f"{hw.devices_per_node} ranks per node ({src})")
    return hw, notes


def main(argv=None) -> int:
    try:
        args, opt = parse(argv)
    except ConfigError as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return 2
    world = _world(args, opt)
    args.train.dry_run = True  # planning needs no --train-iters
    # No model given and nothing else asked: the question is what fits here.
    ask_max = opt.max_model or not (
        opt.shape_given or opt.paper_table or opt.throughput or opt.json
    )
    if ask_max and not opt.shape_given:
        _searchable_base(args)
    try:
        args = resolve(args, world)
    except ConfigError as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return 2
    headroom = (
        opt.host_headroom_gb
        if opt.host_headroom_gb is not None
        else HEADROOM_FRACTION * opt.host_memory_gb
    )
    hw = Hardware(
        opt.device_memory_gb,
        opt.host_memory_gb,
        opt.devices_per_node,
        opt.device_reserved_gb,
        opt.host_process_gb,
        host_headroom_gb=headroom,
        device_memory_reserve_gb=opt.device_memory_reserve_gb,
    )
    run = run_from_args(args, world, opt.mode, cuda=not opt.plan_cpu)
    if opt.paper_table:
        print(
            "largest GPT that fits (family gpt3, seq 1024, micro-batch "
            f"{args.train.micro_batch_size}, recomputation on, fp16, GPT-2 vocabulary):"
        )
        print(format_paper_table(paper_table(micro_batch=args.train.micro_batch_size)))
        print(bytes_per_param_note())
        print(format_recipe_table())
    if opt.throughput:
        _throughput(args, opt)
    if ask_max:
        return _answer_max_model(args, opt, run, hw)
    if _searches_layout(opt, world):
        run = _choose_layout(args, opt, run, hw, world)
    if not (opt.paper_table or opt.throughput):
        note = None
        if run.mode == "offload" and args.optim.optimizer_offload_fraction is None:
            # keep on the device what fits there; with the overlap, what hides best
            machine = _machine(opt, hw)[0] if run.overlap else None
            run, note = _fraction_line(run, hw, machine, opt.batch_per_gpu)
        plan = plan_job(run, hw, source="meta")
        if opt.json:
            _print_json(args, run, plan)
        else:
            _print_assumed(args, opt, run, hw)
            print(describe_model(args, world))
            if note:
                print(note)
            print(format_job(plan))
            print("same model and layout, other modes:")
            print(format_comparison(compare_modes(run, hw)))
            if plan.fits:
                _print_speed_and_launch(args, opt, run, plan, args.model)
    return 0


def _world(args: Args, opt) -> int:
    """GPUs to plan for: --world-size, else one node of the --machine, else WORLD_SIZE."""
    if args.parallel.world_size:
        return args.parallel.world_size
    if opt.machine:
        return opt.devices_per_node
    return int(os.environ.get("WORLD_SIZE", "1"))


def _searches_layout(opt, world: int) -> bool:
    """A model on several GPUs with TP not given: the planner chooses TP, DP and F."""
    return world > 1 and not (opt.tp_given or opt.paper_table or opt.throughput or opt.json)


def _choose_layout(args: Args, opt, run: Run, hw: Hardware, world: int) -> Run:
    """Print the layouts that fit, best first; returns the best (TP, DP, micro-batches,
    F) and sets the flags it changes, or ``run`` as it was when none fits."""
    machine, _ = _machine(opt, hw)
    pick = run.mode == "offload" and args.optim.optimizer_offload_fraction is None
    layouts, refused = search_layouts(
        args, run, hw, machine, world, opt.batch_per_gpu, opt.global_batch_given, pick
    )
    print(format_layouts(layouts, refused, world))
    if not layouts:
        print(f"no layout fits {world} GPU(s); the plan at TP={run.tp}:")
        return run
    best = layouts[0]
    args.parallel.tensor_model_parallel_size = best.run.tp
    args.train.global_batch_size = best.batch_per_rank * best.run.dp
    opt.batch_per_gpu = best.batch_per_rank  # the speed and the launch line use it
    return best.run


def _searchable_base(args: Args) -> None:
    """The max-model search sets the shape itself; only the TP checks of the base shape
    matter: heads (and so width) divisible by TP."""
    tp = args.parallel.tensor_model_parallel_size
    heads = math.lcm(16, tp)
    args.model = replace(
        args.model,
        num_attention_heads=heads,
        hidden_size=128 * heads,
        ffn_hidden_size=4 * 128 * heads,
    )
