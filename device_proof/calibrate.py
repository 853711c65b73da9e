"""Calibration, the proof's first lines: what this machine does, for the throughput model
(``calib.json``) and for the later sections. Figures, except one physics-certain gate: a
GEMM cannot beat the device's tensor-core peak (a faster reading means a broken timer).

On the CPU (the rehearsal) the "device" is host memory: the copies are host copies and
the GEMM runs on the CPU, so the lines are the same and their values mean nothing.
"""

from __future__ import annotations

import math
import os
import platform
import time

import torch

from mp_offload.runtime.cpu_threads import available_cores
from mp_offload.runtime.logger import device_peak_tflops

from .report import check, fig

GB = 1e9
# SDPA kernels by the name sdpa_kernel takes; "default" lets torch choose.
SDPA_BACKENDS = ("default", "MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def host_memory_bytes(root: str = "/") -> int | None:
    """min(the cgroup's memory limit, MemAvailable): what a run may allocate now."""
    sys_ = lambda p: os.path.join(root, p.lstrip("/"))
    limits = []
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = (_read(sys_(path)) or "").strip()
        if text.isdigit() and int(text) < 1 << 60:  # v1 says "no limit" with a huge number
            limits.append(int(text))
    for line in (_read(sys_("/proc/meminfo")) or "").splitlines():
        if line.startswith("MemAvailable:"):
            limits.append(int(line.split()[1]) * 1024)
    return min(limits) if limits else None


def timed(fn, device: torch.device, repeats: int) -> float:
    """Seconds of one ``fn()``: CUDA events around the repeats on a GPU, else the wall."""
    fn()  # warm-up
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(repeats):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / repeats


def machine(calib: dict, device: torch.device):
    """The machine this runs on, one line."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (rehearsal)"
    calib.update(
        name=name,
        torch=torch.__version__,
        python=platform.python_version(),
        cuda=torch.version.cuda,
        cores=available_cores(),
        host_memory_gb=(host_memory_bytes() or 0) / GB,
    )
    text = ", ".join(f"{k} {calib[k]}" for k in ("name", "torch", "python", "cuda", "cores"))
    yield fig("calib.machine", f"{text}, host memory {calib['host_memory_gb']:.1f} GB")


def copies(calib: dict, device: torch.device, mb: int, repeats: int = 5):
    """Pinned device->host and host->device copies, each way alone."""
    cuda, n = device.type == "cuda", mb * (1 << 20)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    calib["d2h_gbs"] = n / timed(lambda: host.copy_(dev, non_blocking=cuda), device, repeats) / GB
    yield fig("calib.pinned_d2h_gbs", calib["d2h_gbs"], f"GB/s, {mb} MiB copies")
    calib["h2d_gbs"] = n / timed(lambda: dev.copy_(host, non_blocking=cuda), device, repeats) / GB
    yield fig("calib.pinned_h2d_gbs", calib["h2d_gbs"], f"GB/s, {mb} MiB copies")
    dev2 = torch.empty_like(dev)
    calib["device_mem_gbs"] = 2 * n / timed(lambda: dev2.copy_(dev), device, repeats) / GB
    yield fig("calib.device_mem_gbs", calib["device_mem_gbs"], "GB/s read + written")


def host_dram(calib: dict, mb: int, repeats: int = 5):
    """Host memory streamed by torch's copy on every usable core (read + write)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(available_cores())
    try:
        a = torch.empty(mb * (1 << 18), dtype=torch.float32)
        b = torch.empty_like(a)
        a.fill_(1.0)  # first touch: the pages exist before they are timed
        b.fill_(0.0)
        seconds = timed(lambda: b.copy_(a), torch.device("cpu"), repeats)
    finally:
        torch.set_num_threads(threads)  # the run's own rule for what follows
    calib["host_stream_gbs"] = 2 * a.numel() * 4 / seconds / GB
    yield fig("calib.host_dram_gbs", calib["host_stream_gbs"], f"GB/s, {available_cores()} threads")


def cpu_adam(calib: dict):
    """One thread of the C++ Adam (the throughput model's rate per core)."""
    from mp_offload.planner.throughput import measure_adam_rate

    calib["adam_rate_per_core"] = measure_adam_rate()
    yield fig("calib.cpu_adam_rate_per_core", calib["adam_rate_per_core"], "elements/s, 1 thread")


def gemm(calib: dict, device: torch.device, n: int, repeats: int = 5):
    """bf16 GEMM on the device (fp32 on the CPU: its bf16 GEMMs are not the point)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x, y = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    calib["gemm_tflops"] = tflops = 2 * n**3 / timed(lambda: x @ y, device, repeats) / 1e12
    peak = device_peak_tflops() if device.type == "cuda" else None
    ok = math.isfinite(tflops) and 0 < tflops <= (peak or math.inf)
    want = f"in (0, {peak:g}] (the dense peak)" if peak else "> 0 (no known peak here)"
    yield check("calib.gemm_tflops", ok, tflops, f"{want}; {n}^3 {str(dtype)[6:]}")


def _sdpa_once(q, k, v):
    qi, ki, vi = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True)
    out.backward(torch.ones_like(out))
    return [out.detach(), qi.grad, ki.grad, vi.grad]


def sdpa_repeats(backend: str, q, k, v) -> str:
    """ "yes" when two forward+backward passes on ``backend`` are bitwise equal, "no", or
    "n/a" (no such kernel for these inputs here)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        if backend == "default":
            runs = [_sdpa_once(q, k, v) for _ in range(2)]
        else:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                runs = [_sdpa_once(q, k, v) for _ in range(2)]
    except (RuntimeError, AttributeError):
        return "n/a"
    return "yes" if all(torch.equal(a, b) for a, b in zip(*runs)) else "no"


def sdpa_determinism(calib: dict, device: torch.device, cfg: dict):
    """Each SDPA kernel run twice under deterministic algorithms, at the equivalences'
    head shape; where the default is not repeatable they pin the math kernel."""
    heads, seq = cfg["num_attention_heads"], cfg["seq_length"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    shape = (2, heads, seq, cfg["hidden_size"] // heads)
    q, k, v = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(3))
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        got = {b: sdpa_repeats(b, q, k, v) for b in SDPA_BACKENDS}
    finally:
        torch.use_deterministic_algorithms(before)
    calib["sdpa_repeatable"] = got
    text = ", ".join(f"{b.split('_')[0].lower()} {r}" for b, r in got.items())
    yield fig("calib.sdpa_deterministic", text, "bitwise twice; the equivalences pin math if not")
