"""optimizer/host_side.py on a small layout (three Linear layers, three padded buckets),
built as ``sides.make_sides`` builds it, without an optimizer: each chunk received lands
in the staging (one micro-batch) or sums into the fp32 gradient (two, on the caller's
thread or the worker), with its squares counted for the norm over the parameters only;
the step is torch's AdamW; the new params go up into this rank's chunks of the flat
buffer only; commit and parts round-trip the stored forms; the buffers are the
placement's."""

import pytest
import torch
from cpu_adam_ref import ATOL, RTOL
from zero_helpers import adamw_reference, small_parts

from mp_offload.ops.cpu_adam import split_fp32
from mp_offload.optimizer.adam_calls import StepHyper
from mp_offload.optimizer.host_side import HostSide
from mp_offload.optimizer.side import Micro
from mp_offload.optimizer.streams import HostStreams

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
DECAY, SCALE = 0.1, 0.5  # matrices' weight decay; the unscale x clip factor


def _side(dp=1, dp_rank=0, **options):
    _, layout, place, flat = small_parts(dp, dp_rank, **options)
    return layout, place, flat, HostSide(layout, place, HostStreams(), flat, dp_rank)


def _params_mask(b) -> torch.Tensor:
    """Which elements of bucket ``b``'s chunk (one DP rank: the bucket) are parameters."""
    mask = torch.zeros(b.numel, dtype=torch.bool)
    for s in b.slots:
        mask[s.start - b.start :][: s.numel] = True
    return mask


def _deliver(side, b, out, micro):
    side.receive(b, out, side.launched(b, out, None, micro), micro)


def _hyper(layout, step: int) -> StepHyper:
    """Every slot stepped: matrices with DECAY, vectors without (``default_groups``)."""
    keys = [(HP["lr"], step, DECAY if s.param.ndim > 1 else 0.0) for s in layout.slots]
    return StepHyper(tuple(keys), HP["betas"], HP["eps"], SCALE)


def _slice(layout, seed: int, padding=0.0) -> torch.Tensor:
    """A random slice, ``padding`` where no parameter lies."""
    t = torch.full((layout.slice_numel,), padding)
    gen = torch.Generator().manual_seed(seed)
    for _, _, o, n in layout.owned_pieces():
        t[o : o + n] = torch.randn(n, generator=gen)
    return t


def test_one_micro_batch_lands_in_the_staging_and_counts_its_parameters():
    layout, _, _, side = _side()
    assert side.reads_staging and side.adam_grads is side.staging
    side.start_step()
    want = 0.0
    for b in layout.buckets:
        out = torch.randn(b.numel, generator=torch.Generator().manual_seed(b.index))
        _deliver(side, b, out, Micro(True, True, True))
        assert torch.equal(side.staging[b.slice_offset :][: b.chunk], out)
        want += out[_params_mask(b)].double().square().sum()  # never the padding
    got = sum(side.norm_parts)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("worker", [False, True], ids=["caller", "worker"])
def test_two_micro_batches_sum_in_fp32_and_the_last_counts_the_sum(worker):
    layout, _, _, side = _side(dtype=torch.bfloat16, micro_batches=2)
    assert not side.reads_staging and side.grads.dtype == torch.float32
    if worker:
        side.start_worker()
    side.start_step()
    gen = torch.Generator().manual_seed(0)
    outs = [[torch.randn(b.numel, generator=gen).bfloat16() for b in layout.buckets]]
    outs.append([torch.randn(b.numel, generator=gen).bfloat16() for b in layout.buckets])
    for i, micro in enumerate((Micro(True, False, False), Micro(False, True, False))):
        for b in layout.buckets:
            _deliver(side, b, outs[i][b.index], micro)
        side.end_backward(micro)
    want = 0.0
    for b in layout.buckets:
        total = outs[0][b.index].float() + outs[1][b.index].float()
        assert torch.equal(side.grads[b.slice_offset :][: b.chunk], total)
        want += total[_params_mask(b)].double().square().sum()
    assert len(side.norm_parts) == len(layout.buckets)  # the last micro-batch's only
    torch.testing.assert_close(sum(side.norm_parts), want, rtol=1e-12, atol=0)


def test_three_steps_are_torchs_adamw_and_the_params_go_up():
    layout, _, flat, side = _side()
    init = _slice(layout, 1)
    t = side.target("master")
    t.copy_(init)
    side.commit("master", t)
    grads = [_slice(layout, 10 + k) for k in range(3)]
    for k, g in enumerate(grads):
        side.staging.copy_(g)
        side.step(_hyper(layout, k + 1), upload=True)
    want = adamw_reference(layout, init, grads, decay=DECAY, grad_scale=SCALE, **HP)
    for key, w in zip(("master", "exp_avg", "exp_avg_sq"), want):
        torch.testing.assert_close(side.parts(key), w, rtol=RTOL, atol=ATOL)
    for b in layout.buckets:  # fp32: the master itself goes up
        lo, hi = b.chunk_range(0)
        assert torch.equal(flat[lo:hi], side.parts("master")[b.slice_offset :][: b.chunk])
    assert side.bytes_up == 3 * layout.slice_numel * 4


@pytest.mark.parametrize("rank", [0, 1])
def test_bf16_params_go_up_into_this_ranks_chunks_only(rank):
    layout, place, flat, side = _side(2, rank, dtype=torch.bfloat16)
    assert not place.adam_writes_flat  # two ranks: the slice is not the flat buffer
    master = _slice(layout, 2)
    t = side.target("master")
    t.copy_(master)
    side.commit("master", t)  # the staging follows the committed master
    hi = split_fp32(master)[0]  # the split rule of bf16 params made on the host
    assert torch.equal(side.states[0].hi, hi)
    assert ((hi.float() - master).abs() <= master.abs() * 2**-8).all()  # within a bf16 ulp
    side.publish()
    mine = torch.zeros(flat.numel(), dtype=torch.bool)
    for b in layout.buckets:
        lo, end = b.chunk_range(rank)
        mine[lo:end] = True
        assert torch.equal(flat[lo:end], hi[b.slice_offset :][: b.chunk])
    assert not flat[~mine].any()  # the other rank's chunks come by the all-gather


def test_remainders_commit_and_parts_round_trip_the_fp32_master():
    layout, _, _, side = _side(dtype=torch.bfloat16, store_param_remainders=True)
    master = _slice(layout, 3)
    t = side.target("master")  # an fp32 tensor to fill: the stored form is (hi, lo)
    assert t.dtype == torch.float32 and side.states[0].master.dtype == torch.int16
    t.copy_(master)
    side.commit("master", t)
    assert torch.equal(side.parts("master"), master)  # bf16 hi + int16 lo: exact


def test_dense_forms_are_their_live_tensors():
    layout, _, _, side = _side()
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert side.parts(key) is side.target(key)  # a save and a load copy nothing
        t = side.target(key)
        t.copy_(_slice(layout, 4))
        side.commit(key, t)
        assert torch.equal(side.parts(key), _slice(layout, 4))


def test_an_8bit_bucket_is_stepped_in_one_call_or_refused():
    layout, _, _, side = _side(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    keys = [(1e-3 if s.param.ndim > 1 else 1e-2, 1, 0.0) for s in layout.slots]
    split = StepHyper(tuple(keys), HP["betas"], HP["eps"], 1.0)  # two lrs in one bucket
    g = _slice(layout, 5)
    side.staging.copy_(g)
    with pytest.raises(RuntimeError, match="8-bit moments step a bucket's chunk in one call"):
        side.step(split, upload=False)
    side.step(_hyper(layout, 1), upload=False)  # one lr: one call a bucket
    want = (1 - HP["betas"][0]) * g * SCALE  # the first step's exp_avg
    got = side.parts("exp_avg")
    # exp_avg's codes are 2^(k/8) steps under the block's absmax (csrc/q8_codes.h): a value
    # within the code range (2^-15.9 under it) is stored within one step of itself.
    inside = want.abs() >= want.abs().max() * 2**-15
    assert inside.sum() == layout.slice_numel - (g == 0).sum()  # every parameter here
    assert ((got[inside] / want[inside] - 1).abs() < 2 ** (1 / 8) - 1).all()
    assert not got[g == 0].any()


def test_the_buffers_are_the_placements_and_dpu_alternates_the_gradient():
    layout, place, _, side = _side(dpu_warmup_steps=1)
    names = [n for n, _ in side.buffers()]
    for buf in place.buffers:
        if buf.side == "host":
            assert names.count(buf.name) == buf.copies, buf
    assert set(names) <= {b.name for b in place.buffers if b.side == "host"}
    first, second = side.staging_copies
    assert side.adam_grads is first
    side.alternate_grads()  # backward t+1 writes the other copy while Adam reads this one
    assert side.adam_grads is second
    side.alternate_grads()
    assert side.adam_grads is first


def test_the_overlap_swaps_its_two_states():
    _, place, _, side = _side(overlap_cpu_optimizer=True)
    assert place.buffer("master").copies == 2
    live, spare = side.states
    assert live.master.data_ptr() != spare.master.data_ptr()
    side.swap_states()
    assert side.states == [spare, live]
