"""Which ``--optimizer-offload-fraction`` to run with: the largest device share that fits.

The optimizer splits each rank's slice at a bucket boundary (``split_buckets``), so the
candidates are the J + 1 boundaries of its J bucket chunks. Device memory only grows
with the device share (and host memory only shrinks), so the largest share that fits the
device is found by bisection over the boundaries; the F printed is a short decimal that
the optimizer rounds back to that very boundary.

With ``--overlap-cpu-optimizer`` a larger device share is not always faster: the host's
CPU Adam hides under backward, the device share's Adam does not. ``least_exposed`` then
picks, among the boundaries that fit, the one whose exposed optimizer time (the larger of
the device share's Adam and what the host leaves after backward: ``cost`` gives the two)
is smallest:
the device part only grows with the share and the host part only shrinks (fewer buckets
for the worker, fewer copies up), so their larger is smallest where they cross, found by
bisection; of equal costs the smallest share (the least device memory).
"""

from __future__ import annotations

from ..optimizer.device_share import actual_fraction, split_buckets
from .memory import Hardware, JobPlan, Run, moment_bytes, plan_job


def fraction_for(chunks, device_buckets: int) -> float:
    """The shortest decimal F that ``split_buckets`` rounds to ``device_buckets``."""
    exact = actual_fraction(chunks, device_buckets)
    for digits in range(2, 12):
        f = min(1.0, max(0.0, round(exact, digits)))
        if split_buckets(chunks, f) == device_buckets:
            return f
    return exact


def pick_offload_fraction(run: Run, hw: Hardware, cost=None) -> tuple[float, JobPlan]:
    """(F, plan at F): the smallest F whose plan fits device memory; F = 1 (and its plan,
    which then does not fit) when even full offload does not. ``run.mode`` is offload.
    ``cost(F)`` (the overlap: its (device, host) exposed seconds): of the F that fit, the
    one whose larger is the smallest."""
    full = plan_job(run.at_fraction(1.0), hw)
    if not full.fits_device or 1 in moment_bytes(run.options):  # 8-bit: all on the host
        return 1.0, full
    chunks = full.ranks[0].shapes.chunks
    # DPU and remainders need a host share: keep at least one bucket there.
    o = run.options
    host_share = o.dpu_warmup_steps is not None or o.store_param_remainders
    top = len(chunks) - 1 if host_share else len(chunks)

    def plan(j: int) -> JobPlan:
        return plan_job(run.at_fraction(fraction_for(chunks, j)), hw)

    ok, bad = 0, top + 1  # ``ok`` fits the device; ``bad`` is the first known not to
    while bad - ok > 1:
        mid = (ok + bad) // 2
        ok, bad = (mid, bad) if plan(mid).fits_device else (ok, mid)
    if ok == 0 and cost is None:
        return 1.0, full
    if cost is not None:
        ok = least_exposed(lambda j: cost(fraction_for(chunks, j)), ok)  # (device, host)
    return fraction_for(chunks, ok), plan(ok) if ok else full


def least_exposed(parts, top: int) -> int:
    """The device bucket count j in [0, top] of the smallest ``max(*parts(j))``, where
    ``parts(j) = (device, host)``, device non-decreasing and host non-increasing in j;
    of equal costs the smallest j."""

    def first(pred, lo: int, hi: int) -> int:  # the first j in [lo, hi) with pred, else hi
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if pred(mid) else (mid + 1, hi)
        return lo

    cross = first(lambda j: parts(j)[0] >= parts(j)[1], 0, top + 1)
    best = min((j for j in (cross - 1, cross) if 0 <= j <= top), key=lambda j: max(parts(j)))
    cheapest = max(parts(best))
    # before the crossing the cost is the host part, which only falls: the first as cheap
    return first(lambda j: max(parts(j)) <= cheapest, 0, best)
