"""optimizer/placement.py: one placement of every ZeRO buffer, allocated by the optimizer
and summed by the planner; the flags translated once (OptimizerOptions.from_args)."""

import pytest
import torch
from helpers import ADAM_HP as HP
from helpers import tiny_gpt_config
from zero_helpers import build_zero, mode_id

from mp_offload import parallel_state as ps
from mp_offload.config import parse_args, resolve
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.optimizer import build_optimizer
from mp_offload.optimizer.host_state import Q8Moment
from mp_offload.optimizer.layout import FlatLayout
from mp_offload.optimizer.options import OptimizerOptions, legal_modes
from mp_offload.optimizer.placement import placement
from mp_offload.optimizer.zero import ZeroOptimizer
from mp_offload.planner import rank_shapes, spec_named_params
from mp_offload.planner.cli import run_from_args

SINGLE = ps.ParallelGroup.single()
BF16 = torch.bfloat16
# The one table of legal modes, plus the mixed moments it does not generate (its moments
# axis gives both moments one dtype): each moment's buffers are placed by its own dtype.
MODES = legal_modes(bucket_size=900) + [
    OptimizerOptions(dtype=BF16, bucket_size=900, micro_batches=4, exp_avg_sq_dtype=BF16),
    OptimizerOptions(
        dtype=BF16, bucket_size=900, micro_batches=4, accumulate_on_device=True, exp_avg_dtype=BF16
    ),
    OptimizerOptions(
        dtype=BF16, bucket_size=900, store_param_remainders=True, exp_avg_sq_dtype=torch.uint8
    ),
]


def _tensors(opt: ZeroOptimizer, name: str) -> list[torch.Tensor]:
    """The optimizer's tensors for one placed buffer, from the sides' ``buffers()`` (an
    8-bit moment's codes, its pieces end to end, and its scales)."""
    if name == "params":
        return [opt.flat]
    if name == "grad_accumulation":
        return [opt.reducer.source.buffer]
    out = []
    for side in opt.sides:
        for n, t in side.buffers():
            if isinstance(t, Q8Moment) and name in (n, n + ".scales"):
                codes = torch.cat([p.codes for _, p in sorted(t.pieces.items())])
                out.append(t.scales if name.endswith(".scales") else codes)
            elif n == name:
                if not isinstance(t, torch.Tensor):  # a stored form: its tensor
                    t = t.master if hasattr(t, "master") else t.t
                out.append(t)
    return out


def test_every_mode_has_its_own_id():
    ids = [mode_id(o) for o in MODES]
    assert len(set(ids)) == len(ids), [i for i in ids if ids.count(i) > 1]


@pytest.mark.parametrize("options", MODES, ids=mode_id)
def test_the_optimizer_allocates_exactly_its_placement(options):
    """Buffer by buffer: the copies, elements, dtype and side the placement names."""
    model = GPTModel(GPTConfig(**tiny_gpt_config()), tp_group=SINGLE)
    opt = build_zero(model, **HP, dp=SINGLE, tp=SINGLE, device="cpu", options=options)
    for buf in opt.placement.buffers:
        if buf.name == "grad_buckets":  # made as backward needs them (planner test: bytes)
            assert (opt.reducer.source.max_bucket, opt.reducer.source.dtype) == (
                buf.numel,
                buf.dtype,
            )
            continue
        got = _tensors(opt, buf.name)
        assert len(got) == buf.copies, buf
        for t in got:
            assert (t.numel(), t.dtype, t.device.type) == (buf.numel, buf.dtype, "cpu"), buf
    # From the fields, not the options' own ``offloaded``: F = 0 offloads nothing.
    offloaded = options.cpu_offload and options.offload_fraction != 0.0
    assert opt.placement.offloaded == options.offloaded == offloaded
    assert (opt.placement.share_numel > 0) == (offloaded and options.offload_fraction < 1.0)


@pytest.mark.parametrize("options", MODES, ids=mode_id)
def test_the_layout_and_the_planners_shapes_place_alike(options):
    """The planner places from its RankShapes, the optimizer from its FlatLayout: the same
    buffers, DP = 2 and CUDA (pinned staging) included."""
    named = spec_named_params(GPTConfig(**tiny_gpt_config()), 1)
    for dp, device_type in ((1, "cpu"), (2, "cuda")):
        layout = FlatLayout(named, dp, 0, 0, options.bucket_size)
        shapes = rank_shapes(named, dp, options.bucket_size)
        assert placement(layout, options, device_type) == placement(shapes, options, device_type)


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
