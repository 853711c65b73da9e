"""optimizer/placement.py: one placement of every ZeRO buffer, allocated by the optimizer
and summed by the planner; the flags translated once (OptimizerOptions.from_args)."""

import pytest
import torch
from helpers import ADAM_HP as HP
from helpers import tiny_gpt_config

from mp_offload import parallel_state as ps
from mp_offload.config import parse_args, resolve
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.optimizer import build_optimizer
from mp_offload.optimizer.host_state import Q8Moment
from mp_offload.optimizer.layout import FlatLayout
from mp_offload.optimizer.options import OptimizerOptions
from mp_offload.optimizer.placement import placement
from mp_offload.optimizer.zero import ZeroOptimizer
from mp_offload.planner import rank_shapes, spec_named_params
from mp_offload.planner.cli import run_from_args

SINGLE = ps.ParallelGroup.single()
BF16 = torch.bfloat16
OPTIONS = [
    dict(dtype=BF16),
    dict(dtype=BF16, cpu_offload=False),
    dict(dtype=BF16, dpu_warmup_steps=0),
    dict(dtype=torch.float32),
    dict(dtype=BF16, micro_batches=4, exp_avg_sq_dtype=BF16),
    dict(dtype=BF16, micro_batches=4, accumulate_on_device=True, exp_avg_dtype=BF16),
    dict(dtype=BF16, offload_fraction=0.5, dpu_warmup_steps=0),
    dict(dtype=BF16, offload_fraction=0.0),
    dict(dtype=BF16, store_param_remainders=True),
    dict(dtype=BF16, store_param_remainders=True, offload_fraction=0.5, micro_batches=4),
    dict(dtype=BF16, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
    dict(dtype=BF16, store_param_remainders=True, exp_avg_sq_dtype=torch.uint8),
    dict(dtype=BF16, overlap_cpu_optimizer=True),
    dict(dtype=BF16, micro_batches=4, offload_fraction=0.5, overlap_cpu_optimizer=True),
]


def _tensors(opt: ZeroOptimizer, name: str) -> list[torch.Tensor]:
    """The optimizer's tensors for one placed buffer (an 8-bit moment's codes, its pieces
    end to end, and its scales)."""
    if name.startswith("share."):
        return [getattr(opt.share, name.split(".")[1])]
    if name.endswith(".scales"):
        return [getattr(opt, name.split(".")[0]).scales]
    q = getattr(opt, name, None)
    if isinstance(q, Q8Moment):
        return [torch.cat([p.codes for _, p in sorted(q.pieces.items())])]
    one = dict(
        params=opt.flat,
        grad_accumulation=opt.reducer.acc_buffer,
        master=opt.master,
        exp_avg=opt.exp_avg,
        exp_avg_sq=opt.exp_avg_sq,
        param_staging=None if opt.param_staging is opt.flat else opt.param_staging,
    )
    if name in one:  # the overlap's second copy (its spare HostState) beside the live one
        spare = opt.spare_state
        key = dict(param_staging="hi").get(name, name)
        extra = [] if spare is None or not hasattr(spare, key) else [getattr(spare, key)]
        extra = [t for t in extra if t is not None and t is not opt.flat]  # in place: no copy
        return ([] if one[name] is None else [one[name]]) + extra
    return dict(grads=opt.grads, grad_staging=opt.grad_staging)[name]


@pytest.mark.parametrize("kw", OPTIONS)
def test_the_optimizer_allocates_exactly_its_placement(kw):
    """Buffer by buffer: the copies, elements, dtype and side the placement names."""
    model = GPTModel(GPTConfig(**tiny_gpt_config()), tp_group=SINGLE)
    opt = ZeroOptimizer(model, **HP, dp=SINGLE, tp=SINGLE, device="cpu", bucket_size=900, **kw)
    for buf in opt.placement.buffers:
        if buf.name == "grad_buckets":  # made as backward needs them (planner test: bytes)
            assert (opt.reducer.max_bucket, opt.reducer.dtype) == (buf.numel, buf.dtype)
            continue
        got = _tensors(opt, buf.name)
        assert len(got) == buf.copies, buf
        for t in got:
            assert (t.numel(), t.dtype, t.device.type) == (buf.numel, buf.dtype, "cpu"), buf
    offloaded = kw.get("cpu_offload", True) and kw.get("offload_fraction") != 0.0
    assert opt.cpu_offload == opt.placement.offloaded == offloaded
    assert opt.share_numel == opt.placement.share_numel
    assert (opt.share_numel > 0) == (kw.get("offload_fraction") == 0.5)


@pytest.mark.parametrize("kw", OPTIONS)
def test_the_layout_and_the_planners_shapes_place_alike(kw):
    """The planner places from its RankShapes, the optimizer from its FlatLayout: the same
    buffers, DP = 2 and CUDA (pinned staging) included."""
    named = spec_named_params(GPTConfig(**tiny_gpt_config()), 1)
    o = OptimizerOptions(bucket_size=900, **kw)
    for dp, device_type in ((1, "cpu"), (2, "cuda")):
        layout = FlatLayout(named, dp, 0, 0, 900)
        shapes = rank_shapes(named, dp, 900)
        assert placement(layout, o, device_type) == placement(shapes, o, device_type)


def test_the_flags_are_translated_once_for_the_optimizer_and_the_planner(monkeypatch):
    flags = ["--bf16", "--cpu-offload", "--exp-avg-sq-dtype", "bf16", "--train-iters", "1"]
    flags += ["--optimizer-offload-fraction", "0.5", "--global-batch-size", "4"]
    flags += ["--micro-batch-size", "1", "--reduce-bucket-size", "900"]
    flags += ["--dpu-warmup-steps", "3", "--accumulate-allreduce-grads-in-fp32"]
    args = resolve(parse_args(flags), 1)
    want = OptimizerOptions.from_args(args)
    assert want.micro_batches == 4 and want.reduce_dtype == torch.float32
    assert (want.exp_avg_sq_dtype, want.offload_fraction, want.dpu_warmup_steps) == (BF16, 0.5, 3)
    args.model = GPTConfig(**tiny_gpt_config())
    model = GPTModel(args.model, tp_group=SINGLE)
    monkeypatch.setattr(ps, "get_data_parallel_group", lambda: SINGLE)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_group", lambda: SINGLE)
    opt = build_optimizer(model, args, torch.device("cpu"))
    assert opt.options == want
    run = run_from_args(args, 1, cuda=False)
    assert run.options == want  # the planner plans from the optimizer's own options
    shapes = rank_shapes(spec_named_params(args.model, 1), 1, run.options.bucket_size)
    assert placement(shapes, run.options, "cpu") == placement(shapes, want, "cpu")
