"""tools/generate.py's start-up: it joins torchrun's world through the project's own
(``distributed.init_distributed``: rendezvous message, timeout), never a bare
``init_process_group``."""

import torch
import torch.distributed as dist

from mp_offload import generation
from mp_offload.runtime import distributed


def test_generate_joins_the_world_through_the_projects_start_up(monkeypatch):
    joined = []

    def init_distributed(device=None, timeout_minutes=10.0):
        joined.append(timeout_minutes)
        return torch.device("cpu")

    def bare(*a, **k):
        raise AssertionError("init_process_group called directly: no rendezvous message")

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed, "init_distributed", init_distributed)
    monkeypatch.setattr(dist, "init_process_group", bare)
    device, created = generation._setup(1)
    assert (device.type, created, joined) == ("cpu", True, [10.0])


def test_a_single_process_starts_no_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: 1 / 0)
    assert generation._setup(1) == (torch.device("cpu"), False)
