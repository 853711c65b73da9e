"""--accumulate-grads-on-device against host accumulation (bf16, DP=1, four micro-batches).

The device path sums the micro-batches in an fp32 buffer, as the host path sums the
chunks that come down, so both give Adam the same gradient; only the norm is summed
differently (fp32 partial norms on the device, fp64 on the host).
"""

import torch
from helpers import ADAM_HP, tiny_gpt_config
from zero_helpers import build_zero, live, wrap_adam

from mp_offload import parallel_state as ps
from mp_offload.data.loader import MockGPTDataset
from mp_offload.model.gpt import GPTConfig, GPTModel

SINGLE = ps.ParallelGroup.single()
_DATA = MockGPTDataset(10_000, 16, 96, seed=5)
MICRO, GBS = 4, 8


def _batch(step):
    t = torch.stack([torch.from_numpy(_DATA[step * GBS + i]["text"]) for i in range(GBS)])
    return t[:, :-1], t[:, 1:]


def _losses(on_device: bool, steps: int = 10, **kw):
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**tiny_gpt_config()), tp_group=SINGLE)
    opt = build_zero(
        model,
        **ADAM_HP,
        dp=SINGLE,
        tp=SINGLE,
        device="cpu",
        dtype=torch.bfloat16,
        cpu_offload=True,
        bucket_size=2000,
        micro_batches=MICRO,
        accumulate_on_device=on_device,
        **kw,
    )
    losses, first_grad = [], []
    adam = live(opt).adam

    def recording_adam(param, grad, *a, **k):  # keeps what Adam read at the first step
        if not losses:
            first_grad.append(grad.float().clone())  # one piece (bucket) per call
        return adam(param, grad, *a, **k)

    wrap_adam(opt, lambda _: recording_adam)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        total = 0.0
        for k in range(MICRO):
            part = slice(k * GBS // MICRO, (k + 1) * GBS // MICRO)
            loss = model(x[part], y[part]).float().mean() / MICRO
            opt.backward(loss)
            total += float(loss.detach())
        opt.step(ADAM_HP["lr"])
        losses.append(total)
    return losses, torch.cat(first_grad)


def test_device_accumulation_gives_the_host_accumulation_losses():
    (host, host_grad), (device, device_grad) = _losses(False), _losses(True)
    # the same fp32 sums of the same bf16 gradients, in the same order: bitwise
    assert torch.equal(device_grad, host_grad), "the step's gradient differs"
    worst = max(abs(a - b) / abs(b) for a, b in zip(device, host))
    assert worst <= 1e-6, f"device vs host accumulation: worst relative loss gap {worst:.2e}"
