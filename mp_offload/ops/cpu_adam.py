"""Fused CPU Adam/AdamW for ZeRO-Offload (Python face of ``mp_offload._cpu_adam``).

The C++ kernel works on raw addresses and trusts its caller, so every check
(dtype, device, contiguity, sizes, aliasing, hyper-parameters) happens here,
before any pointer crosses over. One call makes one pass over memory: it reads
param/grad/exp_avg/exp_avg_sq, writes param/exp_avg/exp_avg_sq and, optionally,
the new param rounded to fp16/bf16 into ``param_out`` (the copy that goes back
to the GPU). The math is torch.optim.AdamW / Adam's, operation for operation.

The moments may be kept in bf16 (each on its own, like Megatron-core's
--exp-avg-dtype / --exp-avg-sq-dtype): the kernel widens them, runs the step in
fp32 and stores them rounded to nearest even. ``decay_runs`` lets one call cover
a whole slice whose elements take different weight decay (decayed matrices,
undecayed biases and norms): one pass, one parallel region, the GIL released.

Either moment may also be block-wise 8-bit (``Blockwise8``: uint8 codes and one
fp32 absmax scale per ``Q8_BLOCK`` = 256 elements, a log code per moment; see
``quantize_8bit``): each block is decoded, stepped in fp32 exactly as above and
re-encoded in the same pass.

``adam_step_remainder`` is the same step for a bf16 model whose fp32 master is
kept as two 16-bit halves (the kernel of the planned ``--store-param-remainders``):
``param_hi``, the bf16 param that goes to the device, and ``param_lo``, a remainder from which the
master is rebuilt exactly (``split_fp32`` / ``join_fp32``, the rule in their
docstrings). The kernel reads and writes the halves in place: no fp32 master,
no separate bf16 copy. ``adam_step(..., bf16_rounding="split")`` rounds a bf16
``param_out`` by the same rule, so both paths can hand the device the same bits.

Threads default to the run's one rule (``mp_offload/runtime/cpu_threads.py``: the cores of
the affinity mask and cgroup quota shared among the node's ranks), applied at the first
call that needs it, not at import. ``set_num_threads(n)`` overrides it and holds whatever
OMP_NUM_THREADS says (torchrun sets it to 1 per worker): the kernel passes n in a
num_threads clause; ``last_num_threads()`` reports the team the last call really ran
with. ``MP_OFFLOAD_CPU_ADAM_SIMD`` = scalar|avx2|avx512|auto
forces the SIMD path at import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

import mp_offload._cpu_adam as _C  # the extension module itself, not the package
from mp_offload.ops.adam_args import (
    DTYPE_CODES,
    MOMENT_DTYPES,
    Q8_BLOCK,
    Blockwise8,
    as_step,
    check_buffers,
    check_hyper,
    check_moment,
    check_no_overlap,
    check_remainder_buffers,
    check_rounding,
    check_runs,
    check_tensor,
    dst_ptrs,
    hyper_args,
    moment_args,
    moment_bufs,
    ptr,
)
from mp_offload.runtime.cpu_threads import default_threads_per_rank

__all__ = [
    "Q8_BLOCK",
    "Blockwise8",
    "CPUAdam",
    "adam_step",
    "adam_step_remainder",
    "available_simd_levels",
    "default_num_threads",
    "dequantize_8bit",
    "get_num_threads",
    "join_fp32",
    "last_num_threads",
    "q8_table",
    "quantize_8bit",
    "set_num_threads",
    "set_simd_level",
    "simd_level",
    "split_fp32",
    "stream_probe",
]


def default_num_threads() -> int:
    """The rule of ``cpu_threads.py`` for a CPU process (the training run applies the
    same rule through ``distributed.apply_cpu_threads``, with the GPU's launch core)."""
    return default_threads_per_rank(gpu=False)


_threads_chosen = False  # set_num_threads called (by the run, the user, or the default)


def _ensure_threads() -> None:
    if not _threads_chosen:
        set_num_threads(default_num_threads())


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
    """Threads used by adam_step / stream_probe (>= 1), whatever OMP_NUM_THREADS says."""
    global _threads_chosen
    _C.set_num_threads(int(n))
    _threads_chosen = True


def get_num_threads() -> int:
    """The count set by set_num_threads (calls on small slices may use fewer)."""
    _ensure_threads()
    return _C.get_num_threads()


def last_num_threads() -> int:
    """Threads that actually ran the last adam_step / stream_probe call (0 before any):
    omp_get_num_threads() read inside its parallel region."""
    return _C.last_num_threads()


# ------------------------------------------------------------- remainders
def split_fp32(
    x: torch.Tensor, hi: torch.Tensor | None = None, lo: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` -> (hi bf16, lo int16), bijective on all 2^32 bit patterns (the C++
    split rule, SIMD and threaded; ``hi``/``lo`` may be given to write into).

    lo = the low 16 bits of x. hi = its top 16 bits plus one where lo >= 0x8000, for
    finite x, the finite magnitudes counted modulo 0x7F80. So hi == x.to(bfloat16)
    (round to nearest even) except
      * exact ties (lo == 0x8000) under an even top half: hi rounds away from zero;
      * |x| >= 0x7F7F8000 (the floats RNE sends to inf): hi = +-0, the one code left
        free (no finite x rounds to +-0 with lo >= 0x8000);
      * inf and NaN: hi = their top half (a NaN whose payload lies in the low half
        only -- a signalling NaN no arithmetic makes -- gives +-inf).
    A finite x never gets an inf or NaN hi. No bijective rule can give RNE(x) at
    every non-tie without such a wrap (docs/DESIGN.md §7)."""
    fn = "split_fp32"
    check_tensor(fn, "x", x, (torch.float32,), None)
    n = x.numel()
    hi = torch.empty(x.shape, dtype=torch.bfloat16) if hi is None else hi
    lo = torch.empty(x.shape, dtype=torch.int16) if lo is None else lo
    check_tensor(fn, "hi", hi, (torch.bfloat16,), n, of="x")
    check_tensor(fn, "lo", lo, (torch.int16,), n, of="x")
    if n:
        check_no_overlap(fn, {"x": x, "hi": hi, "lo": lo})
        _ensure_threads()
        _C.split_fp32(x.data_ptr(), hi.data_ptr(), lo.data_ptr(), n)
    return hi, lo


def join_fp32(hi: torch.Tensor, lo: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(hi bf16, lo int16) -> the fp32 x with split_fp32(x) == (hi, lo), into ``out``
    if given."""
    fn = "join_fp32"
    check_tensor(fn, "hi", hi, (torch.bfloat16,), None)
    n = hi.numel()
    check_tensor(fn, "lo", lo, (torch.int16,), n, of="hi")
    out = torch.empty(hi.shape, dtype=torch.float32) if out is None else out
    check_tensor(fn, "out", out, (torch.float32,), n, of="hi")
    if n:
        check_no_overlap(fn, {"hi": hi, "lo": lo, "out": out})
        _ensure_threads()
        _C.join_fp32(hi.data_ptr(), lo.data_ptr(), out.data_ptr(), n)
    return out


# ---------------------------------------------------------- 8-bit moments
_Q8_KINDS = ("exp_avg", "exp_avg_sq")


def _q8_kind(fn: str, moment) -> bool:
    if moment not in _Q8_KINDS:
        raise ValueError(f"{fn}: moment must be 'exp_avg' or 'exp_avg_sq', got {moment!r}")
    return moment == "exp_avg"


def q8_table(moment: str) -> torch.Tensor:
    """The fp32 value of each of the 256 codes of ``moment`` ('exp_avg': sign bit 7
    and 127 log steps of 2^(1/8) down to 2^-15.75; 'exp_avg_sq': 0 and 255 steps down
    to 2^-31.75), before its block's scale: element = RN(table[code] * scale)."""
    return torch.tensor(_C.q8_table(_q8_kind("q8_table", moment)), dtype=torch.float32)


def quantize_8bit(
    x: torch.Tensor, moment: str, out: Blockwise8 | None = None, step: int | None = None
) -> Blockwise8:
    """fp32 ``x`` -> its Blockwise8 in the code of ``moment`` ('exp_avg' or
    'exp_avg_sq'), into ``out`` if given. Scale = absmax per block (NaN for a block with
    an inf or NaN); each element the code whose decoded value is nearest (ties to the
    lower), or with ``step`` the dithered choice adam_step makes at that step between
    the two codes around it (csrc/q8_codes.h, THE FREEZE). Either way a decoded value
    comes back as its own code: quantize_8bit(dequantize_8bit(q)) == q."""
    fn = "quantize_8bit"
    is_m = _q8_kind(fn, moment)
    step = 0 if step is None else as_step(fn, step)
    check_tensor(fn, "x", x, (torch.float32,), None)
    n = x.numel()
    out = Blockwise8.zeros(n) if out is None else out
    check_moment(fn, "out", out, n, of="x")
    if n:
        check_no_overlap(fn, {"x": x, **moment_bufs("out", out)})
        _ensure_threads()
        _C.q8_quantize(x.data_ptr(), out.codes.data_ptr(), out.scales.data_ptr(), n, is_m, step)
    return out


def dequantize_8bit(q: Blockwise8, moment: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Blockwise8 -> fp32 (each code's value times its block's scale), into ``out``
    if given; the values adam_step steps from."""
    fn = "dequantize_8bit"
    is_m = _q8_kind(fn, moment)
    if not isinstance(q, Blockwise8):
        raise TypeError(f"{fn}: q must be a Blockwise8, got {type(q).__name__}")
    n = q.codes.numel() if isinstance(q.codes, torch.Tensor) else 0
    check_moment(fn, "q", q, n, of="q.codes")
    out = torch.empty(n) if out is None else out
    check_tensor(fn, "out", out, (torch.float32,), n, of="q.codes")
    if n:
        check_no_overlap(fn, {**moment_bufs("q", q), "out": out})
        _ensure_threads()
        _C.q8_dequantize(q.codes.data_ptr(), q.scales.data_ptr(), out.data_ptr(), n, is_m)
    return out


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
    param_out: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    decay_runs: Sequence[tuple[int, int]] | None = None,
    bf16_rounding: str = "nearest_even",
    param_dst: torch.Tensor | None = None,
    exp_avg_dst: torch.Tensor | None = None,
    exp_avg_sq_dst: torch.Tensor | None = None,
) -> None:
    """One Adam (adamw=False, L2 added to the grad) or AdamW step, in place or out of place.

    param: fp32 contiguous CPU (updated in place).
    exp_avg, exp_avg_sq: fp32 or bf16 (each on its own), contiguous CPU, same numel;
    updated in place (bf16 ones are widened, the step runs in fp32 and they are
    stored rounded to nearest even, exactly like ``.to(torch.bfloat16)``); or a
    Blockwise8 each (decoded, stepped in fp32, re-encoded as quantize_8bit(..., step=step) does).
    grad: fp32/fp16/bf16 contiguous CPU, same numel; multiplied by grad_scale first
    (loss-scale unscaling and clipping folded into the same pass).
    param_out: optional fp16/bf16 contiguous CPU (pinned is fine), same numel;
    receives the new param rounded to nearest even, in the same pass.
    step: the 1-based step number used for bias correction.
    decay_runs: optional sequence of (start, end) element ranges, sorted and
    non-overlapping within [0, numel]: weight_decay applies to them only, every
    other element gets weight decay 0. Bitwise the same as one call per run with
    the right weight_decay, but one pass with the threads splitting the whole slice.
    None (the default): weight_decay applies everywhere.
    bf16_rounding: how a bf16 param_out is rounded: "nearest_even" (torch's .to) or
    "split" (split_fp32's hi: the bits adam_step_remainder hands the device).
    param_dst, exp_avg_dst, exp_avg_sq_dst: all or none; out of place, the new state
    goes there (each of its source's dtype and size, overlapping no other buffer) and
    param/exp_avg/exp_avg_sq stay untouched: bit for bit copying them there and stepping
    in place, with the in-place step's bytes (the kernel streams the stores). fp32/bf16
    moments only.
    """
    fn = "adam_step"
    dsts = {"param_dst": param_dst, "exp_avg_dst": exp_avg_dst, "exp_avg_sq_dst": exp_avg_sq_dst}
    n = check_buffers(fn, param, grad, exp_avg, exp_avg_sq, param_out, dsts)
    step = as_step(fn, step)
    check_hyper(fn, lr, beta1, beta2, eps, weight_decay, grad_scale)
    rounding = check_rounding(fn, bf16_rounding, param_out)
    runs = None if decay_runs is None else check_runs(fn, decay_runs, n)
    if n == 0:
        return
    _ensure_threads()
    mt, vt, ms, vs = moment_args(exp_avg, exp_avg_sq)
    hp = hyper_args(lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale)
    ins = (grad.data_ptr(), DTYPE_CODES[grad.dtype], ptr(exp_avg), ptr(exp_avg_sq))
    out = (0, 0) if param_out is None else (param_out.data_ptr(), DTYPE_CODES[param_out.dtype])
    _C.adam_step(
        param.data_ptr(), *ins, *out, n, step, *hp, mt, vt, runs, rounding, ms, vs, *dst_ptrs(dsts)
    )


def adam_step_remainder(
    param_hi: torch.Tensor,
    param_lo: torch.Tensor,
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
    grad_scale: float = 1.0,
    decay_runs: Sequence[tuple[int, int]] | None = None,
    param_hi_dst: torch.Tensor | None = None,
    param_lo_dst: torch.Tensor | None = None,
    exp_avg_dst: torch.Tensor | None = None,
    exp_avg_sq_dst: torch.Tensor | None = None,
) -> None:
    """adam_step on a master kept as halves: param_hi (bf16, the param the device
    gets) and param_lo (int16), updated in place, or out of place into the four
    ``*_dst`` (all or none, as adam_step's). Bitwise the same step as adam_step
    on join_fp32(param_hi, param_lo) with a bf16 param_out and bf16_rounding="split":
    new master == join_fp32(new hi, new lo), new hi == that param_out, moments equal.
    Other arguments as adam_step's."""
    fn = "adam_step_remainder"
    dsts = {
        "param_hi_dst": param_hi_dst,
        "param_lo_dst": param_lo_dst,
        "exp_avg_dst": exp_avg_dst,
        "exp_avg_sq_dst": exp_avg_sq_dst,
    }
    n = check_remainder_buffers(fn, param_hi, param_lo, grad, exp_avg, exp_avg_sq, dsts)
    step = as_step(fn, step)
    check_hyper(fn, lr, beta1, beta2, eps, weight_decay, grad_scale)
    runs = None if decay_runs is None else check_runs(fn, decay_runs, n)
    if n == 0:
        return
    _ensure_threads()
    mt, vt, ms, vs = moment_args(exp_avg, exp_avg_sq)
    hp = hyper_args(lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale)
    ins = (grad.data_ptr(), DTYPE_CODES[grad.dtype], ptr(exp_avg), ptr(exp_avg_sq))
    halves = (param_hi.data_ptr(), param_lo.data_ptr())
    _C.adam_step_remainder(*halves, *ins, n, step, *hp, mt, vt, runs, ms, vs, *dst_ptrs(dsts))


def stream_probe(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None = None,
) -> float:
    """adam_step's memory traffic with trivial math: one pass with exactly the same
    loads/stores (and threads, ranges, SIMD path) as our kernel. Returns the
    pass's wall time in seconds. It shares our access pattern, so it is NOT a
    machine ceiling (bench/bench_cpu_adam.py measures that with several
    independent patterns). OVERWRITES param/exp_avg/exp_avg_sq/param_out with
    junk: give it scratch buffers."""
    fn = "stream_probe"
    if isinstance(exp_avg, Blockwise8) or isinstance(exp_avg_sq, Blockwise8):
        raise TypeError(f"{fn}: 8-bit (Blockwise8) moments have no probe; pass fp32/bf16 tensors")
    n = check_buffers(fn, param, grad, exp_avg, exp_avg_sq, param_out)
    if n == 0:
        return 0.0
    _ensure_threads()
    return _C.stream_probe(
        param.data_ptr(),
        grad.data_ptr(),
        DTYPE_CODES[grad.dtype],
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        0 if param_out is None else param_out.data_ptr(),
        0 if param_out is None else DTYPE_CODES[param_out.dtype],
        n,
        DTYPE_CODES[exp_avg.dtype],
        DTYPE_CODES[exp_avg_sq.dtype],
    )


# ---------------------------------------------------------------- optimizer
class CPUAdam(torch.optim.Optimizer):
    """torch.optim.Optimizer over fp32 CPU params using the fused kernel.

    Per-param state matches torch's Adam/AdamW layout: ``step`` (0-dim fp32
    tensor), ``exp_avg``, ``exp_avg_sq``. ``adamw=True`` is AdamW (decoupled
    decay), ``adamw=False`` is Adam with L2 added to the gradient.
    ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (torch.float32 or torch.bfloat16)
    set how each moment is stored; loaded state is converted to them.
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
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
    ):
        if len(betas) != 2:
            raise ValueError(f"CPUAdam: betas must be a pair, got {betas!r}")
        check_hyper("CPUAdam", lr, betas[0], betas[1], eps, weight_decay)
        for name, dt in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dt not in MOMENT_DTYPES:
                raise TypeError(
                    f"CPUAdam: {name} must be torch.float32 or torch.bfloat16, got {dt}"
                )
        self._moment_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "adamw": adamw,
            "bias_correction": bias_correction,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                check_tensor("CPUAdam", "param", p, (torch.float32,), None)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
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
                    for key, dt in self._moment_dtypes.items():
                        state[key] = torch.zeros_like(
                            p, dtype=dt, memory_format=torch.contiguous_format
                        )
                for key, dt in self._moment_dtypes.items():  # e.g. after load_state_dict
                    if state[key].dtype != dt or not state[key].is_contiguous():
                        state[key] = state[key].to(dt).contiguous()
                state["step"] += 1
                adam_step(
                    p,
                    p.grad.contiguous(),
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    step=int(state["step"].item()),
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    adamw=group.get("adamw", True),
                    bias_correction=group.get("bias_correction", True),
                )
        return loss
