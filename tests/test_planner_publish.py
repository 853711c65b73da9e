"""planner/publish.py: the next forward behind the copies up and the all-gathers, by hand;
and the throughput model's DPU step, whose copies the forward now hides."""

import pytest

from mp_offload.planner.publish import (
    Bucket,
    device_gathers,
    forward_delay,
    forward_order,
    host_ready_in_turn,
)
from mp_offload.planner.throughput import Machine, step_time, ten_b


def _host(n, copy, forward, gather=0.0):
    return [Bucket(forward, gather, copy, 1) for _ in range(n)]


def test_copies_faster_than_the_forward_cost_only_the_first():
    # copies land at 1, 2, 3; the forward (2 s a bucket) waits 1 s for the first only
    assert forward_delay(_host(3, 1.0, 2.0), [0.0] * 3, start=0.0) == pytest.approx(1.0)


def test_copies_slower_than_the_forward_cost_what_the_forward_cannot_cover():
    # copies land at 3, 6, 9; the forward (1 s a bucket) ends at 10 instead of 3
    assert forward_delay(_host(3, 3.0, 1.0), [0.0] * 3, start=0.0) == pytest.approx(7.0)


def test_the_device_share_comes_first_and_its_forward_hides_the_copies():
    device = [Bucket(4.0, 0.0, None, 1)]
    assert forward_delay(device + _host(2, 1.0, 1.0), [0.0] * 2, start=0.0) == 0.0


def test_the_synchronous_copies_follow_the_cpu_adam_bucket_by_bucket():
    buckets = _host(3, 1.0, 1.0)
    adam = host_ready_in_turn(buckets, 6.0)  # 2 s of CPU Adam a bucket, in forward order
    assert adam == pytest.approx([2.0, 4.0, 6.0])
    # the copies land at 3, 5, 7; the forward starts at 6, when the CPU Adam is done
    assert forward_delay(buckets, adam, start=6.0) == 0.0
    assert forward_delay(_host(3, 1.0, 0.1), adam, start=6.0) == pytest.approx(0.8)


def test_the_overlaps_copies_leave_during_backward_in_its_order():
    # steps done 0.5 s, 2 s and 3 s before the end of backward, in forward order (the
    # worker steps the last first): its copies of 1 s go up as each step ends, the last
    # bucket's first, and land at -2, -1, 0.5: the forward, at 0, waits 0.5 s, then never
    buckets, ready = _host(3, 1.0, 0.1), [-0.5, -2.0, -3.0]
    assert forward_delay(buckets, ready, 0.0, backward_order=True) == pytest.approx(0.5)
    # the same copies in forward order would land at 0.5, 1.5, 2.5: the forward waits more
    assert forward_delay(buckets, ready, 0.0) == pytest.approx(0.5 + 0.9 + 0.9)


def test_the_gathers_queue_behind_the_device_shares_and_behind_their_copies():
    # gathers of 1 s behind the device share's, which end at 2: at 3, 4 (copies at .5, 1)
    got = forward_delay(_host(2, 0.5, 0.5, gather=1.0), [0.0] * 2, start=0.0, gathers_from=2.0)
    assert got == pytest.approx(3.0 + (4.0 - 3.5))


def test_forward_order_reverses_the_layout_and_marks_the_device_share():
    got = forward_order([10, 30, 60], 2, forward=10.0, gather=1.0, copy_s=0.1)
    assert [b.elements for b in got] == [60, 30, 10]  # the device share: the forward's first
    assert [b.copy for b in got] == [None, pytest.approx(3.0), pytest.approx(1.0)]
    assert [b.forward for b in got] == pytest.approx([6.0, 3.0, 1.0])
    assert device_gathers(got) == pytest.approx(0.6)


def test_the_dpu_step_exposes_less_than_every_copy_up():
    """10B on one V100 with DPU: before, the step waited for every copy up after the join;
    now the forward starts behind the first bucket's and runs behind the rest."""
    st = step_time(ten_b(), 1, Machine(), batch_per_gpu=4, micro_batch=4)
    before = st.compute + st.grad_exposed + max(0.0, st.adam_host - st.compute) + st.copy_up
    assert st.copy_up > 0 and before - st.copy_up < st.step_dpu < before
