"""A step-time model of TP x ZeRO-Offload DP, set against the paper's scaling claim.

Per DP rank, with n = its host slice (host_numel), P = its TP rank's flat buffer,
e = 2 bytes, B = sequences per GPU per step in micro-batches of b, F = training
FLOPs per token (flops_per_token, recomputation counted), C = sustained device FLOPS:

  per micro-batch (B/b of them)
    forward+backward   b*s*F/(T*C)
    TP all-reduces     (T>1) 6 per layer with recomputation, 4 without, of e*s*b*h
                       bytes each, ring: 2(T-1)/T * bytes / intra-node bandwidth
    gradients          reduce-scatter (D-1)/D*e*P bytes over the DP link and e*n bytes
                       down PCIe on a dedicated copy stream (optimizer/reducer.py:
                       CopyStream), so both overlap backward (the last 3/4 of the work
                       with recomputation); only the excess counts
    fp32 accumulation  a host thread adds each staged chunk as its copy lands: 10 B per
                       element of n (read 4+2, write 4) at this rank's share of host
                       bandwidth; it overlaps backward like the copies, only the excess counts
  per step (host passes over the slice, each at this rank's share of host bandwidth)
    zero the grads     4 B per element of n (the fp32 gradient slice, before backward)
    grad norm          4 B per element of n
    CPU Adam           n / rate; rate = min(cores_per_rank * per-core rate,
                       host bandwidth share / 30 B) (Adam reads p,g,m,v and writes p,m,v
                       and the fp16 copy: 30 B per element, memory-bound)
    copy up            e*n bytes over PCIe
    all-gather         (D-1)/D*e*P bytes over the DP link
  DPU: CPU Adam and the copy up run behind the next step's forward/backward; only
  what does not fit under it counts.
  Partial offload (``offload_fraction`` F < 1): every host and PCIe term above counts
  only the host part of the slice; the device share (its first buckets) is updated by a
  fused device Adam, 34 B per element at device memory bandwidth (28 for Adam, 6 to
  round the master into the parameters), launched before the CPU Adam and running
  beside it: the step's optimizer time is the larger of the two. With DPU the device
  Adam sits in the device's stream before the next forward, so it counts in full.

Without offload (``mode``): "zero2" keeps the fp32 slice on the device, so the host
terms go (no PCIe, no host accumulation) and zeroing, norm and Adam are passes over the
slice at device memory bandwidth; "pytorch" (no ZeRO) all-reduces the gradients of
every micro-batch (twice the reduce-scatter's bytes, overlapping backward), runs Adam
over all of its parameters on the device and needs no all-gather. Neither has DPU.

The DP link is the intra-node bandwidth while T*D fits in one node, else the per-GPU
share of the node's network. TFLOPS/GPU = B*s*F/T / step time. Not modelled: kernel
efficiency changing with shapes, collective latency, host contention between the Adam
thread and accumulation under DPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..model.gpt import GPTConfig, flops_per_token
from ..optimizer.base import DEFAULT_BUCKET_SIZE
from .shapes import rank_shapes, spec_named_params

# Host memory traffic per element of the slice, by pass (what the code does today).
ZERO_BYTES_PER_ELEMENT = 4  # zero_grad: write the fp32 gradient slice
ACCUMULATE_BYTES_PER_ELEMENT = 10  # per micro-batch: read 2 (staging) + 4, write 4
NORM_BYTES_PER_ELEMENT = 4  # read the fp32 gradient slice
ADAM_BYTES_PER_ELEMENT = 30  # read p, g, m, v; write p, m, v and the low-precision copy
DEVICE_SHARE_BYTES_PER_ELEMENT = 34  # fused Adam 28, then master -> params 4 + 2


@dataclass
class Machine:
    """Defaults: a DGX-2 (16x V100-32GB, 2x 24-core Xeon, 8x 100 Gb/s InfiniBand)."""

    device_tflops: float = 50.0  # sustained fwd/bwd, fp16 tensor cores on big GEMMs
    devices_per_node: int = 16
    intra_node_gbs: float = 100.0  # GB/s per GPU in collectives (NVSwitch)
    inter_node_gbs: float = 6.25  # GB/s per GPU: 100 GB/s of network per 16 GPUs
    pcie_gbs: float = 12.0  # GB/s host<->device per GPU (PCIe 3 x16, achieved)
    cpu_cores_per_node: int = 48
    host_mem_gbs: float = 120.0  # sustained per node; 10B Adam in 2.6 s, as the paper
    adam_rate_per_core: float = 80e6  # elements/s; replaced by a measurement if possible
    device_mem_gbs: float = 900.0  # device memory bandwidth (V100 HBM2): Adam without offload


def measure_adam_rate(numel: int = 1 << 22, repeats: int = 3) -> float | None:
    """Elements/s of one thread of the C++ CPU Adam here, or None without the extension."""
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

    @property
    def tokens_per_day(self) -> float:
        return self.tokens_per_step * 86400 / self.step_sync

    @property
    def days_per_billion_tokens(self) -> float:
        return 1e9 / self.tokens_per_day


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
) -> StepTime:
    if gpus % tp:
        raise ValueError(f"{gpus} GPUs do not split into TP={tp}")
    if mode not in ("offload", "zero2", "pytorch"):
        raise ValueError(f"mode must be offload, zero2 or pytorch, got {mode!r}")
    dp = gpus // tp
    recompute = cfg.recompute_activations
    shapes = rank_shapes(spec_named_params(cfg, tp), dp, bucket_size)
    n, P, e = shapes.host_numel, shapes.flat_numel, elem_bytes
    kept = shapes.device_share(offload_fraction) if mode == "offload" else 0
    n -= kept  # partial offload: the host terms count the host part only
    F = flops_per_token(cfg, recompute, tp)
    s, h, L = cfg.seq_length, cfg.hidden_size, cfg.num_layers
    micro = batch_per_gpu // micro_batch
    ranks_node = min(gpus, machine.devices_per_node)
    host_bw = machine.host_mem_gbs * 1e9 / ranks_node
    dp_bw = (
        machine.intra_node_gbs if gpus <= machine.devices_per_node else machine.inter_node_gbs
    ) * 1e9
    pcie = machine.pcie_gbs * 1e9

    fb = micro_batch * s * F / tp / (machine.device_tflops * 1e12)
    bwd = fb * (3 / 4 if recompute else 2 / 3)
    tp_comm = 0.0
    if tp > 1:
        n_ar = (6 if recompute else 4) * L
        volume = n_ar * 2 * (tp - 1) / tp * e * s * micro_batch * h
        tp_comm = volume / (machine.intra_node_gbs * 1e9)
    rs = (dp - 1) / dp * e * P / dp_bw
    ag = (dp - 1) / dp * e * P / dp_bw
    if mode == "offload":
        accumulate_work = ACCUMULATE_BYTES_PER_ELEMENT * n / host_bw
        # reduce-scatter, copy down and host accumulation are pipelined under backward
        grad_exposed = max(0.0, max(rs, e * n / pcie) - bwd)
        accumulate = max(0.0, accumulate_work - bwd - grad_exposed)
        zero = ZERO_BYTES_PER_ELEMENT * n / host_bw
        norm = NORM_BYTES_PER_ELEMENT * n / host_bw
        rate = min(
            machine.cpu_cores_per_node / ranks_node * machine.adam_rate_per_core,
            host_bw / ADAM_BYTES_PER_ELEMENT,
        )
        adam_host = n / rate
        adam_device = DEVICE_SHARE_BYTES_PER_ELEMENT * kept / (machine.device_mem_gbs * 1e9)
        adam = max(adam_host, adam_device)  # the device share runs beside the CPU Adam
        up = e * n / pcie
    else:  # the optimizer state on the device: passes at device memory bandwidth
        dev_bw = machine.device_mem_gbs * 1e9
        if mode == "pytorch":  # all-reduce (2x the bytes), Adam over every parameter
            rs, ag, n = 2 * rs, 0.0, shapes.params
        grad_exposed, accumulate, up = max(0.0, rs - bwd), 0.0, 0.0
        zero = ZERO_BYTES_PER_ELEMENT * n / dev_bw
        norm = NORM_BYTES_PER_ELEMENT * n / dev_bw
        adam = ADAM_BYTES_PER_ELEMENT * n / dev_bw
        adam_host, adam_device = 0.0, adam
    per_micro = fb + tp_comm + grad_exposed + accumulate
    work = micro * per_micro
    sync = work + zero + norm + adam + up + ag
    dpu = (
        work + zero + norm + adam_device + max(0.0, adam_host - micro * fb) + up + ag
        if mode == "offload"
        else sync
    )
    flops = batch_per_gpu * s * F / tp
    return StepTime(
        gpus,
        tp,
        dp,
        micro * fb,
        micro * tp_comm,
        micro * grad_exposed,
        micro * accumulate,
        zero,
        norm,
        adam,
        up,
        ag,
        sync,
        dpu,
        flops / sync / 1e12,
        flops / dpu / 1e12,
        mode,
        (batch_per_gpu // micro_batch) * micro_batch * dp * s,
        adam_host,
        adam_device,
        1.0 - kept / shapes.host_numel if mode == "offload" else 0.0,
    )


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
