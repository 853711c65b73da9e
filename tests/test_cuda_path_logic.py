"""The CUDA path's logic, shown on the CPU: which device threads bind, exact pinned sizes,
the copy stream's order, nothing crossing to the host without offload, DPU failures."""

import contextlib
import threading
import weakref

import pytest
import torch
from dist_helpers import run_distributed
from zero_helpers import build_zero, host_tensor, live, wrap_adam

from mp_offload import parallel_state as ps
from mp_offload.data.loader import BatchIterator, MockGPTDataset, SizedPlaceholder
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.ops.cpu_adam import split_fp32
from mp_offload.optimizer import host_memory, zero
from mp_offload.optimizer import streams as streams_mod
from mp_offload.optimizer.host_accumulator import HostAccumulator
from mp_offload.optimizer.layout import FlatLayout
from mp_offload.optimizer.streams import HostStreams
from mp_offload.training import train_step

CFG = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=96,
    make_vocab_size_divisible_by=8,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
HP = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=0.5)
SINGLE = ps.ParallelGroup.single()


def _model():
    torch.manual_seed(0)
    return GPTModel(GPTConfig(**CFG), tp_group=SINGLE)


def _tokens(step=0, n=4):
    data = MockGPTDataset(64, 16, 96, seed=2)
    return torch.stack([torch.from_numpy(data[step * n + i]["text"]) for i in range(n)])


def _loss(model, step=0):
    t = _tokens(step)
    return model(t[:, :-1], t[:, 1:]).mean()


def _step(model, opt, step=0):
    """One optimizer step over ``_tokens(step)``, as the training loop takes it."""
    return train_step(model, opt, iter([_tokens(step)]), 1, 1e-3, SINGLE, torch.device("cpu"))


def test_accumulator_thread_binds_the_rank_device(monkeypatch):
    seen = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: seen.append((threading.current_thread().name, d))
    )
    acc = HostAccumulator(HostStreams(torch.device("cuda", 3)))
    dst = torch.zeros(4)
    acc.submit(lambda: dst.add_(torch.ones(4)))
    acc.wait()
    assert seen == [("host-grad-accumulate", torch.device("cuda", 3))]
    assert torch.equal(dst, torch.ones(4))


def test_accumulator_thread_that_cannot_bind_fails_wait_not_hangs(monkeypatch):
    def refuse(d):
        raise RuntimeError("invalid device ordinal")

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    acc = HostAccumulator(HostStreams(torch.device("cuda", 9)))
    acc.submit(lambda: None)
    with pytest.raises(RuntimeError, match="host gradient accumulation failed"):
        acc.wait()


def test_dpu_thread_binds_the_optimizer_device(monkeypatch):
    seen = []
    monkeypatch.setattr(
        streams_mod,
        "set_thread_device",
        lambda d: seen.append((threading.current_thread().name, d)),
    )
    model = _model()
    opt = build_zero(
        model,
        **HP,
        dp=SINGLE,
        tp=SINGLE,
        device="cpu",
        dtype=torch.bfloat16,
        cpu_offload=True,
        dpu_warmup_steps=0,
    )
    _step(model, opt)
    opt.flush()
    assert seen == [("dpu-adam", torch.device("cpu"))]


def test_dpu_failure_stops_the_run_and_publishes_nothing():
    model = _model()
    opt = build_zero(
        model,
        **HP,
        dp=SINGLE,
        tp=SINGLE,
        device="cpu",
        dtype=torch.bfloat16,
        cpu_offload=True,
        dpu_warmup_steps=1,
    )
    for step in range(2):  # one synchronous step, then the first delayed one
        if step == 1:

            def broken(*a, **k):
                raise ValueError("kernel exploded")

            wrap_adam(opt, lambda _: broken)
        _step(model, opt, step)
    before = opt.flat.clone()
    with pytest.raises(
        RuntimeError, match="delayed \\(DPU\\) optimizer step failed: ValueError: kernel exploded"
    ):
        opt.flush()
    assert torch.equal(opt.flat, before), "a failed delayed step must publish nothing"


def test_without_offload_nothing_crosses_to_the_host():
    model = _model()
    opt = build_zero(
        model, **HP, dp=SINGLE, tp=SINGLE, device="cpu", dtype=torch.bfloat16, cpu_offload=False
    )
    for step in range(2):
        _step(model, opt, step)
    assert opt.stats()["host_device_bytes_per_param"] == 0.0
    assert opt.host_side is None
    assert opt.memory_bytes()["host"] == {"staging": 0}
    # and the same fp32 master as with offload, published rounded to bf16: on the device to
    # nearest even, by the host's split rule with offload (docs/DESIGN.md §7; the two
    # differ at exact ties only)
    with_offload = build_zero(
        _model(), **HP, dp=SINGLE, tp=SINGLE, device="cpu", dtype=torch.bfloat16, cpu_offload=True
    )
    m2 = with_offload.model
    for step in range(2):
        _step(m2, with_offload, step)
    master = opt.device_side.master
    assert torch.equal(master, host_tensor(with_offload, "master"))
    assert torch.equal(opt.flat, master.to(torch.bfloat16))
    assert torch.equal(with_offload.flat, split_fp32(master)[0])
    assert with_offload.stats()["host_device_bytes_per_param"] == 4.0


def test_pinned_staging_is_requested_at_its_exact_size():
    asked = []
    t = host_memory.host_empty(
        3_000_001, torch.bfloat16, pin=True, register=lambda t, n: asked.append(n)
    )
    assert asked == [6_000_002] and t.numel() == 3_000_001 and not t.is_pinned()
    host_memory.host_empty(5, torch.bfloat16, pin=False, register=lambda t, n: asked.append(n))
    assert asked == [6_000_002]


class _FakeEvent:
    def __init__(self, log, n):
        self.log, self.n = log, n

    def synchronize(self):
        self.log.append(("host-waits", self.n))


class _FakeCopyStream(HostStreams):
    """Records the order of operations the CUDA copy stream would queue (the optimizer's
    ``streams`` seam, asynchronous as on a GPU)."""

    asynchronous = True

    def __init__(self, log=None):
        super().__init__()
        self.log, self.copies, self.dsts = [] if log is None else log, 0, []
        self.afters = []

    def copy_down(self, dst, src, after=None):
        self.afters.append(after is not None)
        if after is not None:  # the copy stream waits for the reduce-scatter
            after.wait()
        self.copies += 1
        self.log.append(("copy", self.copies))
        self.dsts.append(dst.data_ptr())
        dst.copy_(src)
        return _FakeEvent(self.log, self.copies)

    def before_reuse(self, done):
        if done is not None:
            self.log.append(("reuse-after", done.n))

    def drain(self):
        self.log.append(("drain", self.copies))


def test_copy_stream_order_and_buffer_reuse_through_a_fake():
    """Each chunk is copied on the copy stream; its fp32 add (two micro-batches: host
    accumulation on the worker thread) waits for that copy's event; a bucket buffer (DP=1:
    the chunk is the buffer) is reused only after its copy."""
    fake = _FakeCopyStream()
    sums = []
    for copier in (fake, None):  # the CUDA wiring (staging + copy stream) vs on-device sums
        model = _model()
        opt = build_zero(model, **HP, dp=SINGLE, tp=SINGLE, device="cpu", bucket_size=600,
                         cpu_offload=copier is not None, micro_batches=2,
                         streams=copier)  # fmt: skip
        layout = opt.layout
        for micro in range(2):
            opt.backward(_loss(model, micro))
        side = opt.host_side or opt.device_side
        sums.append((side.grads, opt.reducer.norm_squared()))
    assert torch.equal(sums[0][0], sums[1][0]), "the first micro-batch must overwrite"
    # the host sums squares in fp64; the device path takes an fp32 norm per range first
    assert torch.allclose(sums[0][1], sums[1][1], rtol=1e-6)
    buckets = len(layout.buckets)
    assert buckets >= 3 and fake.copies == 2 * buckets
    log = fake.log
    for k in range(1, 2 * buckets + 1):  # the host adds chunk k only after its copy
        assert log.index(("copy", k)) < log.index(("host-waits", k))
    reuses = [e for e in log if e[0] == "reuse-after"]
    assert reuses, "with two buffers and more buckets, buffers are reused"
    for _, k in reuses:  # reused only after (in stream order) the copy that read it
        assert log.index(("copy", k)) < log.index(("reuse-after", k))


def test_non_reader_ranks_know_the_end_without_reading_the_device():
    data = MockGPTDataset(10, 8, 50, seed=0)
    reader = BatchIterator(data, 0, 2, 0, 1, 8, "cpu")
    other = BatchIterator(SizedPlaceholder(len(data)), 0, 2, 0, 1, 8, "cpu", is_reader=False)
    assert len(list(reader)) == len(list(other)) == 5


@pytest.mark.parametrize("micro_batches,on_device", [(1, False), (2, False), (2, True)])
def test_each_copy_is_queued_when_its_bucket_launches(micro_batches, on_device):
    """DP=1: a bucket's copy down is queued as soon as its last gradient arrived (so it
    overlaps the backward of the next buckets), and the compute stream waits for it only
    when it reuses that buffer, after the next bucket's copy has been queued too."""
    log = []
    fake = _FakeCopyStream(log)
    model = _model()
    layout = FlatLayout(list(model.named_parameters()), 1, 0, 0, 600)
    bucket_of = {id(s.param): s.bucket for s in layout.slots}
    for s in layout.slots:  # registered first: runs before the reducer's own hook
        s.param.register_post_accumulate_grad_hook(lambda p: log.append(("grad", bucket_of[id(p)])))
    opt = build_zero(model, **HP, dp=SINGLE, tp=SINGLE, device="cpu", bucket_size=600,
                     dtype=torch.bfloat16, micro_batches=micro_batches,
                     accumulate_on_device=on_device, streams=fake)  # fmt: skip
    assert [(s.name, s.numel) for s in opt.layout.slots] == [
        (s.name, s.numel) for s in layout.slots
    ]
    staging = opt.host_side.staging
    at = {b.slice_offset: b.index for b in layout.buckets}
    for micro in range(micro_batches):
        first = len(fake.dsts)
        opt.backward(_loss(model, micro))
        if on_device and micro < micro_batches - 1:
            assert len(fake.dsts) == first, "device accumulation copies the sum only"
            continue
        assert len(fake.dsts) - first == len(layout.buckets)
    elem = staging.element_size()
    copied = [at[(d - staging.data_ptr()) // elem] for d in fake.dsts]
    grads_seen: dict[int, int] = {}
    k = 0
    for i, e in enumerate(log):
        if e[0] == "grad":
            grads_seen[e[1]] = grads_seen.get(e[1], 0) + 1
        elif e[0] == "copy":
            b = copied[k]
            k += 1
            assert log[i - 1] == ("grad", b), f"copy of bucket {b} not queued at its launch"
            assert grads_seen[b] % len(layout.buckets[b].slots) == 0
    reuses = [e[1] for e in log if e[0] == "reuse-after"]
    if not on_device:
        assert reuses, "with two buffers and more buckets, buffers are reused"
    for j in reuses:  # the next bucket's copy was queued before the wait for this one
        if j % len(layout.buckets) == 0:
            continue  # the last copy of a micro-batch: reused by the next micro-batch
        assert log.index(("copy", j + 1)) < log.index(("reuse-after", j))


def test_a_device_without_an_index_is_the_current_cuda_device(monkeypatch):
    """``cuda`` alone is resolved once to the current device, so each thread that binds it
    (the host accumulator, the DPU thread) names that GPU; torch.cuda.set_device refuses
    a device without an index."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert host_memory.resolve_device("cuda") == torch.device("cuda", 5)
    assert host_memory.resolve_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert host_memory.resolve_device("cpu") == torch.device("cpu")
    seen = []

    def set_device(d):
        if d.index is None:
            raise ValueError("Expected a cuda device with a specified index")
        seen.append(d)

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    host_memory.set_thread_device(torch.device("cuda"))
    acc = HostAccumulator(HostStreams(torch.device("cuda")))
    acc.submit(lambda: None)
    acc.wait()
    assert seen == [torch.device("cuda", 5)] * 2


def test_the_optimizer_resolves_its_device_where_it_enters(monkeypatch):
    asked = []

    def resolve(d):
        asked.append(d)
        return torch.device("cpu")

    monkeypatch.setattr(zero, "resolve_device", resolve)
    opt = build_zero(_model(), **HP, dp=SINGLE, tp=SINGLE, device="cuda", cpu_offload=True)
    assert asked == ["cuda"] and opt.device == torch.device("cpu")


class _FakeCudart:
    def __init__(self, code):
        self.code, self.unregistered = code, []

    def cudaHostRegister(self, ptr, nbytes, flags):
        return self.code

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)

    @staticmethod
    def cudaGetErrorString(code):
        return {2: "out of memory", 712: "part or all of the range is already registered"}[code]


def test_a_failed_registration_names_the_cuda_error(monkeypatch):
    for code, limit in ((2, True), (712, False)):
        monkeypatch.setattr(torch.cuda, "cudart", lambda c=code: _FakeCudart(c))
        with pytest.raises(RuntimeError) as e:
            host_memory.host_empty(1000, torch.bfloat16, pin=True)
        msg = str(e.value)
        assert f"cudaHostRegister of 2,000 bytes of host staging failed: CUDA error {code}" in msg
        assert _FakeCudart.cudaGetErrorString(code) in msg
        assert ("locked-memory limit" in msg) == limit, msg
        assert "ulimit" not in msg


def test_registration_is_undone_with_the_tensor_but_not_at_exit(monkeypatch):
    fake = _FakeCudart(0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    t = host_memory.host_empty(10, torch.float32, pin=True)
    ptr = t.data_ptr()
    (fin,) = [f for f in list(weakref.finalize._registry) if f.peek()[1] == fake.cudaHostUnregister]
    assert fin.atexit is False, "the CUDA context may be gone at interpreter exit"
    del t
    assert fake.unregistered == [ptr]


def test_adam_runs_per_bucket_and_each_upload_follows_its_piece():
    """The synchronous step runs Adam one bucket at a time, in the order forward t+1 uses
    the buckets (the reverse of the layout's gradient order), and queues each bucket's
    upload right after its piece; the result is bitwise one call over the whole slice."""
    from mp_offload.ops.cpu_adam import adam_step

    model = _model()
    opt = build_zero(model, **HP, dp=SINGLE, tp=SINGLE, device="cpu", dtype=torch.bfloat16,
                     cpu_offload=True, bucket_size=600, micro_batches=2)  # fmt: skip
    host, log, calls = opt.host_side, [], []
    adam, upload = live(opt).adam, host.upload
    start = {b.slice_offset: b.index for b in opt.layout.buckets}

    def logged_adam(param, *a, **k):
        h = (param.data_ptr() - live(opt).master.data_ptr()) // 4
        log.append(("adam", start[h]))
        calls.append(dict(k))
        return adam(param, *a, **k)

    def logged_upload(p, state):
        log.append(("upload", p.bucket.index))
        upload(p, state)

    wrap_adam(opt, lambda _: logged_adam)
    host.upload = logged_upload
    for step in range(2):
        opt.zero_grad()
        for micro in range(2):
            opt.backward(_loss(model, 2 * step + micro))
        keys = ("master", "exp_avg", "exp_avg_sq")
        state = [host_tensor(opt, k).clone() for k in keys[:1]] + [host.grads.clone()]
        state += [host_tensor(opt, k).clone() for k in keys[1:]]
        log.clear(), calls.clear()
        opt.step(1e-3)
        order = sorted((b.index for b in opt.layout.buckets), reverse=True)
        assert len(order) >= 3
        assert log == [(kind, i) for i in order for kind in ("adam", "upload")]
        # the same step as one kernel call over the slice, decay where the groups say
        master, grad, m, v = state
        out = torch.empty_like(host_tensor(opt, "param_staging"))
        k = dict(calls[0], param_out=out)
        decay = [(g.slice_start, g.slice_end) for g in opt.layout.segments
                 if g.slot is not None and opt.layout.slots[g.slot].param.ndim > 1]  # fmt: skip
        k["decay_runs"] = decay
        adam_step(master, grad, m, v, **k)
        for key, whole in zip(keys, (master, m, v)):
            assert torch.equal(host_tensor(opt, key), whole)
        assert torch.equal(host_tensor(opt, "param_staging"), out)
        assert torch.equal(opt.flat.view(-1)[: out.numel()], out)


def test_norm_parts_on_two_devices_cross_once(monkeypatch):
    """Partial offload with k > 1: the device share's norm parts are summed on the device
    and cross to the host once, not once per bucket ("meta" stands in for the GPU)."""
    model = _model()
    opt = build_zero(model, **HP, dp=SINGLE, tp=SINGLE, device="cpu", cpu_offload=True,
                     bucket_size=600, offload_fraction=0.5)  # fmt: skip
    reducer = opt.reducer
    reducer.micro = reducer.micro_batches
    opt.host_side.norm_parts = [torch.full((), 2.0, dtype=torch.float64) for _ in range(3)]
    opt.device_side.norm_parts = [torch.empty((), dtype=torch.float64, device="meta")] * 4
    crossings = []

    def cpu(t):
        if t.device.type != "cpu":
            crossings.append(t.device)
            return torch.full((), 1.0, dtype=torch.float64)
        return t

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    total = reducer.norm_squared()
    assert crossings == [torch.device("meta")]
    assert total.device.type == "cpu" and float(total) == 7.0


def test_optimizer_time_excludes_the_device_tail_of_backward(monkeypatch):
    """train_step waits for the device before it starts the optimizer's clock: the tail of
    backward (which the norm would wait for) is reported apart, as device_tail_ms."""
    import time

    from mp_offload import training
    from mp_offload.optimizer.base import StepResult

    class SlowStep:
        autocast_dtype = None

        def zero_grad(self, lr=None):
            pass

        def backward(self, loss):
            loss.backward()

        def step(self, lr):
            time.sleep(0.05)
            return StepResult(grad_norm=1.0)

    waited = []
    monkeypatch.setattr(training, "_wait_for_device", lambda d: (waited.append(d), time.sleep(0.3)))
    model = _model()
    out = training.train_step(
        model, SlowStep(), iter([_tokens(0)]), 1, 1e-3, SINGLE, torch.device("cpu")
    )
    assert waited == [torch.device("cpu")]
    assert 50 <= out.optimizer_ms < 250, out.optimizer_ms
    assert out.device_tail_ms >= 300


def _early_copy_dp2_worker(rank, world):
    ps.initialize_model_parallel(1)  # DP=2
    dp = ps.get_data_parallel_group()
    out = []
    for copier in (_FakeCopyStream(), None):
        model = _model()
        opt = build_zero(model, **HP, dp=dp, tp=SINGLE, device="cpu", bucket_size=600,
                         dtype=torch.bfloat16, micro_batches=2, streams=copier)  # fmt: skip
        layout = opt.layout
        for micro in range(2):
            opt.backward(_loss(model, 2 * rank + micro))
        out.append((opt.host_side.grads.clone(), opt.reducer.norm_squared()))
        if copier is not None:  # every copy waited (on its stream) for its reduce-scatter
            assert copier.copies == 2 * len(layout.buckets)
            assert len(copier.afters) == copier.copies and all(copier.afters)
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_dp2_copies_wait_on_the_reduce_scatter_and_equal_the_inline_path():
    run_distributed(_early_copy_dp2_worker, 2)


class _Recorder:
    """Stands in for torch.cuda's Stream/Event/stream() and logs what CopyStream asks."""

    def __init__(self, monkeypatch):
        self.log = []
        rec = self

        class Stream:
            def __init__(self, name="copy"):
                self.name = name

            def wait_stream(self, other):
                rec.log.append(("wait_stream", self.name, other.name))

            def wait_event(self, event):
                rec.log.append(("wait_event", self.name, event.n))

        class Event:
            def __init__(self, blocking=False):
                self.blocking, self.n = blocking, len(rec.log)

            def record(self, stream=None):
                rec.log.append(("record", getattr(stream, "name", "compute"), self.blocking))

            def synchronize(self):
                rec.log.append(("host_waits", self.n, self.blocking))

        compute = Stream("compute")
        current = [compute]

        @contextlib.contextmanager
        def on(stream):
            current.append(stream)
            yield
            current.pop()

        monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream())
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", on)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: current[-1])
        monkeypatch.setattr(
            torch.Tensor, "record_stream", lambda t, s: rec.log.append(("in_use_on", s.name))
        )


def test_copy_stream_waits_where_the_chunk_is_ready_and_its_events_block(monkeypatch):
    from mp_offload.optimizer.streams import CudaStreams

    rec = _Recorder(monkeypatch)
    cs = CudaStreams(torch.device("cuda", 0))

    class Work:
        def wait(self):  # NCCL: the current stream (here the copy stream) waits
            rec.log.append(("work_wait", torch.cuda.current_stream().name))

    dst, src = torch.zeros(4), torch.arange(4.0)
    done = cs.copy_down(dst, src)  # DP=1: after what the compute stream queued
    assert torch.equal(dst, src)
    cs.copy_down(torch.zeros(4), src, after=Work())  # DP>1: after the reduce-scatter only
    cs.before_reuse(done)
    cs.drain()
    assert rec.log == [
        ("wait_stream", "copy", "compute"),
        ("record", "copy", True),
        ("in_use_on", "copy"),
        ("work_wait", "copy"),
        ("record", "copy", True),
        ("in_use_on", "copy"),
        ("wait_event", "compute", done.n),
        ("record", "copy", True),
        ("host_waits", 7, True),
    ]
