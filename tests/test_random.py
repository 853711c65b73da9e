"""RNG tracker streams and activation checkpointing."""

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from torch import nn

from mp_offload import parallel_state as ps
from mp_offload.tensor_parallel import checkpoint, get_rng_tracker, model_parallel_seed


def _gather(x, group):
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x, group=group.torch_group())
    return parts


def _worker(rank, world):
    ps.initialize_model_parallel(2)
    group = ps.get_tensor_model_parallel_group()
    model_parallel_seed(1234, ps.get_tensor_model_parallel_rank())
    shared = torch.rand(8)
    with get_rng_tracker().fork():
        split = torch.rand(8)
    after = torch.rand(8)
    s, p, a = _gather(shared, group), _gather(split, group), _gather(after, group)
    assert torch.equal(s[0], s[1]), "default stream must agree across TP ranks"
    assert not torch.equal(p[0], p[1]), "tracker stream must differ across TP ranks"
    assert torch.equal(a[0], a[1]), "forking must not disturb the default stream"


@pytest.mark.slow
def test_tracker_streams_across_tp_ranks():
    run_distributed(_worker, 2)


def test_fork_continues_its_own_stream():
    model_parallel_seed(7, 0)
    with get_rng_tracker().fork():
        a = torch.rand(4)
    with get_rng_tracker().fork():
        b = torch.rand(4)
    assert not torch.equal(a, b)
    model_parallel_seed(7, 0)
    with get_rng_tracker().fork():
        assert torch.equal(torch.rand(4), a)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        x = nn.functional.dropout(self.fc(x), 0.5)
        with get_rng_tracker().fork():
            x = nn.functional.dropout(torch.tanh(x), 0.3)
        return x


def test_checkpoint_gives_identical_gradients():
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(4, 16)
    grads = []
    for use_ckpt in (False, True):
        model_parallel_seed(99, 0)
        block.zero_grad()
        xi = x.clone().requires_grad_()
        y = checkpoint(block, xi) if use_ckpt else block(xi)
        after = torch.rand(3)  # RNG after the block must not depend on checkpointing
        y.pow(2).sum().backward()
        grads.append((xi.grad.clone(), block.fc.weight.grad.clone(), after))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_checkpoint_replays_under_the_forward_autocast():
    """bf16 autocast in forward: the recompute in backward must run in bf16 too."""
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(4, 16)
    grads = []
    for use_ckpt in (False, True):
        model_parallel_seed(99, 0)
        block.zero_grad()
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = checkpoint(block, xi) if use_ckpt else block(xi)
        y.float().pow(2).sum().backward()
        grads.append((xi.grad.clone(), block.fc.weight.grad.clone()))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_the_replay_runs_under_the_forward_sdpa_backends():
    """Forward inside ``sdpa_kernel([MATH])``, backward after it: the recompute sees the
    forward's switches (math only), and the caller's come back afterwards."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cuda = torch.backends.cuda
    seen = []

    def f(x):
        seen.append(
            (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled())
        )
        return x * 2

    x = torch.randn(3, requires_grad=True)
    with sdpa_kernel([SDPBackend.MATH]):
        y = checkpoint(f, x)
    outside = (cuda.flash_sdp_enabled(), cuda.math_sdp_enabled())
    y.sum().backward()
    assert outside == (True, True)  # the test's premise: backward runs with flash enabled
    assert seen == [(False, False, True)] * 2
    assert (cuda.flash_sdp_enabled(), cuda.math_sdp_enabled()) == (True, True)


def test_a_math_pinned_attention_replays_on_the_math_kernel():
    """SDPA under MATH in forward: the checkpointed gradients are the plain MATH ones bit
    for bit (a replay on the CPU flash kernel rounds differently)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32) for _ in range(3))
    attend = lambda q, k, v: nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    grads = []
    for use_ckpt in (False, True):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel([SDPBackend.MATH]):
            y = checkpoint(attend, *inputs) if use_ckpt else attend(*inputs)
        y.pow(2).sum().backward()
        grads.append([t.grad for t in inputs])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
