"""The CUDA ordering of the offload path, checked on the CPU (``stream_checker``): every
legal offload mode runs race-free with late copies and equals the synchronous CPU run
bit for bit, and each ordering mistake injected into the optimizer is caught."""

import pytest
import torch
from helpers import tiny_gpt_config
from stream_checker import RaceStreams, StreamRace
from zero_helpers import build_zero

from mp_offload import parallel_state as ps
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.optimizer import host_accumulator, host_side, reducer
from mp_offload.optimizer.options import legal_modes

SINGLE = ps.ParallelGroup.single()
HP = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=0.0)
OFFLOAD = [o for o in legal_modes(bucket_size=900) if o.offloaded]


def _run(options, streams=None, steps=3):
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**tiny_gpt_config()), tp_group=SINGLE)
    opt = build_zero(model, **HP, dp=SINGLE, tp=SINGLE, device="cpu", options=options,
                     streams=streams)  # fmt: skip
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


def _id(o) -> str:
    dt = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "8bit"}
    parts = [dt[o.dtype], f"F{o.offload_fraction:g}", f"m{dt[o.exp_avg_dtype]}"]
    parts += ["rem"] * o.store_param_remainders + ["ovl"] * o.overlap_cpu_optimizer
    parts += ["dpu"] * (o.dpu_warmup_steps is not None)
    return "-".join(parts + [f"k{o.micro_batches}" + "d" * o.accumulate_on_device])


@pytest.mark.parametrize("options", OFFLOAD, ids=_id)
def test_every_offload_mode_is_race_free_and_equals_the_synchronous_run(options):
    checker = RaceStreams()
    late = _run(options, checker)
    assert checker.landed > 0 and checker.orders > 0
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
    with pytest.raises(StreamRace, match=match):
        _run(options, RaceStreams())


def test_a_missing_upload_wait_before_a_staging_rewrite_is_caught(monkeypatch):
    real = host_side.HostSide.step

    def no_wait(self, hyper, upload, grad=None):
        self.states[0].uploaded = None  # as if the step did not wait for its copies up
        return real(self, hyper, upload, grad)

    monkeypatch.setattr(host_side.HostSide, "step", no_wait)
    # fp32: the master itself goes up (bf16 on one CPU rank writes the params in place)
    _caught(FP32, "wrote the source of the copy up")


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
    with pytest.raises(RuntimeError) as e:
        _run(HOST_SUMS, RaceStreams())
    assert isinstance(e.value.__cause__, StreamRace), e.value
    assert "read the destination of the copy down" in str(e.value.__cause__)
