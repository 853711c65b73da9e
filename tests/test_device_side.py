"""optimizer/device_side.py on a small layout (three Linear layers, three padded buckets),
built as ``sides.make_sides`` builds it, without an optimizer: the first micro-batch's
chunk is copied into the fp32 gradient and the next ones added, the squares counted over
the parameters only; the step is torch's AdamW; the publish writes the master, rounded,
into this rank's chunks of the flat buffer only; as a partial offload's device share it
holds the last buckets under the placement's "share." names."""

import pytest
import torch
from cpu_adam_ref import ATOL, RTOL
from zero_helpers import adamw_reference, small_parts

from mp_offload.optimizer.adam_calls import StepHyper
from mp_offload.optimizer.device_side import DeviceSide
from mp_offload.optimizer.placement import STATE
from mp_offload.optimizer.side import Micro
from mp_offload.optimizer.streams import HostStreams

CPU = torch.device("cpu")
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
DECAY, SCALE = 0.1, 0.5  # matrices' weight decay; the unscale x clip factor


def _side(dp=1, dp_rank=0, **options):
    """Without offload: the device side holds every bucket."""
    _, layout, place, flat = small_parts(dp, dp_rank, cpu_offload=False, **options)
    return layout, place, flat, DeviceSide(layout, place, CPU, HostStreams(), "")


def _params_mask(b) -> torch.Tensor:
    """Which elements of bucket ``b``'s chunk (one DP rank: the bucket) are parameters."""
    mask = torch.zeros(b.numel, dtype=torch.bool)
    for s in b.slots:
        mask[s.start - b.start :][: s.numel] = True
    return mask


def _slice(layout, seed: int) -> torch.Tensor:
    """A random slice, zero where no parameter lies."""
    t = torch.zeros(layout.slice_numel)
    gen = torch.Generator().manual_seed(seed)
    for _, _, o, n in layout.owned_pieces():
        t[o : o + n] = torch.randn(n, generator=gen)
    return t


def test_one_micro_batch_is_copied_and_counted_over_the_parameters():
    layout, _, _, side = _side()
    side.start_step()
    want = 0.0
    for b in layout.buckets:
        side.grads[b.slice_offset :][: b.chunk].fill_(7.0)  # last step's: overwritten
        out = torch.randn(b.numel, generator=torch.Generator().manual_seed(b.index))
        side.receive(b, out, None, Micro(True, True, True))
        assert torch.equal(side.grads[b.slice_offset :][: b.chunk], out)
        want += out[_params_mask(b)].double().square().sum()  # never the padding
    torch.testing.assert_close(sum(side.norm_parts), want, rtol=1e-12, atol=0)


def test_micro_batches_add_up_and_the_last_counts_the_sum():
    layout, _, _, side = _side(micro_batches=3)
    side.start_step()
    gen = torch.Generator().manual_seed(0)
    outs = {
        b.index: [torch.randn(b.numel, generator=gen) for _ in range(3)] for b in layout.buckets
    }
    micros = (Micro(True, False, False), Micro(False, False, False), Micro(False, True, False))
    for i, micro in enumerate(micros):
        for b in layout.buckets:
            side.receive(b, outs[b.index][i], None, micro)
        assert len(side.norm_parts) == (len(layout.buckets) if micro.last else 0)
    want = 0.0
    for b in layout.buckets:
        a, c, d = outs[b.index]
        assert torch.equal(side.grads[b.slice_offset :][: b.chunk], a + c + d)
        want += (a + c + d)[_params_mask(b)].double().square().sum()
    torch.testing.assert_close(sum(side.norm_parts), want, rtol=1e-12, atol=0)


def test_three_steps_are_torchs_adamw():
    layout, _, _, side = _side()
    init = _slice(layout, 1)
    side.target("master").copy_(init)  # the live tensor: nothing to commit
    grads = [_slice(layout, 10 + k) for k in range(3)]
    for k, g in enumerate(grads):
        side.grads.copy_(g)
        keys = [(HP["lr"], k + 1, DECAY if s.param.ndim > 1 else 0.0) for s in layout.slots]
        side.step(StepHyper(tuple(keys), HP["betas"], HP["eps"], SCALE))
    want = adamw_reference(layout, init, grads, decay=DECAY, grad_scale=SCALE, **HP)
    for key, w in zip(("master", "exp_avg", "exp_avg_sq"), want):
        torch.testing.assert_close(side.parts(key), w, rtol=RTOL, atol=ATOL)


def test_a_slot_not_stepped_is_left_alone():
    layout, _, _, side = _side()
    side.target("master").copy_(_slice(layout, 2))
    side.grads.copy_(_slice(layout, 3))
    before = side.master.clone()
    keys = [None if i == 0 else (HP["lr"], 1, 0.0) for i in range(len(layout.slots))]
    side.step(StepHyper(tuple(keys), HP["betas"], HP["eps"], 1.0))
    frozen = torch.zeros(layout.slice_numel, dtype=torch.bool)
    for slot, _, o, n in layout.owned_pieces():
        frozen[o : o + n] = slot.index == 0
    assert torch.equal(side.master[frozen], before[frozen])
    assert not side.exp_avg[frozen].any()
    assert (side.master[~frozen] != before[~frozen]).any()


@pytest.mark.parametrize("rank", [0, 1])
def test_the_publish_rounds_the_master_into_this_ranks_chunks_only(rank):
    layout, _, flat, side = _side(2, rank, dtype=torch.bfloat16)
    master = _slice(layout, 4)
    side.target("master").copy_(master)
    side.publish(flat, rank)
    mine = torch.zeros(flat.numel(), dtype=torch.bool)
    for b in layout.buckets:
        lo, hi = b.chunk_range(rank)
        mine[lo:hi] = True
        assert torch.equal(flat[lo:hi], master[b.slice_offset :][: b.chunk].bfloat16())
    assert not flat[~mine].any()  # the other rank's chunks come by the all-gather


def test_a_device_share_holds_the_last_buckets_under_the_share_names():
    _, layout, place, _ = small_parts(offload_fraction=0.5)
    first, end = place.device_range
    assert 0 < first < end == len(layout.buckets)
    side = DeviceSide(layout, place, CPU, HostStreams(), "share.")
    assert [b.index for b in side.buckets] == list(range(first, end))
    assert side.offset == layout.buckets[first].slice_offset
    assert side.numel == place.share_numel == layout.slice_numel - side.offset
    assert side.owns(side.offset) and not side.owns(side.offset - 1)
    for name, t in side.buffers():
        buf = place.buffer(name)
        assert name.startswith("share.") and (buf.side, buf.numel) == ("device", t.numel())
    assert sorted(n for n, _ in side.buffers()) == sorted("share." + k for k in STATE)
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert side.parts(key) is side.target(key)  # a save and a load copy nothing
