"""planner/overlap_schedule.py: the overlapped host step, bucket by bucket, by hand."""

import pytest

from mp_offload.planner.overlap_schedule import Buckets, buckets, keeping_up_backward, schedule


def _three(work_1: float) -> Buckets:
    """Three host buckets (20%, 30%, 50% of the slice), 1 s down and 1 s up each."""
    return Buckets(
        (0.2, 0.3, 0.5), (True,) * 3, (0.0,) * 3, (1.0,) * 3, (4.0, work_1, 1.0), (1.0,) * 3
    )


def test_schedule_by_hand():
    # backward 10 s: computed at 2, 5, 10; landed at 3, 6, 11; the worker steps bucket 0
    # over [3, 7], bucket 1 over [7, 11.5] (it waited), bucket 2 over [11.5, 12.5]. The end
    # of backward at 11 (the last chunk landed); the worker done at 12.5, then 3 copies up.
    got = schedule(_three(4.5), 10.0)
    assert got.exposed == pytest.approx(1.5 + 3.0)
    assert got.hidden == pytest.approx(8.0)
    assert got.keeps_up is False  # bucket 2 landed at 11 with the worker busy until 11.5
    # bucket 1 done at 11: the worker is free as bucket 2 lands
    assert schedule(_three(4.0), 10.0).keeps_up is True


def test_device_share_buckets_skip_the_worker_and_the_copies():
    host_only = schedule(_three(4.5), 10.0)
    b = _three(4.5)
    on_device = Buckets(b.share, (False, True, True), b.reduce, b.down, b.work, b.up)
    got = schedule(on_device, 10.0)
    # bucket 1 lands at 6 and is stepped over [6, 10.5], bucket 2 over [11, 12]; 2 copies up
    assert got.hidden == pytest.approx(4.5) and got.exposed == pytest.approx(1.0 + 2.0)
    assert got.keeps_up and not host_only.keeps_up


def test_buckets_splits_per_element_costs_and_the_device_share():
    b = buckets([10, 30, 60], 1, 2.0, 0.1, 0.01, 0.2)
    assert b.share == pytest.approx((0.1, 0.3, 0.6)) and b.host == (False, True, True)
    assert b.reduce == pytest.approx((0.2, 0.6, 1.2))
    assert b.down == pytest.approx((0.0, 3.0, 6.0)) and b.up == pytest.approx((0.0, 6.0, 12.0))
    assert b.work == pytest.approx((0.0, 0.3, 0.6))


def test_keeping_up_backward_is_the_threshold():
    b = _three(4.5)
    t = keeping_up_backward(b, 1.0)
    assert schedule(b, t).keeps_up and not schedule(b, 0.99 * t).keeps_up
    # by hand: bucket 1 ends at max(0.2t + 5, 0.5t + 1) + 4.5, bucket 2 lands at t + 1;
    # below t = 40/3 the first term is the larger: 0.2t + 9.5 <= t + 1 from t = 10.625
    assert t == pytest.approx(10.625, rel=2e-3)
    assert keeping_up_backward(b, 1000.0) == pytest.approx(t, rel=2e-3)  # from above too
