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
