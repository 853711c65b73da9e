"""The worker that accumulates gradient chunks on the host (used on CUDA with offload)."""
import threading

import pytest
import torch

from mp_offload.optimizer.host_accumulator import HostAccumulator


class _Event:
    """Stands in for a CUDA event: the add must wait until it is set."""

    def __init__(self):
        self.flag = threading.Event()

    def synchronize(self):
        assert self.flag.wait(10)


def test_adds_land_after_their_event_and_wait_blocks_until_done():
    acc = HostAccumulator()
    grad = torch.zeros(1000)
    chunks = [torch.randn(100) for _ in range(10)]
    events = [_Event() for _ in chunks]
    for k, (c, e) in enumerate(zip(chunks, events)):
        acc.add(grad[k * 100:(k + 1) * 100], c, e)
    assert grad.abs().sum() == 0, "nothing may be added before its copy has landed"
    for e in reversed(events):
        e.flag.set()
    acc.wait()
    assert torch.equal(grad, torch.cat(chunks))
    for k, c in enumerate(chunks):  # a second micro-batch accumulates on top
        acc.add(grad[k * 100:(k + 1) * 100], c)
    acc.wait()
    assert torch.equal(grad, 2 * torch.cat(chunks))


def test_a_failed_add_is_raised_by_wait():
    acc = HostAccumulator()
    acc.add(torch.zeros(3), torch.zeros(4))
    with pytest.raises(RuntimeError, match="host gradient accumulation failed"):
        acc.wait()
    acc.add(torch.zeros(2), torch.ones(2))
    acc.wait()  # the worker keeps serving after a reported failure


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 7, 1000, 4099])
def test_host_accumulate_equals_torch(dtype, n):
    from mp_offload.ops import host_ops
    src = torch.randn(n).to(dtype)
    if n > 3:  # the fp16/bf16 edge values: inf, a subnormal, -0
        src[:3] = torch.tensor([float("inf"), 1e-7 if dtype == torch.float16 else 1e-40, -0.0])
    base = torch.randn(n)
    dst = base.clone()
    host_ops.accumulate_(dst, src, overwrite=False)
    assert torch.equal(dst, base + src.float())
    host_ops.accumulate_(dst, src, overwrite=True)
    assert torch.equal(dst, src.float())
    ranges = [(0, n // 3), (n // 2, n)]
    got = host_ops.sum_squares(base, ranges)
    want = sum(base[a:z].double().square().sum() for a, z in ranges)
    assert torch.allclose(got, torch.as_tensor(want, dtype=torch.float64), rtol=1e-12)


def test_host_accumulate_refuses_bad_input():
    from mp_offload.ops import host_ops
    with pytest.raises(ValueError, match="dst fp32"):
        host_ops.accumulate_(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4), False)
    with pytest.raises(ValueError, match="of one shape"):
        host_ops.accumulate_(torch.zeros(4), torch.zeros(5), False)
    with pytest.raises(ValueError, match="outside"):
        host_ops.sum_squares(torch.zeros(4), [(2, 9)])
