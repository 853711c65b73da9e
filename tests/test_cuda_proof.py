"""The device proof's own CUDA tests (``scripts/device_check.sh`` stage 2). Each runs on
the CPU too (the CPU as the device: the rehearsal runs those cases), so its logic is proven
here; the CUDA cases are marked ``cuda`` and skip without a GPU."""

import statistics
import time

import pytest
import torch

from mp_offload.device_proof import toy
from mp_offload.optimizer.base import DEFAULT_BUCKET_SIZE

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
CFG = toy.TINY
# No clipping where two paths are compared bitwise: each computes the norm its own way
# (the device from its chunks, the host in its last accumulation pass), and the clip
# factor would carry that last-bit difference into the weights.
NO_CLIP = dict(clip_grad=0.0)


def _batches(step, k, batch=4, device="cpu"):
    return [toy.tokens(CFG, batch, step * k + i, device) for i in range(k)]


def _train(device, steps, k=1, batch=4, autocast=None, **kw):
    m = toy.model(device, **CFG)
    opt = toy.zero(m, device, **kw)
    losses = [toy.step(opt, m, _batches(s, k, batch, device), autocast)[0] for s in range(steps)]
    opt.flush()
    return losses, opt


@pytest.mark.parametrize("device", DEVICES)
def test_k2_on_the_host_accumulator_equals_k1_with_the_batch_doubled(device):
    """Two micro-batches of 4 summed in the host's fp32 slice against one batch of 8."""
    m2, m1 = toy.model(device, **CFG), toy.model(device, **CFG)
    opt2 = toy.zero(m2, device, dtype=torch.float32, micro_batches=2)
    opt1 = toy.zero(m1, device, dtype=torch.float32)
    for s in range(3):
        two = toy.step(opt2, m2, _batches(s, 2, 4, device))
        one = toy.step(opt1, m1, [torch.cat(_batches(s, 2, 4, device))])
        # the same sums in another order: fp32 rounding of a mean over 8 vs two over 4
        # (the weights are not compared: Adam's first steps turn rounding into sign flips)
        assert abs(two[0] - one[0]) <= 1e-6 * abs(one[0]), (s, two[0], one[0])
        g2, g1 = two[1].grad_norm, one[1].grad_norm
        assert abs(g2 - g1) <= 1e-6 * g1, (s, g2, g1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_accumulation_equals_host_accumulation(device, dtype):
    """k=4: the same fp32 sums whether the device or the host adds the micro-batches."""
    auto = torch.bfloat16 if dtype == torch.bfloat16 else None
    kw = dict(dtype=dtype, micro_batches=4, reduce_dtype=torch.float32, **NO_CLIP)
    host, oh = _train(device, 3, k=4, batch=2, autocast=auto, **kw)
    dev, od = _train(device, 3, k=4, batch=2, autocast=auto, accumulate_on_device=True, **kw)
    assert dev == host
    assert torch.equal(od.master, oh.master)


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_reduce_brings_fp32_gradients_down(device):
    """bf16 training, fp32 reduce: the chunks come down (and are staged) in fp32, 4 B per
    element down and 2 up, and the run learns."""
    losses, opt = _train(
        device, 8, dtype=torch.bfloat16, reduce_dtype=torch.float32, autocast=torch.bfloat16
    )
    assert all(s.dtype == torch.float32 for s in opt.grad_staging)
    assert opt.stats()["host_device_bytes_per_param"] == 6.0
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_moments_with_a_device_share(device):
    """F=0.5 with bf16 moments: the device share keeps its moments in bf16 and the run
    steps like F=1: exactly on the CPU (the same arithmetic); on a GPU within 1e-5 as in
    test_offload_fraction's CUDA test (nvcc contracts a*b+c into FMAs, the C++ Adam is
    built with -ffp-contract=off)."""
    kw = dict(dtype=torch.float32, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    kw.update(NO_CLIP)
    half, opt = _train(device, 4, offload_fraction=0.5, **kw)
    one, _ = _train(device, 4, offload_fraction=1.0, **kw)
    assert opt.share is not None and opt.share.exp_avg.dtype == torch.bfloat16
    assert opt.share.exp_avg.device.type == device and opt.exp_avg.dtype == torch.bfloat16
    if device == "cpu":
        assert half == one
    else:
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(half, one)), (half, one)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("on_device", [False, True])
def test_the_overlapped_step_is_the_synchronous_step(device, on_device):
    """--overlap-cpu-optimizer on this device (pinned staging, the copies' events, the
    second staging's last copy up waited for before the worker writes it): k=2 in bf16 on
    both accumulation paths, the losses and the state bit for bit the synchronous step's,
    every step taken by the overlap (committed or, where the clip applies, replayed)."""
    # clip at 1.4: the first steps' norms (about 1.56, 1.48) clip, the next (1.33-1.38) not
    kw = dict(dtype=torch.bfloat16, micro_batches=2, accumulate_on_device=on_device)
    kw.update(clip_grad=1.4)
    sync, o_sync = _train(device, 5, k=2, batch=2, autocast=torch.bfloat16, **kw)
    ovl, o_ovl = _train(
        device, 5, k=2, batch=2, autocast=torch.bfloat16, overlap_cpu_optimizer=True, **kw
    )
    assert ovl == sync
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(o_ovl, name), getattr(o_sync, name)), name
    assert torch.equal(o_ovl.flat, o_sync.flat)  # the parameters the device holds
    st = o_ovl.stats()
    assert st["overlap_steps"] == 5 and "overlap_steps" not in o_sync.stats()
    assert 0 < st["overlap_replays"] < 5  # both a replay and a commit


@pytest.mark.parametrize("device", DEVICES)
def test_a_dpu_thread_failure_surfaces(device):
    m = toy.model(device, **CFG)
    opt = toy.zero(m, device, dtype=torch.bfloat16, dpu_warmup_steps=0)

    def broken(*args):
        raise MemoryError("injected")

    opt._adam_pass = broken
    toy.step(opt, m, _batches(0, 1, 4, device), torch.bfloat16)  # the thread fails...
    with pytest.raises(RuntimeError, match="DPU.*MemoryError: injected"):
        toy.step(opt, m, _batches(1, 1, 4, device), torch.bfloat16)  # ...and says so here


# Backward with offload against backward without, at DP=1: the copies down must hide under
# backward on a GPU (15%); on the CPU the "copy" is a host copy on the compute thread.
BACKWARD_RATIO = {"cuda": 1.15, "cpu": 1.5}


def _timed_backward(opt, m, t) -> float:
    opt.zero_grad()
    with torch.autocast(t.device.type, dtype=torch.bfloat16):
        loss = m(t[:, :-1], t[:, 1:]).mean()
    if t.device.type != "cuda":
        t0 = time.perf_counter()
        opt.backward(loss)
        return time.perf_counter() - t0
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    opt.backward(loss)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3


def _backward_seconds(device, cfg, batch, repeats=7):
    """Median backward seconds (without offload, with offload), the two stepped in turn: on
    a shared CPU the load then falls on both alike."""
    bucket = DEFAULT_BUCKET_SIZE if device == "cuda" else 3000  # the real buckets on a GPU
    runs = {}
    for offload in (False, True):
        m = toy.model(device, **cfg)
        opt = toy.zero(m, device, dtype=torch.bfloat16, cpu_offload=offload, bucket_size=bucket)
        runs[offload] = (m, opt)
    t = toy.tokens(cfg, batch, 0, device)
    times = {False: [], True: []}
    for _ in range(repeats + 1):  # the first allocates the buffers
        for offload, (m, opt) in runs.items():
            times[offload].append(_timed_backward(opt, m, t))
    for _, opt in runs.values():
        opt.step(toy.HP["lr"])
        opt.flush()
    return tuple(statistics.median(times[k][1:]) for k in (False, True))


@pytest.mark.parametrize("device", DEVICES)
def test_backward_with_offload_takes_little_more_than_without(device):
    small = dict(CFG, num_layers=4, hidden_size=128, seq_length=128)
    without, with_ = _backward_seconds(device, toy.MEDIUM if device == "cuda" else small, 4)
    assert with_ <= BACKWARD_RATIO[device] * without, (with_, without)
