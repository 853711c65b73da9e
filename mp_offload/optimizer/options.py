"""The ZeRO optimizer's options, and the one table of which of them combine.

``OptimizerOptions`` says how one optimizer is built (everything but the hyperparameters
and the parameter groups); ``placement.py`` turns it into buffers, the optimizer
allocates exactly those and the planner plans from the same object. ``RULES`` is the only
place a combination is refused: each rule is one line with its reason, written with
``{field}`` names that the caller renders as it is spoken to (``FLAGS`` for the command
line, ``KEYWORDS`` for ``OffloadAdamW``). ``legal_modes()`` generates the mode matrix the
tests run from the same table.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from .base import DEFAULT_BUCKET_SIZE

# torch.uint8: block-wise 8-bit (ops.adam_args.Blockwise8: uint8 codes + an fp32 scale a block)
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}
_MOMENT_NAMES = {v: k for k, v in MOMENT_DTYPES.items()}
_BF16 = torch.bfloat16


@dataclass(frozen=True)
class Rule:
    """An illegal combination: ``when(options)`` is true for it; ``why`` names fields as
    ``{field}`` (rendered with their values by ``render``)."""

    name: str
    when: object  # OptimizerOptions -> bool
    why: str


def _q8(o) -> bool:
    return torch.uint8 in (o.exp_avg_dtype, o.exp_avg_sq_dtype)


RULES = (
    Rule(
        "fraction_without_offload",
        lambda o: o.offload_fraction != 1.0 and not o.cpu_offload,
        "{offload_fraction} needs {cpu_offload} (without it the whole optimizer state is on "
        "the device)",
    ),
    Rule(
        "dpu_without_offload",
        lambda o: o.dpu_warmup_steps is not None and not o.cpu_offload,
        "{dpu_warmup_steps} needs {cpu_offload}",
    ),
    Rule(
        "dpu_without_host_share",
        lambda o: o.dpu_warmup_steps is not None and o.cpu_offload and not o.offloaded,
        "{dpu_warmup_steps} needs a host share: {offload_fraction} offloads nothing",
    ),
    Rule(
        "remainders_without_bf16",
        lambda o: o.store_param_remainders and o.dtype != _BF16,
        "{store_param_remainders} needs {bf16}: it keeps the fp32 master as the bf16 "
        "parameter plus a 16-bit remainder",
    ),
    Rule(
        "remainders_without_host",
        lambda o: o.store_param_remainders and o.dtype == _BF16 and not o.offloaded,
        "{store_param_remainders} needs {cpu_offload} with a host share (F > 0): it is the "
        "host's form of the master",
    ),
    Rule(
        "exp_avg_8bit_on_device",
        lambda o: o.exp_avg_dtype == torch.uint8 and not o.host_only,
        "{exp_avg_dtype} needs {cpu_offload} with the whole state on the host "
        "({offload_fraction=1}): the device-side Adam has no 8-bit moments",
    ),
    Rule(
        "exp_avg_sq_8bit_on_device",
        lambda o: o.exp_avg_sq_dtype == torch.uint8 and not o.host_only,
        "{exp_avg_sq_dtype} needs {cpu_offload} with the whole state on the host "
        "({offload_fraction=1}): the device-side Adam has no 8-bit moments",
    ),
    Rule(
        "overlap_without_offload",
        lambda o: o.overlap_cpu_optimizer and not o.cpu_offload,
        "{overlap_cpu_optimizer} needs {cpu_offload} (it overlaps the CPU Adam)",
    ),
    Rule(
        "overlap_without_host_share",
        lambda o: o.overlap_cpu_optimizer and o.cpu_offload and not o.offloaded,
        "{overlap_cpu_optimizer} needs a host share: {offload_fraction}",
    ),
    Rule(
        "overlap_with_dpu",
        lambda o: o.overlap_cpu_optimizer and o.dpu_warmup_steps is not None,
        "{overlap_cpu_optimizer} and {dpu_warmup_steps} are exclusive (DPU already overlaps "
        "the CPU Adam, one step late)",
    ),
    Rule(
        "overlap_with_8bit",
        lambda o: o.overlap_cpu_optimizer and _q8(o),
        "{overlap_cpu_optimizer} with 8bit {exp_avg_dtype}/{exp_avg_sq_dtype} is not supported "
        "(the 8-bit kernel steps in place): use fp32 or bf16 moments",
    ),
)


def _value(field: str, o) -> str:
    v = getattr(o, field, None)
    if isinstance(v, torch.dtype):
        return _MOMENT_NAMES.get(v, str(v))
    return f"{v:g}" if isinstance(v, float) else str(v)


def _flag(field: str, o) -> str:
    """A field as the command line says it (with its value where that helps)."""
    named = {
        "offload_fraction": "--optimizer-offload-fraction",
        "dpu_warmup_steps": "--dpu-warmup-steps",
        "cpu_offload": "--cpu-offload",
        "store_param_remainders": "--store-param-remainders",
        "overlap_cpu_optimizer": "--overlap-cpu-optimizer",
        "bf16": "--bf16",
        "offload_fraction=1": "--optimizer-offload-fraction 1",
        "exp_avg_dtype": "--exp-avg-dtype",
        "exp_avg_sq_dtype": "--exp-avg-sq-dtype",
    }
    out = named[field]
    if field == "offload_fraction" and o.offload_fraction != 1.0:
        out += f" {_value(field, o)}"
    if field in ("exp_avg_dtype", "exp_avg_sq_dtype") and getattr(o, field) == torch.uint8:
        out += " 8bit"
    return out


def _keyword(field: str, o) -> str:
    """A field as ``OffloadAdamW``'s keywords say it."""
    special = {"bf16": "dtype=torch.bfloat16", "offload_fraction=1": "offload_fraction=1.0"}
    if field in special:
        return special[field]
    v = getattr(o, field)
    if isinstance(v, torch.dtype):
        return f"{field}={_MOMENT_NAMES.get(v, str(v))!r}"
    return f"{field}={v!r}"


FLAGS, KEYWORDS = _flag, _keyword


def render(rule: Rule, o, names=FLAGS) -> str:
    """``rule``'s line with its fields named by ``names`` (``FLAGS`` or ``KEYWORDS``)."""
    out, rest = [], rule.why
    while "{" in rest:
        head, rest = rest.split("{", 1)
        field, rest = rest.split("}", 1)
        out += [head, names(field, o)]
    return "".join(out + [rest])


def broken_rules(o) -> list[Rule]:
    """The rules ``o`` breaks (empty: a legal combination)."""
    return [r for r in RULES if r.when(o)]


class IllegalModes(ValueError):
    """Options that do not combine: one line per broken rule, in flag names (``lines``
    renders them another way)."""

    def __init__(self, options, rules: list[Rule]):
        self.options, self.rules = options, rules
        super().__init__("\n".join(self.lines(FLAGS)))

    def lines(self, names=FLAGS) -> list[str]:
        return [render(r, self.options, names) for r in self.rules]


def compute_dtype(args) -> torch.dtype:
    t = args.train
    return torch.float16 if t.fp16 else (torch.bfloat16 if t.bf16 else torch.float32)


@dataclass(frozen=True)
class OptimizerOptions:
    """How one ZeRO optimizer is built (everything but the hyperparameters and groups).

    ``dpu_warmup_steps`` turns on the one-step delayed update after that many steps;
    ``loss_scale`` (fp16) holds the dynamic loss scaler's settings; ``offload_fraction``
    (with ``cpu_offload``): the share of the slice offloaded, F = 0 being no offload;
    ``accumulate_dtype``: of the device buffer that sums the micro-batches with
    ``accumulate_on_device``; ``reduce_dtype``: of the gradient buckets (None: ``dtype``);
    ``overlap_cpu_optimizer``: the CPU Adam runs on each host chunk during backward
    (``schedules.Overlapped``), the state in two copies. Illegal combinations raise
    ``IllegalModes`` (``RULES``).
    """

    dtype: torch.dtype = torch.float32  # of the device parameters (the compute dtype)
    cpu_offload: bool = True
    bucket_size: int = DEFAULT_BUCKET_SIZE
    dpu_warmup_steps: int | None = None
    loss_scale: dict | None = None
    micro_batches: int = 1
    accumulate_on_device: bool = False
    reduce_dtype: torch.dtype | None = None
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    offload_fraction: float = 1.0
    accumulate_dtype: torch.dtype = torch.float32
    store_param_remainders: bool = False
    overlap_cpu_optimizer: bool = False

    def __post_init__(self):
        if not 0.0 <= self.offload_fraction <= 1.0:
            raise ValueError(
                f"--optimizer-offload-fraction must be >= 0 and <= 1, got {self.offload_fraction}"
            )
        broken = broken_rules(self)
        if broken:
            raise IllegalModes(self, broken)

    @property
    def offloaded(self) -> bool:
        """Any state on the host: F = 0 is exactly the device-resident ZeRO-2."""
        return self.cpu_offload and self.offload_fraction != 0.0

    @property
    def host_only(self) -> bool:
        """All of the state on the host (F = 1)."""
        return self.offloaded and self.offload_fraction == 1.0

    @property
    def accumulates_on_device(self) -> bool:
        """The micro-batches are summed in a device buffer (only k > 1 has any to sum)."""
        return self.accumulate_on_device and self.micro_batches > 1

    @classmethod
    def checked(cls, **fields) -> tuple[OptimizerOptions, list[Rule]]:
        """(the options, the rules they break), without raising (the config asks here)."""
        o = object.__new__(cls)
        for k, v in {**_DEFAULTS, **fields}.items():
            object.__setattr__(o, k, v)
        return o, broken_rules(o)

    @classmethod
    def from_args(cls, args) -> OptimizerOptions:
        return cls(**option_fields(args))


def option_fields(args) -> dict:
    """The flags as ``OptimizerOptions`` fields (validated by the config through
    ``OptimizerOptions.checked``, built by ``from_args``)."""
    o, t = args.optim, args.train
    loss_scale = dict(
        initial=o.initial_loss_scale,
        min=o.min_loss_scale,
        window=o.loss_scale_window,
        hysteresis=o.hysteresis,
    )
    fraction = o.optimizer_offload_fraction
    return dict(
        dtype=compute_dtype(args),
        cpu_offload=o.cpu_offload,
        bucket_size=o.reduce_bucket_size,
        dpu_warmup_steps=o.dpu_warmup_steps,
        loss_scale=loss_scale if t.fp16 else None,
        micro_batches=t.num_micro_batches,  # (config.resolve)
        accumulate_on_device=o.accumulate_grads_on_device,
        reduce_dtype=torch.float32 if o.accumulate_allreduce_grads_in_fp32 else None,
        exp_avg_dtype=MOMENT_DTYPES[o.exp_avg_dtype],
        exp_avg_sq_dtype=MOMENT_DTYPES[o.exp_avg_sq_dtype],
        offload_fraction=1.0 if fraction is None else fraction,
        store_param_remainders=o.store_param_remainders,
        overlap_cpu_optimizer=o.overlap_cpu_optimizer,
    )


_DEFAULTS = {
    f: OptimizerOptions.__dataclass_fields__[f].default
    for f in OptimizerOptions.__dataclass_fields__
}

# The axes of the mode matrix: every value a test should see of each mode.
MODE_AXES = dict(
    dtype=(torch.float32, torch.bfloat16, torch.float16),
    cpu_offload=(True, False),
    offload_fraction=(1.0, 0.5, 0.0),
    store_param_remainders=(False, True),
    moments=("fp32", "bf16", "8bit"),
    overlap_cpu_optimizer=(False, True),
    dpu_warmup_steps=(None, 1),
    accumulation=("none", "host", "device"),
)


def _mode_fields(combo: dict) -> dict:
    fields = {k: v for k, v in combo.items() if k not in ("moments", "accumulation")}
    m = MOMENT_DTYPES[combo["moments"]]
    fields.update(exp_avg_dtype=m, exp_avg_sq_dtype=m)
    acc = combo["accumulation"]
    fields.update(micro_batches=1 if acc == "none" else 2, accumulate_on_device=acc == "device")
    if fields["dtype"] == torch.float16:
        fields["loss_scale"] = dict(initial=2.0**12, min=1.0, window=1000, hysteresis=2)
    return fields


def legal_modes(**fixed) -> list[OptimizerOptions]:
    """Every legal combination of ``MODE_AXES`` (``fixed`` pins fields, e.g. bucket_size)."""
    out = []
    keys = list(MODE_AXES)
    for values in itertools.product(*MODE_AXES.values()):
        fields = {**_mode_fields(dict(zip(keys, values))), **fixed}
        if not broken_rules(OptimizerOptions.checked(**fields)[0]):
            out.append(OptimizerOptions(**fields))
    return out


__all__ = ["OptimizerOptions", "IllegalModes", "RULES", "legal_modes", "replace"]
