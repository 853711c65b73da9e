"""The overlapped host step (``--overlap-cpu-optimizer``) in the throughput model.

With the overlap a host worker runs the CPU Adam on each host bucket as soon as its
gradient is final, during the last micro-batch's backward; at the end of backward the step
waits for the worker, commits (the global norm is known then) and queues every host
bucket's new params up (optimizer/schedules.py). So what the step waits for after
backward is what is left of the worker's queue; the copies up follow, and the next
forward runs behind them (planner/publish.py). Per bucket, in gradient (backward) order,
over the last backward of ``bwd`` seconds:

  computed   bwd * (the slice's elements up to and including bucket j) / the slice's:
             backward's work is taken as even over the parameters (the layout is in
             gradient order, so bucket j is complete once backward has passed its share)
  reduced    a FIFO on the DP link after it is computed: its share of the reduce-scatter
  landed     a FIFO on the copy stream after it is reduced: its chunk's copy down (host
             buckets; the device share's chunks stay on the device)
  stepped    a FIFO on the host worker after it landed: its last accumulation (the host
             sum of k > 1 micro-batches) and its CPU Adam; its new params go up then
             (``ends``: when, for planner/publish.py)

Exposed: the worker's end minus the end of backward. Hidden: the worker's seconds before
the end of backward. The worker *keeps up* when it is idle as the last host gradient
lands: all that is then exposed is the last bucket's own step, the floor of this layout
(the last bucket to arrive is a host bucket; DESIGN.md §8). Not modelled: replays (a step
that clips or overflows runs one more Adam pass over the host part, as the synchronous
step does), host contention between the worker and the compute thread.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Buckets:
    """One rank's buckets in gradient order: seconds each takes on each resource."""

    share: tuple[float, ...]  # its share of the slice's elements (sums to 1)
    host: tuple[bool, ...]  # on the host (else the device share: stepped at step time)
    reduce: tuple[float, ...]  # its reduce-scatter
    down: tuple[float, ...]  # its copy down (0: a device-share bucket)
    work: tuple[float, ...]  # the host worker's: last accumulation + CPU Adam (0: device)


@dataclass(frozen=True)
class Overlap:
    exposed: float  # seconds after the end of backward until the worker is done
    hidden: float  # seconds of host work done before the end of backward
    keeps_up: bool  # the worker is idle when the last host gradient lands
    ends: tuple[float, ...] = ()  # each host bucket's step done, from the end of backward


def buckets(chunks, device_from: int, reduce_s: float, down_s, work_s) -> Buckets:
    """``chunks``: elements per bucket in slice (gradient) order; from ``device_from`` on
    they are the device share (the last to arrive). ``reduce_s`` is the whole
    reduce-scatter's seconds; ``down_s``, ``work_s`` are seconds per host element."""
    total = sum(chunks) or 1
    host = [j < device_from for j in range(len(chunks))]
    per = lambda s: tuple(c * s if h else 0.0 for c, h in zip(chunks, host))  # noqa: E731
    return Buckets(
        tuple(c / total for c in chunks),
        tuple(host),
        tuple(reduce_s * c / total for c in chunks),
        per(down_s),
        per(work_s),
    )


def schedule(b: Buckets, bwd: float) -> Overlap:
    """The overlapped host step of one rank whose last backward takes ``bwd`` seconds."""
    done = reduced = landed = worker = 0.0
    steps, last_land, idle_at_last = [], None, True
    for share, host, rs, down, work in zip(b.share, b.host, b.reduce, b.down, b.work):
        done += share * bwd
        reduced = max(done, reduced) + rs
        landed = max(reduced, landed) + down
        if host:
            idle_at_last, last_land = worker <= landed, landed
            start = max(landed, worker)
            worker = start + work
            steps.append((start, worker))
    end = max(bwd, reduced, landed)  # the end of backward: every chunk landed
    hidden = sum(max(0.0, min(z, end) - a) for a, z in steps)
    exposed = max(0.0, worker - end)
    ends = tuple(z - end for _, z in steps)
    return Overlap(exposed, hidden, last_land is None or idle_at_last, ends)


def keeping_up_backward(b: Buckets, bwd: float) -> float:
    """The shortest last backward (seconds, within 0.1%) from which the worker keeps up:
    arrivals spread with backward's length while the host work stays, so the property
    holds from one length on; ``bwd`` is a length to start from."""
    if not any(b.host):  # the whole slice on the device: nothing to keep up with
        return 0.0
    lo, hi = 0.0, max(bwd, 1e-9)
    for _ in range(200):  # each doubling spreads the arrivals further apart
        if schedule(b, hi).keeps_up:
            break
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if schedule(b, mid).keeps_up else (mid, hi)
    return hi
