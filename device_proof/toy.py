"""A GPT and its ZeRO optimizer in this process, one device, no process group, built the
way a user builds them: the model (a copy of one initial model, so every variant starts
from the same weights) moved to its device and cast to its dtype, then the optimizer
over it."""

from __future__ import annotations

import copy

import torch

from mp_offload import parallel_state as ps
from mp_offload.data.loader import MockGPTDataset
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.optimizer.options import OptimizerOptions
from mp_offload.optimizer.zero import ZeroOptimizer
from mp_offload.tensor_parallel import model_parallel_seed

# No clipping: where two paths are compared bitwise, each computes the norm its own way
# (the device from its chunks, the host in its last pass), and the clip factor would carry
# that last-bit difference into the weights.
HP = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=0.0)
SINGLE = ps.ParallelGroup.single()
_FIXED = dict(make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0)
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=200)
# The equivalences on a GPU: ~3M parameters in ~50 buckets, milliseconds a step.
SMALL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256, vocab_size=1024)
# The speed figures on a GPU: ~300M parameters, PCIe and the CPU Adam beside backward.
MEDIUM = dict(
    num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=50257
)


_INITIAL: dict = {}


def initial(cfg: dict, seed: int = 42) -> GPTModel:
    """The one initial model (fp32, CPU) every variant of a section copies (made once)."""
    key = (seed, *sorted(cfg.items()))
    if key not in _INITIAL:
        torch.manual_seed(seed)
        model_parallel_seed(seed, 0, "cpu")
        _INITIAL[key] = GPTModel(GPTConfig(**{**_FIXED, **cfg}), tp_group=SINGLE)
    return _INITIAL[key]


def model(init: GPTModel, device, dtype: torch.dtype | None = None, resident=True) -> GPTModel:
    """A copy of ``init`` cast to ``dtype``, moved to ``device`` first when ``resident``
    (what a user does before making the optimizer), else left on the CPU."""
    m = copy.deepcopy(init)
    if resident:
        m.to(device)
    return m.to(dtype) if dtype is not None else m


def zero(m: GPTModel, device, streams=None, **options) -> ZeroOptimizer:
    """The optimizer over ``m``; ``options``: ``OptimizerOptions`` fields (small buckets
    by default: many of them, so the copy path's order matters); ``streams``: e.g. a
    ``ledger.CopyLedger`` that watches its copies."""
    opts = OptimizerOptions(**{"bucket_size": 3000, **options})
    device = torch.device(device)
    return ZeroOptimizer(
        m, dp=SINGLE, tp=SINGLE, device=device, options=opts, streams=streams, **HP
    )


def tokens(cfg: dict, batch: int, index: int, device) -> torch.Tensor:
    """Micro-batch ``index``: learnable mock sequences (the same for the same arguments)."""
    data = MockGPTDataset(batch * (index + 1), cfg["seq_length"], cfg["vocab_size"], seed=5)
    rows = [torch.from_numpy(data[index * batch + i]["text"]) for i in range(batch)]
    return torch.stack(rows).to(device)


def step(opt: ZeroOptimizer, m: GPTModel, batches: list[torch.Tensor]):
    """One optimizer step over ``batches`` (its micro-batches); returns (loss, result)."""
    opt.zero_grad(lr=HP["lr"])  # before backward: the overlapped Adam steps during it
    total = 0.0
    for t in batches:
        loss = m(t[:, :-1], t[:, 1:]).mean() / len(batches)
        opt.backward(loss)
        total += loss.item()
    return total, opt.step(HP["lr"])


def flat_params(m: GPTModel, opt: ZeroOptimizer | None = None) -> torch.Tensor:
    """Every parameter, in order, as one tensor in its own dtype (a copy); ``opt``: the
    optimizer over ``m``, whose uploads the read waits for (outside a forward)."""
    if opt is not None:
        opt.params_ready()
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def master(opt: ZeroOptimizer) -> torch.Tensor:
    """The fp32 master as a checkpoint holds it (device share and host part joined)."""
    saved = opt.state_dict()["master"]
    parts = saved if isinstance(saved, (list, tuple)) else [saved]
    return torch.cat([p.detach().float().cpu().reshape(-1) for p in parts])
