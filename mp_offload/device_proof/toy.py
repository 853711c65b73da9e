"""A GPT and its ZeRO optimizer in this process, one device, no process group: what the
profiled step (stage 4) and the CUDA proof tests build."""

from __future__ import annotations

import torch

from .. import parallel_state as ps
from ..data.loader import MockGPTDataset
from ..model.gpt import GPTConfig, GPTModel
from ..optimizer.zero import ZeroOptimizer
from ..tensor_parallel import model_parallel_seed

HP = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=1.0)
SINGLE = ps.ParallelGroup.single()
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=200)
# About 300M parameters: big enough for PCIe time to matter beside backward on one GPU.
MEDIUM = dict(
    num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=50257
)


def model(device, seed: int = 42, **cfg) -> GPTModel:
    """The same weights for the same seed on every device (initialised on the CPU)."""
    torch.manual_seed(seed)
    model_parallel_seed(seed, 0, "cpu")
    full = dict(make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(GPTConfig(**{**full, **cfg}), tp_group=SINGLE).to(device)


def zero(m: GPTModel, device, **kw) -> ZeroOptimizer:
    """``kw``: ZeroOptimizer's arguments, HP's included (e.g. ``clip_grad``)."""
    kw = {**HP, "bucket_size": 3000, **kw}  # many buckets: the copy path's order matters
    return ZeroOptimizer(m, dp=SINGLE, tp=SINGLE, device=torch.device(device), **kw)


def tokens(cfg: dict, batch: int, step: int, device) -> torch.Tensor:
    """Micro-batch ``step``: learnable mock sequences (the same for the same arguments)."""
    data = MockGPTDataset(batch * (step + 1), cfg["seq_length"], cfg["vocab_size"], seed=5)
    rows = [torch.from_numpy(data[step * batch + i]["text"]) for i in range(batch)]
    return torch.stack(rows).to(device)


def step(opt: ZeroOptimizer, m: GPTModel, batches: list[torch.Tensor], autocast=None):
    """One optimizer step over ``batches`` (its micro-batches); returns (loss, result)."""
    opt.zero_grad(lr=HP["lr"])  # before backward: --overlap-cpu-optimizer steps during it
    total = 0.0
    for t in batches:
        with torch.autocast(
            t.device.type, dtype=autocast or torch.float32, enabled=autocast is not None
        ):
            loss = m(t[:, :-1], t[:, 1:]).mean() / len(batches)
        opt.backward(loss)
        total += loss.item()
    return total, opt.step(HP["lr"])
