"""The learning-rate schedule at chosen points (counted in samples, as Megatron does)."""

import math

import pytest

from mp_offload.lr_scheduler import LRScheduler


def test_warmup_then_cosine_to_min():
    s = LRScheduler(1e-3, 1e-4, warmup_samples=100, decay_samples=1100, style="cosine")
    assert s.get_lr(0) == 0.0
    assert s.get_lr(50) == pytest.approx(5e-4)
    assert s.get_lr(100) == pytest.approx(1e-3)
    assert s.get_lr(600) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))  # halfway: cos = 0
    assert s.get_lr(100 + 250) == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi / 4)) * 9e-4)
    assert s.get_lr(1100) == pytest.approx(1e-4)
    assert s.get_lr(5000) == pytest.approx(1e-4)


def test_linear_and_constant():
    s = LRScheduler(2.0, 0.0, 0, 100, "linear")
    assert [s.get_lr(x) for x in (0, 25, 100, 200)] == pytest.approx([2.0, 1.5, 0.0, 0.0])
    c = LRScheduler(3e-4, 0.0, 10, 100, "constant")
    assert c.get_lr(5) == pytest.approx(1.5e-4) and c.get_lr(99) == 3e-4


def test_bad_schedule_is_named():
    with pytest.raises(ValueError, match="--lr-decay-style"):
        LRScheduler(1.0, 0.0, 0, 10, "exp")
    with pytest.raises(ValueError, match="--min-lr"):
        LRScheduler(1.0, 2.0, 0, 10, "cosine")
