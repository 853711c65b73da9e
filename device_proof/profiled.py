"""One profiled offload step: the share of its device->host copy time that overlaps
kernels on other streams (on the CPU: ops on other threads)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from . import toy
from .overlap import Event, copy_overlap_share


def split_events(events, cuda: bool) -> tuple[list[Event], list[Event]]:
    """(copies, kernels) as (start, end, stream) from the profiler's events. CUDA: the
    D2H memcpys, and every kernel that is not a memcpy/memset (Hopper's cuBLAS calls its
    GEMMs nvjet_*, so no name filter); CPU: ``aten::copy_`` and every other op, the
    thread standing in for the stream."""
    copies, kernels = [], []
    for e in events:
        on_device = e.device_type == torch.autograd.DeviceType.CUDA
        if on_device != cuda:
            continue
        span = (e.time_range.start, e.time_range.end, e.device_resource_id if cuda else e.thread)
        if cuda:
            if "Memcpy DtoH" in e.name:
                copies.append(span)
            elif not e.name.startswith(("Memcpy", "Memset")):
                kernels.append(span)
        else:
            (copies if e.name == "aten::copy_" else kernels).append(span)
    return copies, kernels


def profiled_share(opt, m, batches) -> dict:
    """Profile one step of ``opt`` (already warmed up) over ``batches``."""
    cuda = opt.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        toy.step(opt, m, batches)
        if cuda:
            torch.cuda.synchronize()
    opt.flush()
    copies, kernels = split_events(prof.events(), cuda)
    return dict(share=copy_overlap_share(copies, kernels), copies=len(copies), kernels=len(kernels))
