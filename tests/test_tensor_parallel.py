"""Tensor-parallel primitives and layers equal their unsplit counterparts (gloo, CPU)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_helpers import run_distributed

from mp_offload import parallel_state as ps
from mp_offload.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    gather_sequence_to_tp_region,
    reduce_from_tp_region,
    reduce_scatter_from_tp_region,
    register_sequence_parallel_grad_hooks,
    scatter_to_sequence_region,
    scatter_to_tp_region,
    split_for_rank,
    vocab_parallel_cross_entropy,
)
from mp_offload.tensor_parallel.utils import merge_partitions

TOL = dict(rtol=1e-5, atol=1e-6)


def _check_primitives(rank, tp, group):
    x = torch.arange(8.0).reshape(2, 4).requires_grad_()
    up = torch.full((2, 4), float(rank + 1))  # rank-dependent upstream gradient
    total = float(sum(range(1, tp + 1)))

    y = copy_to_tp_region(x, group)
    assert torch.equal(y, x)
    y.backward(up)
    assert torch.equal(x.grad, torch.full((2, 4), total)), "copy: backward must all-reduce"

    x.grad = None
    y = reduce_from_tp_region(x * (rank + 1), group)
    assert torch.equal(y, x.detach() * total), "reduce: forward must all-reduce"
    y.backward(up)
    assert torch.equal(x.grad, up * (rank + 1)), "reduce: backward is identity"

    x8 = torch.arange(16.0).reshape(2, 8).requires_grad_()
    y = scatter_to_tp_region(x8, group)
    assert torch.equal(y, x8.detach().chunk(tp, -1)[rank])
    y.backward(torch.full_like(y, float(rank)))
    expect = torch.cat([torch.full((2, 8 // tp), float(r)) for r in range(tp)], -1)
    assert torch.equal(x8.grad, expect), "scatter: backward must all-gather"

    xr = torch.full((2, 2), float(rank), requires_grad=True)
    y = gather_from_tp_region(xr, group)
    assert torch.equal(y, torch.cat([torch.full((2, 2), float(r)) for r in range(tp)], -1))
    g = torch.arange(2.0 * 2 * tp).reshape(2, 2 * tp)
    y.backward(g)
    assert torch.equal(xr.grad, g.chunk(tp, -1)[rank]), "gather: backward must split"


def _grads_equal(par, ref, rank, tp, dim, stride):
    assert torch.allclose(par, split_for_rank(ref, dim, tp, rank, stride), **TOL)


def _check_layers(rank, tp, group):
    torch.manual_seed(1)
    x = torch.randn(3, 5, 16)
    for stride in (1, 3):
        torch.manual_seed(10)
        ref = ColumnParallelLinear(16, 24, stride=stride, tp_group=ps.ParallelGroup.single())
        torch.manual_seed(10)
        par = ColumnParallelLinear(16, 24, stride=stride, tp_group=group)
        _grads_equal(par.weight.data, ref.weight.data, rank, tp, 0, stride)
        xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        yr, yp = ref(xr), par(xp)
        _grads_equal(yp, yr, rank, tp, -1, stride)
        g = torch.randn(yr.shape, generator=torch.Generator().manual_seed(3))
        yr.backward(g)
        yp.backward(split_for_rank(g, -1, tp, rank, stride))
        _grads_equal(par.weight.grad, ref.weight.grad, rank, tp, 0, stride)
        _grads_equal(par.bias.grad, ref.bias.grad, rank, tp, 0, stride)
        assert torch.allclose(xp.grad, xr.grad, **TOL)

    # Column with gather_output, then row-parallel with a replicated input.
    torch.manual_seed(11)
    ref = ColumnParallelLinear(16, 8, gather_output=True, tp_group=ps.ParallelGroup.single())
    torch.manual_seed(11)
    par = ColumnParallelLinear(16, 8, gather_output=True, tp_group=group)
    assert torch.allclose(par(x), ref(x), **TOL)

    for input_is_parallel in (False, True):
        torch.manual_seed(12)
        ref = RowParallelLinear(
            16, 12, input_is_parallel=input_is_parallel, tp_group=ps.ParallelGroup.single()
        )
        torch.manual_seed(12)
        par = RowParallelLinear(16, 12, input_is_parallel=input_is_parallel, tp_group=group)
        xr = x.clone().requires_grad_()
        xp = (x if not input_is_parallel else split_for_rank(x, -1, tp, rank)).clone()
        xp.requires_grad_()
        yr, yp = ref(xr), par(xp)
        assert torch.allclose(yp, yr, **TOL)
        yr.sum().backward()
        yp.sum().backward()
        _grads_equal(par.weight.grad, ref.weight.grad, rank, tp, 1, 1)
        assert torch.allclose(par.bias.grad, ref.bias.grad, **TOL)
        want = xr.grad if not input_is_parallel else split_for_rank(xr.grad, -1, tp, rank)
        assert torch.allclose(xp.grad, want, **TOL)

    torch.manual_seed(13)
    ref = VocabParallelEmbedding(32, 6, tp_group=ps.ParallelGroup.single())
    torch.manual_seed(13)
    par = VocabParallelEmbedding(32, 6, tp_group=group)
    ids = torch.randint(0, 32, (4, 7))
    yr, yp = ref(ids), par(ids)
    assert torch.allclose(yp, yr, **TOL)
    g = torch.randn(yr.shape)
    yr.backward(g)
    yp.backward(g)
    _grads_equal(par.weight.grad, ref.weight.grad, rank, tp, 0, 1)


def _seq(x, tp, rank):
    """This rank's shard of a [b, s, ...] tensor along the sequence."""
    return x.chunk(tp, dim=1)[rank]


def _check_sequence_primitives(rank, tp, group):
    full = torch.arange(2.0 * 4 * tp * 3).reshape(2, 4 * tp, 3)
    x = full.clone().requires_grad_()
    y = scatter_to_sequence_region(x, group)
    assert torch.equal(y, _seq(full, tp, rank))
    y.backward(torch.full_like(y, float(rank)))
    expect = torch.cat([torch.full((2, 4, 3), float(r)) for r in range(tp)], 1)
    assert torch.equal(x.grad, expect), "scatter (sequence): backward must all-gather"

    shard = torch.full((2, 4, 3), float(rank), requires_grad=True)
    y = gather_from_sequence_region(shard, group)
    assert torch.equal(y, expect)
    y.backward(full)
    assert torch.equal(shard.grad, _seq(full, tp, rank)), "gather (sequence): bwd splits"

    x = (full * (rank + 1)).requires_grad_()
    y = reduce_scatter_from_tp_region(x, group)
    total = float(sum(range(1, tp + 1)))
    assert torch.equal(y, _seq(full, tp, rank) * total), "reduce-scatter: sum, then split"
    y.backward(torch.full_like(y, float(rank)))
    assert torch.equal(x.grad, expect), "reduce-scatter: backward must all-gather"

    shard = torch.full((2, 4, 3), float(rank), requires_grad=True)
    y = gather_sequence_to_tp_region(shard, group)
    assert torch.equal(y, expect)
    y.backward(full * (rank + 1))
    assert torch.equal(shard.grad, _seq(full, tp, rank) * total), (
        "gather to TP: backward must reduce-scatter"
    )


def _check_sequence_parallel_layers(rank, tp, group):
    """Layers fed by sequence shards equal the unsplit layers on the whole sequence."""
    single = ps.ParallelGroup.single()
    x = torch.randn(3, 4 * tp, 16, generator=torch.Generator().manual_seed(2))
    g = torch.randn(3, 4 * tp, 24, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(20)
    ref = ColumnParallelLinear(16, 24, stride=3, tp_group=single)
    torch.manual_seed(20)
    par = ColumnParallelLinear(16, 24, stride=3, tp_group=group, sequence_parallel=True)
    xr, xp = x.clone().requires_grad_(), _seq(x, tp, rank).clone().requires_grad_()
    yr, yp = ref(xr), par(xp)
    _grads_equal(yp, yr, rank, tp, -1, 3)  # the whole sequence, this rank's columns
    yr.backward(g)
    yp.backward(split_for_rank(g, -1, tp, rank, 3))
    _grads_equal(par.weight.grad, ref.weight.grad, rank, tp, 0, 3)
    _grads_equal(par.bias.grad, ref.bias.grad, rank, tp, 0, 3)
    assert torch.allclose(xp.grad, _seq(xr.grad, tp, rank), **TOL)

    torch.manual_seed(21)
    ref = RowParallelLinear(24, 16, tp_group=single)
    torch.manual_seed(21)
    par = RowParallelLinear(24, 16, tp_group=group, sequence_parallel=True)
    assert par.bias.sequence_parallel == (tp > 1) and not ref.bias.sequence_parallel
    assert register_sequence_parallel_grad_hooks(par, group) == (1 if tp > 1 else 0)
    xr, xp = g.clone().requires_grad_(), split_for_rank(g, -1, tp, rank).requires_grad_()
    yr, yp = ref(xr), par(xp)
    assert torch.allclose(yp, _seq(yr, tp, rank), **TOL)
    up = torch.randn(yr.shape, generator=torch.Generator().manual_seed(4))
    yr.backward(up)
    yp.backward(_seq(up, tp, rank))
    _grads_equal(par.weight.grad, ref.weight.grad, rank, tp, 1, 1)
    # The hook summed the shard-partial bias gradient over TP before accumulation.
    assert torch.allclose(par.bias.grad, ref.bias.grad, **TOL)
    assert torch.allclose(xp.grad, split_for_rank(xr.grad, -1, tp, rank), **TOL)

    torch.manual_seed(22)
    ref = VocabParallelEmbedding(32, 6, tp_group=single)
    torch.manual_seed(22)
    par = VocabParallelEmbedding(32, 6, tp_group=group, reduce_scatter=True)
    ids = torch.randint(0, 32, (2, 4 * tp), generator=torch.Generator().manual_seed(5))
    yr, yp = ref(ids), par(ids)
    assert torch.allclose(yp, _seq(yr, tp, rank), **TOL)
    up = torch.randn(yr.shape, generator=torch.Generator().manual_seed(6))
    yr.backward(up)
    yp.backward(_seq(up, tp, rank))
    _grads_equal(par.weight.grad, ref.weight.grad, rank, tp, 0, 1)


def _check_cross_entropy(rank, tp, group):
    torch.manual_seed(5)
    logits = (torch.randn(3, 7, 64) * 4).requires_grad_()
    target = torch.randint(0, 64, (3, 7))
    ref = F.cross_entropy(logits.view(-1, 64), target.view(-1), reduction="none").view(3, 7)
    local = split_for_rank(logits.detach(), -1, tp, rank).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, group)
    assert torch.allclose(loss, ref, **TOL)
    w = torch.rand(3, 7)
    (ref * w).sum().backward()
    (loss * w).sum().backward()
    _grads_equal(local.grad, logits.grad, rank, tp, -1, 1)


def _worker(rank, world, tp):
    ps.initialize_model_parallel(tp)
    group = ps.get_tensor_model_parallel_group()
    r = ps.get_tensor_model_parallel_rank()
    _check_primitives(r, tp, group)
    _check_layers(r, tp, group)
    _check_sequence_primitives(r, tp, group)
    _check_sequence_parallel_layers(r, tp, group)
    _check_cross_entropy(r, tp, group)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_layers_equal_unsplit(tp):
    # world 4: with TP=2 there are two TP groups (DP=2), which also checks group isolation.
    run_distributed(_worker, 4, tp)


def test_tp1_layers_and_loss_single_process():
    single = ps.ParallelGroup.single()
    _check_primitives(0, 1, single)
    _check_layers(0, 1, single)
    _check_sequence_primitives(0, 1, single)
    _check_sequence_parallel_layers(0, 1, single)
    _check_cross_entropy(0, 1, single)


def test_layers_before_initialisation_raise():
    """No silent unsplit model: without initialize_model_parallel a layer must be told."""
    from mp_offload.model.gpt import GPTConfig, GPTModel

    ps.destroy_model_parallel()
    for build in (
        lambda: ColumnParallelLinear(16, 8),
        lambda: RowParallelLinear(16, 8),
        lambda: VocabParallelEmbedding(32, 6),
        lambda: GPTModel(
            GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32)
        ),
    ):
        with pytest.raises(ps.ParallelStateError, match="initialize_model_parallel"):
            build()
    with pytest.raises(ps.ParallelStateError):
        ps.get_data_parallel_rank()
    with pytest.raises(TypeError, match="ParallelGroup"):
        ColumnParallelLinear(16, 8, tp_group="single-process")


def test_planned_group_builds_shapes_but_cannot_communicate():
    planned = ps.ParallelGroup.planned(4, 3)
    layer = ColumnParallelLinear(16, 8, tp_group=planned, device="meta")
    assert layer.weight.shape == (2, 16)
    with pytest.raises(ps.ParallelStateError, match="planned group of 4"):
        reduce_from_tp_region(torch.ones(2), planned)


def test_split_merge_roundtrip():
    full = torch.randn(12, 5)
    for tp in (1, 2, 4):
        for stride in (1, 3):
            parts = [split_for_rank(full, 0, tp, r, stride) for r in range(tp)]
            assert torch.equal(merge_partitions(parts, 0, stride), full)
    parts = [split_for_rank(full, 0, 2, r, 3) for r in range(2)]
    # stride 3 over [q; k; v]: rank 0 holds q0, k0, v0
    assert torch.equal(parts[0], torch.cat([full[0:2], full[4:6], full[8:10]]))


def test_invalid_layouts_name_the_flag():
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 3 does not divide"):
        ps.validate_parallel_sizes(4, 3)
    with pytest.raises(ValueError, match="--num-attention-heads 6"):
        ps.validate_parallel_sizes(4, 4, num_attention_heads=6)
    with pytest.raises(ValueError, match="--hidden-size 30"):
        ps.validate_parallel_sizes(4, 4, hidden_size=30)
    assert ps.rank_layout(8, 2) == ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]])
    assert dist.is_available()
