"""A step-time model of TP x ZeRO-Offload DP, set against the paper's scaling claim.

Per DP rank, with n = its host slice (slice_numel), P = its TP rank's flat buffer,
e = 2 bytes, B = sequences per GPU per step in micro-batches of b, F = training
FLOPs per token (flops_per_token, recomputation counted), C = sustained device FLOPS:

  per micro-batch (k = B/b of them)
    forward+backward   b*s*F/(T*C)
    TP all-reduces     (T>1) 6 per layer with recomputation, 4 without, of e*s*b*h
                       bytes each, ring: 2(T-1)/T * bytes / intra-node bandwidth
    gradients          reduce-scatter (D-1)/D*e*P bytes over the DP link and r*n bytes
                       down PCIe (r: the reduce dtype's bytes), each bucket's copy
                       enqueued on the copy stream when the bucket is launched, so both
                       overlap backward (the last 3/4 of the work with recomputation);
                       only the excess counts. With --accumulate-grads-on-device only the
                       last micro-batch's chunks go down (under its own backward).
    host accumulation  k > 1 on the host only: a host thread adds each staged chunk into
                       the fp32 sum as its copy lands, the first micro-batch overwriting
                       (r + 4 B per element), the others adding (r + 4 + 4 B) at this
                       rank's share of host bandwidth; it overlaps backward like the copies
  per step (host passes over the slice, each at this rank's share of host bandwidth)
    CPU Adam           n / rate; rate = min(cores_per_rank * per-core rate,
                       host bandwidth share / bytes): reads p, g, m, v, writes p, m, v and
                       the rounded params (e, none in fp32); g is the staging itself (r B)
                       when k = 1 or accumulated on the device, else the fp32 sum; the
                       moments 4 or 2 B. 30 B per element in the paper's setting.
    copy up            e*n bytes over PCIe, bucket by bucket in forward order, each
                       bucket's all-gather behind it; the next forward waits for a bucket
                       only where it first reads it (planner/publish.py): only what the
                       copies and gathers fall behind the forward counts
    all-gather         (D-1)/D*e*P bytes over the DP link (the device share's: before the
                       forward, on the compute stream)
  No zeroing pass (the first micro-batch overwrites) and no norm pass (its squares are
  summed where each gradient first exists: on the device, or in the accumulation's pass).
  Every byte count comes from ops/traffic.py, the account the kernels' benchmarks use.
  DPU: the CPU Adam runs behind the next step's forward/backward (only what does not fit
  under it counts); the copies up go at the step, behind which the forward runs as above.
  Overlap (--overlap-cpu-optimizer, ``step_overlap``): each host bucket's last
  accumulation and CPU Adam run on a host worker as its gradient lands during the last
  micro-batch's backward; after backward only what is left of the worker's queue counts,
  beside the device share's Adam (after it with k > 1 host sums, whose norm the step
  waits for), then the copies up as above (planner/overlap_schedule.py, per bucket).
  ``hide_tokens_per_step``: the tokens per step (the micro-batch grown, k kept) from which
  the worker keeps up with the arriving gradients.
  Partial offload (``offload_fraction`` F < 1): every host and PCIe term above counts
  only the host part of the slice; the device share (its last buckets) is updated by
  torch's fused AdamW, 34 B per element at device memory bandwidth (28 for Adam, 6 to
  round the master into the parameters), launched before the CPU Adam and running
  beside it: the step's optimizer time is the larger of the two. With DPU the device
  Adam sits in the device's stream before the next forward, so it counts in full.
  PCIe: ``pcie_gbs`` one way; ``pcie_each_way_gbs`` per direction while both run at once.
  Beside the CPU Adam (``streamed``, ``step_streamed``): an Adam on the GPU over the host
  part's state streamed up and back (``streamed_gpu_step``: master and moments each way at
  the both-ways PCIe speed, through host memory, at device memory bandwidth; pipelined,
  the slowest counts), after the device share's Adam: the other design, priced alike.

Without offload (``mode``): "zero2" keeps the fp32 slice on the device, so the host
terms go (no PCIe, no host accumulation) and the fused AdamW and the publish are one
pass over the slice at device memory bandwidth (34 B); "pytorch" (no ZeRO) all-reduces
the gradients of every micro-batch (twice the reduce-scatter's bytes, overlapping
backward), reads them for the clipping norm, runs Adam over all of its parameters on
the device and needs no all-gather. Neither has DPU.

The DP link is the intra-node bandwidth while T*D fits in one node, else the per-GPU
share of the node's network. TFLOPS/GPU = B*s*F/T / step time. Not modelled: kernel
efficiency changing with shapes, collective latency, host contention between the Adam
thread and accumulation under DPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..model.gpt import GPTConfig, flops_per_token
from ..ops.traffic import accumulate_arrays, adam_arrays, bytes_per_element, publish_arrays
from ..optimizer.base import DEFAULT_BUCKET_SIZE
from ..optimizer.split import split_buckets
from .overlap_schedule import Overlap, buckets, keeping_up_backward, schedule
from .publish import device_gathers, forward_delay, forward_order, host_ready_in_turn
from .shapes import spec_rank_shapes


@dataclass
class Machine:
    """Defaults: a DGX-2 (16x V100-32GB, 2x 24-core Xeon, 8x 100 Gb/s InfiniBand)."""

    device_tflops: float = 50.0  # sustained fwd/bwd, fp16 tensor cores on big GEMMs
    devices_per_node: int = 16
    intra_node_gbs: float = 100.0  # GB/s per GPU in collectives (NVSwitch)
    inter_node_gbs: float = 6.25  # GB/s per GPU: 100 GB/s of network per 16 GPUs
    pcie_gbs: float = 12.0  # GB/s host<->device per GPU (PCIe 3 x16, achieved), one way
    cpu_cores_per_node: int = 48
    host_mem_gbs: float = 120.0  # sustained per node; 10B Adam in 2.6 s, as the paper
    # elements/s of one core of the C++ CPU Adam: its fp32 tile takes about 0.8 ns an
    # element on an AVX-512 core (docs/PERFORMANCE.md). A stated figure for the named
    # machine, never one measured where the planner runs: the same question gets the same
    # answer on any machine. The host bandwidth bounds it on every preset.
    adam_rate_per_core: float = 1e9
    device_mem_gbs: float = 900.0  # device memory bandwidth (V100 HBM2): Adam without offload
    # GB/s per direction while both directions copy at once; None: PCIE_DUPLEX_SHARE of
    # pcie_gbs
    pcie_duplex_gbs: float | None = None

    @property
    def pcie_each_way_gbs(self) -> float:
        """Per direction, both directions at once."""
        if self.pcie_duplex_gbs is not None:
            return self.pcie_duplex_gbs
        return PCIE_DUPLEX_SHARE * self.pcie_gbs


# Pinned copies both ways at once on the lent H200 ran at 11-16 GB/s each, against about
# 25 GB/s one way: each direction keeps about (11 + 16) / 2 / 25 of its one-way speed.
PCIE_DUPLEX_SHARE = 0.54


def measure_adam_rate(numel: int = 1 << 22, repeats: int = 3) -> float | None:
    """Elements/s of one thread of the C++ CPU Adam here, or None without the extension.
    For a calibration on the machine being measured (the device proof); the planner never
    calls it: its answers are of the named machine."""
    try:
        import torch

        from ..ops import cpu_adam
    except ImportError:
        return None
    before = cpu_adam.get_num_threads()
    cpu_adam.set_num_threads(1)
    try:
        p, g, m, v = (torch.rand(numel) for _ in range(4))
        out = torch.empty(numel, dtype=torch.bfloat16)
        best = float("inf")
        for step in range(1, repeats + 1):
            t0 = time.perf_counter()
            cpu_adam.adam_step(
                p,
                g,
                m,
                v,
                step=step,
                lr=1e-4,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.01,
                param_out=out,
            )
            best = min(best, time.perf_counter() - t0)
        return numel / best
    finally:
        cpu_adam.set_num_threads(before)


@dataclass
class StepTime:
    gpus: int
    tp: int
    dp: int
    compute: float
    tp_comm: float
    grad_exposed: float
    accumulate: float
    zero: float
    norm: float
    adam: float
    copy_up: float
    all_gather: float
    step_sync: float
    step_dpu: float
    tflops_sync: float
    tflops_dpu: float
    mode: str = "offload"
    tokens_per_step: int = 0  # sequences per step (B x DP) x sequence length
    adam_host: float = 0.0  # partial offload: the CPU Adam over the host part...
    adam_device: float = 0.0  # ...beside the device Adam over the device share
    offload_fraction: float = 1.0
    step_overlap: float = 0.0  # offload with --overlap-cpu-optimizer (else step_sync)
    host_exposed: float = 0.0  # overlap: seconds after backward (Adam left, copies' wait)
    host_hidden: float = 0.0  # overlap: host work seconds run under backward
    hide_tokens_per_step: float = 0.0  # overlap: the worker keeps up from this many tokens
    # offload: a GPU step on the host part's state streamed up and back instead of the CPU
    # Adam and the copy up (``streamed_gpu_step``), beside the device share's Adam
    streamed: float = 0.0
    # the synchronous step with that GPU step in place of the CPU Adam and the copies up
    # (offload only; the gradients priced as they come down here)
    step_streamed: float = 0.0
    publish_sync: float = 0.0  # the synchronous step's wait for the copies up and gathers
    publish_overlap: float = 0.0  # the overlapped step's (in host_exposed)

    @property
    def tokens_per_day(self) -> float:
        return self.tokens_per_step * 86400 / self.step_sync

    @property
    def days_per_billion_tokens(self) -> float:
        return 1e9 / self.tokens_per_day


def _offload_gradients(k, down, accumulate_s, r, on_device, bwd, rs):
    """(exposed transfer, exposed accumulation, of which the last micro-batch's) of
    offload's k micro-batches. Micro-batch i's reduce-scatter (``rs``), copy down (``down``
    seconds for its chunks: each bucket's copy is enqueued on the copy stream when the
    bucket is launched) and host accumulation (``accumulate_s`` seconds per byte per element
    of the host sum, 0: Adam reads the staging; a host thread adds each chunk as it lands)
    all run under its backward ``bwd``; only the excess counts. With device accumulation
    only the last micro-batch's chunks go down. The first, the middle and the last
    micro-batch are each alike: counted once each, however large k is."""

    def one(first: bool, last: bool) -> tuple[float, float]:
        copy = down if last or not on_device else 0.0
        acc = bytes_per_element(accumulate_arrays(r, first)) * accumulate_s
        g = max(0.0, max(rs, copy) - bwd)
        return g, max(0.0, acc - bwd - g)

    if k < 1:
        return 0.0, 0.0, 0.0
    kinds = [(1, one(True, k == 1)), (max(0, k - 2), one(False, False))]
    kinds += [(1, one(False, True))] if k > 1 else []
    exposed = sum(count * g for count, (g, _) in kinds)
    total = sum(count * a for count, (_, a) in kinds)
    return exposed, total, one(k == 1, True)[1]  # the last micro-batch's own accumulation


def streamed_state_bytes(moments=(4, 4), remainders: bool = False) -> int:
    """Bytes per element of the optimizer state a GPU step on host-resident state streams
    each way: the fp32 master (with remainders only the 2-byte remainder: the bf16 param
    is on the device) and both moments."""
    return (2 if remainders else 4) + sum(moments)


def streamed_gpu_step(n: int, e: int, moments, remainders, machine: Machine, ranks_node: int):
    """Seconds of an Adam step on the GPU over ``n`` elements whose state lives on the host:
    streamed up and back in chunks, both directions at once (``pcie_each_way_gbs``), the
    host memory read and written (this rank's share of the node's bandwidth), fused AdamW
    and the publish at device memory bandwidth; pipelined, so the slowest of the three. The
    params are published on the device (none go up)."""
    state = streamed_state_bytes(moments, remainders) * n
    pcie = state / (machine.pcie_each_way_gbs * 1e9)
    host = 2 * state / (machine.host_mem_gbs * 1e9 / ranks_node)
    device = device_adam_bytes(e, moments) * n / (machine.device_mem_gbs * 1e9)
    return max(pcie, host, device)


def _offload_optimizer(n, kept, e, r, reads_staging, moments, rem, machine, host_bw, ranks_node):
    """(CPU Adam over the host part, device Adam over the device share) seconds; bytes
    from ops/traffic.py, the gradient as Adam reads it (the staging itself when reads_staging,
    else the fp32 sum), the rounded params written beside (none in fp32)."""
    host_bytes = host_adam_bytes(e, r, reads_staging, moments, rem)
    rate = min(
        machine.cpu_cores_per_node / ranks_node * machine.adam_rate_per_core,
        host_bw / host_bytes,
    )
    return n / rate, device_adam_bytes(e, moments) * kept / (machine.device_mem_gbs * 1e9)


def host_adam_bytes(
    e: int, r: int, reads_staging: bool, moments=(4, 4), remainders: bool = False
) -> int:
    """Bytes per element of the CPU Adam over the host part: the gradient as it reads it
    (the r-byte staging when ``reads_staging``, else the fp32 sum), the rounded params written
    beside (e bytes; none in fp32, where the master itself goes up; none with remainders,
    whose master is the bf16 param plus its remainder)."""
    grad = r if reads_staging else 4
    return bytes_per_element(adam_arrays(grad, *moments, e if e < 4 else 0, remainders))


def device_adam_bytes(e: int, moments=(4, 4)) -> int:
    """Bytes per element of Adam where the state is on the device (fused AdamW over the
    fp32 master, gradient and moments) and of publishing the master into the params."""
    return bytes_per_element(adam_arrays(4, *moments) + publish_arrays(e))


def _overlap_host(chunks, offload_fraction, bwd, rs, r, pcie, work_s):
    """(the overlapped host step at this backward, the backward from which its worker
    keeps up): r bytes per element down over ``pcie`` B/s, ``work_s`` seconds per element
    of the worker's (the last micro-batch's accumulation, if any, and CPU Adam)."""
    device_from = len(chunks) - split_buckets(chunks, offload_fraction)
    per_bucket = buckets(chunks, device_from, rs, r / pcie, work_s)
    return schedule(per_bucket, bwd), keeping_up_backward(per_bucket, bwd)


def _offload_terms(
    shapes, n, kept, k, e, r, bwd, rs, machine, host_bw, ranks_node,
    offload_fraction, accumulate_on_device, moment_bytes, remainders,
):  # fmt: skip
    """Offload's terms of ``step_time`` over the host part of n elements (``kept`` on the
    device): (exposed gradient transfer, exposed accumulation, of which the last
    micro-batch's, CPU Adam, device Adam, copy up, the overlapped host step, the backward
    from which its worker keeps up, the GPU step on streamed state)."""
    pcie = machine.pcie_gbs * 1e9
    reads_staging = k == 1 or accumulate_on_device  # Adam reads the staging: no fp32 sum
    grad_exposed, accumulate, acc_last = _offload_gradients(
        k, n * r / pcie, 0.0 if reads_staging else n / host_bw, r, accumulate_on_device, bwd, rs
    )
    adam_host, adam_device = _offload_optimizer(
        n, kept, e, r, reads_staging, moment_bytes, remainders, machine, host_bw, ranks_node
    )
    up = e * n / pcie
    acc_s = 0.0 if reads_staging else bytes_per_element(accumulate_arrays(r, False))
    work_s = (adam_host / n if n else 0.0) + acc_s / host_bw  # the worker's, per element
    ov, hide_bwd = _overlap_host(shapes.chunks, offload_fraction, bwd, rs, r, pcie, work_s)
    # the streamed GPU step over the host part runs on the device after its share's Adam
    streamed = adam_device + streamed_gpu_step(n, e, moment_bytes, remainders, machine, ranks_node)
    return grad_exposed, accumulate, acc_last, adam_host, adam_device, up, ov, hide_bwd, streamed


def _schedules(pub, H: float, D: float, under: float, ov: Overlap, beside: bool):
    """Seconds after backward (and the norm) of each schedule's optimizer and publish, and
    the synchronous and the overlapped step's waits for the copies up: ``pub`` the buckets
    in forward order (planner/publish.py), ``H``/``D`` the CPU and the device share's
    Adam, ``under`` the forward/backward DPU's host step runs behind, ``ov`` the overlap's
    worker (what it leaves after backward; each bucket's speculative step, whose params go
    up then), ``beside``: the device share's Adam runs beside what the worker leaves (the
    host's norm is the device's), else after it."""
    ag_dev = device_gathers(pub)
    # synchronous: the device share's Adam, publish and gathers first, beside the CPU Adam,
    # which steps the host buckets in forward order, each copied up behind its piece
    start = max(H, D + ag_dev)
    pub_sync = forward_delay(pub, host_ready_in_turn(pub, H), start, D + ag_dev)
    sync = start + pub_sync
    # DPU: the join waits for what forward/backward did not hide; then the device share's
    # publish and gathers, the copies up, and the device share's Adam before the forward
    dpu = max(0.0, H - under) + ag_dev + D
    dpu += forward_delay(pub, [0.0] * len(pub), ag_dev + D, ag_dev)
    # overlap: the worker's leftover beside (or before) the device share's Adam; each host
    # bucket went up as its speculative step ended (the worker's order is backward's); the
    # gathers are issued at the step
    left = ov.exposed
    start = max(left, D + ag_dev) if beside else left + D + ag_dev
    pub_ov = forward_delay(pub, list(reversed(ov.ends)), start, start, backward_order=True)
    return sync, dpu, start + pub_ov, pub_sync, pub_ov


def _dp_link_gbs(gpus: int, machine: Machine) -> float:
    """The DP link: intra-node while the job fits a node, else the per-GPU network share."""
    return machine.intra_node_gbs if gpus <= machine.devices_per_node else machine.inter_node_gbs


def _tp_comm(cfg: GPTConfig, tp: int, e: int, micro_batch: int, machine: Machine) -> float:
    """Seconds of one micro-batch's TP all-reduces (ring, intra-node bandwidth)."""
    if tp == 1:
        return 0.0
    volume = (6 if cfg.recompute_activations else 4) * cfg.num_layers * 2 * (tp - 1) / tp
    return (
        volume * e * cfg.seq_length * micro_batch * cfg.hidden_size / (machine.intra_node_gbs * 1e9)
    )


def _data_parallel(gpus: int, tp: int, mode: str) -> int:
    if gpus % tp:
        raise ValueError(f"{gpus} GPUs do not split into TP={tp}")
    if mode not in ("offload", "zero2", "pytorch"):
        raise ValueError(f"mode must be offload, zero2 or pytorch, got {mode!r}")
    return gpus // tp


def step_time(
    cfg: GPTConfig,
    gpus: int,
    machine: Machine,
    tp: int = 1,
    batch_per_gpu: int = 16,
    micro_batch: int = 4,
    elem_bytes: int = 2,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    mode: str = "offload",
    offload_fraction: float = 1.0,
    accumulate_on_device: bool = False,
    moment_bytes: tuple[int, int] = (4, 4),
    reduce_bytes: int | None = None,
    remainders: bool = False,
) -> StepTime:
    dp = _data_parallel(gpus, tp, mode)
    shapes = spec_rank_shapes(cfg, tp, dp, bucket_size)
    n, P, e, r = shapes.slice_numel, shapes.flat_numel, elem_bytes, reduce_bytes or elem_bytes
    kept = shapes.device_share(offload_fraction) if mode == "offload" else 0
    n -= kept  # partial offload: the host terms count the host part only
    F, s = flops_per_token(cfg, cfg.recompute_activations, tp), cfg.seq_length
    k = batch_per_gpu // micro_batch
    ranks_node = min(gpus, machine.devices_per_node)
    host_bw = machine.host_mem_gbs * 1e9 / ranks_node
    dev_bw, dp_bw = machine.device_mem_gbs * 1e9, _dp_link_gbs(gpus, machine) * 1e9
    fb = micro_batch * s * F / tp / (machine.device_tflops * 1e12)
    bwd = fb * (3 / 4 if cfg.recompute_activations else 2 / 3)
    tp_comm = _tp_comm(cfg, tp, e, micro_batch, machine)
    rs = ag = (dp - 1) / dp * e * P / dp_bw
    norm = 0.0  # ZeRO: the squares are summed where each gradient first exists
    if mode == "offload":
        grad_exposed, accumulate, acc_last, adam_host, adam_device, up, ov, hide_bwd, streamed = (
            _offload_terms(
                shapes, n, kept, k, e, r, bwd, rs, machine, host_bw, ranks_node,
                offload_fraction, accumulate_on_device, moment_bytes, remainders,
            )
        )  # fmt: skip
        adam = max(adam_host, adam_device)  # the device share runs beside the CPU Adam
    else:  # the optimizer state on the device: passes at device memory bandwidth
        adam_bytes = device_adam_bytes(e, moment_bytes)
        if mode == "pytorch":  # all-reduce (2x the bytes), Adam over every parameter
            rs, ag, n = 2 * rs, 0.0, shapes.params
            norm = e * n / dev_bw  # clip_grad_norm_ reads every gradient
        grad_exposed, accumulate, up = k * max(0.0, rs - bwd), 0.0, 0.0
        acc_last, ov, hide_bwd = 0.0, Overlap(0.0, 0.0, True), 0.0  # the sync step
        adam = adam_bytes * n / dev_bw
        adam_host, adam_device, streamed = 0.0, adam, 0.0
    work = k * (fb + tp_comm) + grad_exposed + accumulate
    host_from = len(shapes.chunks) - split_buckets(shapes.chunks, offload_fraction)
    pub = forward_order(
        shapes.chunks, host_from if mode == "offload" else 0, fb - bwd, ag,
        e / (machine.pcie_gbs * 1e9),
    )  # fmt: skip
    before = work + norm
    sync, dpu, overlap, pub_sync, pub_ov = _schedules(
        pub, adam_host, adam_device, k * fb, ov, k == 1 or accumulate_on_device
    )
    sync, dpu, overlap = before + sync, before + dpu, before - acc_last + overlap
    if mode != "offload":
        dpu = sync
    flops = batch_per_gpu * s * F / tp
    tokens = k * micro_batch * dp * s
    return StepTime(
        gpus, tp, dp, k * fb, k * tp_comm, grad_exposed, accumulate, 0.0, norm, adam, up, ag,
        sync, dpu, flops / sync / 1e12, flops / dpu / 1e12, mode, tokens,
        adam_host, adam_device, 1.0 - kept / shapes.slice_numel if mode == "offload" else 0.0,
        overlap, ov.exposed + pub_ov, ov.hidden, tokens * hide_bwd / bwd if bwd else 0.0, streamed,
        work + norm + streamed + ag if mode == "offload" else sync, pub_sync, pub_ov,
    )  # fmt: skip


def scaling(cfg: GPTConfig, machine: Machine, gpus=(1, 2, 4, 8, 16, 32, 64, 128), **kw):
    return [step_time(cfg, g, machine, **kw) for g in gpus]


def ten_b() -> GPTConfig:
    """The paper's (and DeepSpeed's example) 10B: 50 x 4096, 32 heads, seq 1024."""
    return GPTConfig(
        num_layers=50,
        hidden_size=4096,
        num_attention_heads=32,
        seq_length=1024,
        vocab_size=50257,
        recompute_activations=True,
    )


def format_scaling(rows: list[StepTime]) -> str:
    head = (
        f"{'GPUs':>5} {'TPxDP':>7} {'compute':>8} {'tp-comm':>8} {'grad-exp':>8} "
        f"{'accum':>6} {'host':>5} {'adam':>6} {'up':>5} {'gather':>7} {'step s':>7} "
        f"{'TF/GPU':>7} {'DPU s':>7} {'TF/GPU':>7}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.gpus:5d} {f'{r.tp}x{r.dp}':>7} {r.compute:8.2f} {r.tp_comm:8.2f} "
            f"{r.grad_exposed:8.2f} {r.accumulate:6.2f} {r.zero + r.norm:5.2f} "
            f"{r.adam:6.2f} {r.copy_up:5.2f} "
            f"{r.all_gather:7.2f} {r.step_sync:7.2f} {r.tflops_sync:7.1f} "
            f"{r.step_dpu:7.2f} {r.tflops_dpu:7.1f}"
        )
    return "\n".join(lines)


def plot_scaling(rows: list[StepTime], path: str, title: str) -> bool:
    """Write the PNG; False (and nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    g = [r.gpus for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(g, [r.tflops_sync for r in rows], "o-", label="this model: synchronous step")
    ax.plot(g, [r.tflops_dpu for r in rows], "s--", label="this model: with DPU")
    # The paper publishes a claim, not a curve we could copy: >30 TFLOPS/GPU from 1 to
    # 128 GPUs at 10B, and ~40 TFLOPS on one V100.
    ax.axhline(30, ls=":", lw=2, color="tab:green", label="paper: >30 TF/GPU, 1-128 GPUs")
    ax.plot([1], [40], "*", ms=14, color="tab:red", label="paper: ~40 TF on one V100")
    ax.set_xscale("log", base=2)
    ax.set_xticks(g, [str(x) for x in g])
    ax.set_ylim(0, max(55, max(r.tflops_dpu for r in rows) * 1.15))
    ax.set_xlabel("GPUs")
    ax.set_ylabel("TFLOPS per GPU")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


__all__ = [
    "Machine",
    "StepTime",
    "step_time",
    "scaling",
    "ten_b",
    "format_scaling",
    "plot_scaling",
    "measure_adam_rate",
]
