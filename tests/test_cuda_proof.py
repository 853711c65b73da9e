"""The device proof's checks as tests: every equivalence, the DPU "delayed" check and the
upload order pass on the real optimizer, on the CPU here and on a GPU where there is one
(the ``cuda`` cases; ``scripts/device_check.sh`` runs the same tasks in one process)."""

import pytest
import torch

from device_proof import equivalence as eq
from device_proof import toy
from device_proof import upload_order as uo

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
TASKS = {fn.__name__: fn for fn in (*eq.TASKS, *uo.TASKS)}


def _section(device):
    cfg, bucket = (toy.TINY, 3000) if device == "cpu" else (toy.SMALL, 1 << 16)
    return eq.Section(device, cfg, bucket)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("task", list(TASKS))
def test_the_proofs_task_passes_on_the_real_optimizer(device, task):
    sec = _section(device)
    with eq.deterministic(sec):
        lines = list(TASKS[task](sec))
    failed = [line for line in lines if line[0] == "FAIL"]
    assert lines and not failed, failed


@pytest.mark.parametrize("device", DEVICES)
def test_a_dpu_thread_failure_surfaces(device):
    m = toy.model(toy.initial(toy.TINY), device, torch.bfloat16)
    opt = toy.zero(m, device, dtype=torch.bfloat16, dpu_warmup_steps=0)

    def broken(*args):
        raise MemoryError("injected")

    opt._adam_pass = broken
    batch = [toy.tokens(toy.TINY, 4, 0, device)]
    toy.step(opt, m, batch)  # the thread fails...
    with pytest.raises(RuntimeError, match="DPU.*MemoryError: injected"):
        toy.step(opt, m, batch)  # ...and says so here
