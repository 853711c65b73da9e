"""Speed figures: recorded beside what the throughput model (fed the calibration) expects,
never judged, until a first reading has calibrated the model. Only the traffic is a check:
the bytes the copies move are set by the layout, not by the machine.

- step time of each mode (no offload, offload, DPU, the overlap), median of the timed steps;
- PCIe GB/s each way and the bytes per parameter, from the copies themselves
  (``ledger.CopyLedger``: events around each copy);
- the CPU Adam's GB/s on every usable core; the share of the host's time the overlap hid;
- the share of the D2H copy time under kernels on other streams (a profiled step).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import torch

from mp_offload.model.gpt import GPTConfig
from mp_offload.ops.traffic import adam_arrays, bytes_per_element
from mp_offload.planner.throughput import Machine, step_time
from mp_offload.runtime.cpu_threads import available_cores

from . import toy
from .equivalence import BF16
from .ledger import CopyLedger
from .profiled import profiled_share
from .report import check, fig

MODES = {
    "zero2": dict(cpu_offload=False),
    "offload": {},
    "dpu": dict(dpu_warmup_steps=0),
    "overlap": dict(overlap_cpu_optimizer=True),
}


@dataclass
class Bench:
    """The speed section's model and sizes (``rows`` sequences a step, one micro-batch)."""

    device: str
    cfg: dict
    rows: int
    warmup: int
    steps: int
    bucket_size: int

    @property
    def init(self):
        return toy.initial(self.cfg)  # made by the first task that needs it

    def batch(self, s: int) -> list[torch.Tensor]:
        return [toy.tokens(self.cfg, self.rows, s, self.device)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _build(b: Bench, **options):
    m = toy.model(b.init, b.device, BF16)
    return m, toy.zero(m, b.device, dtype=BF16, bucket_size=b.bucket_size, **options)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def modelled(b: Bench, calib: dict) -> dict:
    """The throughput model's step seconds for each mode, on the calibrated machine."""
    m = Machine(
        device_tflops=calib.get("gemm_tflops", 1.0),
        devices_per_node=1,
        pcie_gbs=min(calib.get("d2h_gbs", 1.0), calib.get("h2d_gbs", 1.0)),
        cpu_cores_per_node=calib.get("cores", 1),
        host_mem_gbs=calib.get("host_stream_gbs", 1.0),
        device_mem_gbs=calib.get("device_mem_gbs", 1.0),
    )
    if calib.get("adam_rate_per_core"):
        m.adam_rate_per_core = calib["adam_rate_per_core"]
    cfg = GPTConfig(**{k: b.cfg[k] for k in toy.TINY})
    kw = dict(batch_per_gpu=b.rows, micro_batch=b.rows, bucket_size=b.bucket_size)
    off, zero2 = step_time(cfg, 1, m, **kw), step_time(cfg, 1, m, mode="zero2", **kw)
    return dict(
        zero2=zero2.step_sync, offload=off.step_sync, dpu=off.step_dpu, overlap=off.step_overlap
    )


def step_times(b: Bench, calib: dict):
    """Each mode built in turn (one at a time in memory), median wall time of its steps."""
    try:
        model = {k: f"model {v * 1e3:.4g} ms" for k, v in modelled(b, calib).items()}
    except Exception as e:  # noqa: BLE001 - a figure without its expectation, not none
        model = {k: f"model: {type(e).__name__}: {e}" for k in MODES}
    for mode, options in MODES.items():
        m, opt = _build(b, **options)
        times, hidden = [], []
        for s in range(b.warmup + b.steps):
            t0 = time.perf_counter()
            toy.step(opt, m, b.batch(s))
            _sync(b.device)
            times.append(time.perf_counter() - t0)
            st = opt.stats()
            if "host_hidden_ms" in st:
                hidden.append(
                    st["host_hidden_ms"] / max(st["host_hidden_ms"] + st["host_exposed_ms"], 1e-9)
                )
        opt.flush()
        ms = statistics.median(times[b.warmup :]) * 1e3
        yield fig(f"speed.step_ms.{mode}", ms, model[mode])
        if hidden:
            share = statistics.median(hidden[b.warmup :])
            yield fig("speed.host_hidden_share", share, "of the host step under backward")
        del m, opt
        _free()


def traffic(b: Bench):
    """DPU (a staging both ways on every device): the copies of steps 2.. seen one by one.
    Down: the bf16 gradient chunks; up: the bf16 params (step 1 publishes nothing)."""
    ledger = CopyLedger(b.device, timed=True)
    m, opt = _build(b, dpu_warmup_steps=0, streams=ledger)
    toy.step(opt, m, b.batch(0))
    _sync(b.device)
    ledger.copies.clear()  # the copies of steps 2 and 3 only
    for s in range(1, 3):
        toy.step(opt, m, b.batch(s))
    _sync(b.device)
    seen = list(ledger.copies)
    opt.flush()
    ledger.copies[:] = seen  # the last flush's uploads belong to no timed step
    numel = 2 * (opt.layout.slice_numel - opt.placement.share_numel)  # two steps' host part
    for way in ("d2h", "h2d"):
        per = ledger.nbytes(way) / numel
        yield check(
            f"traffic.{way}_bytes_per_param", per == 2.0, per, "== 2 (bf16, from the copies)"
        )
        secs = ledger.seconds(way)
        gbs = ledger.nbytes(way) / secs / 1e9 if secs > 0 else float("nan")
        yield fig(f"speed.pcie_{way}_gbs", gbs, "GB/s: the copies' bytes / their own time")
    del m, opt
    _free()


def cpu_adam_gbs(b: Bench, numel: int):
    """The C++ Adam on every usable core over ``numel`` elements: bf16 grads in, bf16
    params out, fp32 master and moments (28 B an element)."""
    from mp_offload.ops import cpu_adam

    cores, threads = available_cores(), cpu_adam.get_num_threads()
    p, g32, m, v = (torch.rand(numel) for _ in range(4))
    g, out = g32.to(BF16), torch.empty(numel, dtype=BF16)
    del g32
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    best = float("inf")
    cpu_adam.set_num_threads(cores)
    try:
        for step in range(1, 4):
            t0 = time.perf_counter()
            cpu_adam.adam_step(p, g, m, v, step=step, param_out=out, **hyper)
            best = min(best, time.perf_counter() - t0)
    finally:
        cpu_adam.set_num_threads(threads)  # the run's own rule for what follows
    nbytes = bytes_per_element(adam_arrays(grad=2, param_out=2))
    yield fig(
        "speed.cpu_adam_gbs",
        numel * nbytes / best / 1e9,
        f"GB/s, {cores} threads, {nbytes} B/element",
    )


def d2h_overlap(b: Bench):
    m, opt = _build(b)
    toy.step(opt, m, b.batch(0))  # warm-up: buffers, streams, kernels chosen
    got = profiled_share(opt, m, b.batch(1))
    why = "of the D2H copy time under other streams' kernels"
    yield fig("speed.d2h_overlap_share", got["share"], f"{why} ({got['copies']} copies)")
    del m, opt
    _free()
