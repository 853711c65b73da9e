"""``python -m mp_offload.plan`` (``mp_offload/plan.py``) and ``python -m
mp_offload.planner``: the planner's command line.

The planner takes pretrain_gpt.py's own flags (the generated parser of config/flags.py), so a
training command line can be planned by handing it to ``python -m mp_offload.plan`` with
hardware flags, or by adding ``--dry-run`` to it (``dry_run.py``: hardware from the
environment). The flags and presets are ``arguments.py``'s, what is printed is
``report.py``'s; this module decides what to answer.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import replace

from ..config import Args, ConfigError, resolve
from ..model.gpt import num_parameters
from .arguments import HEADROOM_FRACTION, _machine, parse, run_from_args
from .memory import GiB, Hardware, Run, compare_modes, format_comparison, format_job, plan_job
from .parallel_layout import format_layouts, relaxed, search_layouts, without_sequence_parallel
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

MAX_WORLD = 1 << 20  # GPUs: beyond any machine built, and the node lists stay small


def main(argv=None) -> int:
    try:
        args, opt = parse(argv)
        world = _world(args, opt)
        args.train.dry_run = True  # planning needs no --train-iters
        # No model given and nothing else asked: the question is what fits here.
        ask_max = opt.max_model or not (
            opt.shape_given or opt.paper_table or opt.throughput or opt.json
        )
        if ask_max and not opt.shape_given:
            _searchable_base(args)
        args = resolve(args, world)
    except ConfigError as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return 2
    hw = _hardware(opt)
    if opt.global_batch_given:  # the command's global batch is what is priced
        opt.batch_per_gpu = max(1, opt.global_batch_given // (world // _tp(args)))
    if _plans_the_flags_model(opt, ask_max):
        too_big = weights_problem(args, world, hw, _searches_layout(opt, world))
        if too_big:
            print(f"plan: nothing fits: {too_big}", file=sys.stderr)
            return 1
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
    if not (opt.paper_table or opt.throughput):
        _answer_plan(args, opt, run, hw, world)
    return 0


def _tp(args: Args) -> int:
    return args.parallel.tensor_model_parallel_size


def _batched(args: Args, opt, run: Run) -> Run:
    """``run`` with the step's micro-batches: --batch-per-gpu (or the global batch / DP)
    in micro-batches of its size, as the launch line will run it (and the global batch set
    to match, for the description)."""
    k = max(1, opt.batch_per_gpu // run.micro_batch)
    args.train.global_batch_size = k * run.micro_batch * run.dp
    return run.with_options(micro_batches=k)


def _hardware(opt) -> Hardware:
    headroom = (
        opt.host_headroom_gb
        if opt.host_headroom_gb is not None
        else HEADROOM_FRACTION * opt.host_memory_gb
    )
    return Hardware(
        opt.device_memory_gb,
        opt.host_memory_gb,
        opt.devices_per_node,
        opt.device_reserved_gb,
        opt.host_process_gb,
        host_headroom_gb=headroom,
        device_memory_reserve_gb=opt.device_memory_reserve_gb,
    )


def _plans_the_flags_model(opt, ask_max: bool) -> bool:
    """The model of the flags is planned (not a searched, the paper's or the 10B one)."""
    if ask_max or not opt.shape_given or opt.paper_table:
        return False
    return not opt.throughput or opt.throughput_model == "flags"


def weights_problem(args: Args, world: int, hw: Hardware, search: bool) -> str | None:
    """A line when the model's weights alone exceed a GPU's usable memory at the largest TP
    (every mode keeps its TP shard of the weights on each device), else None. Checked
    before any layout is made: a bucket layout of 10^18 parameters would not end."""
    tp = args.parallel.tensor_model_parallel_size
    if search:  # the largest TP that divides the world within a node
        tp = max(t for t in range(1, min(world, hw.devices_per_node) + 1) if world % t == 0)
    m = args.model
    e = 4 if not (args.train.bf16 or args.train.fp16) else 2
    n = num_parameters(m, tp)
    need = e * n / tp
    if need <= hw.device_usable_gb * GiB:
        return None
    size = f"{n / 1e9:.2f}B" if n < 1e12 else f"{n:.3g}"
    return (
        f"{n:,} parameters ({size}) need {need / GiB:,.1f} GiB per GPU for their "
        f"{e}-byte weights alone at TP={tp} (the most on {world} GPU(s), "
        f"{hw.devices_per_node} per node), more than the {hw.device_usable_gb:.1f} GiB "
        f"usable of --device-memory-gb {hw.device_memory_gb:g}"
    )


def _answer_plan(args: Args, opt, run: Run, hw: Hardware, world: int) -> None:
    """The plan of the flags' model (its layout chosen when TP is not given), the other
    modes beside it, and when it fits its speed and launch line."""
    said = None
    if _searches_layout(opt, world):
        args, run, said = _choose_layout(args, opt, run, hw, world)
    elif not opt.json:  # --json plans the command as it is, for the device proof
        run = _batched(args, opt, run)
    run, note, plan = _fraction_and_plan(args, opt, run, hw)
    if not plan.fits and not opt.json and not _searches_layout(opt, world):
        args, run, note, plan, said = _retry(args, opt, run, note, plan, hw)
    if opt.json:
        _print_json(args, run, plan)
        return
    _print_assumed(args, opt, run, hw)
    if said:
        print(said)
    print(describe_model(args, world))
    if note:
        print(note)
    print(format_job(plan))
    print("same model and layout, other modes:")
    print(format_comparison(compare_modes(run, hw)))
    if plan.fits:
        _print_speed_and_launch(args, opt, run, plan, args.model)


def _fraction_and_plan(args: Args, opt, run: Run, hw: Hardware):
    """(run, the offload fraction's line or None, its plan): with offload and no F given,
    the device keeps what fits there (with the overlap, what hides best)."""
    note = None
    if run.mode == "offload" and args.optim.optimizer_offload_fraction is None:
        machine = _machine(opt, hw)[0] if run.options.overlap_cpu_optimizer else None
        run, note = _fraction_line(run, hw, machine, opt.batch_per_gpu)
    return run, note, plan_job(run, hw, source="meta")


def _retry(args: Args, opt, run: Run, note, plan, hw: Hardware):
    """A plan that does not fit as asked, planned again with the memory savers
    (``relaxed``): that one when it fits, else the one asked, and a line saying so."""
    more_args, more_run, turned = relaxed(args, run, sequence_parallel=run.tp > 1)
    if not turned:
        return args, run, note, plan, None
    more_run = _batched(more_args, opt, more_run)
    more_run, more_note, more_plan = _fraction_and_plan(more_args, opt, more_run, hw)
    if not more_plan.fits:
        said = f"does not fit even with {' '.join(turned)}: {more_plan.shortfall()}"
        return args, run, note, plan, said
    said = f"turned on to fit: {' '.join(turned)} (as asked it does not: {plan.shortfall()})"
    return more_args, more_run, more_note, more_plan, said


def _world(args: Args, opt) -> int:
    """GPUs to plan for: --world-size, else one node of the --machine, else WORLD_SIZE."""
    world = args.parallel.world_size
    if not world:
        world = opt.devices_per_node if opt.machine else int(os.environ.get("WORLD_SIZE", "1"))
    if world > MAX_WORLD:
        raise ConfigError(f"--world-size must be <= {MAX_WORLD:,}, got {world:,}")
    return world


def _searches_layout(opt, world: int) -> bool:
    """A model on several GPUs with TP not given: the planner chooses TP, DP and F."""
    return world > 1 and not (opt.tp_given or opt.paper_table or opt.throughput or opt.json)


def _choose_layout(args: Args, opt, run: Run, hw: Hardware, world: int):
    """Print the layouts that fit, best first (when none does, those with the memory
    savers of ``relaxed`` on); returns (args, run, a line saying what was turned on) of
    the best (TP, DP, micro-batches, F) or, when none fits, of the nearest miss."""
    machine, _ = _machine(opt, hw)
    pick = run.mode == "offload" and args.optim.optimizer_offload_fraction is None

    def search(a: Args, r: Run):
        found = search_layouts(
            a, r, hw, machine, world, opt.batch_per_gpu, opt.global_batch_given, pick
        )
        print(format_layouts(found, world))
        return found

    found, turned = search(args, run), []
    if not found.fits:
        more_args, more_run, turned = relaxed(args, run)
        if turned:
            print(f"nothing fits as asked: the layouts with {' '.join(turned)}")
            found, args, run = search(more_args, more_run), more_args, more_run
    best = found.fits[0] if found.fits else found.nearest_miss
    if best is None:
        print(f"no layout fits {world} GPU(s); the plan at TP={run.tp}:")
        return args, run, None
    run = best.run
    if turned and run.tp == 1 and "--sequence-parallel" in turned:
        turned.remove("--sequence-parallel")  # nothing to split the sequence over
        args, run = without_sequence_parallel(args, best)
    if found.fits:
        said = f"turned on to fit: {' '.join(turned)}" if turned else None
    else:
        print(
            f"no layout fits {world} GPU(s){' even so' if turned else ''}; the nearest miss "
            f"(the highest TP), TP={best.run.tp} x DP={best.run.dp}: {best.plan.shortfall()}"
        )
        said = None
    args.parallel.tensor_model_parallel_size = best.run.tp
    args.train.global_batch_size = best.batch_per_rank * best.run.dp
    opt.batch_per_gpu = best.batch_per_rank  # the speed and the launch line use it
    return args, run, said


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
