"""``python -m mp_offload.plan`` (and the pieces ``pretrain_gpt.py --dry-run`` uses:
``mp_offload/dry_run.py``).

The planner takes pretrain_gpt.py's own flags (the generated parser of config.py), so
a training command line can be planned by adding ``--dry-run`` (hardware from the
environment, see ``hardware_from_env``) or by handing it to ``python -m
mp_offload.plan`` with hardware flags.
"""

from __future__ import annotations

import argparse
import json
import math
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
from ..optimizer.options import OptimizerOptions
from .answer import (
    MODE_LABELS,
    TRAIN_TOKENS,
    compare_max_models,
    format_max_models,
    format_speed,
    format_split_gain,
    format_wall_time,
    larger_elsewhere,
    launch_command,
    speed,
)
from .fraction import pick_offload_fraction
from .layout import format_layouts, search_layouts
from .memory import (
    ALL_MODES,
    DEVICE_RESERVE_FRACTION,
    DEVICE_RESERVE_MIN_GB,
    EXACT,
    GiB,
    Hardware,
    JobPlan,
    Run,
    compare_modes,
    format_comparison,
    format_job,
    plan_job,
)
from .named_models import (
    MACHINE_GPUS,
    MACHINE_PRESETS,
    MODEL_PRESETS,
    RECIPES,
    recipe_label,
)
from .search import (
    FAMILIES,
    bytes_per_param_note,
    format_paper_table,
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
    """The plan's view of a training command line (its resolved ``Args``)."""
    tp = args.parallel.tensor_model_parallel_size
    if mode is None:
        mode = (
            "pytorch"
            if args.optim.optimizer == "torch-adamw"
            else "offload"
            if args.optim.cpu_offload
            else "zero2"
        )
    o = OptimizerOptions.from_args(args)  # the flags as the optimizer reads them
    t = args.train
    run = Run.from_options(
        args.model, o, tp=tp, dp=world // tp, mode=mode, micro_batch=t.micro_batch_size, cuda=cuda
    )
    return replace(run, dpu=run.dpu and mode == "offload")


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


def _options(m) -> str:
    """The non-GPT-2 parts of a model, for the one-line description."""
    parts = ["RMSNorm"] if m.rms_norm else []
    parts += ["SwiGLU"] if m.swiglu else []
    if m.position_embedding_type == "rope":
        base, percent = m.rotary
        parts.append(f"rope base {base:g}" + (f" x{percent:g}" if percent != 1 else ""))
    parts += [f"GQA {m.num_query_groups} groups"] if m.group_query_attention else []
    parts += ["untied head"] if m.untie_embeddings_and_output_weights else []
    parts += ["no linear bias"] if m.disable_bias_linear else []
    parts += ["sequence parallel"] if m.sequence_parallel else []
    return f" ({', '.join(parts)})" if parts else ""


def describe_model(args: Args, world: int) -> str:
    m, tp = args.model, args.parallel.tensor_model_parallel_size
    rc = m.recompute_activations
    n = num_parameters(m, tp)
    f = flops_per_token(m, rc, tp)
    tokens = args.train.global_batch_size * m.seq_length  # (resolved)
    return (
        f"GPT {m.num_layers} layers x hidden {m.hidden_size}, {m.num_attention_heads} heads,"
        f" ffn {m.ffn_hidden_size}, seq {m.seq_length}, padded vocabulary "
        f"{m.padded_vocab_size(tp)}{_options(m)}\n"
        f"parameters {n:,} ({n / 1e9:.2f}B); training FLOPs per token {f / 1e9:.2f} G "
        f"({'with' if rc else 'without'} recomputation); per step "
        f"{tokens:,} tokens = {f * tokens / 1e15:.2f} PFLOP"
    )


def _fraction_line(run: Run, hw: Hardware) -> tuple[Run, str]:
    """The run at the largest device share that fits, and a line saying so."""
    f, plan = pick_offload_fraction(run, hw)
    s = plan.ranks[0].shapes
    kept = s.device_share(f)
    if f == 1.0:
        why = "nothing more fits the device" if plan.fits_device else "it does not fit even so"
        return run, f"offload fraction: 1 (all of the optimizer state on the host: {why})"
    zero2 = ", = ZeRO-2 without offload" if f == 0 else ""
    return replace(run, offload_fraction=f), (
        f"offload fraction: --optimizer-offload-fraction {f:g}{zero2} (the largest device "
        f"share that fits {hw.device_usable_gb:.1f} GiB: the first {kept:,} of each rank's "
        f"{s.slice_numel:,} elements, {kept / s.slice_numel:.1%} of its optimizer state, stay on "
        f"the device; "
        f"device peak {plan.device_peak / GiB:.2f} GiB)"
    )


# -------------------------------------------------------------- the plan CLI
def _planner_parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.description = "Plan memory (and throughput) of pretrain_gpt.py runs"
    for adds, title, desc in (
        (_hardware_flags, "planner: hardware", "per device and per node; --machine sets them"),
        (_plan_flags, "planner: what to plan", "the model (--model or the training flags)"),
        (_speed_flags, "planner: speed model", "the throughput model; --machine sets them"),
    ):
        adds(_adder(p.add_argument_group(title, desc)))
    _short_help(p)
    # Flags left out take the launch scripts' values (LAUNCH_DEFAULTS): None marks "not given".
    p.set_defaults(**{dest: None for dest in (*LAUNCH_DEFAULTS, *SHAPE_DESTS)})
    return p


def _adder(group):
    """``add(flag, ...)``: a planner flag in ``group``, its value at ``opt.<name>``."""

    def add(flag, **kw):
        if kw.get("action") is None and "choices" not in kw:
            kw["metavar"] = flag[2:].replace("-", "_").upper()
        group.add_argument(flag, dest="plan." + flag[2:].replace("-", "_"), **kw)

    return add


def _hardware_flags(add) -> None:
    add("--device-memory-gb", type=float, default=80.0, help="per device, GiB")
    add("--host-memory-gb", type=float, default=256.0, help="per node, GiB")
    add(
        "--host-headroom-gb",
        type=float,
        default=None,
        help="host memory per node a plan must leave free: OS, page cache, other jobs "
        f"(default: {HEADROOM_FRACTION * 100:g}%% of --host-memory-gb)",
    )
    add("--devices-per-node", type=int, default=8, help="GPUs per node (TP stays in one)")
    add(
        "--device-reserved-gb",
        type=float,
        default=1.0,
        help="CUDA context, library workspaces, allocator slack (GiB)",
    )
    add(
        "--device-memory-reserve-gb",
        type=float,
        default=None,
        help="device memory a plan must leave free against fragmentation and workspace "
        "growth, beyond the --device-reserved-gb it counts (default: the larger of "
        f"{DEVICE_RESERVE_FRACTION * 100:g}%% of --device-memory-gb and "
        f"{DEVICE_RESERVE_MIN_GB:g} GiB)",
    )
    add("--host-process-gb", type=float, default=2.0, help="per-rank process overhead (GiB)")


def _plan_flags(add) -> None:
    add(
        "--mode",
        choices=ALL_MODES,
        default=None,
        help="plan this mode (default: what the optimizer flags say)",
    )
    add("--fp32", action="store_true", help="plan fp32 weights (default: --bf16)")
    add(
        "--no-cpu-offload",
        action="store_true",
        help="plan without ZeRO-Offload (default: --cpu-offload)",
    )
    add(
        "--no-recompute-activations",
        action="store_true",
        help="plan without recomputation (default: --recompute-activations)",
    )
    add("--plan-cpu", action="store_true", help="plan a CPU run (no CUDA gradient staging)")
    add("--json", action="store_true", help="print the plan as JSON")
    add(
        "--model",
        choices=sorted(MODEL_PRESETS),
        default=None,
        help="start from a published shape's flags (flags given here still win)",
    )
    add(
        "--machine",
        choices=sorted(MACHINE_PRESETS),
        default=None,
        help="start from a machine's hardware flags (memory, links, TFLOPS; flags given "
        "here still win)",
    )
    add("--max-model", action="store_true", help="largest GPT of --family that fits")
    add(
        "--family",
        choices=FAMILIES,
        default="gpt3",
        help="gpt3: width and depth grow together (depth h/128..h/64); layers: only depth",
    )
    add("--paper-table", action="store_true", help="the ZeRO-Offload paper's size claims")
    add(
        "--train-tokens",
        type=float,
        default=None,
        help="tokens to train: prints the wall time, and the launch line trains them "
        "(default: 1e9; --train-iters or --train-samples say it too)",
    )


def _speed_flags(add) -> None:
    add("--throughput", action="store_true", help="step-time model, 10B model, 1..128 GPUs")
    add(
        "--throughput-model",
        choices=("10b", "flags"),
        default="10b",
        help="--throughput's model: the paper's 10B or the flags' own",
    )
    add(
        "--gpus",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8, 16, 32, 64, 128],
        help="--throughput's GPU counts",
    )
    add("--batch-per-gpu", type=int, default=16, help="sequences per GPU per step")
    add("--device-tflops", type=float, default=Machine.device_tflops, help="sustained, per GPU")
    add(
        "--intra-node-gbs",
        type=float,
        default=Machine.intra_node_gbs,
        help="GB/s per GPU in collectives within a node",
    )
    add(
        "--inter-node-gbs",
        type=float,
        default=Machine.inter_node_gbs,
        help="GB/s per GPU in collectives across nodes",
    )
    add("--pcie-gbs", type=float, default=Machine.pcie_gbs, help="GB/s host<->device per GPU")
    add("--cpu-cores-per-node", type=int, default=Machine.cpu_cores_per_node, help="for CPU Adam")
    add(
        "--host-mem-gbs",
        type=float,
        default=Machine.host_mem_gbs,
        help="host memory bandwidth per node, GB/s",
    )
    add(
        "--adam-rate-per-core",
        type=float,
        default=None,
        help="elements/s (default: measured here, else 8e7)",
    )
    add(
        "--tp-devices-per-node",
        type=int,
        default=Machine.devices_per_node,
        help="devices per node for the throughput model",
    )
    add(
        "--device-mem-gbs",
        type=float,
        default=Machine.device_mem_gbs,
        help="device memory bandwidth (the optimizer step without offload)",
    )
    add("--plot", default=None, help="write the throughput PNG here (needs matplotlib)")


# The training flags --help shows: those that change a plan most. Every other flag of
# pretrain_gpt.py is taken too, listed by its own --help.
HELP_TRAINING_FLAGS = (
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--ffn-hidden-size",
    "--seq-length",
    "--vocab-size",
    "--tensor-model-parallel-size",
    "--sequence-parallel",
    "--world-size",
    "--micro-batch-size",
    "--global-batch-size",
    "--train-iters",
    "--train-samples",
    "--fp16",
    "--bf16",
    "--cpu-offload",
    "--optimizer-offload-fraction",
    "--recompute-activations",
)


def _short_help(p: argparse.ArgumentParser) -> None:
    p.usage = "python -m mp_offload.plan [--model NAME] [--machine NAME] [flags]"
    p.epilog = (
        "Every flag of pretrain_gpt.py is taken (python pretrain_gpt.py --help lists them); "
        "flags not given take the launch scripts' values (--bf16 --cpu-offload "
        "--recompute-activations --seq-length 2048)."
    )
    for action in p._actions:
        if not action.dest.startswith("plan.") and action.option_strings:
            if not set(action.option_strings) & {"-h", *HELP_TRAINING_FLAGS}:
                action.help = argparse.SUPPRESS
    for group in p._action_groups:  # a training group left with nothing to show goes
        if all(a.help == argparse.SUPPRESS for a in group._group_actions):
            group.title = group.description = None


# What scripts/pretrain_gpt_*.sh train with, assumed by the planner for flags not given.
LAUNCH_DEFAULTS = {
    "train.bf16": "--bf16",
    "optim.cpu_offload": "--cpu-offload",
    "model.recompute_activations": "--recompute-activations",
    "model.seq_length": "--seq-length 2048",
    "model.vocab_size": "--vocab-size 50257",
}
SHAPE_DESTS = (
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.ffn_hidden_size",
)
HEADROOM_FRACTION = 0.10


def _launch_defaults(parts: dict, opt: argparse.Namespace) -> list[str]:
    """Fill the flags left out (None) with the launch scripts' values; returns the flags
    so assumed. Sets ``opt.shape_given`` (a model-shape flag was given) and
    ``opt.mode_given`` (the user chose offload or not)."""
    m, t, o = parts["model"], parts["train"], parts["optim"]
    if opt.fp32 and (t["fp16"] or t["bf16"]):
        raise ConfigError("--fp32 excludes --fp16 and --bf16")
    if opt.no_cpu_offload and o["cpu_offload"]:
        raise ConfigError("--no-cpu-offload excludes --cpu-offload")
    if opt.no_recompute_activations and m["recompute_activations"]:
        raise ConfigError("--no-recompute-activations excludes --recompute-activations")
    if opt.train_tokens is not None and not opt.train_tokens > 0:
        raise ConfigError(f"--train-tokens must be > 0, got {opt.train_tokens:g}")
    counted = t["train_iters"] is not None or t["train_samples"] is not None
    if opt.train_tokens is not None and counted:
        raise ConfigError("--train-tokens excludes --train-iters and --train-samples")
    opt.mode_given = bool(
        o["cpu_offload"] or opt.no_cpu_offload or opt.mode or o["optimizer"] != "adam"
    )
    opt.shape_given = any(parts[g][f] is not None for g, f in (d.split(".") for d in SHAPE_DESTS))
    filled = {
        "train.bf16": not (t["fp16"] or opt.fp32),
        "optim.cpu_offload": not opt.mode_given,
        "model.recompute_activations": not opt.no_recompute_activations,
        "model.seq_length": 2048,
        "model.vocab_size": 50257,
    }
    assumed = []
    for dest, value in filled.items():
        group, name = dest.split(".")
        if parts[group][name] is None:
            parts[group][name] = value
            if value is not False:
                assumed.append(LAUNCH_DEFAULTS[dest])
    for dest in SHAPE_DESTS:
        group, name = dest.split(".")
        if parts[group][name] is None:
            del parts[group][name]  # GPTConfig's own default
    return assumed


def parse(argv=None) -> tuple[Args, argparse.Namespace]:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    first.add_argument("--model", choices=sorted(MODEL_PRESETS))
    first.add_argument("--machine", choices=sorted(MACHINE_PRESETS))
    first.add_argument("--tensor-model-parallel-size")
    known = first.parse_known_args(argv)[0]
    preset = known.model
    if known.machine:
        argv = [*MACHINE_PRESETS[known.machine], *argv]
    if preset:
        argv = [*MODEL_PRESETS[preset], *argv]
    ns = vars(parse_with_config(_planner_parser(), argv))
    parts: dict[str, dict] = {name: {} for name in [*CONFIG_CLASSES, "plan"]}
    for key, value in ns.items():
        if key == "config":
            continue
        group, name = key.split(".", 1)
        parts[group][name] = value
    opt = argparse.Namespace(**parts["plan"])
    opt.assumed = _launch_defaults(parts, opt)
    # Given on the command line (not the defaults): TP pins the layout, a global batch
    # is kept by every layout searched.
    opt.tp_given = known.tensor_model_parallel_size is not None
    opt.global_batch_given = parts["train"]["global_batch_size"]
    args = Args(**{n: cls(**parts[n]) for n, cls in CONFIG_CLASSES.items()})
    return args, opt


def recipe_plan(recipe) -> tuple[JobPlan, Run]:
    """The plan of one named-model recipe, as ``--model NAME FLAGS`` would make it."""
    args, opt = parse(["--model", recipe.model, *recipe.flags, "--world-size", str(recipe.world)])
    args.train.dry_run = True
    args = resolve(args, recipe.world)
    hw = Hardware(
        opt.device_memory_gb,
        opt.host_memory_gb,
        opt.devices_per_node,
        opt.device_reserved_gb,
        opt.host_process_gb,
        device_memory_reserve_gb=opt.device_memory_reserve_gb,
    )
    run = run_from_args(args, recipe.world, cuda=True)
    return plan_job(run, hw), run


def format_recipe_table() -> str:
    lines = [
        "\nthe Llama recipes (scripts/pretrain_llama*.sh), planned per rank (GiB):",
        f"{'model':<12}{'hardware':<32}{'configuration':<46}{'device':>14}{'host/node':>16}  fits",
    ]
    for recipe in RECIPES:
        plan, run = recipe_plan(recipe)
        dev = f"{plan.device_peak / GiB:.1f}/{plan.hw.device_memory_gb:g}"
        host = f"{plan.host_node_peak / GiB:.0f}/{plan.hw.host_usable_gb:g}"
        why = (
            "yes"
            if plan.fits
            else "no ("
            + ", ".join(
                w for w, ok in (("device", plan.fits_device), ("host", plan.fits_host)) if not ok
            )
            + ")"
        )
        label = f"{recipe_label(recipe)}, k={run.micro_batches}"
        lines.append(
            f"{recipe.model:<12}{recipe.hardware:<32}{label:<46}{dev:>14}{host:>16}  {why}"
        )
    return "\n".join(lines)


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
            run, note = _fraction_line(run, hw)  # keep on the device what fits there
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


def _print_json(args: Args, run: Run, plan: JobPlan) -> None:
    rp = plan.ranks[0]
    print(
        json.dumps(
            dict(
                mode=run.mode,
                tp=run.tp,
                dp=run.dp,
                offload_fraction=run.offload_fraction,
                device=rp.device,
                host=rp.host,
                device_total=plan.device_peak,
                host_node=plan.host_node_peak,
                fits=plan.fits,
                exact=list(EXACT),
                parameters=num_parameters(args.model, run.tp),
            )
        )
    )


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


def _precision(args: Args) -> str:
    return "bf16" if args.train.bf16 else "fp16" if args.train.fp16 else "fp32"


def _print_assumed(args: Args, opt, run: Run, hw: Hardware) -> None:
    m = args.model
    nodes = -(-run.world // hw.devices_per_node)
    print(
        f"planning {_precision(args)}, {MODE_LABELS.get(run.mode, run.mode)}, recompute "
        f"{'on' if m.recompute_activations else 'off'}, seq {m.seq_length}, micro-batch "
        f"{run.micro_batch}, TP={run.tp} x DP={run.dp}"
        + (
            f"; assumed (the launch scripts' defaults; give the flag to change it): "
            f"{' '.join(opt.assumed)}"
            if opt.assumed
            else ""
        )
    )
    print(
        f"hardware: {run.world} x {hw.device_memory_gb:g} GiB device(s) "
        f"({hw.device_reserve_gb:.1f} GiB kept free, --device-memory-reserve-gb) "
        f"on {nodes} node(s) "
        f"of {hw.devices_per_node}, host {hw.host_memory_gb:g} GiB per node with "
        f"{hw.host_headroom_gb:.1f} GiB kept free (--host-headroom-gb)"
    )


def _machine(opt, hw: Hardware) -> tuple[Machine, str]:
    if opt.adam_rate_per_core is None and not hasattr(opt, "measured_rate"):
        opt.measured_rate = measure_adam_rate()  # once: the layout table and the time agree
    measured = opt.measured_rate if opt.adam_rate_per_core is None else None
    rate = opt.adam_rate_per_core or measured or Machine.adam_rate_per_core
    src = (
        "measured here, 1 thread"
        if measured
        else "given"
        if opt.adam_rate_per_core
        else "stated default"
    )
    return Machine(
        opt.device_tflops,
        hw.devices_per_node,
        opt.intra_node_gbs,
        opt.inter_node_gbs,
        opt.pcie_gbs,
        opt.cpu_cores_per_node,
        opt.host_mem_gbs,
        rate,
        opt.device_mem_gbs,
    ), src


def _print_speed_and_launch(
    args: Args, opt, run: Run, plan, cfg, machine=None, rate_src: str = ""
) -> None:
    if machine is None:
        machine, rate_src = _machine(opt, plan.hw)
    st = speed(cfg, run, machine, opt.batch_per_gpu)
    print(format_speed(st, cfg, machine, rate_src))
    if run.mode == "offload" and run.offload_fraction < 1:
        full = speed(cfg, replace(run, offload_fraction=1.0), machine, opt.batch_per_gpu)
        print(format_split_gain(st, full))
    tokens = _tokens_wanted(args, opt, st)
    print(format_wall_time(tokens or TRAIN_TOKENS, st, _priced_for(opt)))
    where = (
        "every node, with its NODE_RANK and node 0's MASTER_ADDR"
        if len(plan.node_ranks) > 1
        else "this node"
    )
    tokens = tokens or TRAIN_TOKENS
    print(
        f"launch ({where}; {math.ceil(tokens / st.tokens_per_step):,} iterations = "
        f"{tokens / 1e9:g}B tokens):"
    )
    print(
        "  "
        + launch_command(
            cfg,
            run,
            plan,
            st,
            _precision(args),
            args.data.data_path,
            args.data.tokenizer_model,
            args.optim.dpu_warmup_steps,
            train_tokens=tokens,
        )
    )


def _tokens_wanted(args: Args, opt, st) -> float | None:
    """Tokens to train: --train-tokens, or --train-samples / --train-iters at the planned
    global batch; None when none is given."""
    t = args.train
    if opt.train_tokens is not None:
        return opt.train_tokens
    if t.train_samples is not None:
        return t.train_samples * args.model.seq_length
    if t.train_iters is not None:
        return t.train_iters * st.tokens_per_step
    return None


def _priced_for(opt) -> str:
    """Which GPU the speed is the speed of."""
    if opt.machine:
        return f"priced for --machine {opt.machine}: {MACHINE_GPUS[opt.machine]}"
    return (
        "priced for the paper's DGX-2 V100s (no --machine given: pass one, e.g. --machine "
        "hgx-h100, or --device-tflops and the link flags)"
    )


def _answer_max_model(args: Args, opt, run: Run, hw: Hardware) -> int:
    _print_assumed(args, opt, run, hw)
    machine, rate_src = _machine(opt, hw)
    # No F given: offload keeps on the device the share of its state that fits there.
    pick = run.mode == "offload" and args.optim.optimizer_offload_fraction is None
    answers = compare_max_models(run, hw, opt.family, machine, opt.batch_per_gpu, pick)
    mine = answers[run.mode].found
    if mine.cfg is not None:
        c = mine.cfg
        print(
            f"max model ({opt.family}), {run.mode}: {mine.params / 1e9:.2f}B = --num-layers "
            f"{c.num_layers} --hidden-size {c.hidden_size} --num-attention-heads "
            f"{c.num_attention_heads} (stopped by: {mine.limit})"
        )
        print(format_job(mine.plan))
    print(
        f"largest GPT per mode (family {opt.family}), same hardware, TP and batch; "
        f"{opt.batch_per_gpu} sequences per GPU per step:"
    )
    print(format_max_models(answers))
    note = larger_elsewhere(answers, run.mode)
    if note:
        print(note)
    if mine.cfg is None:
        print(f"max model ({opt.family}): nothing fits with {run.mode}")
        return 1
    _print_speed_and_launch(args, opt, mine.plan.run, mine.plan, mine.cfg, machine, rate_src)
    return 0


def _throughput(args: Args, opt) -> None:
    measured = measure_adam_rate() if opt.adam_rate_per_core is None else None
    rate = opt.adam_rate_per_core or measured or Machine.adam_rate_per_core
    machine = Machine(
        opt.device_tflops,
        opt.tp_devices_per_node,
        opt.intra_node_gbs,
        opt.inter_node_gbs,
        opt.pcie_gbs,
        opt.cpu_cores_per_node,
        opt.host_mem_gbs,
        rate,
    )
    cfg = ten_b() if opt.throughput_model == "10b" else args.model
    cfg = replace(cfg, recompute_activations=True) if opt.throughput_model == "10b" else cfg
    tp = 1 if opt.throughput_model == "10b" else args.parallel.tensor_model_parallel_size
    rows = scaling(
        cfg,
        machine,
        [g for g in opt.gpus if g % tp == 0],
        tp=tp,
        batch_per_gpu=opt.batch_per_gpu,
        micro_batch=args.train.micro_batch_size,
    )
    src = (
        "measured here, 1 thread"
        if measured
        else "given"
        if opt.adam_rate_per_core
        else "stated default"
    )
    print(
        f"throughput model: {num_parameters(cfg, tp) / 1e9:.2f}B ({cfg.num_layers}x"
        f"{cfg.hidden_size}, seq {cfg.seq_length}), TP={tp}, {opt.batch_per_gpu} sequences "
        f"per GPU per step in micro-batches of {args.train.micro_batch_size}; device "
        f"{machine.device_tflops:g} TFLOPS sustained, DP link {machine.intra_node_gbs:g} GB/s "
        f"in a node / {machine.inter_node_gbs:g} GB/s per GPU across, PCIe "
        f"{machine.pcie_gbs:g} GB/s, host {machine.host_mem_gbs:g} GB/s and "
        f"{machine.cpu_cores_per_node} cores per {machine.devices_per_node}-GPU node, CPU Adam "
        f"{rate / 1e6:.0f} M elements/s per core ({src}); times in seconds per step"
    )
    print(format_scaling(rows))
    if opt.plot:
        ok = plot_scaling(
            rows,
            opt.plot,
            f"{num_parameters(cfg, tp) / 1e9:.1f}B GPT, "
            f"ZeRO-Offload DP, predicted vs the paper's claim",
        )
        print(f"wrote {opt.plot}" if ok else "matplotlib is not installed: no plot written")
