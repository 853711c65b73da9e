"""The publish in the throughput model: how long the next forward waits for the new params.

The optimizer (optimizer/zero.py) queues each host bucket's new params up on their own
stream in forward order, each bucket's all-gather right behind its copy, and a module's
forward waits only for its own buckets. The device share (the forward's first buckets)
is rounded and all-gathered on the compute stream before the forward. So the forward runs
behind the copies, not after them: the step is longer only where a copy or a gather falls
behind the forward. Per bucket j in forward order (the layout's reverse):

  up_j      = max(up_{j-1}, ready_j) + copy_j     the copies up, one after another (in
                                                  backward order for the overlap's worker)
  gather_j  = max(gather_{j-1}, up_j) + ag_j      the all-gathers, one FIFO (NCCL's stream)
  forward_j = max(forward_{j-1}, gather_j) + f_j  the forward over the bucket's layers

from forward_0 = ``start`` (the compute stream is free for the forward: the device share's
Adam, publish and gathers done, the training thread back) and gather_0 = ``gathers_from``
(the device share's gathers, first in the FIFO, or when the step issues the gathers).
``ready_j``: when host bucket j's new params are on the host (before 0, the end of
backward, for the overlap's speculative steps, whose copies leave during backward). The
forward's work is taken as even over the parameters, as backward's is in
overlap_schedule.py. The delay is forward_last - start - the forward's seconds: the sum
of the forward's waits.
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
    elements: int  # this rank's chunk of it


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


def forward_delay(buckets, ready, start: float, gathers_from: float = 0.0,
                  backward_order: bool = False) -> float:  # fmt: skip
    """Seconds the next forward ends later than if every param were in place at ``start``.
    ``ready``: when each host bucket's new params exist, in forward order; the copies go up
    one after another in that order (``backward_order``: in the reverse one, as the
    overlap's worker steps them), the gathers in forward order from ``gathers_from``."""
    host = [b for b in buckets if b.copy is not None]
    landed, t = [0.0] * len(host), float("-inf")
    for i in reversed(range(len(host))) if backward_order else range(len(host)):
        t = max(t, ready[i]) + host[i].copy
        landed[i] = t
    gathered, f, waited, j = gathers_from, start, 0.0, 0
    for b in buckets:
        if b.copy is not None:
            gathered = max(gathered, landed[j]) + b.gather
            j += 1
            waited += max(0.0, gathered - f)  # the forward reached the bucket before it
            f = max(f, gathered)
        f += b.forward
    return waited


def device_gathers(buckets) -> float:
    """The device share's all-gathers: on the compute stream, before the forward."""
    return sum(b.gather for b in buckets if b.copy is None)


def host_ready_in_turn(buckets, total: float) -> list[float]:
    """Each host bucket's new params, in forward order, when a CPU Adam of ``total``
    seconds steps them one after another in that order (the synchronous step)."""
    host = [b.elements for b in buckets if b.copy is not None]
    n, done, out = sum(host) or 1, 0, []
    for e in host:
        done += e
        out.append(total * done / n)
    return out
