"""CPU Adam with bf16 moments (exp_avg / exp_avg_sq each fp32 or bf16): bit for bit
against the fp32 reference step with the moments stored rounded to nearest even, and
the CPUAdam optimizer keeping the dtypes."""

import copy

import pytest
import torch
from cpu_adam_ref import (
    CONFIGS,
    GRAD_DTYPES,
    HYPER,
    MOMENT_IDS,
    MOMENTS,
    OUT_DTYPES,
    SIZES,
    _bits_equal,
    _ref_step,
    _round_moments,
    level_fixture,  # noqa: F401 (pytest fixture)
)
from torch import nn

from mp_offload.ops import cpu_adam as ca


@pytest.mark.parametrize("moments", MOMENTS, ids=MOMENT_IDS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=["noout", "out_fp16", "out_bf16"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["g_fp32", "g_fp16", "g_bf16"])
def test_bf16_moments_match_reference(level, grad_dtype, out_dtype, moments):
    """bf16 moments: widened, the fp32 step of _ref_step (the param update sees the
    unrounded moments), then stored rounded to bf16 -- bit for bit."""
    mt, vt = moments
    gen = torch.Generator().manual_seed(4321)
    for n in SIZES:
        for adamw, wd, bc in CONFIGS:
            p0 = torch.randn(n, generator=gen)
            m = (torch.randn(n, generator=gen) * 0.1).to(mt)  # non-trivial starting moments
            v = (torch.rand(n, generator=gen) * 0.01).to(vt)
            p, rp, rm, rv = p0.clone(), p0.clone(), m.float().clone(), v.float().clone()
            out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
            for step in range(1, 5):
                g = torch.randn(n, generator=gen).to(grad_dtype)
                ca.adam_step(
                    p,
                    g,
                    m,
                    v,
                    step=step,
                    weight_decay=wd,
                    adamw=adamw,
                    bias_correction=bc,
                    param_out=out,
                    **HYPER,
                )
                _ref_step(
                    rp,
                    g.float(),
                    rm,
                    rv,
                    step=step,
                    weight_decay=wd,
                    adamw=adamw,
                    bias_correction=bc,
                    **HYPER,
                )
                sm, sv = _round_moments(rm, rv, mt, vt)
                ctx = f"{level} n={n} adamw={adamw} wd={wd} bc={bc} step={step}"
                assert m.dtype == mt and v.dtype == vt, ctx
                assert _bits_equal(p, rp) and _bits_equal(m, sm) and _bits_equal(v, sv), ctx
                if out is not None:
                    assert _bits_equal(out, p.to(out_dtype)), ctx


def test_bf16_moments_round_ties_to_even(level):
    """Enough elements that some fp32 moments land exactly halfway between two
    bf16 values (low 16 bits 0x8000): those must go to the even neighbour."""
    n, gen = 1 << 18, torch.Generator().manual_seed(99)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m0 = (torch.randn(n, generator=gen) * 0.1).bfloat16()
    v0 = (torch.rand(n, generator=gen) * 0.01).bfloat16()
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    ca.adam_step(p, g, m, v, step=3, weight_decay=0.1, **HYPER)
    rp, rm, rv = p0.clone(), m0.float(), v0.float()
    _ref_step(rp, g, rm, rv, step=3, weight_decay=0.1, adamw=True, bias_correction=True, **HYPER)
    for got, exact in ((m, rm), (v, rv)):
        ties = (exact.view(torch.int32) & 0xFFFF) == 0x8000
        assert ties.sum() > 0, "no ties in the sample: grow n"
        assert _bits_equal(got, exact.to(torch.bfloat16))
        assert ((got[ties].view(torch.int16) & 1) == 0).all()  # even mantissa
    assert _bits_equal(p, rp)


def test_bf16_moments_optimizer():
    """CPUAdam keeps its moments in the dtypes asked for, also after load_state_dict
    (which casts state to the param's fp32)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    kw = {"lr": 1e-2, "weight_decay": 0.01}
    opt = ca.CPUAdam(model.parameters(), exp_avg_dtype=torch.bfloat16, **kw)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 8)).square().sum().backward()
        opt.step()
    for st in opt.state.values():
        assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.float32
    opt2 = ca.CPUAdam(model.parameters(), exp_avg_dtype=torch.bfloat16, **kw)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt2.zero_grad()
    model(torch.randn(5, 8)).square().sum().backward()
    opt2.step()
    for st in opt2.state.values():
        assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.float32
    with pytest.raises(TypeError, match="exp_avg_sq_dtype must be torch.float32 or torch.bfloat16"):
        ca.CPUAdam(model.parameters(), exp_avg_sq_dtype=torch.float16)
