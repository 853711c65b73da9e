"""The CUDA ordering of the offload path, checked on the CPU (``stream_checker``): the
production ``CudaStreams`` under a fake ``torch.cuda`` whose copies land late. Every
legal offload mode, placed as on a GPU, runs race-free and equals the synchronous CPU
run bit for bit; each ordering mistake injected into the production code is caught with
its call site: a removed ``wait_stream`` or ``record_stream``, a missing upload wait
before a staging rewrite, a bucket buffer reused before its copy's event, a missing
drain before the Adam reads the staging, an accumulator that does not wait for the
copy's event; and a host kernel handed device memory."""

import inspect
import re
import textwrap
import threading

import pytest
import torch
from helpers import tiny_gpt_config
from stream_checker import RaceStreams, StreamRace, gpu_placement
from zero_helpers import build_zero, mode_id

from mp_offload import parallel_state as ps
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.optimizer import host_accumulator, host_side, reducer, schedules
from mp_offload.optimizer.options import legal_modes
from mp_offload.optimizer.streams import CudaStreams

SINGLE = ps.ParallelGroup.single()
HP = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=0.0)
OFFLOAD = [o for o in legal_modes(bucket_size=900) if o.offloaded]


def _run(options, streams=None, steps=3, clip=0.0):
    if streams is not None:
        with gpu_placement():
            return _run_on(options, streams, steps, clip)
    return _run_on(options, None, steps, clip)


def _run_on(options, streams, steps, clip):
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**tiny_gpt_config()), tp_group=SINGLE)
    hp = dict(HP, clip_grad=clip)
    opt = build_zero(model, **hp, dp=SINGLE, tp=SINGLE, device="cpu", options=options,
                     streams=streams)  # fmt: skip
    if streams is not None:
        streams.watch(model)  # a forward that reads weights still in flight fails
        streams.attach(opt)  # which bucket's weights a copy up writes
    g = torch.Generator().manual_seed(1)
    vocab, seq = model.cfg.vocab_size if hasattr(model, "cfg") else 64, 16
    k = options.micro_batches
    for _ in range(steps):
        opt.zero_grad(lr=HP["lr"])
        for _ in range(k):
            t = torch.randint(0, min(vocab, 64), (2, seq + 1), generator=g)
            low = options.dtype != torch.float32
            with torch.autocast("cpu", dtype=options.dtype, enabled=low):
                opt.backward(model(t[:, :-1], t[:, 1:]).float().mean() / k)
        opt.step()
    opt.flush()
    return opt.flat.clone()


@pytest.mark.parametrize("options", OFFLOAD, ids=mode_id)
def test_every_offload_mode_is_race_free_and_equals_the_synchronous_run(options):
    checker = RaceStreams()
    late = _run(options, checker)
    assert checker.landed > 0 and checker.orders > 0
    assert checker.ups > 0, "the params go up from a host staging, as on a GPU"
    assert torch.equal(late, _run(options)), "late copies changed the result"


BF16 = next(o for o in OFFLOAD if o.dtype == torch.bfloat16 and o.micro_batches == 1
            and o.offload_fraction == 1 and not o.overlap_cpu_optimizer
            and o.dpu_warmup_steps is None and not o.store_param_remainders
            and o.exp_avg_dtype == torch.float32)  # fmt: skip
FP32 = next(o for o in OFFLOAD if o.dtype == torch.float32 and o.micro_batches == 1
            and o.offload_fraction == 1 and not o.overlap_cpu_optimizer
            and o.dpu_warmup_steps is None and o.exp_avg_dtype == torch.float32)  # fmt: skip
HOST_SUMS = next(o for o in OFFLOAD if o.dtype == torch.bfloat16 and o.micro_batches == 2
                 and not o.accumulate_on_device and o.offload_fraction == 1
                 and not o.overlap_cpu_optimizer and o.dpu_warmup_steps is None
                 and not o.store_param_remainders and o.exp_avg_dtype == torch.float32)  # fmt: skip


def _caught(options, match):
    """The run fails with a ``StreamRace`` that says ``match`` (on the training thread, or
    on a worker, then re-raised there as the cause of the worker's failure)."""
    with pytest.raises((StreamRace, RuntimeError)) as e:
        _run(options, RaceStreams())
    race = e.value
    while race is not None and not isinstance(race, StreamRace):
        race = race.__cause__
    assert race is not None, f"not a stream race: {e.value!r}"
    assert re.search(match, str(race)), race


def _without(method, statement: str, instead: str = "pass"):
    """``method`` compiled from its production source with the line that is
    ``statement`` (its comment aside) made ``instead``: the mistake is made in the real
    code, at its real line numbers."""
    lines, first = inspect.getsourcelines(method)
    lines = textwrap.dedent("".join(lines)).splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.split("#")[0].strip() == statement]
    assert len(hits) == 1, f"{statement!r} is not a line of {method.__qualname__}"
    indent = lines[hits[0]][: len(lines[hits[0]]) - len(lines[hits[0]].lstrip())]
    lines[hits[0]] = indent + instead + "\n"
    code = "\n" * (first - 1) + "".join(lines)
    scope: dict = {}
    exec(compile(code, inspect.getsourcefile(method), "exec"), method.__globals__, scope)
    return scope[method.__name__]


def _copy_line() -> int:
    """The line of ``CudaStreams.copy_down``'s copy: the site a report must name."""
    lines, first = inspect.getsourcelines(CudaStreams.copy_down)
    return first + next(i for i, line in enumerate(lines) if "dst.copy_(src" in line)


WAIT_STREAM = "self.stream.wait_stream(compute)"
RECORD_STREAM = "src.record_stream(self.stream)"


class _Collective:
    def wait(self):  # gloo: done on the host; NCCL: the current stream waits for it
        pass


def _bucket_through_the_seam(streams, after=None) -> None:
    """One bucket's copy down as the reducer and the host side drive it (after the
    reduce-scatter ``after`` with DP > 1)."""
    bucket, stage = torch.arange(8.0), torch.zeros(8)
    landed = streams.copy_down(stage, bucket, after=after)
    assert stage.isnan().all(), "a copy down is late until something orders it"
    streams.wait(landed)  # the host worker
    streams.host_access(reads=(stage,))
    streams.before_reuse(landed)
    bucket.fill_(-1.0)  # the next bucket
    assert torch.equal(stage, torch.arange(8.0))


@pytest.mark.parametrize("statement", [WAIT_STREAM, RECORD_STREAM])
def test_the_seam_is_green_under_the_fake_until_a_statement_is_removed(monkeypatch, statement):
    _bucket_through_the_seam(RaceStreams())
    monkeypatch.setattr(CudaStreams, "copy_down", _without(CudaStreams.copy_down, statement))
    with pytest.raises(StreamRace, match=f"streams.py:{_copy_line()} "):
        _bucket_through_the_seam(RaceStreams())


def test_a_collectives_wait_orders_the_copy_without_wait_stream(monkeypatch):
    real = CudaStreams.copy_down
    monkeypatch.setattr(CudaStreams, "copy_down", _without(real, WAIT_STREAM))
    _bucket_through_the_seam(RaceStreams(), after=_Collective())  # DP > 1: no wait_stream
    monkeypatch.setattr(CudaStreams, "copy_down", _without(real, "after.wait()"))
    with pytest.raises(StreamRace, match="did not wait for the compute stream"):
        _bucket_through_the_seam(RaceStreams(), after=_Collective())


def test_a_worker_threads_wait_lands_only_what_its_event_covers():
    streams = RaceStreams()
    first, second = torch.arange(4.0), torch.arange(4.0) + 10
    got_first, got_second = torch.zeros(4), torch.zeros(4)
    landed = streams.copy_down(got_first, first)
    streams.copy_down(got_second, second)
    worker = threading.Thread(target=streams.wait, args=(landed,))
    worker.start()
    worker.join()
    assert torch.equal(got_first, first) and got_second.isnan().all()
    with pytest.raises(StreamRace, match="read the destination of the copy down"):
        streams.host_access(reads=(got_second,))


def _schedule(name):
    base = dict(dtype=torch.bfloat16, micro_batches=1, offload_fraction=1,
                store_param_remainders=False, exp_avg_dtype=torch.float32)  # fmt: skip
    want = dict(sync=(False, None), dpu=(False, 1), overlap=(True, None))[name]
    return next(o for o in OFFLOAD if all(getattr(o, k) == v for k, v in base.items())
                and (o.overlap_cpu_optimizer, o.dpu_warmup_steps) == want)  # fmt: skip


@pytest.mark.parametrize("name", ["sync", "dpu"])
def test_the_forward_starts_behind_the_first_buckets_upload_not_behind_all(name):
    """The copies up go in forward order on their own stream; a module's forward waits
    only for its own buckets: the next forward starts while later buckets are still in
    flight (the checker's forward hooks count them), race-free and bitwise the CPU's."""
    checker = RaceStreams()
    late = _run(_schedule(name), checker)
    assert max(checker.in_flight) > 0, "every upload had landed before the forward began"
    offsets = checker.fake.up_offsets
    bursts = [[]]  # one per publish: forward order is falling flat offsets (reverse layout)
    for a, b in zip(offsets, offsets[1:] + [None]):
        bursts[-1].append(a)
        if b is not None and b >= a:
            bursts.append([])
    assert len(bursts) >= 3 and all(len(x) > 1 for x in bursts), bursts
    assert torch.equal(late, _run(_schedule(name))), "late copies changed the result"


def test_the_overlaps_copies_up_leave_during_backward(monkeypatch):
    """With the overlap each bucket's new params go up from the worker as soon as its
    speculative step is done, during backward: at the step every host bucket is up
    already (queued behind its copy down, race-free), and the result is the CPU's."""
    checker, at_step = RaceStreams(), []
    real = host_side.HostSide.swap_states

    def swap_states(self):  # the step, once the worker is done: before any copy up of its own
        at_step.append((len(checker.fake.up_offsets), len(self.pieces)))
        return real(self)

    monkeypatch.setattr(host_side.HostSide, "swap_states", swap_states)
    late = _run(_schedule("overlap"), checker)
    ups = [n for n, _ in at_step]
    pieces = at_step[0][1]
    assert ups == [pieces * (i + 1) for i in range(len(ups))], (ups, pieces)
    monkeypatch.undo()
    assert torch.equal(late, _run(_schedule("overlap"))), "late copies changed the result"


OVERLAP = _schedule("overlap")
REPLAYS = 1e-3  # a clip threshold far below the norm: the overlap replays every step


def test_the_overlaps_replay_goes_up_again_behind_the_speculations_copies():
    """Clipping every step: the speculation is recomputed and its params go up again,
    after the speculation's copies up have read the staging the replay rewrites."""
    checker = RaceStreams()
    late = _run(OVERLAP, checker, clip=REPLAYS)
    assert torch.equal(late, _run(OVERLAP, clip=REPLAYS)), "late copies changed the result"


def test_a_replay_that_does_not_wait_for_the_speculations_copies_is_caught(monkeypatch):
    wait = "self.host.streams.wait(new.uploaded)"
    monkeypatch.setattr(schedules.Overlapped, "step", _without(schedules.Overlapped.step, wait))
    with pytest.raises((StreamRace, RuntimeError)) as e:
        _run(OVERLAP, RaceStreams(), clip=REPLAYS)
    assert re.search("wrote the source of the copy up .* before waiting", str(e.value))


# ------------------------------------------------------------ injected mistakes
def _caught_at_the_copy(options, match):
    """Caught, naming the seam's copy and the host side's call that issued it."""
    site = rf"optimizer/streams.py:{_copy_line()} \(copy_down\) called from "
    _caught(options, site + r"optimizer/host_side.py:\d+ \(_queue_down\)" + match)


def test_a_removed_wait_stream_is_caught(monkeypatch):
    monkeypatch.setattr(CudaStreams, "copy_down", _without(CudaStreams.copy_down, WAIT_STREAM))
    _caught_at_the_copy(BF16, ".*did not wait for the compute stream")


def test_a_removed_record_stream_is_caught(monkeypatch):
    monkeypatch.setattr(CudaStreams, "copy_down", _without(CudaStreams.copy_down, RECORD_STREAM))
    _caught_at_the_copy(BF16, ".*not recorded on the copy's stream")


@pytest.mark.parametrize("options", [BF16, FP32], ids=["param-staging", "fp32-master"])
def test_a_missing_upload_wait_before_a_staging_rewrite_is_caught(monkeypatch, options):
    real = host_side.HostSide.step

    def no_wait(self, hyper, upload, grad=None):
        self.states[0].uploaded = None  # as if the step did not wait for its copies up
        return real(self, hyper, upload, grad)

    monkeypatch.setattr(host_side.HostSide, "step", no_wait)
    _caught(options, "wrote the source of the copy up")  # fp32: the master itself goes up


def test_a_bucket_buffer_reused_before_its_copy_is_caught(monkeypatch):
    monkeypatch.setattr(reducer.BucketBuffers, "_take", _take_without_waiting)
    _caught(BF16, "rewritten before it landed")


def _take_without_waiting(self, pending):
    if not self._pool and pending and self.num_buffers >= reducer.BUCKET_BUFFERS:
        self._drain_one()
    if self._pool:
        return self._pool.pop()[0]  # the copy's event is dropped: no before_reuse
    self.num_buffers += 1
    return torch.empty(self.max_bucket, dtype=self.dtype, device=self.device)


def test_a_missing_drain_before_the_adam_reads_the_staging_is_caught(monkeypatch):
    monkeypatch.setattr(host_side.HostSide, "end_backward", lambda self, micro: self.wait())
    _caught(BF16, "read the destination of the copy down")


def test_an_accumulator_that_does_not_wait_for_the_copy_is_caught(monkeypatch):
    real = host_accumulator.HostAccumulator.submit
    monkeypatch.setattr(
        host_accumulator.HostAccumulator, "submit", lambda self, work, ready=None: real(self, work)
    )
    _caught(HOST_SUMS, "read the destination of the copy down")


def test_a_host_kernel_handed_device_memory_is_caught(monkeypatch):
    # the host sum reads the reduced chunk on the device instead of its staging copy
    own = "job = self._accumulate(b, self.grads[lo : lo + b.chunk], stage, micro)"
    wrong = _without(host_side.HostSide._queue_down, own, own.replace("stage", "out"))
    monkeypatch.setattr(host_side.HostSide, "_queue_down", wrong)
    _caught(HOST_SUMS, r"handed device memory \(the source of the copy down at")


# Every other ordering statement of the seam, removed, is caught in a run too.
ORDERING = [
    ("copy_down", "done.record(self.stream)", "HOST_SUMS", "read the destination of the copy"),
    ("before_reuse", "self.cuda.current_stream().wait_event(event)", "BF16", "rewritten before"),
    ("drain", "done.record(self.stream)", "BF16", "read the destination of the copy down"),
    ("drain", "done.synchronize()", "BF16", "read the destination of the copy down"),
    (
        "open_uploads",
        "self.up.wait_stream(self.cuda.current_stream())",
        "BF16",
        "copy up .* may overwrite the weights before the compute stream's reads",
    ),
    ("copy_up", "done.record(self.up)", "BF16", "read weights before their copy up"),
    (
        "wait_upload",
        "self.cuda.current_stream().wait_event(event)",
        "BF16",
        "read weights before their copy up",
    ),
    (
        "copy_up",
        "self.up.wait_event(after)",
        "OVERLAP",
        "copy up .* may overwrite the weights before the compute stream's reads",
    ),
]


@pytest.mark.parametrize("method, statement, options, match", ORDERING)
def test_each_ordering_statement_of_the_seam_is_needed(monkeypatch, method, statement, options,
                                                        match):  # fmt: skip
    cut = _without(getattr(CudaStreams, method), statement)
    monkeypatch.setattr(CudaStreams, method, cut)
    _caught(globals()[options], match)
