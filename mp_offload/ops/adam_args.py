"""The C++ Adam's arguments: the dtype codes the kernel takes, the block-wise 8-bit moment
(``Blockwise8``), and the checks that turn every bad input into one clear error naming the
function and the argument before any pointer reaches C++."""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterable
from typing import NamedTuple

import torch

import mp_offload._cpu_adam as _C  # the extension module itself, not the package

DTYPE_CODES = {
    torch.float32: _C.DTYPE_FLOAT32,
    torch.float16: _C.DTYPE_FLOAT16,
    torch.bfloat16: _C.DTYPE_BFLOAT16,
}
GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OUT_DTYPES = (torch.float16, torch.bfloat16)
MOMENT_DTYPES = (torch.float32, torch.bfloat16)
BF16_ROUNDING = {"nearest_even": 0, "split": 1}
Q8_BLOCK = _C.Q8_BLOCK  # elements per scale of an 8-bit moment


class Blockwise8(NamedTuple):
    """A block-wise 8-bit moment: ``codes`` (uint8, one per element) and ``scales``
    (fp32, the absmax of each block of Q8_BLOCK elements, the last one possibly
    partial; NaN for a block that held an inf or NaN). Blocks count from codes[0]:
    a view must start on a block (and its scales at that block) and end on one or
    at its storage's end, so that no block is split between two calls."""

    codes: torch.Tensor
    scales: torch.Tensor

    @staticmethod
    def zeros(n: int) -> Blockwise8:
        """n elements of 0 (codes 0, scales 0)."""
        return Blockwise8(torch.zeros(n, dtype=torch.uint8), torch.zeros(-(-n // Q8_BLOCK)))


def check_tensor(fn: str, name: str, t, dtypes, numel: int | None, of: str = "param") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{fn}: {name} must be a CPU tensor, got device '{t.device}'")
    if t.layout != torch.strided:
        raise ValueError(f"{fn}: {name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in dtypes:
        names = "/".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{fn}: {name} must be {names}, got {str(t.dtype).replace('torch.', '')}")
    if not t.is_contiguous():
        raise ValueError(
            f"{fn}: {name} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})"
        )
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{fn}: {name} has {t.numel()} elements, {of} has {numel}")


def check_moment(fn: str, name: str, t, numel: int, of: str = "param") -> None:
    """A moment: an fp32/bf16 tensor, or a Blockwise8 whose blocks start at its first
    element and end at its last (or at its storage's end: the one partial block)."""
    if not isinstance(t, Blockwise8):
        return check_tensor(fn, name, t, MOMENT_DTYPES, numel, of)
    check_tensor(fn, f"{name}.codes", t.codes, (torch.uint8,), numel, of)
    blocks = -(-numel // Q8_BLOCK)
    check_tensor(
        fn, f"{name}.scales", t.scales, (torch.float32,), blocks, f"{of}'s {numel} elements need"
    )
    at = t.codes.storage_offset()
    if at % Q8_BLOCK:
        raise ValueError(
            f"{fn}: {name}.codes starts at element {at} of its storage, not on a block "
            f"of {Q8_BLOCK} (8-bit moments are stepped in whole blocks)"
        )
    if numel % Q8_BLOCK and at + numel != t.codes.untyped_storage().nbytes():
        raise ValueError(
            f"{fn}: {name}.codes ends inside a block of {Q8_BLOCK} ({numel} elements from "
            f"{at}); only the end of its storage may cut a block short"
        )


def moment_args(m, v) -> tuple:
    """The kernel's (exp_avg_dtype, exp_avg_sq_dtype, exp_avg_scale_ptr, exp_avg_sq_scale_ptr)."""
    codes, ptrs = [], []
    for t in (m, v):
        q8 = isinstance(t, Blockwise8)
        codes.append(_C.DTYPE_Q8 if q8 else DTYPE_CODES[t.dtype])
        ptrs.append(t.scales.data_ptr() if q8 else 0)
    return (*codes, *ptrs)


def moment_bufs(name: str, t) -> dict:
    """The tensors of a moment, named for the overlap check."""
    if isinstance(t, Blockwise8):
        return {f"{name}.codes": t.codes, f"{name}.scales": t.scales}
    return {name: t}


def ptr(t) -> int:
    return t.codes.data_ptr() if isinstance(t, Blockwise8) else t.data_ptr()


def check_no_overlap(fn: str, tensors: dict) -> None:
    """The kernel writes param/exp_avg/exp_avg_sq/param_out while reading all:
    any two sharing bytes would make the result depend on the vector width."""
    spans = []
    for name, t in tensors.items():
        if t is not None:
            a0 = t.data_ptr()
            spans.append((a0, a0 + t.numel() * t.element_size(), name))
    spans.sort()  # by start: only neighbours can overlap first
    for (_, a1, na), (b0, _, nb) in itertools.pairwise(spans):
        if b0 < a1:
            first, second = sorted((na, nb), key=list(tensors).index)
            raise ValueError(f"{fn}: {first} and {second} overlap in memory")


def as_step(fn: str, step) -> int:
    if isinstance(step, torch.Tensor):
        if step.numel() != 1:
            raise ValueError(f"{fn}: step tensor must have one element, got {step.numel()}")
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, numbers.Real):
        raise TypeError(f"{fn}: step must be an integer, got {type(step).__name__}")
    if isinstance(step, float) and not step.is_integer():
        raise ValueError(f"{fn}: step must be an integer, got {step}")
    step = int(step)
    if step < 1:
        raise ValueError(f"{fn}: step must be >= 1, got {step}")
    return step


def check_hyper(fn: str, lr, beta1, beta2, eps, weight_decay, grad_scale=1.0) -> None:
    for name, x in (
        ("lr", lr),
        ("beta1", beta1),
        ("beta2", beta2),
        ("eps", eps),
        ("weight_decay", weight_decay),
        ("grad_scale", grad_scale),
    ):
        t = type(x)  # float/int first: the ABC check below costs ~10x more per call
        if not (
            (t is float or t is int or (t is not bool and isinstance(x, numbers.Real)))
            and math.isfinite(x)
        ):
            raise ValueError(f"{fn}: {name} must be a finite real number, got {x!r}")
    if lr < 0:
        raise ValueError(f"{fn}: lr must be >= 0, got {lr}")
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"{fn}: beta1 must be in [0, 1), got {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"{fn}: beta2 must be in [0, 1), got {beta2}")
    if eps < 0:
        raise ValueError(f"{fn}: eps must be >= 0, got {eps}")
    if weight_decay < 0:
        raise ValueError(f"{fn}: weight_decay must be >= 0, got {weight_decay}")


def hyper_args(lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale) -> tuple:
    """The kernel's hyper-parameter arguments, in its order and types."""
    floats = (float(x) for x in (lr, beta1, beta2, eps, weight_decay))
    return (*floats, bool(adamw), bool(bias_correction), float(grad_scale))


def check_buffers(fn, param, grad, exp_avg, exp_avg_sq, param_out, dsts=None) -> int:
    """adam_step's buffers (``dsts``: its out-of-place ``*_dst`` by name, see check_dsts)."""
    check_tensor(fn, "param", param, (torch.float32,), None)
    n = param.numel()
    check_tensor(fn, "grad", grad, GRAD_DTYPES, n)
    check_moment(fn, "exp_avg", exp_avg, n)
    check_moment(fn, "exp_avg_sq", exp_avg_sq, n)
    if param_out is not None:
        check_tensor(fn, "param_out", param_out, OUT_DTYPES, n)
    srcs = {"param": param, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    dsts = check_dsts(fn, srcs, dsts or {})
    if n:
        moments = {**moment_bufs("exp_avg", exp_avg), **moment_bufs("exp_avg_sq", exp_avg_sq)}
        bufs = {"param": param, "grad": grad, **moments, "param_out": param_out, **dsts}
        check_no_overlap(fn, bufs)
    return n


def check_remainder_buffers(fn, param_hi, param_lo, grad, exp_avg, exp_avg_sq, dsts) -> int:
    """adam_step_remainder's buffers, as check_buffers."""
    check_tensor(fn, "param_hi", param_hi, (torch.bfloat16,), None)
    n = param_hi.numel()
    check_tensor(fn, "param_lo", param_lo, (torch.int16,), n, of="param_hi")
    check_tensor(fn, "grad", grad, GRAD_DTYPES, n, of="param_hi")
    check_moment(fn, "exp_avg", exp_avg, n, of="param_hi")
    check_moment(fn, "exp_avg_sq", exp_avg_sq, n, of="param_hi")
    srcs = {"param_hi": param_hi, "param_lo": param_lo}
    srcs.update(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    dsts = check_dsts(fn, srcs, dsts)
    if n:
        bufs = {"param_hi": param_hi, "param_lo": param_lo, "grad": grad}
        moments = {**moment_bufs("exp_avg", exp_avg), **moment_bufs("exp_avg_sq", exp_avg_sq)}
        check_no_overlap(fn, {**bufs, **moments, **dsts})
    return n


def check_dsts(fn: str, srcs: dict, dsts: dict) -> dict:
    """Out-of-place state: ``dsts`` ("<src>_dst" -> tensor or None, in the order of
    ``srcs``) all None (in place: returns {}) or all given, each of its source's dtype and
    size; 8-bit (Blockwise8) moments step in place only. Returns the given ones."""
    given = [k for k, t in dsts.items() if t is not None]
    if not given:
        return {}
    if len(given) != len(srcs):
        missing = [f"{k}_dst" for k in srcs if dsts.get(f"{k}_dst") is None]
        raise ValueError(
            f"{fn}: {', '.join(f'{k}_dst' for k in srcs)} go together (all or none): "
            f"got {', '.join(given)} without {', '.join(missing)}"
        )
    for name, src in srcs.items():
        if isinstance(src, Blockwise8):
            raise TypeError(
                f"{fn}: {name}_dst needs an fp32/bf16 {name}: an 8-bit (Blockwise8) {name} "
                "is stepped in place only"
            )
        check_tensor(fn, f"{name}_dst", dsts[f"{name}_dst"], (src.dtype,), src.numel(), of=name)
    return dict(dsts)


def dst_ptrs(dsts: dict) -> list:
    """The kernel's *_dst_ptr arguments (0: in place)."""
    return [0 if t is None else t.data_ptr() for t in dsts.values()]


def check_rounding(fn: str, bf16_rounding, param_out) -> int:
    """bf16_rounding -> its code; "split" only with a bf16 param_out to round."""
    if not isinstance(bf16_rounding, str) or bf16_rounding not in BF16_ROUNDING:
        raise ValueError(
            f"{fn}: bf16_rounding must be 'nearest_even' or 'split', got {bf16_rounding!r}"
        )
    if bf16_rounding == "split" and (param_out is None or param_out.dtype != torch.bfloat16):
        got = "none" if param_out is None else str(param_out.dtype).replace("torch.", "")
        raise ValueError(f"{fn}: bf16_rounding='split' needs a bfloat16 param_out, got {got}")
    return BF16_ROUNDING[bf16_rounding]


def check_runs(fn: str, runs, n: int) -> list:
    """decay_runs -> [(start, end), ...]: pairs of ints, 0 <= start <= end <= n,
    sorted and non-overlapping (each starts at or after the previous one's end).
    Empty runs are allowed (a zero-size tensor) and do nothing."""
    if isinstance(runs, torch.Tensor):
        runs = runs.tolist()
    if isinstance(runs, (str, bytes)) or not isinstance(runs, Iterable):
        raise TypeError(
            f"{fn}: decay_runs must be a sequence of (start, end) pairs, got {type(runs).__name__}"
        )
    runs = list(runs)
    out = []
    prev_end = 0
    for k, r in enumerate(runs):  # fast path; bad_run explains the first problem
        try:
            s, e = r
        except (TypeError, ValueError):
            raise TypeError(
                f"{fn}: decay_runs[{k}] must be a (start, end) pair, got {r!r}"
            ) from None
        if type(s) is not int or type(e) is not int:
            if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in (s, e)):
                raise TypeError(f"{fn}: decay_runs[{k}] must hold two integers, got {r!r}")
            s, e = int(s), int(e)
        if not prev_end <= s <= e <= n:
            bad_run(fn, runs, k, n)
        prev_end = e
        out.append((s, e))
    return out


def bad_run(fn: str, runs: list, k: int, n: int) -> None:
    """Raise the ValueError that names what is wrong with runs[k] (runs[:k] are fine)."""
    s, e = (int(x) for x in runs[k])
    at = f"{fn}: decay_runs[{k}] = ({s}, {e})"
    if s > e:
        raise ValueError(f"{at} has start > end")
    if s < 0 or e > n:
        raise ValueError(f"{at} is out of range [0, {n}] (param has {n} elements)")
    ps, pe = (int(x) for x in runs[k - 1])
    if s < ps:
        raise ValueError(f"{at} is unsorted: it starts before decay_runs[{k - 1}] = ({ps}, {pe})")
    raise ValueError(f"{at} overlaps decay_runs[{k - 1}] = ({ps}, {pe})")
