"""What one TP rank holds: its parameters' shapes, and the flat layout ZeRO gives them.

Two sources of the same list, so the planner is exact and still fast:
- ``meta_named_params`` builds the real ``GPTModel`` on the meta device (no memory)
  as TP rank r of a TP group of size T. It is the ground truth: whatever gpt.py
  builds is what gets planned. Used by ``--dry-run``.
- ``spec_named_params`` writes the same list down from the config in microseconds
  (the model-size search evaluates hundreds of shapes). ``check_spec`` holds it
  against the meta build, and the tests do so for several shapes and TP sizes.

Both feed ``mp_offload.optimizer.layout.FlatLayout`` itself, so buckets, padding and
each DP rank's host slice come from the very rules the optimizer allocates with.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import parallel_state as ps
from ..model.gpt import GPTConfig
from ..optimizer.layout import FlatLayout


def meta_named_params(cfg: GPTConfig, tp: int, tp_rank: int = 0,
                      dtype=torch.bfloat16) -> list[tuple[str, torch.nn.Parameter]]:
    """The real model's ``named_parameters()`` on TP rank ``tp_rank`` of ``tp``, on meta."""
    from ..model.gpt import GPTModel
    model = GPTModel(cfg, tp_group=ps.ParallelGroup.planned(tp, tp_rank), dtype=dtype,
                     device="meta")
    return list(model.named_parameters())


class ShapeParam:
    """Just enough of a parameter for FlatLayout: numel, ndim and the TP metadata."""

    def __init__(self, shape: tuple[int, ...], sharded: bool, dim: int = -1, stride: int = 1):
        self.shape = torch.Size(shape)
        self.ndim = len(shape)
        self.tensor_model_parallel, self.partition_dim, self.partition_stride = \
            sharded, dim, stride

    def numel(self) -> int:
        return math.prod(self.shape)


def spec_named_params(cfg: GPTConfig, tp: int) -> list[tuple[str, ShapeParam]]:
    """GPTModel's parameters on one TP rank, in ``named_parameters()`` order.

    Sharded (split over TP): the vocabulary slice of the tied embedding, the column-
    parallel QKV / fc1 weights and biases, the row-parallel proj / fc2 weights.
    Replicated: positions, LayerNorms, row-parallel biases.
    """
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    rep = lambda *s: ShapeParam(s, False)  # noqa: E731
    out = [("wte.weight", ShapeParam((cfg.padded_vocab_size(tp) // tp, h), True, 0)),
           ("wpe.weight", rep(cfg.max_position_embeddings, h))]
    for i in range(cfg.num_layers):
        p = f"blocks.{i}."
        out += [(p + "ln1.weight", rep(h)), (p + "ln1.bias", rep(h)),
                (p + "attn.qkv.weight", ShapeParam((3 * h // tp, h), True, 0, 3)),
                (p + "attn.qkv.bias", ShapeParam((3 * h // tp,), True, 0, 3)),
                (p + "attn.proj.weight", ShapeParam((h, h // tp), True, 1)),
                (p + "attn.proj.bias", rep(h)),
                (p + "ln2.weight", rep(h)), (p + "ln2.bias", rep(h)),
                (p + "mlp.fc1.weight", ShapeParam((f // tp, h), True, 0)),
                (p + "mlp.fc1.bias", ShapeParam((f // tp,), True, 0)),
                (p + "mlp.fc2.weight", ShapeParam((h, f // tp), True, 1)),
                (p + "mlp.fc2.bias", rep(h))]
    out += [("ln_f.weight", rep(h)), ("ln_f.bias", rep(h))]
    return out


def check_spec(cfg: GPTConfig, tp: int, tp_rank: int = 0) -> None:
    """Raise if the written-down list differs from what gpt.py really builds."""
    real = [(n, tuple(p.shape), bool(p.tensor_model_parallel))
            for n, p in meta_named_params(cfg, tp, tp_rank)]
    spec = [(n, tuple(p.shape), p.tensor_model_parallel) for n, p in spec_named_params(cfg, tp)]
    if real != spec:
        diff = next((a, b) for a, b in zip(real + [None], spec + [None]) if a != b)
        raise RuntimeError(f"planner: spec_named_params is out of date with gpt.py: "
                           f"model has {diff[0]}, spec has {diff[1]}")


@dataclass
class RankShapes:
    """The exact element counts one rank allocates (see ZeroOptimizer)."""
    params: int  # this TP rank's parameters, unpadded (what plain PyTorch would hold)
    sharded: int  # of which split over TP
    replicated: int  # of which held whole by every TP rank
    flat_numel: int  # the padded flat device buffer
    host_numel: int  # this DP rank's slice: master / m / v / grad, each
    max_bucket: int  # elements of one gradient bucket buffer
    num_buckets: int


def rank_shapes(named_params, dp: int, bucket_size: int, tp_rank: int = 0,
                dp_rank: int = 0) -> RankShapes:
    layout = FlatLayout(list(named_params), dp, dp_rank, tp_rank, bucket_size)
    sharded = sum(p.numel() for _, p in named_params if p.tensor_model_parallel)
    total = sum(p.numel() for _, p in named_params)
    return RankShapes(params=total, sharded=sharded, replicated=total - sharded,
                      flat_numel=layout.numel, host_numel=layout.host_numel,
                      max_bucket=max(b.numel for b in layout.buckets),
                      num_buckets=len(layout.buckets))
