"""Shared helpers of the ZeRO optimizer's tests: build one from keywords as the tests
write them (the hyperparameters, the groups and any ``OptimizerOptions`` field), and name
a mode in a test id."""

from __future__ import annotations

import dataclasses

import torch

from mp_offload.optimizer.options import OptimizerOptions
from mp_offload.optimizer.zero import ZeroOptimizer

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
