"""The worker that accumulates gradient chunks on the host (used on CUDA with offload).

The C++ accumulation it runs is tested in test_host_ops.py."""

import threading

import pytest
import torch

from mp_offload.optimizer.host_accumulator import HostAccumulator
from mp_offload.optimizer.streams import HostStreams


class _Event:
    """Stands in for a CUDA event: the add must wait until it is set."""

    def __init__(self):
        self.flag = threading.Event()

    def synchronize(self):
        assert self.flag.wait(10)


def _add(dst, src):
    return lambda: dst.add_(src)


def test_adds_land_after_their_event_and_wait_blocks_until_done():
    acc = HostAccumulator(HostStreams())
    grad = torch.zeros(1000)
    chunks = [torch.randn(100) for _ in range(10)]
    events = [_Event() for _ in chunks]
    for k, (c, e) in enumerate(zip(chunks, events)):
        acc.submit(_add(grad[k * 100 : (k + 1) * 100], c), e)
    assert grad.abs().sum() == 0, "nothing may be added before its copy has landed"
    for e in reversed(events):
        e.flag.set()
    acc.wait()
    assert torch.equal(grad, torch.cat(chunks))
    for k, c in enumerate(chunks):  # a second micro-batch accumulates on top
        acc.submit(_add(grad[k * 100 : (k + 1) * 100], c))
    acc.wait()
    assert torch.equal(grad, 2 * torch.cat(chunks))


def test_a_failed_add_is_raised_by_wait():
    acc = HostAccumulator(HostStreams())
    acc.submit(_add(torch.zeros(3), torch.zeros(4)))
    with pytest.raises(RuntimeError, match="host gradient accumulation failed"):
        acc.wait()
    acc.submit(_add(torch.zeros(2), torch.ones(2)))
    acc.wait()  # the worker keeps serving after a reported failure
