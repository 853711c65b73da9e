"""train_step is the unit the loop and the benchmark share: check it against a hand loop."""

import torch
from helpers import ADAM_HP as HP
from helpers import tiny_gpt_config
from zero_helpers import build_zero

from mp_offload import parallel_state as ps
from mp_offload.data.loader import MockGPTDataset
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.training import train_step

CFG = tiny_gpt_config()
SINGLE = ps.ParallelGroup.single()


def _micro_batches(data, micro):
    i = 0
    while True:
        yield torch.stack([torch.from_numpy(data[i + k]["text"]) for k in range(micro)])
        i += micro


def test_train_step_equals_hand_written_loop():
    data = MockGPTDataset(64, 16, 96, seed=1)
    losses = {}
    for kind in ("train_step", "hand"):
        torch.manual_seed(0)
        model = GPTModel(GPTConfig(**CFG), tp_group=SINGLE)
        opt = build_zero(
            model, **HP, dp=SINGLE, tp=SINGLE, device="cpu", bucket_size=700, micro_batches=2
        )
        batches = _micro_batches(data, 2)
        out = []
        for _ in range(4):
            if kind == "train_step":
                step = train_step(model, opt, batches, 2, 1e-3, SINGLE, torch.device("cpu"))
                out.append((step.loss, step.result.grad_norm))
            else:
                opt.zero_grad()
                total = torch.zeros(())  # summed in fp32, as train_step does
                for _ in range(2):
                    t = next(batches)
                    loss = model(t[:, :-1], t[:, 1:]).mean() / 2
                    opt.backward(loss)
                    total += loss.detach()
                out.append((float(total), opt.step(1e-3).grad_norm))
        losses[kind] = out
    assert losses["train_step"] == losses["hand"]
    norms = [n for _, n in losses["hand"]]
    assert all(n > 0 for n in norms) and len(set(norms)) == len(norms), "steps must update"
