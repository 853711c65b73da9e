"""Shared helpers of the ZeRO optimizer's tests: build one from keywords as the tests
write them (the hyperparameters, the groups and any ``OptimizerOptions`` field), a tiny
one on one CPU rank and its training loop, its state read back, and a mode's test id."""

from __future__ import annotations

import dataclasses

import torch
from helpers import ADAM_HP, micro_batches, tiny_gpt_config

from mp_offload import parallel_state as ps
from mp_offload.data.loader import MockGPTDataset
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.optimizer.layout import FlatLayout
from mp_offload.optimizer.options import OptimizerOptions
from mp_offload.optimizer.placement import Placement, allocate, placement
from mp_offload.optimizer.zero import ZeroOptimizer
from mp_offload.training import train_step

SINGLE, CPU = ps.ParallelGroup.single(), torch.device("cpu")
_DATA = MockGPTDataset(10_000, 16, 96, seed=3)  # learnable: a loss that falls is visible
OPTION_FIELDS = {f.name for f in dataclasses.fields(OptimizerOptions)}
_DT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "8bit"}


def mode_id(o: OptimizerOptions) -> str:
    """A short test id of a mode: compute dtype, where the state is (``dev``, or ``off``
    and the fraction), remainders, moments (one name when both agree), overlap, DPU and
    the accumulation (``k`` micro-batches, ``d``: summed on the device)."""
    parts = [_DT[o.dtype], f"off-F{o.offload_fraction:g}" if o.cpu_offload else "dev"]
    parts += ["rem"] * o.store_param_remainders
    m, v = _DT[o.exp_avg_dtype], _DT[o.exp_avg_sq_dtype]
    parts.append(f"m{m}" if m == v else f"m{m}+{v}")
    parts += ["ovl"] * o.overlap_cpu_optimizer
    parts += [] if o.dpu_warmup_steps is None else [f"dpu{o.dpu_warmup_steps}"]
    return "-".join(parts + [f"k{o.micro_batches}" + "d" * o.accumulate_on_device])


def build_zero(model, **kw) -> ZeroOptimizer:
    """``build_zero(model, ...)`` with the option fields among ``kw`` gathered into
    ``options=`` (or added to a given ``options``)."""
    fields = {k: kw.pop(k) for k in list(kw) if k in OPTION_FIELDS}
    base = kw.pop("options", None)
    options = dataclasses.replace(base, **fields) if base else OptimizerOptions(**fields)
    return ZeroOptimizer(model, options=options, **kw)


def tiny_zero(**kw) -> tuple[GPTModel, ZeroOptimizer]:
    """The tiny GPT (seed 0) and a ZeroOptimizer over it on one CPU rank with ``ADAM_HP``;
    ``kw``: option fields (``bucket_size`` 2000 unless given: a few buckets)."""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**tiny_gpt_config()), tp_group=SINGLE)
    kw.setdefault("bucket_size", 2000)
    return model, build_zero(model, **ADAM_HP, dp=SINGLE, tp=SINGLE, device="cpu", **kw)


def bf16_offload(remainders: bool, **kw) -> tuple[GPTModel, ZeroOptimizer]:
    """``tiny_zero`` in bf16 with offload, with or without ``store_param_remainders``
    (``kw`` overrides, an illegal mix included: the tests of the refusals build it)."""
    kw = {"dtype": torch.bfloat16, "cpu_offload": True, **kw}
    return tiny_zero(**kw, store_param_remainders=remainders)


def tokens(step: int, n: int = 8) -> torch.Tensor:
    """Step ``step``'s ``n`` rows [n, 17] of the mock data (the same rows on every run)."""
    return torch.stack([torch.from_numpy(_DATA[step * n + i]["text"]) for i in range(n)])


def train(model, opt, steps: int, first: int = 0, k: int = 1) -> list[float]:
    """``steps`` training steps from step ``first`` on one rank, each step's 8 rows in
    ``k`` micro-batches (``training.train_step``: what trains is what is checked), then
    the optimizer flushed (DPU); the losses."""
    losses = []
    for step in range(first, first + steps):
        batches = micro_batches(tokens(step), 8 // k)
        losses.append(train_step(model, opt, batches, k, ADAM_HP["lr"], SINGLE, CPU).loss)
    opt.flush()
    return losses


def flat_params(model) -> torch.Tensor:
    """Every parameter of ``model``, in fp32, end to end."""
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def state_cat(opt, key: str) -> torch.Tensor:
    """State ``key`` of ``opt.state_dict()`` as one tensor (its sides' parts joined)."""
    x = opt.state_dict()[key]
    return torch.cat(x if isinstance(x, list) else [x])


def small_parts(dp: int = 1, dp_rank: int = 0, bucket_size: int = 50, **options):
    """What a side or the reducer is made of, without a ZeroOptimizer: (model, layout,
    placement, flat params) of three Linear layers (8-16-16-4, 484 weights) on the CPU.
    At bucket_size 50 they make three padded buckets; ``options``: option fields."""
    torch.manual_seed(0)
    lin = torch.nn.Linear
    model = torch.nn.Sequential(
        lin(8, 16), torch.nn.Tanh(), lin(16, 16), torch.nn.Tanh(), lin(16, 4)
    )
    layout = FlatLayout(list(model.named_parameters()), dp, dp_rank, 0, bucket_size)
    place: Placement = placement(
        layout, OptimizerOptions(bucket_size=bucket_size, **options), "cpu"
    )
    (flat,) = allocate(place.buffer("params"), CPU)
    return model, layout, place, flat


def adamw_reference(layout, master, grads, *, lr, betas, eps, decay, grad_scale=1.0):
    """``torch.optim.AdamW`` over the slice ``master`` (laid out by ``layout``), one step
    per gradient in ``grads`` (each laid out like the slice, times ``grad_scale``);
    ``decay``: the weight decay of matrices, none on vectors (``default_groups``' rule).
    Adam is elementwise, so each owned piece is its own parameter. Returns the slice's
    (master, exp_avg, exp_avg_sq), zero in the padding."""
    pieces = [(slot, o, n) for slot, _, o, n in layout.owned_pieces()]
    params = [torch.nn.Parameter(master[o : o + n].clone()) for _, o, n in pieces]
    decayed = [p for p, (slot, _, _) in zip(params, pieces) if slot.param.ndim > 1]
    plain = [p for p, (slot, _, _) in zip(params, pieces) if slot.param.ndim <= 1]
    groups = [dict(params=decayed, weight_decay=decay), dict(params=plain, weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
    for g in grads:
        for p, (_, o, n) in zip(params, pieces):
            p.grad = g[o : o + n] * grad_scale
        opt.step()
    out = [torch.zeros_like(master) for _ in range(3)]
    for p, (_, o, n) in zip(params, pieces):
        out[0][o : o + n] = p.detach()
        out[1][o : o + n] = opt.state[p]["exp_avg"]
        out[2][o : o + n] = opt.state[p]["exp_avg_sq"]
    return tuple(out)


def live(opt):
    """The host side's live ``HostState`` (master, moments, staging)."""
    return opt.host_side.states[0]


def wrap_adam(opt, wrap) -> None:
    """Replace every host state copy's Adam kernel ``k`` by ``wrap(k)``."""
    for state in opt.host_side.states:
        state.adam = wrap(state.adam)


def host_tensor(opt, key: str):
    """The host side's live ``key`` as stored: "master" (fp32, or the int16 remainder),
    "exp_avg"/"exp_avg_sq" (the tensor, or the Q8Moment), "param_staging" (the hi)."""
    state = live(opt)
    if key == "param_staging":
        return state.hi
    if key == "master":
        return state.master
    form = getattr(state, key)
    return getattr(form, "t", form)
