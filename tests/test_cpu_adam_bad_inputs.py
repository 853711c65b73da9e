"""CPU Adam bad input: every wrong argument (sizes, dtypes, devices, layouts, aliasing,
hyper-parameters, decay runs, raw dtype codes) raises a one-line error and leaves
every buffer untouched."""

import pytest
import torch
from cpu_adam_ref import HYPER, _bufs, _call

from mp_offload import _cpu_adam as _C
from mp_offload.ops import cpu_adam as ca


@pytest.mark.parametrize(
    "runs, exc, match",
    [
        (
            [(4, 8), (0, 3)],
            ValueError,
            r"decay_runs\[1\] = \(0, 3\) is unsorted: it starts before decay_runs\[0\]",
        ),
        (
            [(0, 6), (4, 8)],
            ValueError,
            r"decay_runs\[1\] = \(4, 8\) overlaps decay_runs\[0\] = \(0, 6\)",
        ),
        ([(0, 13)], ValueError, r"decay_runs\[0\] = \(0, 13\) is out of range \[0, 12\]"),
        ([(-1, 3)], ValueError, "is out of range"),
        ([(5, 2)], ValueError, r"decay_runs\[0\] = \(5, 2\) has start > end"),
        ([(0, 2, 3)], TypeError, r"decay_runs\[0\] must be a \(start, end\) pair"),
        ([(0.0, 2)], TypeError, "must hold two integers"),
        (5, TypeError, "decay_runs must be a sequence"),
    ],
)
def test_bad_decay_runs_raise_and_touch_nothing(runs, exc, match):
    bufs = _bufs()
    bufs["param"].fill_(1.0)
    bufs["grad"].fill_(0.5)
    before = {k: v.clone() for k, v in bufs.items()}
    with pytest.raises(exc, match=match):
        _call(bufs, weight_decay=0.1, decay_runs=runs)
    assert all(torch.equal(bufs[k], v) for k, v in before.items())


def test_raw_decay_runs_checked_in_cpp():
    t = torch.zeros(8)
    args = (
        t.data_ptr(),
        t.data_ptr(),
        0,
        t.data_ptr(),
        t.data_ptr(),
        0,
        0,
        8,
        1,
        1e-3,
        0.9,
        0.999,
        1e-8,
        0.1,
        True,
        True,
        1.0,
    )
    for runs, match in (
        ([(3, 9)], "out of range"),
        ([(2, 1)], "start > end"),
        ([(0, 4), (2, 6)], "overlaps"),
    ):
        with pytest.raises(ValueError, match=match):
            _C.adam_step(*args, decay_runs=runs)
    with pytest.raises(ValueError, match="exp_avg_dtype must be 0"):
        _C.adam_step(*args, exp_avg_dtype=1)
    with pytest.raises(ValueError, match="exp_avg_sq_dtype must be 0"):
        _C.adam_step(*args, exp_avg_sq_dtype=7)


@pytest.mark.parametrize(
    "make, kw, exc, match",
    [
        (lambda: _bufs(grad_n=10), {}, ValueError, "grad has 10 elements, param has 12"),
        (
            lambda: dict(_bufs(), exp_avg=torch.zeros(13)),
            {},
            ValueError,
            "exp_avg has 13 elements, param has 12",
        ),
        (
            lambda: _bufs(grad_dtype=torch.float64),
            {},
            TypeError,
            "grad must be float32/float16/bfloat16, got float64",
        ),
        (
            lambda: dict(_bufs(), param=torch.zeros(12, dtype=torch.float16)),
            {},
            TypeError,
            "param must be float32",
        ),
        (
            lambda: dict(_bufs(), exp_avg_sq=torch.zeros(12, dtype=torch.float16)),
            {},
            TypeError,
            "exp_avg_sq must be float32/bfloat16, got float16",
        ),
        (
            lambda: dict(_bufs(), exp_avg=torch.zeros(24)[::2]),
            {},
            ValueError,
            "exp_avg must be contiguous",
        ),
        (
            lambda: dict(_bufs(), exp_avg=torch.zeros(12, dtype=torch.float16)),
            {},
            TypeError,
            "exp_avg must be float32/bfloat16, got float16",
        ),
        (
            lambda: dict(_bufs(), exp_avg_sq=torch.zeros(12, dtype=torch.float64)),
            {},
            TypeError,
            "exp_avg_sq must be float32/bfloat16, got float64",
        ),
        (
            lambda: dict(_bufs(), exp_avg=torch.zeros(12, dtype=torch.int16)),
            {},
            TypeError,
            "exp_avg must be",
        ),
        (
            lambda: dict(
                _bufs(),
                param=torch.zeros(12, dtype=torch.bfloat16),
                exp_avg=torch.zeros(12, dtype=torch.bfloat16),
            ),
            {},
            TypeError,
            "param must be float32",
        ),
        (
            lambda: dict(_bufs(), exp_avg=torch.zeros(13, dtype=torch.bfloat16)),
            {},
            ValueError,
            "exp_avg has 13 elements, param has 12",
        ),
        (
            lambda: dict(_bufs(), exp_avg_sq=torch.zeros(11, dtype=torch.bfloat16)),
            {},
            ValueError,
            "exp_avg_sq has 11 elements, param has 12",
        ),
        (
            lambda: dict(_bufs(), exp_avg_sq=torch.zeros(24, dtype=torch.bfloat16)[::2]),
            {},
            ValueError,
            "exp_avg_sq must be contiguous",
        ),
        (
            lambda: dict(_bufs(), exp_avg=torch.zeros(12, dtype=torch.bfloat16, device="meta")),
            {},
            ValueError,
            "exp_avg must be a CPU tensor",
        ),
        (
            lambda: dict(_bufs(), grad=torch.zeros(4, 3).t()),
            {},
            ValueError,
            "grad must be contiguous",
        ),
        (
            lambda: dict(_bufs(), grad=torch.zeros(12, device="meta")),
            {},
            ValueError,
            "grad must be a CPU tensor",
        ),
        (
            lambda: dict(_bufs(), param=torch.zeros(12, device="meta")),
            {},
            ValueError,
            "param must be a CPU tensor",
        ),
        (lambda: dict(_bufs(), grad=torch.zeros(12).to_sparse()), {}, ValueError, "dense"),
        (lambda: dict(_bufs(), grad=[0.0] * 12), {}, TypeError, "grad must be a torch.Tensor"),
        (_bufs, dict(step=0), ValueError, "step must be >= 1, got 0"),
        (_bufs, dict(step=-3), ValueError, "step must be >= 1"),
        (_bufs, dict(step=1.5), ValueError, "step must be an integer"),
        (_bufs, dict(step=None), TypeError, "step must be an integer"),
        (
            _bufs,
            dict(param_out=torch.zeros(12)),
            TypeError,
            "param_out must be float16/bfloat16, got float32",
        ),
        (
            _bufs,
            dict(param_out=torch.zeros(11, dtype=torch.bfloat16)),
            ValueError,
            "param_out has 11 elements, param has 12",
        ),
        (
            _bufs,
            dict(param_out=torch.zeros(24, dtype=torch.float16)[::2]),
            ValueError,
            "param_out must be contiguous",
        ),
        (_bufs, dict(lr=-1.0), ValueError, "lr must be >= 0"),
        (_bufs, dict(beta1=1.0), ValueError, "beta1 must be in"),
        (_bufs, dict(beta2=-0.1), ValueError, "beta2 must be in"),
        (_bufs, dict(eps=float("nan")), ValueError, "eps must be a finite"),
        (_bufs, dict(weight_decay=-0.1), ValueError, "weight_decay must be >= 0"),
        (_bufs, dict(grad_scale=float("inf")), ValueError, "grad_scale must be a finite"),
    ],
)
def test_bad_inputs_raise_and_touch_nothing(make, kw, exc, match):
    bufs = make()
    before = {
        k: v.clone()
        for k, v in bufs.items()
        if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.layout == torch.strided
    }
    with pytest.raises(exc, match=match):
        _call(bufs, **kw)
    for k, v in before.items():
        assert torch.equal(bufs[k], v), f"{k} was modified"


def test_aliasing_rejected():
    b = _bufs()
    with pytest.raises(ValueError, match="param and exp_avg overlap"):
        ca.adam_step(
            b["param"], b["grad"], b["param"], b["exp_avg_sq"], step=1, weight_decay=0.0, **HYPER
        )
    big = torch.zeros(30)
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq overlap"):
        ca.adam_step(b["param"], b["grad"], big[:12], big[6:18], step=1, weight_decay=0.0, **HYPER)
    pout = b["param"].view(torch.bfloat16)  # 24 bf16 views of the same bytes
    with pytest.raises(ValueError, match="param and param_out overlap"):
        ca.adam_step(
            b["param"],
            b["grad"],
            b["exp_avg"],
            b["exp_avg_sq"],
            param_out=pout[:12],
            step=1,
            weight_decay=0.0,
            **HYPER,
        )


def test_bf16_moment_aliasing_rejected_and_touch_nothing():
    b = _bufs()
    b["grad"].fill_(1.0)
    pm = torch.ones(36, dtype=torch.bfloat16)  # bytes shared by two bf16 moments below
    out = torch.ones(12, dtype=torch.bfloat16)
    cases = [  # (exp_avg, exp_avg_sq, param_out, error)
        (b["param"].view(torch.bfloat16)[6:18], b["exp_avg_sq"], None, "param and exp_avg overlap"),
        (b["exp_avg"], b["grad"].view(torch.bfloat16)[:12], None, "grad and exp_avg_sq overlap"),
        (pm[:12], pm[11:23], None, "exp_avg and exp_avg_sq overlap"),
        (
            pm[:12],
            out.view(torch.int16).view(torch.bfloat16),
            out,
            "exp_avg_sq and param_out overlap",
        ),
    ]
    for m, v, o, match in cases:
        tensors = (b["param"], b["grad"], b["exp_avg"], b["exp_avg_sq"], pm, out)
        snap = [t.clone() for t in tensors]
        with pytest.raises(ValueError, match=match):
            ca.adam_step(
                b["param"], b["grad"], m, v, param_out=o, step=1, weight_decay=0.1, **HYPER
            )
        assert all(torch.equal(x, y) for x, y in zip(snap, tensors)), match


def test_empty_is_noop_and_raw_codes_checked():
    ca.adam_step(
        torch.zeros(0),
        torch.zeros(0),
        torch.zeros(0),
        torch.zeros(0),
        step=1,
        weight_decay=0.0,
        param_out=torch.zeros(0, dtype=torch.bfloat16),
        **HYPER,
    )
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="grad_dtype"):
        _C.adam_step(
            t.data_ptr(),
            t.data_ptr(),
            7,
            t.data_ptr(),
            t.data_ptr(),
            0,
            0,
            4,
            1,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.0,
            True,
            True,
            1.0,
        )
    with pytest.raises(ValueError, match="out_dtype"):
        _C.adam_step(
            t.data_ptr(),
            t.data_ptr(),
            0,
            t.data_ptr(),
            t.data_ptr(),
            t.data_ptr(),
            0,
            4,
            1,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.0,
            True,
            True,
            1.0,
        )
    with pytest.raises(ValueError, match="step must be >= 1"):
        _C.adam_step(
            t.data_ptr(),
            t.data_ptr(),
            0,
            t.data_ptr(),
            t.data_ptr(),
            0,
            0,
            4,
            0,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.0,
            True,
            True,
            1.0,
        )
