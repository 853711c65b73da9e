"""Adam where the state is on the device: torch's fused AdamW on CUDA (no offload and the
device share), the torch ops for bf16 moments, the C++ Adam for state on the host.

The choice is a logic test (a CUDA device needs no GPU to be named); the fused path runs
here on the CPU kernel torch ships (torch >= 2.4) against the torch-ops restatement.
"""

import pytest
import torch

from mp_offload.ops.cpu_adam import adam_step
from mp_offload.optimizer.adam_math import (
    device_adam,
    fused_adam_step,
    fused_adamw_available,
    torch_adam_step,
)
from mp_offload.optimizer.device_side import _adam

F32, BF16 = torch.float32, torch.bfloat16


def _picked(device: str, moments=F32):
    """What the device side chooses for its state on ``device`` (no GPU needed)."""
    return _adam(torch.device(device), moments, moments)


def test_state_on_a_cuda_device_steps_with_the_fused_kernel():
    cuda = torch.device("cuda")
    assert device_adam(cuda, F32, F32) is fused_adam_step
    assert _picked("cuda") is fused_adam_step  # no offload (F = 0): a fair ZeRO-2
    assert _picked("cuda:0") is fused_adam_step
    # The kernel reads every list in the params' dtype: bf16 moments beside the fp32
    # master cannot go through it (torch: "expected scalar type Float but found BFloat16").
    assert device_adam(cuda, BF16, F32) is torch_adam_step
    assert _picked("cuda", BF16) is torch_adam_step
    assert _picked("cpu") is adam_step  # a CPU "device": the C++ Adam, as the host steps


def test_no_fused_kernel_falls_back_to_the_torch_ops(monkeypatch):
    monkeypatch.delattr(torch, "_fused_adamw_")
    monkeypatch.setattr(
        "mp_offload.optimizer.adam_math.fused_adamw_available",
        lambda device_type: hasattr(torch, "_fused_adamw_"),
    )
    assert device_adam(torch.device("cuda"), F32, F32) is torch_adam_step
    assert _picked("cuda") is torch_adam_step


@pytest.mark.skipif(not fused_adamw_available("cpu"), reason="torch has no CPU fused AdamW")
@pytest.mark.parametrize("grad_scale", [1.0, 0.25])
def test_fused_step_equals_the_torch_ops_within_rounding(grad_scale):
    """Decay on some runs, none on others, clipping scale, 5 steps, fp32 throughout: the
    kernel computes the same update in another order (step size lr / bc1, the inverse
    gradient scale), so equal to a few fp32 ulps, and the decay-free runs exactly free."""
    torch.manual_seed(0)
    n = 1024
    runs = [(0, 300), (310, 1000)]
    a = [torch.randn(n), torch.zeros(n), torch.zeros(n)]
    b = [t.clone() for t in a]
    out = torch.empty(n, dtype=BF16)
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=grad_scale)
    for step in range(1, 6):
        g = torch.randn(n)
        # (the kernel unscales the gradient in place: each gets its own copy)
        fused_adam_step(
            a[0], g.clone(), a[1], a[2], step=step, decay_runs=runs, param_out=out, **hp
        )
        torch_adam_step(b[0], g, b[1], b[2], step=step, decay_runs=runs, **hp)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=4 * 2**-23, atol=1e-7)
    assert torch.equal(out, a[0].to(BF16))  # the new params, rounded, as the C++ kernel
    # Weight decay only where asked: without it the decay-free runs are unchanged by it.
    c = [t.clone() for t in b]
    torch.manual_seed(1)
    g = torch.randn(n)
    torch_adam_step(c[0], g, c[1], c[2], step=6, decay_runs=runs, **hp)
    fused_adam_step(b[0], g.clone(), b[1], b[2], step=6, decay_runs=runs, **hp)
    torch.testing.assert_close(b[0][300:310], c[0][300:310], rtol=4 * 2**-23, atol=1e-7)


def test_fused_step_keeps_the_torch_ops_for_plain_adam():
    """L2 Adam or no bias correction: not the kernel's math, so the torch ops, bitwise."""
    torch.manual_seed(0)
    a = [torch.randn(64), torch.zeros(64), torch.zeros(64)]
    b = [t.clone() for t in a]
    g = torch.randn(64)
    hp = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    fused_adam_step(a[0], g, a[1], a[2], adamw=False, **hp)
    torch_adam_step(b[0], g, b[1], b[2], adamw=False, **hp)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
