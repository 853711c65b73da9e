"""--overlap-cpu-optimizer (optimizer/overlap.py): the speculative CPU Adam during backward.

Bitwise the same losses and parameters with and without the flag: commit (no clipping),
replay (clipping), skip (fp16 overflow); F = 0.5, k = 4 on both accumulation paths, bf16
moments; at TP=2 x DP=2 (slow) and on one rank. The worker really runs beside backward;
the buffers are the placement's (the second copy counted); the protocol's lr checks; the
flag's refusals; checkpoints hold the committed copy (resume and reshard: slow).
"""

import statistics
import threading

import pytest
import torch
import torch.distributed as dist
from dist_helpers import log_records, pretrain_worker, run_distributed
from helpers import ADAM_HP as HP
from helpers import CKPT_RUN, micro_batches, tiny_gpt_config
from zero_helpers import build_zero, host_tensor, live, wrap_adam

from mp_offload import parallel_state as ps
from mp_offload.config import ConfigError, parse_args, resolve
from mp_offload.data.loader import MockGPTDataset
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.optimizer.options import OptimizerOptions
from mp_offload.planner import EXACT, Hardware, Run, plan_rank, rank_shapes, spec_named_params
from mp_offload.tensor_parallel import merge_partitions
from mp_offload.training import train_step

GBS = 8
_DATA = MockGPTDataset(10_000, 16, 96, seed=3)
CPU = torch.device("cpu")


def _tokens(step):
    return torch.stack([torch.from_numpy(_DATA[step * GBS + i]["text"]) for i in range(GBS)])


def host_tensor_of(state, name):
    """A HostState copy's tensor of ``name`` (its master, or a moment's tensor)."""
    return state.master if name == "master" else getattr(state, name).t


def _build(overlap, *, dp=None, tp=None, bucket=500, **kw):
    single = ps.ParallelGroup.single()
    torch.manual_seed(42)
    model = GPTModel(GPTConfig(**tiny_gpt_config()), tp_group=tp or single)
    hp = dict(HP, clip_grad=kw.pop("clip_grad", HP["clip_grad"]))
    opt = build_zero(
        model,
        **hp,
        dp=dp or single,
        tp=tp or single,
        device="cpu",
        bucket_size=bucket,
        overlap_cpu_optimizer=overlap,
        **kw,
    )
    return model, opt


def _train(overlap, steps=5, micro=2, **kw):
    """``steps`` steps on this rank's rows of each global batch, ``micro`` rows per
    micro-batch: (losses, grad norms, per-step overlap records, final merged params)."""
    dp, tp = ps.get_data_parallel_group(), ps.get_tensor_model_parallel_group()
    per_rank = GBS // dp.size
    kw.setdefault("micro_batches", per_rank // micro)
    model, opt = _build(overlap, dp=dp, tp=tp, **kw)
    losses, norms, records = [], [], []
    for step in range(steps):
        rows = _tokens(step)[dp.rank * per_rank :][:per_rank]
        lr = HP["lr"] * (step + 1) / steps  # a changing lr: the speculation must use it
        out = train_step(model, opt, micro_batches(rows, micro), per_rank // micro, lr, dp, CPU)
        losses.append(out.loss)
        norms.append(out.result.grad_norm)
        records.append(dict(opt.stats(), skipped=out.result.skipped))
    opt.flush()
    return losses, norms, records, _merged(model, tp), opt


def _merged(model, group):
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if p.tensor_model_parallel and group.size > 1:
            parts = [torch.empty_like(t) for _ in range(group.size)]
            dist.all_gather(parts, t.contiguous(), group=group.torch_group())
            t = merge_partitions(parts, p.partition_dim, p.partition_stride)
        out[name] = t
    return out


def _same(a, b, what):
    """Bitwise: the losses (NaN-aware: a skipped fp16 step may have one) and the params."""
    assert [str(x) for x in a[0]] == [str(y) for y in b[0]], f"{what}: losses differ"
    for name in b[3]:
        assert torch.equal(a[3][name], b[3][name]), f"{what}: {name} differs"


def _compare(what, **kw):
    """Without and with the flag, bitwise; returns the overlap run's records."""
    sync, over = _train(False, **kw), _train(True, **kw)
    _same(over, sync, what)
    assert "replayed" not in sync[2][0]  # no overlap fields without the flag
    return over[2]


def _main_cases():
    """fp32 clipping at the median norm (some steps replay, some commit), fp16 with a
    loss scale that overflows first (skips), F = 0.5, k = 4 on both accumulation paths,
    bf16 moments, remainders (with clipping, and with bf16 moments)."""
    ref = _train(False, clip_grad=0.0)
    clip = statistics.median(ref[1])
    rec = _compare("fp32 clip at the median", clip_grad=clip)
    replays = [r["replayed"] for r in rec]
    assert 0 in replays and 1 in replays, f"clip {clip}: both must happen, {replays}"
    assert rec[-1]["overlap_replays"] == sum(replays) and rec[-1]["overlap_steps"] == 5
    scale = dict(initial=2.0**20, min=1.0, window=1000, hysteresis=1)
    rec = _compare("fp16 overflow", dtype=torch.float16, loss_scale=scale, steps=8)
    skips = [r["skipped"] for r in rec]
    assert skips[0] and not skips[-1], f"the first steps must overflow, the last not: {skips}"
    assert all(r["replayed"] == 0 for r, s in zip(rec, skips) if s)
    _compare("F=0.5", dtype=torch.bfloat16, offload_fraction=0.5)
    _compare("k=4 on the host", micro=1)
    _compare("k=4 on the device", micro=1, accumulate_on_device=True)
    _compare("bf16 moments", dtype=torch.bfloat16, exp_avg_dtype=torch.bfloat16)
    # remainders: hi and lo swap together (the out-of-place remainder kernel)
    rec = _compare(
        "remainders, clip", dtype=torch.bfloat16, store_param_remainders=True, clip_grad=clip
    )
    assert 1 in [r["replayed"] for r in rec]
    _compare(
        "remainders + bf16 moments",
        dtype=torch.bfloat16,
        store_param_remainders=True,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
    )


def _tp2_dp2_worker(rank, world):
    ps.initialize_model_parallel(2)
    _main_cases()


@pytest.mark.slow
def test_tp2_dp2_bitwise_with_and_without_the_overlap():
    run_distributed(_tp2_dp2_worker, 4)


def test_one_rank_bitwise_with_and_without_the_overlap(monkeypatch):
    single = ps.ParallelGroup.single()
    monkeypatch.setattr(ps, "get_data_parallel_group", lambda: single)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_group", lambda: single)
    _main_cases()
    # bf16 on one CPU rank: the sync step writes the flat buffer in place, the overlap not
    _compare("bf16, one micro-batch", dtype=torch.bfloat16, micro=GBS)


# ------------------------------------------------------------------ the worker
def test_the_speculative_adam_runs_on_the_worker_while_backward_goes_on():
    """Each host bucket's Adam is queued during backward and runs on the worker thread:
    backward returns while the first call is still held (a gate) on that thread."""
    model, opt = _build(True, dtype=torch.bfloat16, micro_batches=1, clip_grad=0.0)
    gate, entered, calls, real = threading.Event(), threading.Event(), [], live(opt).adam

    def held(*a, **k):
        calls.append(threading.current_thread().name)
        entered.set()
        assert gate.wait(30), "the gate was never opened"
        real(*a, **k)

    wrap_adam(opt, lambda _: held)
    t = _tokens(0)
    opt.zero_grad(lr=HP["lr"])
    opt.backward(model(t[:, :-1], t[:, 1:]).mean())  # returns: it does not wait for Adam
    assert entered.wait(30), "no Adam call was queued during backward"
    assert calls == ["host-grad-accumulate"], calls  # the first call, held on the worker
    gate.set()
    opt.step(HP["lr"])
    assert len(calls) == len(opt.host_side.pieces) > 1
    assert set(calls) == {"host-grad-accumulate"}
    rec = opt.stats()
    assert rec["host_exposed_ms"] > 0 and rec["host_hidden_ms"] >= 0


class _FakeEvent:
    """A CUDA event's stand-in (CPU): logs who waits on it."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def synchronize(self):
        self.log.append(("sync", self.name, threading.current_thread().name))


def test_each_staging_copy_waits_for_its_own_last_copy_up():
    """The event of a staging's uploads travels with it: the speculation that next writes
    that staging (two steps later) sleeps on it first, on the worker; the other not."""
    model, opt = _build(True, dtype=torch.bfloat16, micro_batches=1, clip_grad=0.0)
    log, real = [], live(opt).adam

    def logged(*a, param_out, **k):
        log.append(("adam", param_out.data_ptr()))
        real(*a, param_out=param_out, **k)

    wrap_adam(opt, lambda _: logged)
    single = ps.ParallelGroup.single()

    def step(i):
        log.clear()
        train_step(model, opt, iter([_tokens(i)]), 1, HP["lr"], single, CPU)
        return list(log)

    step(0)
    first = live(opt).hi  # live after step 1: the uploads of step 1 read it
    live(opt).uploaded = _FakeEvent("first", log)  # as the publish records it on CUDA
    assert [e[0] for e in step(1)] == ["adam"] * len(opt.host_side.pieces)  # the other
    live(opt).uploaded = _FakeEvent("second", log)
    third = step(2)
    assert third[0] == ("sync", "first", "host-grad-accumulate"), third[:2]
    lo, hi = first.data_ptr(), first.data_ptr() + first.numel() * first.element_size()
    assert all(lo <= ptr < hi for kind, ptr in third[1:]) and len(third) == 1 + len(
        opt.host_side.pieces
    )
    assert live(opt).hi is first


def test_a_failing_speculative_step_is_raised_by_the_step_named():
    model, opt = _build(True)

    def broken(*a, **k):
        raise MemoryError("no room")

    wrap_adam(opt, lambda _: broken)
    t = _tokens(0)
    opt.zero_grad(lr=HP["lr"])
    opt.backward(model(t[:, :-1], t[:, 1:]).mean())
    with pytest.raises(RuntimeError) as e:
        opt.step(HP["lr"])
    assert "speculative CPU Adam of bucket" in str(e.value.__cause__)
    assert isinstance(e.value.__cause__.__cause__, MemoryError)


def test_an_lr_changed_after_the_speculation_replays_the_step_exactly():
    """The speculation reads the groups' learning rate as backward runs; a step at another
    rate is recomputed from the committed copy: the same params as the synchronous step."""
    params = {}
    for overlap in (True, False):
        model, opt = _build(overlap)
        t = _tokens(0)
        opt.zero_grad(lr=1e-3)
        opt.backward(model(t[:, :-1], t[:, 1:]).mean())
        opt.step(2e-3)
        params[overlap] = opt.flat.clone()
        if overlap:
            assert opt.stats()["replayed"] == 1
    assert torch.equal(params[True], params[False])


# --------------------------------------------------------------- placement
def test_the_second_copy_is_placed_allocated_and_planned():
    """copies=2 for master, moments and param staging; memory_bytes (the real tensors)
    equals the planner's bytes; +12 B per host element in fp32 state (+2 for bf16 params)."""
    for dtype in (torch.bfloat16, torch.float32):
        reports = {}
        for overlap in (False, True):
            model, opt = _build(overlap, dtype=dtype, bucket=3000)
            reports[overlap] = rep = opt.memory_bytes()
            cfg = GPTConfig(**tiny_gpt_config())
            options = OptimizerOptions(dtype=dtype, bucket_size=3000, overlap_cpu_optimizer=overlap)
            run = Run(cfg, options=options, cuda=False)
            shapes = rank_shapes(spec_named_params(cfg, 1), 1, 3000)
            _, host, _ = plan_rank(run, shapes, Hardware())
            assert {k: v for k, v in host.items() if k in EXACT} == rep["host"]
        n = opt.layout.slice_numel
        extra = {
            k: reports[True]["host"][k] - reports[False]["host"][k] for k in reports[True]["host"]
        }
        # no param staging either way: on one CPU rank both steps write the flat buffer
        # in place (bf16), and in fp32 the master itself goes up
        assert extra == dict(staging=0, master=4 * n, exp_avg=4 * n, exp_avg_sq=4 * n, grads=0)
        for name in ("master", "exp_avg", "exp_avg_sq"):
            spare = host_tensor_of(opt.host_side.states[1], name)
            assert opt.placement.buffer(name).copies == 2
            assert spare.numel() == n and spare.data_ptr() != host_tensor(opt, name).data_ptr()


# ------------------------------------------------------------------- flags
@pytest.mark.parametrize(
    "flags, line",
    [
        (["--cpu-offload", "--dpu-warmup-steps", "2"], "--overlap-cpu-optimizer and --dpu-warmup"),
        (["--optimizer", "torch-adamw"], "--overlap-cpu-optimizer needs --optimizer adam"),
        ([], "--overlap-cpu-optimizer needs --cpu-offload"),
        (["--cpu-offload", "--optimizer-offload-fraction", "0"], "needs a host share"),
    ],
)
def test_the_flag_is_refused_where_it_cannot_apply(flags, line):
    argv = ["--overlap-cpu-optimizer", "--train-iters", "1", *flags]
    with pytest.raises(ConfigError, match=line):
        resolve(parse_args(argv), 1)


def test_the_optimizer_refuses_it_without_offload_or_with_dpu():
    for kw, line in (
        (dict(cpu_offload=False), "--overlap-cpu-optimizer needs --cpu-offload"),
        (dict(dpu_warmup_steps=1), "--overlap-cpu-optimizer and --dpu-warmup-steps are exclusive"),
    ):
        with pytest.raises(ValueError, match=line):
            _build(True, **kw)


def test_the_flag_reaches_the_options():
    from mp_offload.planner.cli import run_from_args

    argv = ["--overlap-cpu-optimizer", "--cpu-offload", "--train-iters", "1"]
    args = resolve(parse_args(argv), 1)
    assert OptimizerOptions.from_args(args).overlap_cpu_optimizer
    args.model = GPTConfig(**tiny_gpt_config())
    run = run_from_args(args, 1, cuda=False)  # the planner plans the second copy
    assert run.options.overlap_cpu_optimizer
    assert not run_from_args(args, 1, mode="zero2").options.overlap_cpu_optimizer


# -------------------------------------------------------------- checkpoints
def _run(world, tp, *extra):
    argv = [*CKPT_RUN, "--tensor-model-parallel-size", str(tp), *extra]
    run_distributed(pretrain_worker, world, argv)


def _numbers(path):
    keep = ("iteration", "loss", "grad_norm", "lr", "valid_loss", "test_loss")
    return [{k: v for k, v in r.items() if k in keep} for r in log_records(path)]


@pytest.mark.slow
def test_checkpoints_hold_the_committed_copy_and_resume_bitwise(tmp_path, capfd):
    """TP=2 x DP=2: the overlap's checkpoint is the synchronous run's, tensor for tensor;
    resumed with the flag it continues bitwise like the unbroken run; resharded to TP=1 x
    DP=2 it is bitwise the resharded resume without the flag. The log has the fields."""
    import os

    from mp_offload.checkpoint.on_disk import iter_dir, optim_file

    ov, unbroken = ["--overlap-cpu-optimizer"], str(tmp_path / "unbroken.jsonl")
    _run(4, 2, *ov, "--log-json", unbroken)
    assert "steps replayed (replay rate" in capfd.readouterr().out
    recs = [r for r in log_records(unbroken) if "loss" in r]
    assert all({"replayed", "host_hidden_ms", "host_exposed_ms"} <= set(r) for r in recs)
    assert recs[-1]["overlap_steps"] == 8
    for name, flags in (("over", ov), ("sync", [])):
        _run(4, 2, *flags, "--save", str(tmp_path / name), "--exit-interval", "4")
    for tp_rank, dp_rank in ((0, 0), (1, 1)):
        a, b = (
            torch.load(os.path.join(iter_dir(str(tmp_path / d), 4), optim_file(tp_rank, dp_rank)))
            for d in ("over", "sync")
        )
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[key], b[key]), (tp_rank, dp_rank, key)
    resumed = str(tmp_path / "resumed.jsonl")
    _run(4, 2, *ov, "--load", str(tmp_path / "over"), "--log-json", resumed)
    assert _numbers(resumed) == [r for r in _numbers(unbroken) if r["iteration"] > 4]
    logs = {}
    for name, flags in (("over", ov), ("sync", [])):
        logs[name] = str(tmp_path / f"reshard_{name}.jsonl")
        _run(2, 1, *flags, "--load", str(tmp_path / "over"), "--log-json", logs[name])
    assert _numbers(logs["over"]) == _numbers(logs["sync"]) != []


def test_the_run_summary_gives_the_replay_rate():
    import time
    from types import SimpleNamespace as NS

    from mp_offload.runtime.logger import run_summary

    args = NS(model=NS(seq_length=16), train=NS(train_iters=8), ckpt=NS(save=None))
    logger = NS(start=time.time(), last_eval={})
    last = dict(iteration=8, consumed_samples=64, loss=4.0, overlap_steps=8, overlap_replays=2)
    out = run_summary(args, logger, last, 0, 0, False)
    assert "overlap     2 of 8 steps replayed (replay rate 25.0%" in out
    del last["overlap_steps"], last["overlap_replays"]
    assert "overlap" not in run_summary(args, logger, last, 0, 0, False)  # without the flag
