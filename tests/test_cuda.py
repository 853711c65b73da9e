"""The CUDA path on a real GPU (skipped without one): tiny models, one process, one GPU.

Each test is small enough that ``pytest -m cuda`` runs in well under a minute on one
H100/H200-class GPU: the next call after the device proof (``scripts/device_check.sh``).
"""

import math
import threading

import pytest
import torch
from kernel_timeline import (
    d2h_overlap_share,
    host_allocated_bytes,
    is_compute,
    is_d2h,
    spans,
    streams_of,
)

from mp_offload import parallel_state as ps
from mp_offload.data.loader import MockGPTDataset
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.optimizer.torch_adamw import param_groups
from mp_offload.optimizer.zero import ZeroOptimizer
from mp_offload.planner.activations import estimate_activations
from mp_offload.tensor_parallel import model_parallel_seed

pytestmark = pytest.mark.cuda

CFG = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=32,
    vocab_size=200,
    make_vocab_size_divisible_by=8,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
HP = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=0.5)
SINGLE = ps.ParallelGroup.single()
DATA = MockGPTDataset(4096, 32, 200, seed=5)
BATCH = 8


def _batch(step):
    t = torch.stack([torch.from_numpy(DATA[step * BATCH + i]["text"]) for i in range(BATCH)])
    t = t.cuda()
    return t[:, :-1], t[:, 1:]


def _model(**over):
    torch.manual_seed(42)
    model_parallel_seed(42, 0, "cuda")
    return GPTModel(GPTConfig(**{**CFG, **over}), tp_group=SINGLE)


def _zero(model, **kw):
    kw.setdefault("bucket_size", 3000)  # many buckets: exercises the copy stream and thread
    return ZeroOptimizer(model, **HP, dp=SINGLE, tp=SINGLE, device="cuda", **kw)


def _run(opt, model, steps):
    losses, results = [], []
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        loss = model(x, y).mean()
        opt.backward(loss)
        results.append(opt.step(HP["lr"]))
        losses.append(loss.item())
    opt.flush()
    return losses, results


def test_offload_fp32_tracks_torch_adamw():
    """The race detector: any missing stream/event wait shows up as a wrong gradient."""
    ref = _model().cuda()
    adamw = torch.optim.AdamW(
        param_groups(ref, HP["weight_decay"]), lr=HP["lr"], betas=HP["betas"], eps=HP["eps"]
    )
    ref_losses = []
    for step in range(10):
        x, y = _batch(step)
        adamw.zero_grad()
        loss = ref(x, y).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), HP["clip_grad"])
        adamw.step()
        ref_losses.append(loss.item())
    model = _model()
    losses, _ = _run(_zero(model, dtype=torch.float32, cpu_offload=True), model, 10)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-4 * abs(b), (losses, ref_losses)


def test_bf16_offload_converges():
    model = _model()
    losses, results = _run(_zero(model, dtype=torch.bfloat16, cpu_offload=True), model, 40)
    assert not any(r.skipped for r in results)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses[::5]


@pytest.mark.parametrize("offload,expected", [(True, 4.0), (False, 0.0)])
def test_host_device_bytes_per_param(offload, expected):
    model = _model()
    opt = _zero(model, dtype=torch.bfloat16, cpu_offload=offload)
    _run(opt, model, 3)
    assert opt.stats()["host_device_bytes_per_param"] == expected


def test_without_offload_every_state_tensor_stays_on_the_device():
    model = _model()
    opt = _zero(model, dtype=torch.bfloat16, cpu_offload=False)
    _run(opt, model, 2)
    for t in (opt.master, opt.exp_avg, opt.exp_avg_sq, *opt.grads, opt.flat):
        assert t.is_cuda
    assert opt.param_staging is None and not opt.grad_staging


def test_dpu_keeps_the_warmup_steps_and_converges():
    m1, m2 = _model(), _model()
    sync, _ = _run(_zero(m1, dtype=torch.bfloat16, cpu_offload=True), m1, 30)
    dpu, _ = _run(_zero(m2, dtype=torch.bfloat16, cpu_offload=True, dpu_warmup_steps=3), m2, 30)
    assert dpu[:4] == sync[:4]
    assert sum(dpu[-5:]) / 5 < 0.85 * sum(dpu[:5]) / 5, dpu[::5]


def test_fp16_overflow_skips_and_lowers_the_scale():
    model = _model()
    opt = _zero(
        model,
        dtype=torch.float16,
        cpu_offload=True,
        loss_scale=dict(initial=2.0**60, min=1.0, window=1000, hysteresis=1),
    )
    _, results = _run(opt, model, 3)
    assert results[0].skipped and opt.scaler.scale < 2.0**60
    assert torch.isfinite(opt.master).all()


def test_recompute_with_dropout_gives_identical_gradients():
    grads = []
    for recompute in (False, True):
        model = _model(
            hidden_dropout=0.1, attention_dropout=0.1, recompute_activations=recompute
        ).cuda()
        model_parallel_seed(7, 0, "cuda")
        x, y = _batch(0)
        loss = model(x, y).mean()
        loss.backward()
        grads.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_recompute_under_bf16_autocast_matches():
    grads = []
    for recompute in (False, True):
        model = _model(recompute_activations=recompute).cuda()
        x, y = _batch(0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y).mean()
        loss.backward()
        grads.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_staging_is_pinned_at_its_exact_size():
    before = host_allocated_bytes(torch.cuda.host_memory_stats())
    model = _model()
    opt = _zero(model, dtype=torch.bfloat16, cpu_offload=True)
    assert opt.param_staging.is_pinned() and opt.grad_staging[0].is_pinned()
    assert opt.pinned_bytes() == 2 * 2 * opt.layout.slice_numel
    # registered memory bypasses the power-of-two caching host allocator: its count stays
    assert host_allocated_bytes(torch.cuda.host_memory_stats()) == before
    _run(opt, model, 2)


def _profiled_backward(model, opt, x, y):
    from torch.profiler import ProfilerActivity, profile

    opt.zero_grad()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        opt.backward(model(x, y).mean())
        torch.cuda.synchronize()
    return spans(prof.events())


def test_gradient_copies_leave_the_compute_stream():
    model = _model()
    opt = _zero(model, dtype=torch.bfloat16, cpu_offload=True)
    _run(opt, model, 1)  # warm-up: buffers, streams, kernels chosen
    timeline = _profiled_backward(model, opt, *_batch(1))
    d2h, compute = streams_of(timeline, is_d2h), streams_of(timeline, is_compute)
    assert d2h and compute, (d2h, compute)
    assert d2h.isdisjoint(compute), f"D2H copies on the compute stream {d2h & compute}"


def test_gradient_copies_overlap_backward_in_time():
    """DP=1: each bucket's copy is queued when the bucket is launched, so it runs while
    backward computes the next buckets (measured from the kernels' start and end)."""
    seq = 1024  # backward per bucket long enough to hide a bucket copy behind
    model = _model(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=seq)
    opt = _zero(model, dtype=torch.bfloat16, cpu_offload=True, bucket_size=4_000_000)
    x = torch.randint(0, CFG["vocab_size"], (8, seq + 1), device="cuda")
    for _ in range(2):  # warm-up
        opt.zero_grad()
        opt.backward(model(x[:, :-1], x[:, 1:]).mean())
        opt.step(HP["lr"])
    share = d2h_overlap_share(_profiled_backward(model, opt, x[:, :-1], x[:, 1:]))
    assert share >= 0.5, f"only {share:.0%} of the D2H copy time overlaps compute"


def test_worker_threads_run_on_the_rank_device():
    index = min(1, torch.cuda.device_count() - 1)
    torch.cuda.set_device(index)
    try:
        model = _model()
        opt = ZeroOptimizer(
            model,
            **HP,
            dp=SINGLE,
            tp=SINGLE,
            device=f"cuda:{index}",
            dtype=torch.bfloat16,
            cpu_offload=True,
            dpu_warmup_steps=0,
        )
        seen = []
        inner = opt._adam_pass

        def spy(*a):
            seen.append((threading.current_thread().name, torch.cuda.current_device()))
            return inner(*a)

        opt._adam_pass = spy
        _run(opt, model, 2)
        assert seen and all(d == index for _, d in seen), seen
        assert any(name == "dpu-adam" for name, _ in seen)
    finally:
        torch.cuda.set_device(0)


@pytest.mark.parametrize("recompute", [False, True])
def test_activation_estimate_within_15_percent(recompute):
    cfg = GPTConfig(
        num_layers=4,
        hidden_size=1024,
        num_attention_heads=16,
        seq_length=1024,
        vocab_size=50257,
        recompute_activations=recompute,
    )
    model_parallel_seed(1234, 0, "cuda")
    model = GPTModel(cfg, tp_group=SINGLE)
    opt = ZeroOptimizer(
        model, **HP, dp=SINGLE, tp=SINGLE, device="cuda", dtype=torch.bfloat16, cpu_offload=True
    )
    micro = 4
    x = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_length + 1), device="cuda")
    for _ in range(2):  # the first pass allocates the bucket buffers; measure the second
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        opt.zero_grad()
        opt.backward(model(x[:, :-1], x[:, 1:]).mean())
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
    est = estimate_activations(cfg, 1, micro, 2, recompute=recompute, flash=True)
    assert abs(measured - est.peak) <= 0.15 * measured, (
        f"measured {measured / 2**20:.0f} MiB, estimated {est.peak / 2**20:.0f} MiB ({est.phase})"
    )


def test_resume_on_cuda_from_a_cpu_saved_checkpoint(tmp_path, monkeypatch):
    from mp_offload.training import pretrain

    monkeypatch.setenv("MASTER_PORT", "29517")
    base = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--vocab-size",
        "200",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--micro-batch-size",
        "4",
        "--hidden-dropout",
        "0.1",
        "--attention-dropout",
        "0.1",
        "--eval-interval",
        "100",
        "--eval-iters",
        "1",
        "--save",
        str(tmp_path),
        "--load",
        str(tmp_path),
        "--save-interval",
        "2",
        "--bf16",
        "--cpu-offload",
    ]
    first = pretrain(base + ["--train-iters", "2", "--device", "cpu"])
    second = pretrain(base + ["--train-iters", "4", "--device", "cuda"])
    assert first["iteration"] == 2 and second["iteration"] == 4
    assert math.isfinite(second["loss"])


def test_device_accumulation_equals_host_accumulation():
    """bf16, four micro-batches: the fp32 sum on the device is the host's fp32 sum of the
    same bf16 chunks, bit for bit; the losses follow within 1e-6."""
    runs = []
    for on_device in (False, True):
        model = _model()
        opt = _zero(model, dtype=torch.bfloat16, micro_batches=4, accumulate_on_device=on_device)
        first, adam, losses = [], opt._adam, []

        def keep(param, grad, *a, _adam=adam, _first=first, _losses=losses, **k):
            if not _losses:  # the first step's gradient, one piece (bucket) per call
                _first.append(grad.float().clone())
            return _adam(param, grad, *a, **k)

        opt._adam = keep
        for step in range(5):
            x, y = _batch(step)
            opt.zero_grad()
            total = 0.0
            for k in range(4):
                part = slice(2 * k, 2 * k + 2)
                loss = model(x[part], y[part]).float().mean() / 4
                opt.backward(loss)
                total += loss.item()
            opt.step(HP["lr"])
            losses.append(total)
        runs.append((losses, torch.cat(first)))
    (host, host_grad), (device, device_grad) = runs
    assert torch.equal(device_grad, host_grad)
    assert max(abs(a - b) / abs(b) for a, b in zip(device, host)) <= 1e-6, (device, host)


@pytest.mark.parametrize("dpu", [None, 2])
def test_remainders_and_8bit_moments_on_the_pinned_path(dpu):
    """--store-param-remainders on CUDA (pinned hi staging, asynchronous copies up, with and
    without DPU): bitwise the run without it; with 8-bit moments as well."""
    q8 = dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    for extra in ({}, q8):
        runs = []
        for remainders in (False, True):
            model = _model()
            opt = _zero(
                model,
                dtype=torch.bfloat16,
                cpu_offload=True,
                dpu_warmup_steps=dpu,
                store_param_remainders=remainders,
                **extra,
            )
            assert opt.param_staging.is_pinned()
            runs.append((_run(opt, model, 8)[0], opt.flat.cpu()))
        (la, fa), (lb, fb) = runs
        assert la == lb and torch.equal(fa, fb), extra
