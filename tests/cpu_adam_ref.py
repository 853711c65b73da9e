"""Shared by the tests/test_cpu_adam*.py files: the SIMD-level fixtures, the
op-by-op reference step, the tolerances against torch.optim, small buffers, and fp32
special values made from their bits.

Two references:
  * ``_ref_step``: torch's single-tensor Adam/AdamW (torch/optim/adam.py)
    written out op by op in exact float32 arithmetic, with FMAs where torch's
    vectorised kernels use them (lerp_, addcmul_, add(alpha=)) and a correctly
    rounded sqrt. The kernel must match it BIT FOR BIT on every path, size,
    grad dtype and option (incl. bias_correction=False, which torch.optim
    lacks, beta1 < 0.5, and grad_scale).
  * torch.optim.AdamW / Adam themselves. torch's vectorised float sqrt is off by
    one ulp on ~0.7% of inputs, which now and then flips the last bit of the
    param (and, through Adam's L2 term, of exp_avg). Measured: here 150 of ~1.9e5
    params differ, by <= 6e-8; on 10^5-element, 5-step runs over several seeds
    |diff| <= 4.8e-7 (1 ulp at |p| >= 4) and |diff| - 1e-6*|ref| <= 7e-9.
    Hence RTOL = 1e-6 (~8 ulp) and ATOL = 1e-8, for param/exp_avg/exp_avg_sq.
    If torch's kernels run without FMA (ATen CPU capability DEFAULT), its lerp/
    addcmul round twice and exp_avg drifts by a few ulp per step (measured
    |diff| <= 6.7e-8 over 5 steps): RTOL = 1e-5, ATOL = 1e-7 then.
"""

import pytest
import torch

from mp_offload.ops import cpu_adam as ca

RTOL, ATOL = (1e-6, 1e-8) if torch.backends.cpu.get_cpu_capability() != "DEFAULT" else (1e-5, 1e-7)
LEVELS = ["scalar", "avx2", "avx512"]
SIZES = [0, 1, 7, 15, 17, 33, 1000, 4099]
GRAD_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OUT_DTYPES = [None, torch.float16, torch.bfloat16]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
# (adamw, weight_decay, bias_correction)
CONFIGS = [
    (True, 0.0, True),
    (True, 0.1, True),
    (False, 0.0, True),
    (False, 0.1, True),
    (True, 0.1, False),
    (False, 0.1, False),
]


# Fixtures named apart from their functions: a test module imports the function, and
# its tests' `level` / `threads` parameters then shadow no import.
@pytest.fixture(params=LEVELS, name="level")
def level_fixture(request):
    if request.param not in ca.available_simd_levels():
        pytest.skip(f"CPU lacks {request.param}")
    before = ca.simd_level()
    ca.set_simd_level(request.param)
    assert ca.simd_level() == request.param
    yield request.param
    ca.set_simd_level(before)


@pytest.fixture(name="threads")
def threads_fixture():
    before = ca.get_num_threads()
    yield
    ca.set_num_threads(before)


def _f32(x):
    """A Python float rounded to float32, as torch does with scalar operands."""
    return torch.tensor(x, dtype=torch.float32).item()


def _op(x):
    """float64 -> float32. +, -, *, / and sqrt done in float64 and rounded once
    are exactly IEEE float32 (53 >= 2*24 + 2 bits: double rounding is harmless)."""
    return x.float()


def _fma(a, b, c):
    """float32 fma(a, b, c): a*b is exact in float64, then one rounding of the
    sum before float32 (double rounding could differ only on ~2^-29 of inputs)."""
    return _op(torch.as_tensor(a, dtype=torch.float64) * b.double() + c.double())


def _ref_step(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction):
    """torch/optim/adam.py _single_tensor_adam, op by op in exact float32
    arithmetic. torch's vectorised CPU kernels fuse add(alpha=), lerp_ and
    addcmul_ into FMAs, emulated here; everything else is a plain rounded op."""
    d = torch.Tensor.double
    if weight_decay != 0:
        if adamw:  # param.mul_(1 - lr * wd)
            p.copy_(_op(d(p) * _f32(1 - lr * weight_decay)))
        else:  # grad = grad.add(param, alpha=wd)
            g = _fma(_f32(weight_decay), p, g)
    w = _f32(1 - beta1)  # exp_avg.lerp_(grad, 1 - beta1): torch switches formula at |w| >= 0.5
    diff = _op(d(g) - d(m))
    m.copy_(_fma(w, diff, m) if abs(w) < 0.5 else _fma(_f32(w - 1), diff, g))
    # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    v.copy_(_fma(_op(d(g) * _f32(1 - beta2)), g, _op(d(v) * _f32(beta2))))
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    # denom = (exp_avg_sq.sqrt() / bc2 ** 0.5).add_(eps)
    # param.addcdiv_(exp_avg, denom, value=-lr / bc1)
    denom = _op(d(_op(d(_op(d(v).sqrt())) / _f32(bc2**0.5))) + _f32(eps))
    p.copy_(_op(d(p) + d(_op(d(_op(d(m) * _f32(-(lr / bc1)))) / d(denom)))))


def _bits_equal(a, b):
    return a.dtype == b.dtype and torch.equal(
        a.view(torch.int16 if a.element_size() == 2 else torch.int32),
        b.view(torch.int16 if b.element_size() == 2 else torch.int32),
    )


# (exp_avg dtype, exp_avg_sq dtype): each moment may be bf16 on its own
MOMENTS = [
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16),
]
MOMENT_IDS = ["m_bf16", "v_bf16", "mv_bf16"]


def _round_moments(rm, rv, mt, vt):
    """The restatement's fp32 moments as the kernel stores them: .to(bf16) (round to
    nearest even) where the moment is bf16. Returns the stored tensors and reloads
    rm/rv from them, as the next step will read them."""
    sm, sv = rm.to(mt), rv.to(vt)
    rm.copy_(sm.float())
    rv.copy_(sv.float())
    return sm, sv


def fp32_from_bits(bits):
    """int64 bit patterns in [0, 2^32) -> fp32."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def special_floats():
    """+-0, subnormals, ties under even and odd tops, the largest finite floats (and
    those about to wrap), +-inf, quiet and signalling NaNs; both signs."""
    bits = [0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x007F_FFFF, 0x0080_0000]
    bits += [0x3F80_8000, 0x3F81_8000, 0x3F80_7FFF, 0x3F80_8001, 0x4000_8000]
    bits += [0x7F7E_8000, 0x7F7F_7FFF, 0x7F7F_8000, 0x7F7F_FFFF, 0x7F7E_FFFF]
    bits += [0x7F80_0000, 0x7F80_0001, 0x7F80_8000, 0x7FC0_0000, 0x7FFF_FFFF, 0x7FA0_1234]
    bits = torch.tensor(bits, dtype=torch.int64)
    return fp32_from_bits(torch.cat([bits, bits | 2**31]))


def _bufs(n=12, grad_n=None, grad_dtype=torch.float32):
    return dict(
        param=torch.zeros(n),
        grad=torch.zeros(n if grad_n is None else grad_n, dtype=grad_dtype),
        exp_avg=torch.zeros(n),
        exp_avg_sq=torch.zeros(n),
    )


def _call(bufs, **kw):
    args = dict(step=1, weight_decay=0.0, **HYPER)
    args.update(kw)
    ca.adam_step(bufs["param"], bufs["grad"], bufs["exp_avg"], bufs["exp_avg_sq"], **args)
