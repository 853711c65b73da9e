"""Which ``--optimizer-offload-fraction`` to run with: the largest device share that fits.

The optimizer splits each rank's slice at a bucket boundary (``split_buckets``), so the
candidates are the J + 1 boundaries of its J bucket chunks. Device memory only grows
with the device share (and host memory only shrinks), so the largest share that fits the
device is found by bisection over the boundaries; the F printed is a short decimal that
the optimizer rounds back to that very boundary.
"""

from __future__ import annotations

from dataclasses import replace

from ..optimizer.device_share import actual_fraction, split_buckets
from .memory import Hardware, JobPlan, Run, plan_job


def fraction_for(chunks, device_buckets: int) -> float:
    """The shortest decimal F that ``split_buckets`` rounds to ``device_buckets``."""
    exact = actual_fraction(chunks, device_buckets)
    for digits in range(2, 12):
        f = min(1.0, max(0.0, round(exact, digits)))
        if split_buckets(chunks, f) == device_buckets:
            return f
    return exact


def pick_offload_fraction(run: Run, hw: Hardware) -> tuple[float, JobPlan]:
    """(F, plan at F): the smallest F whose plan fits device memory; F = 1 (and its plan,
    which then does not fit) when even full offload does not. ``run.mode`` is offload."""
    full = plan_job(replace(run, offload_fraction=1.0), hw)
    if not full.fits_device or 1 in run.moment_bytes:  # 8-bit moments: all on the host
        return 1.0, full
    chunks = full.ranks[0].shapes.chunks
    # DPU and remainders need a host share: keep at least one bucket there.
    top = len(chunks) - 1 if run.dpu or run.remainders else len(chunks)

    def plan(j: int) -> JobPlan:
        return plan_job(replace(run, offload_fraction=fraction_for(chunks, j)), hw)

    ok, bad = 0, top + 1  # ``ok`` fits the device; ``bad`` is the first known not to
    while bad - ok > 1:
        mid = (ok + bad) // 2
        ok, bad = (mid, bad) if plan(mid).fits_device else (ok, mid)
    if ok == 0:
        return 1.0, full
    return fraction_for(chunks, ok), plan(ok)
