"""Per-rank memory plan (docs/DESIGN.md §4), in bytes, by the same categories as
``ZeroOptimizer.memory_bytes()``.

Exact (the bytes of the optimizer's own placement, ``optimizer/placement.py``, summed
by category; the formulas say what it places):
  device params        e * flat_numel             2Ψ/T (+ bucket padding) in fp16/bf16
  device grad_buckets  e * max_bucket * buffers   fixed, not Ψ: buffers = min(2, number
                       of buckets) (BUCKET_BUFFERS in optimizer/placement.py, double
                       buffering: one bucket's reduce-scatter overlaps the backward
                       that fills the next; a third waits for the oldest). Gradients
                       arrive in layout order for this GPT; the pool grows past two
                       only if more than two buckets are filling at once.
  device grad_accumulation  4 * flat_numel with --accumulate-grads-on-device (k > 1): the
                       micro-batches are summed in fp32, as the host sums them
  master / exp_avg / exp_avg_sq  4 * slice_numel each (moments 2 in bf16): 12Ψ/(T·D)
                       on the host with offload (8 with bf16 moments), on the device without
  partial offload      --optimizer-offload-fraction F < 1: the slice's last buckets (about
                       1 - F of it) keep master, moments and an fp32 gradient (4 B) on the
                       device; every host category above counts the rest only
  grads                4 * slice_numel (twice with DPU), the fp32 sum of k > 1 micro-batches
                       accumulated on the host, or any gradient without offload; none with
                       offload when one chunk per step is the whole gradient (k = 1 or
                       device accumulation): Adam reads the staging
  host staging         offload only, pinned at its exact size: e * slice_numel for the new
                       low-precision params (not in fp32; none on a CPU "device" with one
                       DP rank and no DPU, where Adam writes the params in place) +
                       r * slice_numel for gradients coming down (4 * slice_numel, the fp32
                       sum, with device accumulation; twice with DPU when Adam reads them
                       directly)
  (r: bytes of the reduce dtype, e unless --accumulate-allreduce-grads-in-fp32)
  host save            a checkpoint save's transient beside the state: one streamed chunk
                       (4 MiB: SAVE_CHUNK in fp32, optimizer/checkpoint_parts.py) where
                       a state key converts (remainders, 8-bit) or lives on a GPU, never an
                       fp32 copy of the slice; on a GPU at least one parameter of DP rank
                       0's weights, which torch.save copies down one at a time (e * the
                       largest bucket, a bound; counted on every rank)
Estimates: device activations (see activations.py), device workspace (a fixed
reserve for the CUDA context, cuBLAS/NCCL workspaces and allocator slack, plus the
reduce-scatter output chunks: one per bucket buffer, the reducer keeps no more pending),
host process (Python, torch, CUDA runtime, data).
A plan fits the device only below its usable memory: the device less a reserve against
fragmentation and workspace growth (--device-memory-reserve-gb; default the larger of
5% and 2 GiB), as the host keeps its headroom.

Modes, for comparison on the same model and layout:
  offload  this code with --cpu-offload (ZeRO-Offload)
  zero2    this code without it: the partitioned fp32 state stays on the device,
           2Ψ/T + 16Ψ/(T·D) (the paper's ZeRO-2 keeps fp16 grad partitions: 14/D)
  pytorch  plain mixed-precision Adam, no ZeRO: 16Ψ/T on every device
  pytorch-o2  the same as 2020-era PyTorch/apex "O2" ran it: fp32 master gradients
           on top, 20Ψ/T (used to explain the paper's PyTorch baseline)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..model.gpt import GPTConfig
from ..optimizer.checkpoint_parts import save_transient_bytes
from ..optimizer.options import OptimizerOptions
from ..optimizer.placement import placement
from .activations import estimate_activations
from .shapes import RankShapes, meta_named_params, rank_shapes, spec_rank_shapes

GiB = 1 << 30
# Device memory a plan leaves free by default: the larger of this share and this many GiB.
# The caching allocator fragments (blocks of freed activations and buckets that no later
# request fits exactly) and cuBLAS/NCCL/attention workspaces grow with the shapes run, so
# a plan filled to the last GiB fails at the first odd-sized request.
DEVICE_RESERVE_FRACTION = 0.05
DEVICE_RESERVE_MIN_GB = 2.0
MODES = ("offload", "zero2", "pytorch")  # compared by --dry-run
ALL_MODES = MODES + ("pytorch-o2",)
EXACT = (
    "params",
    "grad_buckets",
    "grad_accumulation",
    "master",
    "exp_avg",
    "exp_avg_sq",
    "grads",
    "staging",
)


@dataclass
class Hardware:
    """Sizes are GiB (2^30 bytes): "32 GB" V100s and "80 GB" H100s are GiB-sized."""

    device_memory_gb: float = 80.0
    host_memory_gb: float = 256.0  # per node
    devices_per_node: int = 8
    device_reserved_gb: float = 1.0  # CUDA context + library workspaces + allocator slack
    host_process_gb: float = 2.0  # per rank: interpreter, torch, CUDA runtime, data loader
    name: str = ""
    # Host memory per node left to the OS, page cache, other jobs: a plan must fit in the
    # rest. 0 here (the paper table asks what fits at all); the CLI defaults to 10%.
    host_headroom_gb: float = 0.0
    # Device memory a plan must leave free (fragmentation, workspace growth), GiB; None:
    # the larger of DEVICE_RESERVE_FRACTION of the device and DEVICE_RESERVE_MIN_GB.
    device_memory_reserve_gb: float | None = None

    @property
    def host_usable_gb(self) -> float:
        return self.host_memory_gb - self.host_headroom_gb

    @property
    def device_reserve_gb(self) -> float:
        if self.device_memory_reserve_gb is not None:
            return self.device_memory_reserve_gb
        return max(DEVICE_RESERVE_FRACTION * self.device_memory_gb, DEVICE_RESERVE_MIN_GB)

    @property
    def device_usable_gb(self) -> float:
        return self.device_memory_gb - self.device_reserve_gb


BF16_OPTIONS = OptimizerOptions(dtype=torch.bfloat16)  # offload in bf16, the defaults


@dataclass
class Run:
    """One training configuration to plan: the model, its layout and the optimizer's own
    options (``optimizer/options.py``), which the plan places as the optimizer does."""

    cfg: GPTConfig
    tp: int = 1
    dp: int = 1
    mode: str = "offload"
    micro_batch: int = 1
    options: OptimizerOptions = BF16_OPTIONS
    cuda: bool = True  # the staging is pinned; False: the device is the host (tests)
    flash: bool = True  # fused SDPA kernels keep no s x s scores
    bucket_buffers: int | None = None  # default: ZeroOptimizer's, min(2, number of buckets)

    def __post_init__(self):
        # offload is the options' cpu_offload; the other modes, planned beside it for
        # comparison, keep the state on the device in its device forms
        o = self.options
        if self.mode == "offload" and not o.cpu_offload:
            self.options = replace(o, cpu_offload=True)
        elif self.mode != "offload" and o.cpu_offload:
            self.options = device_resident(o)

    @property
    def world(self) -> int:
        return self.tp * self.dp

    def with_options(self, **fields) -> Run:
        """This run with those options changed (checked as the optimizer checks them)."""
        return replace(self, options=replace(self.options, **fields))

    def at_fraction(self, offload_fraction: float) -> Run:
        """This run at offload fraction F; at F = 0 (ZeRO-2) nothing is left for the
        overlap to hide."""
        overlap = self.options.overlap_cpu_optimizer and offload_fraction != 0
        return self.with_options(offload_fraction=offload_fraction, overlap_cpu_optimizer=overlap)


def device_resident(o: OptimizerOptions) -> OptimizerOptions:
    """``o`` without offload: an fp32 master, the moments in fp32 or bf16 (the device Adam
    has no 8-bit ones), no DPU, no overlap."""

    def device_form(dt: torch.dtype) -> torch.dtype:
        return torch.float32 if dt == torch.uint8 else dt

    return replace(
        o,
        cpu_offload=False,
        offload_fraction=1.0,  # (a fraction needs offload: the options' table)
        dpu_warmup_steps=None,
        exp_avg_dtype=device_form(o.exp_avg_dtype),
        exp_avg_sq_dtype=device_form(o.exp_avg_sq_dtype),
        store_param_remainders=False,
        overlap_cpu_optimizer=False,
    )


def moment_bytes(o: OptimizerOptions) -> tuple[int, int]:
    """Bytes per element of exp_avg and exp_avg_sq (1: 8-bit), as the throughput model
    and ``ops/traffic.py`` count them."""
    return o.exp_avg_dtype.itemsize, o.exp_avg_sq_dtype.itemsize


def elem_bytes(run: Run) -> int:
    """Bytes per element of the compute dtype: 2 for fp16/bf16, 4 for fp32."""
    return run.options.dtype.itemsize


@dataclass
class RankPlan:
    tp_ranks: list[int]
    shapes: RankShapes
    device: dict[str, int]
    host: dict[str, int]
    activation_phase: str

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


@dataclass
class JobPlan:
    run: Run
    hw: Hardware
    ranks: list[RankPlan]  # one per kind of rank (identical buffers grouped)
    node_ranks: list[int] = field(default_factory=list)  # ranks on each node

    @property
    def device_peak(self) -> int:
        return max(r.device_total for r in self.ranks)

    @property
    def host_node_peak(self) -> int:
        per_rank = max(r.host_total for r in self.ranks)
        return max(self.node_ranks) * per_rank

    @property
    def fits_device(self) -> bool:
        return self.device_peak <= self.hw.device_usable_gb * GiB

    @property
    def fits_host(self) -> bool:
        return self.host_node_peak <= self.hw.host_usable_gb * GiB

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    def shortfall(self) -> str:
        """What does not fit and by how much ("" when it all fits)."""
        short = [
            f"{where} short {(need - have * GiB) / GiB:.2f} GiB{per} ({need / GiB:.2f} of "
            f"{have:.1f} usable)"
            for where, need, have, per in (
                ("device", self.device_peak, self.hw.device_usable_gb, " per GPU"),
                ("host", self.host_node_peak, self.hw.host_usable_gb, " per node"),
            )
            if need > have * GiB
        ]
        return ", ".join(short)


def _zero_buffers(run: Run, shapes: RankShapes) -> tuple[dict, dict, int]:
    """(device bytes, host bytes, reduce-scatter outputs) of this code's buffers: the sums
    of the optimizer's own placement (``optimizer/placement.py``), and the transient of a
    save beside them (a streamed chunk, or on a GPU one parameter of DP rank 0's weights:
    at most a bucket; counted on every rank)."""
    place = placement(shapes, run.options, "cuda" if run.cuda else "cpu")
    device, host = place.bytes("device"), place.bytes("host")
    weight = elem_bytes(run) * shapes.max_bucket if run.cuda else 0
    host["save"] = save_transient_bytes(place, run.cuda, weight)
    buckets = place.buffer("grad_buckets")
    if run.bucket_buffers:  # a what-if: more bucket buffers than the optimizer makes
        device["grad_buckets"] = buckets.numel * buckets.dtype.itemsize * run.bucket_buffers
    # Workspace: the reduce-scatter output chunks, one per bucket buffer (the reducer keeps
    # no more pending), in the reduced chunks' dtype.
    rs_out = place.chunk_dtype.itemsize * (shapes.max_bucket // run.dp) * buckets.copies
    return device, host, rs_out if run.dp > 1 else 0


def plan_rank(run: Run, shapes: RankShapes, hw: Hardware) -> tuple[dict, dict, str]:
    """(device bytes, host bytes, activation peak phase) of one rank."""
    e = elem_bytes(run)
    if run.mode not in ALL_MODES:
        raise ValueError(f"unknown mode {run.mode!r}: one of {ALL_MODES}")
    plain = run.mode.startswith("pytorch")
    act = estimate_activations(
        run.cfg, run.tp, run.micro_batch, e, flash=run.flash, grads_resident=plain
    )
    if plain:
        p = shapes.params
        device = dict(
            params=e * p,
            grads=e * p,
            master=4 * p if e < 4 else 0,  # fp32: no copy
            exp_avg=4 * p,
            exp_avg_sq=4 * p,
        )
        if run.mode == "pytorch-o2":
            device["master_grads"] = 4 * p
        host, rs_out = {}, 0
    else:
        device, host, rs_out = _zero_buffers(run, shapes)
    device.update(activations=act.peak, workspace=int(hw.device_reserved_gb * GiB) + rs_out)
    host["process"] = int(hw.host_process_gb * GiB)
    return device, host, act.phase


def _node_ranks(world: int, per_node: int) -> list[int]:
    per_node = max(1, min(per_node, world))
    full, rest = divmod(world, per_node)
    return [per_node] * full + ([rest] if rest else [])


def plan_job(run: Run, hw: Hardware, source: str = "spec") -> JobPlan:
    """Plan every kind of rank. ``source="meta"`` builds the real model on the meta
    device for each TP rank; ``"spec"`` uses the written-down shapes (fast)."""
    kinds: dict[tuple, RankPlan] = {}
    tp_ranks = range(run.tp) if source == "meta" else [0]
    bucket = run.options.bucket_size
    for r in tp_ranks:
        shapes = (
            rank_shapes(meta_named_params(run.cfg, run.tp, r), run.dp, bucket, tp_rank=r)
            if source == "meta"
            else spec_rank_shapes(run.cfg, run.tp, run.dp, bucket)
        )
        device, host, phase = plan_rank(run, shapes, hw)
        key = (tuple(device.items()), tuple(host.items()))
        if key in kinds:
            kinds[key].tp_ranks.append(r)
        else:
            kinds[key] = RankPlan([r], shapes, device, host, phase)
    if source != "meta":  # every TP rank has the same shapes (vocab padded to a multiple)
        next(iter(kinds.values())).tp_ranks[:] = list(range(run.tp))
    return JobPlan(run, hw, list(kinds.values()), _node_ranks(run.world, hw.devices_per_node))


def compare_modes(run: Run, hw: Hardware) -> dict[str, JobPlan]:
    return {m: plan_job(replace(run, mode=m), hw) for m in MODES}


# ------------------------------------------------------------------ printing
def gib(x: float) -> str:
    return f"{x / GiB:9.2f}"


def format_rank(rp: RankPlan, run: Run) -> str:
    s = rp.shapes
    lines = [
        f"  rank kind: TP rank(s) {_ranges(rp.tp_ranks)} x DP ranks 0..{run.dp - 1} "
        f"({len(rp.tp_ranks) * run.dp} of {run.world} ranks)",
        f"    this TP rank's params {s.params:,} ({s.sharded:,} split over TP, "
        f"{s.replicated:,} replicated); flat buffer {s.flat_numel:,} elements in "
        f"{s.num_buckets} buckets (largest {s.max_bucket:,}); host slice {s.slice_numel:,}",
        f"    {'device':<14}{'GiB':>9}      {'host (this rank)':<18}{'GiB':>9}",
    ]
    dev, host = list(rp.device.items()), list(rp.host.items())
    for i in range(max(len(dev), len(host))):
        left = (
            f"{dev[i][0]:<14}{gib(dev[i][1])}{'' if dev[i][0] in EXACT else ' ~'}"
            if i < len(dev)
            else " " * 23
        )
        right = (
            f"{host[i][0]:<18}{gib(host[i][1])}{'' if host[i][0] in EXACT else ' ~'}"
            if i < len(host)
            else ""
        )
        lines.append(f"    {left:<29}{right}")
    lines.append(f"    {'total':<14}{gib(rp.device_total)}      {'total':<18}{gib(rp.host_total)}")
    lines.append(f"    (~ estimate; activation peak at: {rp.activation_phase})")
    return "\n".join(lines)


def _ranges(xs: list[int]) -> str:
    return (
        f"{xs[0]}"
        if len(xs) == 1
        else f"{xs[0]}..{xs[-1]}"
        if xs == list(range(xs[0], xs[-1] + 1))
        else ",".join(map(str, xs))
    )


def format_job(plan: JobPlan) -> str:
    run, hw = plan.run, plan.hw
    dpu = run.options.dpu_warmup_steps is not None
    head = (
        f"plan: mode {run.mode}{' + DPU' if dpu else ''}{_fraction(plan)}, "
        f"TP={run.tp} DP={run.dp} "
        f"(world {run.world}, {hw.devices_per_node} devices/node, "
        f"{len(plan.node_ranks)} node(s)), micro-batch {run.micro_batch} x seq "
        f"{run.cfg.seq_length}, {elem_bytes(run)}-byte params, recompute "
        f"{'on' if run.cfg.recompute_activations else 'off'}"
    )
    body = [format_rank(rp, run) for rp in plan.ranks]
    verdict = (
        f"  device: {plan.device_peak / GiB:.2f} of {hw.device_memory_gb:g} GiB"
        f"{_reserve(hw)} -> "
        f"{'fits' if plan.fits_device else 'DOES NOT FIT'}; host per node: "
        f"{plan.host_node_peak / GiB:.2f} of {hw.host_memory_gb:g} GiB"
        f"{_headroom(hw)} ({max(plan.node_ranks)} ranks) -> "
        f"{'fits' if plan.fits_host else 'DOES NOT FIT'}"
    )
    return "\n".join([head, *body, verdict])


def _fraction(plan: JobPlan) -> str:
    run, f = plan.run, plan.run.options.offload_fraction
    if run.mode != "offload" or f >= 1:
        return ""
    s = plan.ranks[0].shapes
    kept = s.device_share(f)
    return (
        f" with --optimizer-offload-fraction {f:g} (actual "
        f"{1 - kept / s.slice_numel:.4f}: the device keeps {kept:,} of {s.slice_numel:,})"
    )


def _reserve(hw: Hardware) -> str:
    if not hw.device_reserve_gb:
        return ""
    return f" ({hw.device_usable_gb:.1f} usable, {hw.device_reserve_gb:.1f} GiB reserve)"


def _headroom(hw: Hardware) -> str:
    if not hw.host_headroom_gb:
        return ""
    return f" ({hw.host_usable_gb:.1f} usable, {hw.host_headroom_gb:.1f} GiB headroom)"


def format_comparison(plans: dict[str, JobPlan]) -> str:
    lines = [
        "  mode       device GiB/rank  host GiB/node  fits",
        *(
            f"  {m:<9}{p.device_peak / GiB:14.2f}{p.host_node_peak / GiB:15.2f}  "
            f"{'yes' if p.fits else 'no (' + ('device' if not p.fits_device else 'host') + ')'}"
            for m, p in plans.items()
        ),
    ]
    return "\n".join(lines)
