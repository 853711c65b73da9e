"""The publish in the throughput model: how long the next forward waits for the new params.

The optimizer (optimizer/zero.py) queues each host bucket's new params up on their own
stream in forward order, each bucket's all-gather right behind its copy, and a module's
forward waits only for its own buckets. The device share (the forward's first buckets)
is rounded and all-gathered on the compute stream before the forward. So the forward runs
behind the copies, not after them: the step is longer only where a copy or a gather falls
behind the forward. Per bucket j in forward order (the layout's reverse):

  up_j      = max(up_{j-1}, ready_j) + copy_j     the copies up, one after another
  gather_j  = max(gather_{j-1}, up_j) + ag_j      the all-gathers, one FIFO (NCCL's stream)
  forward_j = max(forward_{j-1}, gather_j) + f_j  the forward over the bucket's layers

from forward_0 = ``start`` (the compute stream is free for the forward: the device share's
Adam, publish and gathers done, the training thread back) and gather_0 = ``gathers_from``
(the device share's gathers, first in the FIFO). ``ready_j``: when bucket j's new params
are on the host. The forward's work is taken as even over the parameters, as backward's
is in overlap_schedule.py. The delay is forward_last - start - the forward's seconds: the
sum of the forward's waits.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bucket:
    """One bucket of a rank, in seconds: its layers' share of one forward, its share of the
    all-gather, and its copy up (None: a device-share bucket, published on the device)."""

    forward: float
    gather: float
    copy: float | None
    elements: int  # this rank's chunk of it (a host bucket's share of the CPU Adam)


def forward_order(chunks, device_from: int, forward: float, gather: float, copy_s: float):
    """``chunks``: this rank's elements per bucket in gradient order, from ``device_from``
    on the device share; ``forward``/``gather``: the whole forward's and all-gather's
    seconds; ``copy_s``: seconds per host element up. Returns the buckets in forward order."""
    total = sum(chunks) or 1
    out = []
    for j in reversed(range(len(chunks))):
        c = chunks[j]
        host = j < device_from
        out.append(Bucket(forward * c / total, gather * c / total, c * copy_s if host else None, c))
    return out


def forward_delay(buckets, ready, start: float, gathers_from: float = 0.0) -> float:
    """Seconds the next forward ends later than if every param were in place at ``start``.
    ``ready(elements)``: when the host buckets' new params up to that many elements (in
    forward order) exist; the device share's gathers end at ``gathers_from``."""
    up, gathered, f, host_done, waited = 0.0, gathers_from, start, 0, 0.0
    for b in buckets:
        if b.copy is not None:
            host_done += b.elements
            up = max(up, ready(host_done)) + b.copy
            gathered = max(gathered, up) + b.gather
            waited += max(0.0, gathered - f)  # the forward reached the bucket before it
            f = max(f, gathered)
        f += b.forward
    return waited


def device_gathers(buckets) -> float:
    """The device share's all-gathers: on the compute stream, before the forward."""
    return sum(b.gather for b in buckets if b.copy is None)
