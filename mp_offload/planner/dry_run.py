"""``pretrain_gpt.py --dry-run``: the planner's answer for a training command line, with
the hardware from the environment (``hardware_from_env``) and the vocabulary from the
run's tokenizer, allocating nothing; and ``rank_bytes``, the per-rank host and device
sums a run's memory preflight compares with the machine.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from ..config import Args, ConfigError
from .arguments import HEADROOM_FRACTION, number_problem, run_from_args
from .memory import GiB, Hardware, compare_modes, format_comparison, format_job, plan_job
from .report import _fraction_line, describe_model


def _host_memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    except (ValueError, OSError, AttributeError):
        return None


def _env(name: str, kind, spec: str):
    """The environment variable ``name`` as a ``kind`` in ``spec``; None when unset."""
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        value = kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"{name} must be {what}, got {raw!r}") from None
    problem = number_problem(name, value, spec)
    if problem:
        raise ConfigError(problem)
    return value


def hardware_from_env(world: int) -> tuple[Hardware, list[str]]:
    """Hardware for --dry-run: PLAN_DEVICE_MEMORY_GB / PLAN_DEVICE_MEMORY_RESERVE_GB /
    PLAN_HOST_MEMORY_GB / PLAN_DEVICES_PER_NODE / PLAN_HOST_HEADROOM_GB win; else what a
    CUDA machine reports about itself; else defaults (an 80 GiB GPU of which the larger of
    5% and 2 GiB is kept free, 256 GiB host of which 10% is, min(world, 8) per node).
    Returns the notes saying where each number came from. A variable out of range (or not
    a number) is a ``ConfigError`` naming it."""
    import torch

    notes, hw = [], Hardware()
    cuda = torch.cuda.is_available()
    device = _env("PLAN_DEVICE_MEMORY_GB", float, "0<..")
    if device:
        hw.device_memory_gb, src = device, "PLAN_DEVICE_MEMORY_GB"
    elif cuda:
        hw.device_memory_gb = torch.cuda.get_device_properties(0).total_memory / GiB
        src = f"this machine's {torch.cuda.get_device_name(0)}"
    else:
        src = "default; set PLAN_DEVICE_MEMORY_GB"
    notes.append(f"device memory {hw.device_memory_gb:.1f} GiB ({src})")
    reserve = _env("PLAN_DEVICE_MEMORY_RESERVE_GB", float, "0..")
    if reserve is not None:
        hw.device_memory_reserve_gb, src = reserve, "PLAN_DEVICE_MEMORY_RESERVE_GB"
    else:
        src = "default; set PLAN_DEVICE_MEMORY_RESERVE_GB"
    notes.append(f"of which {hw.device_reserve_gb:.1f} GiB kept free ({src})")
    host = _env("PLAN_HOST_MEMORY_GB", float, "0<..")
    if host:
        hw.host_memory_gb, src = host, "PLAN_HOST_MEMORY_GB"
    elif cuda and _host_memory_gib():
        hw.host_memory_gb, src = _host_memory_gib(), "this machine"
    else:
        src = "default; set PLAN_HOST_MEMORY_GB"
    notes.append(f"host memory per node {hw.host_memory_gb:.1f} GiB ({src})")
    headroom = _env("PLAN_HOST_HEADROOM_GB", float, f"0..{hw.host_memory_gb})")
    if headroom is not None:
        hw.host_headroom_gb, src = headroom, "PLAN_HOST_HEADROOM_GB"
    else:
        hw.host_headroom_gb = HEADROOM_FRACTION * hw.host_memory_gb
        src = f"default {HEADROOM_FRACTION * 100:g}%; set PLAN_HOST_HEADROOM_GB"
    notes.append(f"of which {hw.host_headroom_gb:.1f} GiB kept free ({src})")
    hw.devices_per_node, src = _devices_per_node(world)
    notes.append(f"{hw.devices_per_node} ranks per node ({src})")
    return hw, notes


def _devices_per_node(world: int) -> tuple[int, str]:
    for name in ("PLAN_DEVICES_PER_NODE", "LOCAL_WORLD_SIZE"):
        value = _env(name, int, "1..")
        if value:
            return value, name
    return min(world, 8), "default min(world, 8)"


def _vocabulary(args: Args) -> tuple[int, str]:
    """Training takes the vocabulary from the tokenizer: do the same when one is named.
    (vocabulary, where it came from)."""
    d, flag = args.data, args.model.vocab_size
    if d.mock_data or d.tokenizer_type == "NullTokenizer" or not d.tokenizer_model:
        return flag, f"vocabulary {flag} (--vocab-size)"
    if not os.path.exists(d.tokenizer_model):
        return flag, (
            f"vocabulary {flag} (--vocab-size; --tokenizer-model {d.tokenizer_model} not "
            f"found here)"
        )
    try:
        from ..data.tokenizer import build_tokenizer

        vocab = build_tokenizer(d.tokenizer_type, d.tokenizer_model, vocab_size=flag).vocab_size
        return vocab, f"vocabulary {vocab} (from {d.tokenizer_model})"
    except Exception as e:  # noqa: BLE001 - a plan is still useful without it
        return flag, f"vocabulary {flag} (--vocab-size; tokenizer failed: {e})"


def dry_run(args: Args, world: int) -> None:
    """Plan a training command line without allocating anything, then return."""
    hw, notes = hardware_from_env(world)
    vocab, where = _vocabulary(args)
    args = dataclasses.replace(args, model=dataclasses.replace(args.model, vocab_size=vocab))
    print(f"dry run: world {world}; {where}; " + "; ".join(notes))
    print(describe_model(args, world))
    run = run_from_args(args, world)
    print(format_job(plan_job(run, hw, source="meta")))  # the real model, every TP rank
    if run.mode == "offload" and args.optim.optimizer_offload_fraction is None:
        print(_fraction_line(run, hw)[1])
    print("same model and layout, other modes:")
    print(format_comparison(compare_modes(run, hw)))
    sys.stdout.flush()


def rank_bytes(args: Args, world: int, cuda: bool | None = None) -> tuple[int, int]:
    """(host bytes, device bytes) of one rank of this training command line (its resolved
    ``Args``) at its peak: the planner's own sums, of the largest rank kind. Exact where
    the optimizer places buffers; estimated for activations, the device workspace (1 GiB
    and the reduce-scatter outputs) and the process (2 GiB). ``cuda``: the run's device is a
    GPU (None: torch says); on a CPU run the device sum lives in host memory too. The
    vocabulary is ``args.model``'s (``dry_run`` takes the tokenizer's). Made from the
    written-down shapes (``shapes.spec_named_params``, held to the real model by the tests):
    no model is built, a 70B plan takes well under a second."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    plan = plan_job(run_from_args(args, world, cuda=cuda), Hardware(devices_per_node=1))
    return max(r.host_total for r in plan.ranks), plan.device_peak
