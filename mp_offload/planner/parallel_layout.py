"""Which layout to train a given model with on a given machine: TP, DP and the offload F.

Every GPU of the machine is used (DP = world / TP): with more data-parallel ranks each
rank's slice of the optimizer state only shrinks, so a layout on fewer GPUs never fits
where one on all of them does not. TP runs within a node and must split the model as
the training flags' own checks require (heads, K/V groups, widths: ``config_problems``).
With offload and no ``--optimizer-offload-fraction`` each layout keeps on the device the
share of its optimizer state that fits there (``pick_offload_fraction``). The best of
those that fit is ``best_first``'s first: the decision is made there and nowhere else.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from ..config import Args, config_problems
from .answer import overlap_exposed, speed
from .fraction import pick_offload_fraction
from .memory import GiB, Hardware, JobPlan, Run, plan_job
from .throughput import Machine, StepTime


@dataclass
class Layout:
    run: Run  # tp, dp, micro-batches and the offload fraction F as planned
    plan: JobPlan
    speed: StepTime
    batch_per_rank: int  # sequences per DP rank per step

    @property
    def tokens_per_second(self) -> float:
        overlap = self.run.options.overlap_cpu_optimizer
        step = self.speed.step_overlap if overlap else self.speed.step_sync
        return self.speed.tokens_per_step / step


def best_first(layouts: list[Layout]) -> list[Layout]:
    """Best first: the most tokens per second (the least time for any number of tokens;
    layouts differ in tokens per step, so step time alone does not compare them), then the
    least host memory per node, then the least device memory, then the smaller TP."""
    return sorted(
        layouts,
        key=lambda lay: (
            -lay.tokens_per_second,
            lay.plan.host_node_peak,
            lay.plan.device_peak,
            lay.run.tp,
        ),
    )


def tp_choices(args: Args, world: int, devices_per_node: int) -> dict[int, str]:
    """{TP: "" if the flags allow it at this world size, else the first reason not}."""
    out = {}
    for tp in (t for t in range(1, world + 1) if world % t == 0):
        if tp > devices_per_node:
            out[tp] = f"TP={tp} spans nodes of {devices_per_node}"
            continue
        trial = copy.deepcopy(args)
        trial.parallel.tensor_model_parallel_size = tp
        trial.train.dry_run = True  # a plan needs no --train-iters
        problems = config_problems(trial, world)
        out[tp] = problems[0] if problems else ""
    return out


def plan_layout(
    run: Run,
    hw: Hardware,
    machine: Machine,
    tp: int,
    world: int,
    batch_per_rank: int,
    pick_fraction: bool,
) -> Layout:
    """``run`` laid out as TP=tp x DP=world/tp, with ``batch_per_rank`` sequences per DP
    rank per step in micro-batches of ``run.micro_batch``."""
    k = max(1, batch_per_rank // run.micro_batch)
    r = replace(run, tp=tp, dp=world // tp).with_options(micro_batches=k)
    if pick_fraction and r.mode == "offload":
        # with the overlap: the share of the least exposed optimizer time, of those that fit
        overlap = r.options.overlap_cpu_optimizer
        cost = overlap_exposed(r.cfg, r, machine, batch_per_rank) if overlap else None
        f, plan = pick_offload_fraction(r, hw, cost)
        r = r.at_fraction(f)
    else:
        plan = plan_job(r, hw)
    return Layout(r, plan, speed(r.cfg, r, machine, batch_per_rank), batch_per_rank)


@dataclass
class Search:
    fits: list[Layout]  # best first
    misses: list[Layout]  # allowed by the flags but too large, by TP
    refused: dict[int, str]  # {TP: why not} for every TP not in ``fits``

    @property
    def nearest_miss(self) -> Layout | None:
        """The miss of the highest TP: the least weight per GPU."""
        return self.misses[-1] if self.misses else None


def search_layouts(
    args: Args,
    run: Run,
    hw: Hardware,
    machine: Machine,
    world: int,
    batch_per_rank: int | None,
    global_batch: int | None,
    pick_fraction: bool,
) -> Search:
    """Every layout the flags allow, planned. ``global_batch`` given: each layout keeps it
    (``batch_per_rank`` = global / DP); else ``batch_per_rank`` sequences per DP rank."""
    allowed = tp_choices(args, world, hw.devices_per_node)
    found = Search([], [], {tp: why for tp, why in allowed.items() if why})
    for tp in (t for t, why in allowed.items() if not why):
        per_rank = global_batch // (world // tp) if global_batch else batch_per_rank
        lay = plan_layout(run, hw, machine, tp, world, per_rank, pick_fraction)
        if lay.plan.fits:
            found.fits.append(lay)
        else:
            found.misses.append(lay)
            found.refused[tp] = "does not fit: " + lay.plan.shortfall()
    found.fits = best_first(found.fits)
    return found


def relaxed(args: Args, run: Run, sequence_parallel: bool = True) -> tuple[Args, Run, list[str]]:
    """``args`` and ``run`` with the memory savers a plan turns on when nothing fits as
    asked: micro-batch 1, sequence parallelism (when ``sequence_parallel``: it changes
    nothing at TP=1), recomputation; and the flags of those that were not on already
    (none: nothing to retry)."""
    m, t = args.model, args.train
    sp = sequence_parallel and not m.sequence_parallel
    turned = ["--micro-batch-size 1"] if t.micro_batch_size > 1 else []
    turned += ["--sequence-parallel"] if sp else []
    turned += [] if m.recompute_activations else ["--recompute-activations"]
    if not turned:
        return args, run, []
    out = copy.deepcopy(args)
    out.train.micro_batch_size = 1
    out.model = replace(m, sequence_parallel=m.sequence_parallel or sp, recompute_activations=True)
    return out, replace(run, cfg=out.model, micro_batch=1), turned


def without_sequence_parallel(args: Args, lay: Layout) -> tuple[Args, Run]:
    """A TP=1 layout found with sequence parallelism turned on: the same without it."""
    args.model = replace(args.model, sequence_parallel=False)
    return args, replace(lay.run, cfg=args.model)


def format_layouts(found: Search, world: int) -> str:
    layouts, refused = found.fits, found.refused
    lines = [
        f"layouts on {world} GPU(s), best first (most tokens/s, then least host memory):",
        f"  {'':2}{'TPxDP':>6}{'offload F':>11}{'device GiB':>12}{'host GiB/node':>15}"
        f"{'global batch':>14}{'step s':>8}{'tokens/s':>10}",
    ]
    for i, lay in enumerate(layouts):
        r, p = lay.run, lay.plan
        f = f"{r.options.offload_fraction:.2f}" if r.mode == "offload" else "-"
        lines.append(
            f"  {'*' if i == 0 else ' ':2}{f'{r.tp}x{r.dp}':>6}{f:>11}"
            f"{p.device_peak / GiB:12.1f}{p.host_node_peak / GiB:15.1f}"
            f"{lay.batch_per_rank * r.dp:14d}{lay.speed.step_sync:8.2f}"
            f"{lay.tokens_per_second:10,.0f}"
        )
    for tp, why in sorted(refused.items()):
        lines.append(f"  not TP={tp}: {why}")
    return "\n".join(lines)
