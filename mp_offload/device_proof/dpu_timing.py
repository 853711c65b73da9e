"""The rehearsal's DPU-vs-sync timing: on a shared CPU one iteration of a tiny model swings
by 10x between runs made one after the other, so both optimizers step here in turn, in one
process, and the load falls on both alike."""

from __future__ import annotations

import statistics
import time

import torch

from . import toy
from .checks import Check
from .run_checks import dpu_verdict

REHEARSAL_FACTOR = 1.5
# Steps of ~50 ms on a CPU core: long enough that one scheduling hiccup of a loaded
# machine does not decide the median.
CFG = dict(toy.TINY, num_layers=4, hidden_size=128, seq_length=128)


def _step(opt, m, batch) -> float:
    """One step; returns the seconds of its ``optimizer.step``."""
    opt.zero_grad()
    with torch.autocast(batch.device.type, dtype=torch.bfloat16):
        loss = m(batch[:, :-1], batch[:, 1:]).mean()
    opt.backward(loss)
    t0 = time.perf_counter()
    opt.step(toy.HP["lr"])
    return time.perf_counter() - t0


def dpu_interleaved(device: str = "cpu", steps: int = 16) -> Check:
    runs = {}
    for name, warmup in (("sync", None), ("dpu", 0)):
        m = toy.model(device, **CFG)
        runs[name] = (m, toy.zero(m, device, dtype=torch.bfloat16, dpu_warmup_steps=warmup))
    wall, adam = {"sync": [], "dpu": []}, []
    for i in range(steps):
        batch = toy.tokens(CFG, 4, i, device)
        for name, (m, opt) in runs.items():
            t0 = time.perf_counter()
            step_s = _step(opt, m, batch)
            wall[name].append(time.perf_counter() - t0)
            if name == "sync":
                adam.append(step_s)
    for _, opt in runs.values():
        opt.flush()
    s_ms, d_ms = (statistics.median(wall[k][2:]) * 1e3 for k in ("sync", "dpu"))
    what = "sync's median, stepped in turn"
    return dpu_verdict(statistics.median(adam), s_ms, d_ms, REHEARSAL_FACTOR, what)
