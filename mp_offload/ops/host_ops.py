"""Python face of csrc/host_ops.cpp: the host's gradient accumulation and norm pieces.

Every argument is checked here (CPU, contiguous, dtypes, sizes, ranges) before a raw
pointer reaches C++. Without the extension the same results come from torch ops, only
slower, so callers never need to care whether it was built.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

try:
    from .. import _host_ops as _C
except ImportError:  # not built: torch fallback below
    _C = None

_CODES = {} if _C is None else {torch.float32: _C.DTYPE_FLOAT32,
                                torch.float16: _C.DTYPE_FLOAT16,
                                torch.bfloat16: _C.DTYPE_BFLOAT16}


def _usable(t: torch.Tensor) -> bool:
    return _C is not None and t.device.type == "cpu" and t.is_contiguous()


def set_num_threads(n: int) -> None:
    if _C is not None:
        _C.set_num_threads(int(n))


def accumulate_(dst: torch.Tensor, src: torch.Tensor, overwrite: bool) -> None:
    """``dst = src`` (``overwrite``) or ``dst += src``, dst fp32, src fp32/fp16/bf16."""
    if dst.dtype != torch.float32 or dst.shape != src.shape or src.dtype not in (
            torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"accumulate_: dst fp32 and src fp32/fp16/bf16 of one shape, got "
                         f"{dst.dtype}{tuple(dst.shape)} and {src.dtype}{tuple(src.shape)}")
    if _usable(dst) and _usable(src):
        _C.accumulate(dst.data_ptr(), src.data_ptr(), dst.numel(), _CODES[src.dtype],
                      bool(overwrite))
    elif overwrite:
        dst.copy_(src)
    else:
        dst.add_(src)


def sum_squares(x: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Sum of squares (fp64 scalar) of fp32 ``x`` over sorted, in-bounds ``ranges``."""
    n = x.numel()
    for a, z in ranges:
        if not 0 <= a <= z <= n:
            raise ValueError(f"sum_squares: range ({a}, {z}) outside [0, {n}]")
    if x.dtype == torch.float32 and _usable(x):
        return torch.tensor(_C.sum_squares(x.data_ptr(), list(ranges)), dtype=torch.float64)
    parts = [x[a:z].double().square().sum() for a, z in ranges]
    return torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64)
