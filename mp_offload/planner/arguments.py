"""The plan command line's flags: pretrain_gpt.py's own parser plus the planner's
(hardware, what to plan, speed model), the ``--model`` / ``--machine`` presets, the launch
scripts' defaults for flags not given, and what the flags say: ``Args``, ``Run``, ``Machine``.
"""

from __future__ import annotations

import argparse
import math
import sys

from ..config import CONFIG_CLASSES, Args, ConfigError, build_parser, parse_with_config
from ..config.fields import range_problem
from ..optimizer.options import OptimizerOptions
from .memory import ALL_MODES, DEVICE_RESERVE_FRACTION, DEVICE_RESERVE_MIN_GB, Hardware, Run
from .named_models import MACHINE_PRESETS, MODEL_PRESETS, NO_BF16
from .search import FAMILIES
from .throughput import PCIE_DUPLEX_SHARE, Machine


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
    add(
        "--batch-per-gpu",
        type=int,
        default=None,
        help="sequences per GPU per step when --global-batch-size is not given (default 16)",
    )
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
    add(
        "--pcie-duplex-gbs",
        type=float,
        default=None,
        help="GB/s per direction while both directions copy at once (default: "
        f"{PCIE_DUPLEX_SHARE:g} x --pcie-gbs, as measured on an H200)",
    )
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
        help="elements/s of one core of the C++ CPU Adam (default: the --machine's, else "
        f"{Machine.adam_rate_per_core:g}; never measured here)",
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
DEFAULT_BATCH_PER_GPU = 16  # sequences per GPU per step when no global batch is given


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
    assumed = _machine_precision(t, opt)
    filled = {
        "train.bf16": not (t["fp16"] or opt.fp32),
        "optim.cpu_offload": not opt.mode_given,
        "model.recompute_activations": not opt.no_recompute_activations,
        "model.seq_length": 2048,
        "model.vocab_size": 50257,
    }
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


def _machine_precision(t: dict, opt: argparse.Namespace) -> list[str]:
    """A machine whose GPUs have no bf16 (V100s) plans fp16 when no precision is given, as
    its launch scripts run it, and refuses --bf16. Returns the flag so assumed, if any."""
    if opt.machine not in NO_BF16:
        return []
    if t["bf16"]:
        raise ConfigError(
            f"--bf16: --machine {opt.machine}'s {NO_BF16[opt.machine]} have no bf16; plan --fp16"
        )
    if t["bf16"] is None and not (t["fp16"] or opt.fp32):
        t["fp16"], t["bf16"] = True, False
        return [f"--fp16 ({NO_BF16[opt.machine]}: no bf16)"]
    return []


# The planner's numeric flags and their ranges (``fields.range_problem``'s notation).
PLAN_RANGES = {
    "device_memory_gb": "0<..",
    "host_memory_gb": "0<..",
    "host_headroom_gb": "0..",
    "devices_per_node": "1..",
    "device_reserved_gb": "0..",
    "device_memory_reserve_gb": "0..",
    "host_process_gb": "0..",
    "batch_per_gpu": "1..",
    "device_tflops": "0<..",
    "intra_node_gbs": "0<..",
    "inter_node_gbs": "0<..",
    "pcie_gbs": "0<..",
    "pcie_duplex_gbs": "0<..",
    "cpu_cores_per_node": "1..",
    "host_mem_gbs": "0<..",
    "adam_rate_per_core": "0<..",
    "tp_devices_per_node": "1..",
    "device_mem_gbs": "0<..",
}


def number_problem(name: str, value, spec: str) -> str | None:
    """The line naming ``name`` (a flag or a variable) when ``value`` is not a finite
    number in ``spec``."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{name} must be a finite number, got {value}"
    problem = range_problem("x", value, spec)  # "--x must be ..."
    return problem and name + problem[len("--x") :]


def hardware_problems(opt: argparse.Namespace) -> list[str]:
    """Every planner flag outside its range, one line each (as pretrain_gpt.py's flags)."""
    found = [
        number_problem("--" + name.replace("_", "-"), getattr(opt, name), spec)
        for name, spec in PLAN_RANGES.items()
        if getattr(opt, name) is not None
    ]
    found += [number_problem("--gpus", g, "1..") for g in opt.gpus]
    if opt.host_headroom_gb is not None and opt.host_headroom_gb >= opt.host_memory_gb:
        found.append(
            f"--host-headroom-gb {opt.host_headroom_gb:g} leaves nothing of --host-memory-gb "
            f"{opt.host_memory_gb:g}"
        )
    reserve = opt.device_memory_reserve_gb
    if reserve is not None and reserve + opt.device_reserved_gb >= opt.device_memory_gb:
        found.append(
            f"--device-memory-reserve-gb {reserve:g} and --device-reserved-gb "
            f"{opt.device_reserved_gb:g} leave nothing of --device-memory-gb "
            f"{opt.device_memory_gb:g}"
        )
    return [p for p in found if p]


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
    problems = hardware_problems(opt)
    if problems:
        raise ConfigError(problems[0])
    opt.assumed = _launch_defaults(parts, opt)
    # Given on the command line (not the defaults): TP pins the layout, a global batch
    # is kept by every layout searched.
    opt.tp_given = known.tensor_model_parallel_size is not None
    opt.global_batch_given = parts["train"]["global_batch_size"]
    if opt.global_batch_given and opt.batch_per_gpu is not None:
        raise ConfigError(
            "--batch-per-gpu excludes --global-batch-size: the step's sequences are one or "
            "the other (the global batch is the batch per GPU x DP)"
        )
    opt.batch_per_gpu = opt.batch_per_gpu or DEFAULT_BATCH_PER_GPU
    args = Args(**{n: cls(**parts[n]) for n, cls in CONFIG_CLASSES.items()})
    return args, opt


def run_from_args(args: Args, world: int, mode: str | None = None, cuda: bool = True) -> Run:
    """The plan's view of a training command line (its resolved ``Args``): the optimizer
    options the optimizer itself is built with (``OptimizerOptions.from_args``)."""
    tp = args.parallel.tensor_model_parallel_size
    if mode is None:
        mode = (
            "pytorch"
            if args.optim.optimizer == "torch-adamw"
            else "offload"
            if args.optim.cpu_offload
            else "zero2"
        )
    return Run(
        args.model,
        tp=tp,
        dp=world // tp,
        mode=mode,
        micro_batch=args.train.micro_batch_size,
        options=OptimizerOptions.from_args(args),
        cuda=cuda,
    )


def _machine(opt, hw: Hardware) -> tuple[Machine, str]:
    """The throughput model's machine: the --machine preset's figures, flags given winning,
    and where its CPU Adam rate comes from. Nothing is measured here: a plan is of the named
    machine, the same on an idle and a busy one."""
    rate = opt.adam_rate_per_core or Machine.adam_rate_per_core
    src = (
        "given"
        if opt.adam_rate_per_core
        else f"stated for --machine {opt.machine}"
        if opt.machine
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
        opt.pcie_duplex_gbs,
    ), src
