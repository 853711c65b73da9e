"""Python face of csrc/host_ops.cpp: the host's gradient accumulation and norm pieces.

Every argument is checked here (CPU, contiguous, dtypes, sizes, ranges) before a raw
pointer reaches C++. Without the extension the same results come from torch ops, only
slower, so callers never need to care whether it was built.

The element results are exact (a conversion and one fp32 add), so every SIMD path gives
torch's bits; the sum of squares follows one fixed order on every path and thread count
(see the C++ file). ``MP_OFFLOAD_HOST_OPS_SIMD`` = scalar|avx2|avx512|auto forces the path
at import, ``set_simd_level`` afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:
    import mp_offload._host_ops as _C  # the extension module itself, not the package
except ImportError:  # not built: torch fallback below
    _C = None

_CODES = (
    {}
    if _C is None
    else {
        torch.float32: _C.DTYPE_FLOAT32,
        torch.float16: _C.DTYPE_FLOAT16,
        torch.bfloat16: _C.DTYPE_BFLOAT16,
    }
)


def _usable(t: torch.Tensor) -> bool:
    return _C is not None and t.device.type == "cpu" and t.is_contiguous()


def set_num_threads(n: int) -> None:
    if _C is not None:
        _C.set_num_threads(int(n))


def simd_level() -> str:
    """The active path: 'scalar', 'avx2', 'avx512' ('torch' without the extension)."""
    return "torch" if _C is None else _C.simd_level()


def available_simd_levels() -> list[str]:
    return [] if _C is None else list(_C.available_simd_levels())


def set_simd_level(name: str) -> None:
    """'scalar', 'avx2', 'avx512' or 'auto' (the best this CPU has)."""
    if _C is None:
        raise RuntimeError("set_simd_level: mp_offload._host_ops is not built")
    _C.set_simd_level(name)


def _check_ranges(ranges: Sequence[tuple[int, int]], n: int, what: str) -> list:
    out, prev = [], 0
    for a, z in ranges:
        if not prev <= a <= z <= n:
            raise ValueError(
                f"{what}: range ({a}, {z}) is reversed, outside [0, {n}] or "
                f"overlaps the one before it (ends at {prev})"
            )
        out.append((int(a), int(z)))
        prev = z
    return out


def accumulate_(
    dst: torch.Tensor,
    src: torch.Tensor,
    overwrite: bool,
    norm_ranges: Sequence[tuple[int, int]] | None = None,
) -> torch.Tensor | None:
    """``dst = src`` (``overwrite``) or ``dst += src``, dst fp32, src fp32/fp16/bf16.

    With ``norm_ranges`` (sorted, disjoint) also returns the sum of squares (fp64 scalar)
    of the new ``dst`` over them, computed in the same pass: what ``sum_squares`` gives.
    """
    if (
        dst.dtype != torch.float32
        or dst.shape != src.shape
        or src.dtype not in (torch.float32, torch.float16, torch.bfloat16)
    ):
        raise ValueError(
            f"accumulate_: dst fp32 and src fp32/fp16/bf16 of one shape, got "
            f"{dst.dtype}{tuple(dst.shape)} and {src.dtype}{tuple(src.shape)}"
        )
    ranges = None if norm_ranges is None else _check_ranges(norm_ranges, dst.numel(), "accumulate_")
    if _usable(dst) and _usable(src):
        total = _C.accumulate(
            dst.data_ptr(), src.data_ptr(), dst.numel(), _CODES[src.dtype], bool(overwrite), ranges
        )
        return None if ranges is None else torch.tensor(total, dtype=torch.float64)
    dst.copy_(src) if overwrite else dst.add_(src)
    return None if ranges is None else sum_squares(dst, ranges)


def sum_squares(x: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Sum of squares (fp64 scalar) of fp32/fp16/bf16 ``x`` over sorted, disjoint, in-bounds
    ``ranges`` (each element widened exactly, squared in double, in the fixed order)."""
    ranges = _check_ranges(ranges, x.numel(), "sum_squares")
    if x.dtype in _CODES and _usable(x):
        total = _C.sum_squares(x.data_ptr(), x.numel(), ranges, _CODES[x.dtype])
        return torch.tensor(total, dtype=torch.float64)
    parts = [x.reshape(-1)[a:z].double().square().sum() for a, z in ranges]
    return torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64)
