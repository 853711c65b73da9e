"""optimizer/schedules.py through recording fake sides: when each side steps and when the
params are published. Synchronous: the device side steps and publishes first (its buckets
are the forward's first), then the host steps (uploading), then its publish, at the step.
Delayed: synchronous for the warm-up steps, then the host's Adam of step t on its own
thread, reading that step's gradient buffer while backward t+1 gets the other, published
at step t+1 or at ``flush`` (and a failure there named). Overlapped: each host bucket
stepped speculatively once its gradient is final; at the step the states swap, the pieces
are recomputed only if the real hyperparameters differ, and an overflow puts the params
back."""

import threading
from functools import partial

import pytest
import torch
from helpers import HANG_TIMEOUT

from mp_offload.optimizer.options import OptimizerOptions
from mp_offload.optimizer.schedules import Delayed, Overlapped, Synchronous, schedule_for


class Streams:
    def __init__(self, log):
        self.log = log

    def bind_thread(self):
        self.log.append(("host", "bind_thread", threading.current_thread().name))

    def wait(self, event):
        self.log.append(("host", "streams.wait", event))


class Bucket:
    def __init__(self, index):
        self.index = index


class Piece:
    def __init__(self, index):
        self.bucket = Bucket(index)


class State:
    def __init__(self, name):
        self.name, self.uploaded = name, f"{name} uploaded"


class FakeDevice:
    def __init__(self, log):
        self.log = log

    def step(self, hyper):
        self.log.append(("device", "step", hyper))


class FakeHost:
    """The host side's face as the schedules use it, every call logged; ``gate``: its
    ``step`` waits for it (to show the caller does not)."""

    def __init__(self, log, buckets=(0, 1, 2)):
        self.log, self.streams = log, Streams(log)
        self.grad_buffers = ["grads A", "grads B"]
        self.pieces = [Piece(i) for i in reversed(buckets)]
        self.by_bucket = {p.bucket.index: p for p in self.pieces}
        self.states = [State("live"), State("spare")]
        self.on_final, self.defer_wait, self.gate, self.fail = None, False, None, None
        self.reads_staging = True  # k = 1: the host's norm is the device's

    @property
    def adam_grads(self):
        return self.grad_buffers[0]

    def alternate_grads(self):
        self.grad_buffers.reverse()
        self.log.append(("host", "alternate_grads"))

    def step(self, hyper, upload, grad=None):
        if self.gate is not None:
            assert self.gate.wait(HANG_TIMEOUT)  # a guard against a hang only
        if self.fail is not None:
            raise self.fail
        thread = threading.current_thread().name
        self.log.append(("host", "step", hyper, upload, grad or self.adam_grads, thread))

    def start_worker(self):
        self.log.append(("host", "start_worker"))

    def wait(self):
        self.log.append(("host", "wait"))

    def step_piece(self, p, hyper, src, dst, grad):
        self.log.append(("host", "step_piece", p.bucket.index, hyper, src.name, dst.name))

    def swap_states(self):
        self.states.reverse()
        self.log.append(("host", "swap_states"))

    def upload(self, p, state, gather=True, after=None):
        """Logs (bucket, the state it goes up from or None: only its gather, gather, after);
        returns its event."""
        name = None if state is None else state.name
        self.log.append(("host", "upload", p.bucket.index, name, gather, after))
        return f"upload {p.bucket.index} from {name}"

    def open_uploads(self):
        self.log.append(("host", "open_uploads"))

    def mark_uploaded(self):
        self.log.append(("host", "mark_uploaded"))

    def restore_params(self):
        self.log.append(("host", "restore_params"))


def _sides():
    log = []
    return log, FakeDevice(log), FakeHost(log), partial(_publish, log)


def _publish(log, uploaded=False, device=True, host=True):
    log.append(("publish", uploaded, "both" if device and host else "device" if device else "host"))


def _steps(log):
    """The log less the host's bookkeeping: who stepped, and the publishes."""
    return [e[:2] for e in log if e[0] in ("device", "publish") or e[1] in ("step", "upload")]


def test_synchronous_steps_the_device_then_the_host_then_publishes():
    log, dev, host, publish = _sides()
    sched = Synchronous(dev, host, publish)
    sched.begin(0, 1.0)
    sched.end_backward()
    sched.step("h1", 1)
    assert log == [
        ("device", "step", "h1"),
        ("publish", False, "device"),  # its gathers first in line
        ("host", "step", "h1", True, "grads A", threading.current_thread().name),
        ("publish", True, "host"),  # the host queued each bucket's copy up as it went
    ]
    sched.flush()  # nothing in flight
    assert len(log) == 4
    Synchronous(None, host, publish).step("h2", 2)  # a side may be absent
    Synchronous(dev, None, publish).step("h3", 3)
    assert [e[:3] for e in log[4:]] == [
        ("host", "step", "h2"),
        ("publish", True, "host"),
        ("device", "step", "h3"),
        ("publish", False, "device"),
        ("publish", True, "host"),
    ]


def test_delayed_runs_the_host_step_behind_the_next_step_and_publishes_it_there():
    log, dev, host, publish = _sides()
    sched = Delayed(dev, host, publish, warmup_steps=1)
    sched.step("h1", 1)  # the warm-up: synchronous
    assert _steps(log) == [("device", "step"), ("publish", False), ("host", "step"),
                           ("publish", True)]  # fmt: skip
    del log[:]
    host.gate = threading.Event()
    sched.step("h2", 2)  # returns while the host's Adam waits on its thread
    mine = [e for e in log if e[1] != "bind_thread"]  # (the thread binds when it starts)
    assert mine == [("device", "step", "h2"), ("host", "alternate_grads")]
    assert host.adam_grads == "grads B"  # backward t+1 writes the other buffer
    host.gate.set()
    sched.step("h3", 3)  # step 2 is joined and published first, then step 3 goes
    sched.flush()  # the end of the run (or a save): step 3's params go up
    assert log.count(("host", "bind_thread", "dpu-adam")) == 2
    host_steps = [e[2:] for e in log if e[:2] == ("host", "step")]
    assert host_steps == [
        ("h2", False, "grads A", "dpu-adam"),
        ("h3", False, "grads B", "dpu-adam"),
    ]
    seen = [
        e[:3] for e in log if e[:2] in (("host", "step"), ("device", "step")) or e[0] == "publish"
    ]
    assert seen == [
        ("device", "step", "h2"),
        ("host", "step", "h2"),
        ("publish", False, "both"),  # step 2's params, before step 3's device step
        ("device", "step", "h3"),
        ("host", "step", "h3"),
        ("publish", False, "both"),
    ]
    sched.flush()  # nothing left in flight
    assert log.count(("publish", False, "both")) == 2


def test_a_failed_delayed_step_is_named_and_publishes_nothing():
    log, dev, host, publish = _sides()
    sched = Delayed(dev, host, publish, warmup_steps=0)
    host.fail = ValueError("no memory")
    sched.step("h1", 1)
    with pytest.raises(RuntimeError, match="delayed .DPU. optimizer step failed: ValueError"):
        sched.flush()
    assert not [e for e in log if e[0] == "publish"]
    sched.flush()  # the failure is reported once


def _overlapped(scale=4.0):
    log, dev, host, publish = _sides()
    asked = []

    def hyper_of(grad_scale, stepped=None):
        asked.append(grad_scale)
        return ("spec", grad_scale)

    sched = Overlapped(dev, host, publish, hyper_of)
    sched.begin(0, scale)
    return log, host, sched, asked


def _speculate(host, sched):
    """Backward: each bucket's gradient becomes final; the worker runs its job."""
    assert host.on_final == sched.work and host.defer_wait
    for i in (2, 1, 0, 7):  # 7: a bucket the host does not hold (an empty chunk)
        host.on_final(Bucket(i), f"landed {i}")()
    sched.end_backward()


def test_overlapped_speculates_each_bucket_and_swaps_when_the_guess_holds():
    log, host, sched, asked = _overlapped()
    assert ("host", "start_worker") in log  # a real worker thread, on the CPU too
    _speculate(host, sched)
    assert asked == [0.25]  # unscaled, unclipped: asked once, at the first bucket
    spec = [e for e in log if e[1] == "step_piece"]
    assert spec == [("host", "step_piece", i, ("spec", 0.25), "live", "spare") for i in (2, 1, 0)]
    assert ("host", "streams.wait", "spare uploaded") in log  # its staging's last copy up
    # each bucket's new params go up as soon as it is stepped, behind its copy down
    ups = [e[2:] for e in log if e[1] == "upload"]
    assert ups == [(i, "spare", False, f"landed {i}") for i in (2, 1, 0)]
    assert host.states[1].uploaded == "upload 0 from spare"  # the staging's last reader
    del log[:]
    sched.step(("spec", 0.25), 1)  # the real step is the guess: no recomputation
    assert [e[:3] for e in log] == [
        ("device", "step", ("spec", 0.25)),
        ("publish", False, "device"),
        ("host", "wait"),  # k = 1: after the device's Adam is queued, which runs beside
        ("host", "swap_states"),
    ] + [("host", "upload", i) for i in (2, 1, 0)] + [("publish", True, "host")]
    assert all(e[3:5] == (None, True) for e in log if e[1] == "upload")  # up: only gathers
    assert sched.stats()["overlap_replays"] == 0 and sched.stats()["replayed"] == 0


def test_overlapped_waits_for_the_worker_at_the_end_of_backward_when_it_sums_the_norm():
    log, host, sched, _ = _overlapped()
    host.reads_staging = False  # k > 1 on the host: the worker's sums give the host's norm
    _speculate(host, sched)
    assert log[-1] == ("host", "wait")  # before the global norm is taken
    sched.step(("spec", 0.25), 1)
    assert log.count(("host", "wait")) == 1
    after = [e[:2] for e in log[log.index(("host", "wait")) :]]
    assert after.index(("device", "step")) < after.index(("host", "swap_states"))


def test_overlapped_recomputes_from_the_committed_copy_when_the_step_differs():
    log, host, sched, _ = _overlapped()
    _speculate(host, sched)
    del log[:]
    sched.step(("clipped", 0.1), 1)
    redo = [e for e in log if e[1] == "step_piece"]
    # From the committed copy ("live", the spare after the swap) into the new one.
    assert redo == [("host", "step_piece", i, ("clipped", 0.1), "live", "spare") for i in (2, 1, 0)]
    # first the wait for the speculation's copies up (they read the staging rewritten now),
    # then each recomputed piece goes up again
    assert log.index(("host", "streams.wait", "upload 0 from spare")) < log.index(redo[0])
    ups = [e[2:5] for e in log if e[1] == "upload"]
    assert ups == [(i, "spare", True) for i in (2, 1, 0)]
    assert sched.stats()["overlap_replays"] == 1 and sched.stats()["replayed"] == 1
    assert log[-1] == ("publish", True, "host")


def test_overlapped_refuses_a_bucket_never_stepped_and_an_overflow_restores():
    log, host, sched, _ = _overlapped()
    host.on_final(Bucket(2))()
    sched.end_backward()
    with pytest.raises(RuntimeError, match=r"overlap: buckets \[0, 1\] were never stepped"):
        sched.step(("spec", 0.25), 1)
    sched.skip()  # fp16 overflow: the speculation's in-place params are put back
    back = log[log.index(("host", "restore_params")) :]
    assert [e[:4] for e in back] == [("host", "restore_params"), ("host", "open_uploads")] + [
        ("host", "upload", i, "live") for i in (2, 1, 0)
    ] + [("host", "mark_uploaded")]  # and those it sent up, from the committed state
    assert not [e for e in log if e[0] == "publish" and e[2] != "device"]  # nothing went up


@pytest.mark.parametrize(
    "fields, kind",
    [
        (dict(), Synchronous),
        (dict(cpu_offload=False), Synchronous),
        (dict(dpu_warmup_steps=3), Delayed),
        (dict(overlap_cpu_optimizer=True), Overlapped),
    ],
)
def test_the_options_pick_the_schedule(fields, kind):
    _, dev, host, publish = _sides()
    sched = schedule_for(OptimizerOptions(dtype=torch.bfloat16, **fields), dev, host, publish,
                         lambda s, stepped=None: None)  # fmt: skip
    assert type(sched) is kind
    if kind is Delayed:
        assert sched.warmup_steps == 3
