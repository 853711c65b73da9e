"""The CUDA path's logic, shown on the CPU: which device threads bind, exact pinned sizes,
the copy stream's order, nothing crossing to the host without offload, DPU failures."""

import threading

import pytest
import torch

from mp_offload import parallel_state as ps
from mp_offload.data.loader import BatchIterator, MockGPTDataset, SizedPlaceholder
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.optimizer import host_memory, zero
from mp_offload.optimizer.host_accumulator import HostAccumulator
from mp_offload.optimizer.layout import FlatLayout
from mp_offload.optimizer.reducer import GradientReducer, GradTargets
from mp_offload.optimizer.zero import ZeroOptimizer
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
    acc = HostAccumulator(torch.device("cuda", 3))
    dst = torch.zeros(4)
    acc.add(dst, torch.ones(4))
    acc.wait()
    assert seen == [("host-grad-accumulate", torch.device("cuda", 3))]
    assert torch.equal(dst, torch.ones(4))


def test_accumulator_thread_that_cannot_bind_fails_wait_not_hangs(monkeypatch):
    def refuse(d):
        raise RuntimeError("invalid device ordinal")

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    acc = HostAccumulator(torch.device("cuda", 9))
    acc.add(torch.zeros(2), torch.ones(2))
    with pytest.raises(RuntimeError, match="host gradient accumulation failed"):
        acc.wait()


def test_dpu_thread_binds_the_optimizer_device(monkeypatch):
    seen = []
    monkeypatch.setattr(
        zero, "set_thread_device", lambda d: seen.append((threading.current_thread().name, d))
    )
    model = _model()
    opt = ZeroOptimizer(
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
    opt = ZeroOptimizer(
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

            opt._adam = broken
        _step(model, opt, step)
    before = opt.flat.clone()
    with pytest.raises(
        RuntimeError, match="delayed \\(DPU\\) optimizer step failed: ValueError: kernel exploded"
    ):
        opt.flush()
    assert torch.equal(opt.flat, before), "a failed delayed step must publish nothing"


def test_without_offload_nothing_crosses_to_the_host():
    model = _model()
    opt = ZeroOptimizer(
        model, **HP, dp=SINGLE, tp=SINGLE, device="cpu", dtype=torch.bfloat16, cpu_offload=False
    )
    for step in range(2):
        _step(model, opt, step)
    assert opt.stats()["host_device_bytes_per_param"] == 0.0
    assert opt.param_staging is None and not opt.grad_staging
    assert opt.memory_bytes()["host"] == {"staging": 0}
    # and the published params are the fp32 master rounded to bf16, as with offload
    with_offload = ZeroOptimizer(
        _model(), **HP, dp=SINGLE, tp=SINGLE, device="cpu", dtype=torch.bfloat16, cpu_offload=True
    )
    m2 = with_offload.model
    for step in range(2):
        _step(m2, with_offload, step)
    assert torch.equal(opt.flat, with_offload.flat)
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


class _FakeCopyStream:
    """Records the order of operations the CUDA copy stream would queue."""

    def __init__(self):
        self.log, self.copies = [], 0

    def copy(self, dst, src):
        self.copies += 1
        self.log.append(("copy", self.copies))
        dst.copy_(src)
        return _FakeEvent(self.log, self.copies)

    def before_reuse(self, done):
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
        layout = FlatLayout(list(model.named_parameters()), 1, 0, 0, 600)
        reducer = GradientReducer(
            layout,
            SINGLE,
            torch.device("cpu"),
            torch.float32,
            offload=copier is not None,
            micro_batches=2,
            copier=copier,
        )
        n = layout.host_numel
        reducer.start_step(
            GradTargets(
                staging=torch.empty(n) if copier else None, grads=torch.full((n,), float("nan"))
            )
        )
        for micro in range(2):
            _loss(model, micro).backward()
            reducer.finish()
        sums.append((reducer.targets.grads, reducer.norm_squared()))
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
