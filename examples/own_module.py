#!/usr/bin/env python
"""Your own nn.Module in your own loop, with OffloadAdamW in place of torch.optim.AdamW.

    python examples/own_module.py                               # one process
    torchrun --nproc-per-node 2 examples/own_module.py          # data parallel (gloo on CPU)

The model here (a convolution, a GRU, attention, LayerNorm and a tied input/output
embedding) is one the project does not define; nothing in it changes for the optimizer.
Under torchrun each rank trains on its share of every batch and the optimizer averages
the gradients over the ranks and splits its state between them: no DDP wrapper.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mp_offload import OffloadAdamW  # noqa: E402

VOCAB, HIDDEN, SEQ, BATCH, STEPS = 64, 32, 16, 8, 20


class TinyTagger(nn.Module):
    """Predicts the next token of a sequence: embedding -> conv -> GRU -> attention -> head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.conv = nn.Conv1d(HIDDEN, HIDDEN, kernel_size=3, padding=1)
        self.gru = nn.GRU(HIDDEN, HIDDEN, batch_first=True)
        self.attn = nn.MultiheadAttention(HIDDEN, num_heads=4, batch_first=True)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: stepped once

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2).relu()
        x, _ = self.gru(x)
        mask = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool), 1)
        a, _ = self.attn(x, x, x, attn_mask=mask.to(x.device))
        return self.head(self.norm(x + a))


def batch(step: int):
    """A learnable stream: each sequence counts up from a random start (the same batch on
    every rank, which takes its own share)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    return (start + torch.arange(SEQ + 1)) % VOCAB


def main():
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyTagger()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [dict(params=decay, weight_decay=0.1), dict(params=no_decay, weight_decay=0.0)]
    # opt = torch.optim.AdamW(groups, lr=3e-3)  # the line it replaces
    opt = OffloadAdamW(groups, lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    loss_fn = nn.CrossEntropyLoss()
    for step in range(STEPS):
        tokens = batch(step).chunk(world)[rank]
        logits = model(tokens[:, :-1])
        loss = loss_fn(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        norm = opt.clip_grad_norm_(1.0)  # the global norm, over every rank
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 5 == 0 or step == STEPS - 1:
            mean = loss.detach()
            if dist.is_initialized():  # for the printout: the mean over the ranks' shares
                dist.all_reduce(mean)
            if rank == 0:
                print(f"step {step:2d} | loss {mean.item() / world:.4f} | grad norm {norm:.3f}")
    numel = sum(p.numel() for p in model.parameters())
    for where, buffers in opt.memory_report().items():
        per = ", ".join(f"{k} {v / numel:.1f}" for k, v in buffers.items() if v)
        if rank == 0:
            print(f"{where} bytes per parameter on rank 0: {per}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
