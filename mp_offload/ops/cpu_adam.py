"""Fused CPU Adam/AdamW for ZeRO-Offload (Python face of ``mp_offload._cpu_adam``).

The C++ kernel works on raw addresses and trusts its caller, so every check
(dtype, device, contiguity, sizes, aliasing, hyper-parameters) happens here,
before any pointer crosses over. One call makes one pass over memory: it reads
param/grad/exp_avg/exp_avg_sq, writes param/exp_avg/exp_avg_sq and, optionally,
the new param rounded to fp16/bf16 into ``param_out`` (the copy that goes back
to the GPU). The math is torch.optim.AdamW / Adam's, operation for operation.

Threads default to the cores this rank may use: ``OMP_NUM_THREADS`` if set,
else ``len(os.sched_getaffinity(0)) // LOCAL_WORLD_SIZE`` (ranks sharing a host
must not oversubscribe it). ``MP_OFFLOAD_CPU_ADAM_SIMD`` = scalar|avx2|avx512|auto
forces the SIMD path at import.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Callable, Iterable, Optional

import torch

from mp_offload import _cpu_adam as _C

__all__ = [
    "adam_step",
    "stream_probe",
    "simd_level",
    "set_simd_level",
    "available_simd_levels",
    "set_num_threads",
    "get_num_threads",
    "default_num_threads",
    "CPUAdam",
]

_DTYPE_CODES = {
    torch.float32: _C.DTYPE_FLOAT32,
    torch.float16: _C.DTYPE_FLOAT16,
    torch.bfloat16: _C.DTYPE_BFLOAT16,
}
_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_OUT_DTYPES = (torch.float16, torch.bfloat16)


def default_num_threads() -> int:
    """Cores available to this rank (see module docstring); at least 1."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env:
        try:
            return max(1, int(env.split(",")[0]))  # "8,2" (nested) -> outer level
        except ValueError:
            pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        local_world = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_world = 1
    return max(1, cores // local_world)


def simd_level() -> str:
    """The active kernel: 'scalar', 'avx2' or 'avx512'."""
    return _C.simd_level()


def available_simd_levels() -> list:
    """Kernels this CPU can run, e.g. ['scalar', 'avx2', 'avx512']."""
    return list(_C.available_simd_levels())


def set_simd_level(name: str) -> None:
    """Force 'scalar' | 'avx2' | 'avx512', or 'auto' (best available).

    Raises ValueError for an unknown name, RuntimeError if the CPU lacks it."""
    _C.set_simd_level(str(name))


def set_num_threads(n: int) -> None:
    """OpenMP threads used by adam_step / stream_probe (>= 1)."""
    _C.set_num_threads(int(n))


def get_num_threads() -> int:
    return _C.get_num_threads()


# ------------------------------------------------------------------ checks
def _check_tensor(fn: str, name: str, t, dtypes, numel: Optional[int]) -> None:
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
        raise ValueError(f"{fn}: {name} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{fn}: {name} has {t.numel()} elements, param has {numel}")


def _check_no_overlap(fn: str, tensors: dict) -> None:
    """The kernel writes param/exp_avg/exp_avg_sq/param_out while reading all:
    any two sharing bytes would make the result depend on the vector width."""
    spans = [
        (name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for name, t in tensors.items()
        if t is not None
    ]
    for i, (na, a0, a1) in enumerate(spans):
        for nb, b0, b1 in spans[i + 1 :]:
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{fn}: {na} and {nb} overlap in memory")


def _as_step(fn: str, step) -> int:
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


def _check_hyper(fn: str, lr, beta1, beta2, eps, weight_decay, grad_scale=1.0) -> None:
    def real(name, x):
        if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(float(x)):
            raise ValueError(f"{fn}: {name} must be a finite real number, got {x!r}")

    for name, x in (("lr", lr), ("beta1", beta1), ("beta2", beta2), ("eps", eps),
                    ("weight_decay", weight_decay), ("grad_scale", grad_scale)):
        real(name, x)
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


def _check_buffers(fn, param, grad, exp_avg, exp_avg_sq, param_out) -> int:
    _check_tensor(fn, "param", param, (torch.float32,), None)
    n = param.numel()
    _check_tensor(fn, "grad", grad, _GRAD_DTYPES, n)
    _check_tensor(fn, "exp_avg", exp_avg, (torch.float32,), n)
    _check_tensor(fn, "exp_avg_sq", exp_avg_sq, (torch.float32,), n)
    if param_out is not None:
        _check_tensor(fn, "param_out", param_out, _OUT_DTYPES, n)
    if n:
        _check_no_overlap(fn, {"param": param, "grad": grad, "exp_avg": exp_avg,
                               "exp_avg_sq": exp_avg_sq, "param_out": param_out})
    return n


# ------------------------------------------------------------------ kernels
def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    bias_correction: bool = True,
    param_out: Optional[torch.Tensor] = None,
    grad_scale: float = 1.0,
) -> None:
    """One in-place Adam (adamw=False, L2 added to the grad) or AdamW step.

    param, exp_avg, exp_avg_sq: fp32 contiguous CPU, same numel (updated in place).
    grad: fp32/fp16/bf16 contiguous CPU, same numel; multiplied by grad_scale first
    (loss-scale unscaling and clipping folded into the same pass).
    param_out: optional fp16/bf16 contiguous CPU (pinned is fine), same numel;
    receives the new param rounded to nearest even, in the same pass.
    step: the 1-based step number used for bias correction.
    """
    fn = "adam_step"
    n = _check_buffers(fn, param, grad, exp_avg, exp_avg_sq, param_out)
    step = _as_step(fn, step)
    _check_hyper(fn, lr, beta1, beta2, eps, weight_decay, grad_scale)
    if n == 0:
        return
    _C.adam_step(
        param.data_ptr(), grad.data_ptr(), _DTYPE_CODES[grad.dtype],
        exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        0 if param_out is None else param_out.data_ptr(),
        0 if param_out is None else _DTYPE_CODES[param_out.dtype],
        n, step, float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        bool(adamw), bool(bias_correction), float(grad_scale),
    )


def stream_probe(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: Optional[torch.Tensor] = None,
) -> float:
    """Memory-bandwidth ceiling for adam_step: one pass with exactly the same
    loads/stores (and threads, tiles, SIMD path) but trivial math. Returns the
    pass's wall time in seconds. OVERWRITES param/exp_avg/exp_avg_sq/param_out
    with junk: give it scratch buffers."""
    fn = "stream_probe"
    n = _check_buffers(fn, param, grad, exp_avg, exp_avg_sq, param_out)
    if n == 0:
        return 0.0
    return _C.stream_probe(
        param.data_ptr(), grad.data_ptr(), _DTYPE_CODES[grad.dtype],
        exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        0 if param_out is None else param_out.data_ptr(),
        0 if param_out is None else _DTYPE_CODES[param_out.dtype],
        n,
    )


# ---------------------------------------------------------------- optimizer
class CPUAdam(torch.optim.Optimizer):
    """torch.optim.Optimizer over fp32 CPU params using the fused kernel.

    Per-param state matches torch's Adam/AdamW layout: ``step`` (0-dim fp32
    tensor), ``exp_avg``, ``exp_avg_sq``. ``adamw=True`` is AdamW (decoupled
    decay), ``adamw=False`` is Adam with L2 added to the gradient.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw: bool = True,
        bias_correction: bool = True,
    ):
        if len(betas) != 2:
            raise ValueError(f"CPUAdam: betas must be a pair, got {betas!r}")
        _check_hyper("CPUAdam", lr, betas[0], betas[1], eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw=adamw, bias_correction=bias_correction)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                _check_tensor("CPUAdam", "param", p, (torch.float32,), None)

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CPUAdam does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                for key in ("exp_avg", "exp_avg_sq"):  # e.g. after load_state_dict
                    if not state[key].is_contiguous():
                        state[key] = state[key].contiguous()
                state["step"] += 1
                adam_step(
                    p, p.grad.contiguous(), state["exp_avg"], state["exp_avg_sq"],
                    step=int(state["step"].item()), lr=group["lr"], beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"],
                    adamw=group.get("adamw", True), bias_correction=group.get("bias_correction", True),
                )
        return loss


set_num_threads(default_num_threads())
