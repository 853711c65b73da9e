"""Calibration for the throughput model (``calib.json``): pinned D2H/H2D bandwidth, host
stream bandwidth, device memory bandwidth, bf16 GEMM TFLOPS; and the host memory and
cores this process may really use (cgroup limits, not MemTotal or the core count)."""

from __future__ import annotations

import os
import time

import torch

GB = 1e9


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


def usable_cores(root: str = "/") -> int:
    """The affinity mask, capped by a cgroup v2 CPU quota (``cpu.max``: quota period)."""
    cores = len(os.sched_getaffinity(0))
    fields = (_read(os.path.join(root, "sys/fs/cgroup/cpu.max")) or "").split()
    if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit() and int(fields[1]):
        cores = min(cores, max(1, int(fields[0]) // int(fields[1])))
    return cores


class _Timer:
    """Seconds of a block: CUDA events on a GPU (the copy's own time), else the wall."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, repeats: int) -> float:
        fn()  # warm-up
        if self.cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(repeats):
                fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3 / repeats
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats


def calibrate(device: torch.device, copy_mb: int, gemm_n: int, repeats: int = 5) -> dict:
    """GB/s and TFLOPS measured here. On the CPU (rehearsal) the "device" is host memory:
    the copies are plain host copies and the GEMM runs on the CPU."""
    timer = _Timer(device)
    cuda = device.type == "cuda"
    n = copy_mb * (1 << 20)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    d2h = n / timer(lambda: host.copy_(dev, non_blocking=cuda), repeats) / GB
    h2d = n / timer(lambda: dev.copy_(host, non_blocking=cuda), repeats) / GB
    a, b = torch.empty(n // 4, dtype=torch.float32), torch.empty(n // 4, dtype=torch.float32)
    host_stream = 2 * n / _Timer(torch.device("cpu"))(lambda: b.copy_(a), repeats) / GB
    dev2 = torch.empty_like(dev)
    device_mem = 2 * n / timer(lambda: dev2.copy_(dev), repeats) / GB
    dtype = torch.bfloat16 if cuda else torch.float32  # CPU bf16 GEMMs are not the point here
    x = torch.randn(gemm_n, gemm_n, device=device).to(dtype)
    y = torch.randn(gemm_n, gemm_n, device=device).to(dtype)
    tflops = 2 * gemm_n**3 / timer(lambda: x @ y, repeats) / 1e12
    return dict(
        device=str(device),
        name=torch.cuda.get_device_name(device) if cuda else "cpu (rehearsal)",
        d2h_gbs=d2h,
        h2d_gbs=h2d,
        host_stream_gbs=host_stream,
        device_mem_gbs=device_mem,
        gemm_tflops=tflops,
        gemm_dtype=str(dtype).replace("torch.", ""),
        host_memory_gb=(host_memory_bytes() or 0) / GB,
        cores=usable_cores(),
    )
