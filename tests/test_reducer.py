"""optimizer/reducer.py on its own, with recording sides: each bucket's chunk goes to the
side its route names, once per backward, equal to the bucket's gradients laid out (zero
padding); a bucket no gradient reached still goes; micro-batches arrive one by one, or
summed on the device as one; at DP > 1 the bucket is averaged and reduce-scattered (a
two-rank collective emulated behind its async contract) and handed over only after its
wait; the two pooled bucket buffers are reused only after their copy's event."""

import pytest
import torch
from zero_helpers import small_parts, tiny_zero

from mp_offload.optimizer import reducer as reducer_mod
from mp_offload.optimizer.placement import BUCKET_BUFFERS
from mp_offload.optimizer.reducer import GradientReducer
from mp_offload.optimizer.side import Micro
from mp_offload.optimizer.streams import HostStreams
from mp_offload.parallel_state import ParallelGroup

CPU = torch.device("cpu")
WHOLE = Micro(first=True, last=True, whole=True)


class FakeSide:
    """A side as the reducer sees it: logs every call and keeps each chunk it receives
    (a copy: the chunk is a pooled buffer); ``receive`` returns the copy's "event"."""

    def __init__(self, name: str, log: list):
        self.name, self.log, self.norm_parts, self.got = name, log, [], {}

    def wait(self):
        self.log.append((self.name, "wait"))

    def start_step(self):
        self.log.append((self.name, "start_step"))

    def launched(self, b, out, work, micro):
        if work is not None:
            work.bucket = b  # the emulated collective learns which bucket it reduces
        self.log.append((self.name, "launched", b.index))
        return ("token", b.index)

    def receive(self, b, out, token, micro):
        assert token == ("token", b.index), "the token of this bucket's launch"
        self.log.append((self.name, "receive", b.index, micro))
        self.got.setdefault(b.index, []).append(out.clone())
        return ("landed", b.index)

    def end_backward(self, micro):
        self.log.append((self.name, "end_backward", micro))


class ReuseLog(HostStreams):
    """HostStreams that notes every event a pooled buffer's reuse waits for."""

    def __init__(self):
        super().__init__()
        self.reused = []

    def before_reuse(self, event):
        self.reused.append(event)


def _grads(model, x, upto=None) -> dict:
    """Each parameter's gradient of the test loss, by name (autograd.grad: no hook runs)."""
    named = list(model.named_parameters())
    body = model if upto is None else model[:upto]
    loss = body(x).square().mean()
    got = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, got)}


def _laid_out(layout, grads: dict) -> dict:
    """Bucket index -> the bucket's gradients where its slots lie, zeros in the padding."""
    out = {}
    for b in layout.buckets:
        t = torch.zeros(b.numel)
        for s in b.slots:
            t[s.start - b.start :][: s.numel] = grads[s.name].reshape(-1)
        out[b.index] = t
    return out


def _inputs(seed: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))


def _reducer(layout, place, routes, dp=None, streams=None):
    dp = dp or ParallelGroup.single()
    return GradientReducer(layout, dp, CPU, place, routes, streams or HostStreams())


def test_each_bucket_reaches_its_route_once_as_its_gradients():
    model, layout, place, _ = small_parts()
    log = []
    a, b = FakeSide("a", log), FakeSide("b", log)
    routes = [(a, b)[i % 2] for i in range(len(layout.buckets))]  # the reducer follows these
    x = _inputs(1)
    want = _laid_out(layout, _grads(model, x))
    red = _reducer(layout, place, routes)
    red.start_step()
    model(x).square().mean().backward()  # a plain backward: finish is queued by a hook
    for bucket in layout.buckets:
        side, other = (a, b) if routes[bucket.index] is a else (b, a)
        assert len(side.got[bucket.index]) == 1 and bucket.index not in other.got
        assert torch.equal(side.got[bucket.index][0], want[bucket.index])
    receives = [e for e in log if e[1] == "receive"]
    assert {e[3] for e in receives} == {WHOLE} and len(receives) == len(layout.buckets)
    ends = [i for i, e in enumerate(log) if e[1] == "end_backward"]
    assert len(ends) == 2 and min(ends) > max(log.index(e) for e in receives)
    assert red.got_grad.tolist() == [1] * len(layout.slots)
    assert all(p.grad is None for p in model.parameters())  # no full-size gradient kept
    a.norm_parts = [torch.tensor(x, dtype=torch.float64) for x in (1.5, 2.0)]
    b.norm_parts = [torch.tensor(0.25, dtype=torch.float64)]
    assert float(red.norm_squared()) == 3.75  # the sides' parts, summed


def test_a_bucket_no_gradient_reached_still_goes_as_zeros():
    model, layout, place, _ = small_parts()
    side = FakeSide("s", [])
    red = _reducer(layout, place, [side] * len(layout.buckets))
    x = _inputs(2)
    want = _laid_out(layout, _grads(model, x, upto=3))  # the last Linear is unused
    red.start_step()
    model[:3](x).square().mean().backward()
    unused = {s.index for s in layout.slots if s.name.startswith("4.")}
    assert red.got_grad.tolist() == [int(i not in unused) for i in range(len(layout.slots))]
    for bucket in layout.buckets:  # every bucket, so every DP rank issues the same collectives
        assert torch.equal(side.got[bucket.index][0], want[bucket.index])
    assert not side.got[layout.slots[0].bucket][0].any()


def test_micro_batches_arrive_one_by_one_and_no_more_than_the_step_has():
    model, layout, place, _ = small_parts(micro_batches=2)
    log = []
    side = FakeSide("s", log)
    red = _reducer(layout, place, [side] * len(layout.buckets))
    red.start_step()
    xs = [_inputs(3), _inputs(4)]
    for x in xs:
        with pytest.raises(RuntimeError, match=r"optimizer step after \d of 2 backward calls"):
            red.norm_squared()
        model(x).square().mean().backward()
    micros = [e[3] for e in log if e[1] == "receive"]
    n = len(layout.buckets)
    assert micros == [Micro(True, False, False)] * n + [Micro(False, True, False)] * n
    for i, x in enumerate(xs):
        want = _laid_out(layout, _grads(model, x))
        for bucket in layout.buckets:
            assert torch.equal(side.got[bucket.index][i], want[bucket.index])
    with pytest.raises(RuntimeError, match="more backward calls than the 2 micro-batches"):
        model(xs[0]).square().mean().backward()


def test_device_accumulation_hands_over_the_sum_once():
    model, layout, place, _ = small_parts(micro_batches=2, accumulate_on_device=True)
    log = []
    side = FakeSide("s", log)
    red = _reducer(layout, place, [side] * len(layout.buckets))
    red.start_step()
    xs = [_inputs(5), _inputs(6)]
    model(xs[0]).square().mean().backward()
    assert not [e for e in log if e[1] in ("launched", "receive")]  # nothing reduced yet
    model(xs[1]).square().mean().backward()
    one, two = (_laid_out(layout, _grads(model, x)) for x in xs)
    assert [e[3] for e in log if e[1] == "receive"] == [WHOLE] * len(layout.buckets)
    for bucket in layout.buckets:
        assert len(side.got[bucket.index]) == 1
        assert torch.equal(side.got[bucket.index][0], one[bucket.index] + two[bucket.index])


class Work:
    """The async reduce-scatter of two ranks, done at ``wait``: this rank's chunk of its
    input plus the other rank's (as that rank sends it: already averaged)."""

    def __init__(self, out, data, rank, others, log):
        self.out, self.data, self.rank, self.others, self.log = out, data, rank, others, log
        self.bucket = None  # set by the side's ``launched`` (the reducer passes the work)

    def wait(self):
        self.log.append(("collective", "wait", self.bucket.index))
        total = self.data + self.others[self.bucket.index]
        self.out.copy_(total.view(2, -1)[self.rank])


@pytest.mark.parametrize("rank", [0, 1])
def test_two_ranks_average_and_each_gets_its_chunk_after_the_wait(rank, monkeypatch):
    model, layout, place, _ = small_parts(dp=2, dp_rank=rank)
    pg = object()  # stands for the process group: only handed to the collective
    log = []
    mine, theirs = _inputs(7 + rank), _inputs(8 - rank)
    own, other = _laid_out(layout, _grads(model, mine)), _laid_out(layout, _grads(model, theirs))
    sent = {i: t / 2 for i, t in other.items()}

    def reduce_scatter(out, data, group=None, async_op=False):
        assert group is pg and async_op and out.numel() * 2 == data.numel()
        return Work(out, data, rank, sent, log)

    monkeypatch.setattr(reducer_mod, "reduce_scatter_tensor", reduce_scatter)
    side = FakeSide("s", log)
    red = _reducer(layout, place, [side] * len(layout.buckets), ParallelGroup(2, rank, pg))
    red.start_step()
    model(mine).square().mean().backward()
    for bucket in layout.buckets:
        mean = own[bucket.index] / 2 + other[bucket.index] / 2
        assert torch.equal(side.got[bucket.index][0], mean.view(2, -1)[rank])
        waited = log.index(("collective", "wait", bucket.index))
        assert waited < next(i for i, e in enumerate(log) if e[1:3] == ("receive", bucket.index))


def test_the_two_bucket_buffers_are_reused_after_their_copy_only():
    model, layout, place, _ = small_parts()
    assert len(layout.buckets) > BUCKET_BUFFERS  # a third bucket must reuse a buffer
    streams = ReuseLog()
    red = _reducer(layout, place, [FakeSide("s", [])] * len(layout.buckets), streams=streams)
    red.start_step()
    model(_inputs(9)).square().mean().backward()
    assert red.source.num_buffers == BUCKET_BUFFERS
    assert streams.reused and set(streams.reused) <= {("landed", b.index) for b in layout.buckets}
    buf = place.buffer("grad_buckets")
    assert red.buffer_bytes() == dict(grad_buckets=buf.numel * 4 * BUCKET_BUFFERS)


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])
def test_the_optimizer_routes_each_bucket_to_the_side_that_owns_it(fraction):
    _, opt = tiny_zero(offload_fraction=fraction, bucket_size=900)
    first, end = opt.placement.device_range
    for b in opt.layout.buckets:
        side = opt.device_side if first <= b.index < end else opt.host_side
        assert opt.reducer.routes[b.index] is side
    assert {id(s) for s in opt.reducer.sides} == {id(s) for s in opt.sides}
