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
from ..model.gpt import GPTConfig, layer_widths
from ..optimizer.layout import FlatLayout
from ..optimizer.split import split_buckets


def meta_named_params(
    cfg: GPTConfig, tp: int, tp_rank: int = 0, dtype=torch.bfloat16
) -> list[tuple[str, torch.nn.Parameter]]:
    """The real model's ``named_parameters()`` on TP rank ``tp_rank`` of ``tp``, on meta."""
    from ..model.gpt import GPTModel

    model = GPTModel(
        cfg, tp_group=ps.ParallelGroup.planned(tp, tp_rank), dtype=dtype, device="meta"
    )
    return list(model.named_parameters())


class ShapeParam:
    """Just enough of a parameter for FlatLayout: numel, ndim and the TP metadata."""

    def __init__(self, shape: tuple[int, ...], sharded: bool, dim: int = -1, stride: int = 1):
        self.shape = torch.Size(shape)
        self.ndim = len(shape)
        self.tensor_model_parallel, self.partition_dim, self.partition_stride = sharded, dim, stride

    def numel(self) -> int:
        return math.prod(self.shape)


def spec_named_params(cfg: GPTConfig, tp: int) -> list[tuple[str, ShapeParam]]:
    """GPTModel's parameters on one TP rank, in ``named_parameters()`` order.

    Sharded (split over TP): the vocabulary slice of the embedding (and of the untied
    output layer), the column-parallel QKV / fc1 weights and biases (strides: 3 for
    [q; k; v], 1 for the per-group GQA layout, 2 for SwiGLU's [gate; up]), the
    row-parallel proj / fc2 weights. Replicated: learned positions, norms, row-parallel
    biases. RMSNorm has no bias; --disable-bias-linear drops the linear layers' biases.
    """
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    w = layer_widths(cfg)
    vocab = cfg.padded_vocab_size(tp) // tp
    rep = lambda *s: ShapeParam(s, False)  # noqa: E731
    biases = not cfg.disable_bias_linear

    def norm(name):
        out = [(name + ".weight", rep(h))]
        return out if cfg.rms_norm else out + [(name + ".bias", rep(h))]

    def column(name, rows, stride=1):
        out = [(name + ".weight", ShapeParam((rows // tp, h), True, 0, stride))]
        return (
            out + [(name + ".bias", ShapeParam((rows // tp,), True, 0, stride))] if biases else out
        )

    def row(name, cols):
        out = [(name + ".weight", ShapeParam((h, cols // tp), True, 1))]
        return out + [(name + ".bias", rep(h))] if biases else out

    out = [("wte.weight", ShapeParam((vocab, h), True, 0))]
    if cfg.learned_positions:
        out.append(("wpe.weight", rep(cfg.max_position_embeddings, h)))
    for i in range(cfg.num_layers):
        p = f"blocks.{i}."
        out += [
            *norm(p + "ln1"),
            *column(p + "attn.qkv", w["qkv"], 1 if cfg.group_query_attention else 3),
            *row(p + "attn.proj", h),
            *norm(p + "ln2"),
            *column(p + "mlp.fc1", w["fc1"], 2 if cfg.swiglu else 1),
            *row(p + "mlp.fc2", f),
        ]
    out += norm("ln_f")
    if cfg.untie_embeddings_and_output_weights:
        out.append(("output_layer.weight", ShapeParam((vocab, h), True, 0)))
    return out


def check_spec(cfg: GPTConfig, tp: int, tp_rank: int = 0) -> None:
    """Raise if the written-down list differs from what gpt.py really builds (names,
    shapes and the split: tensor_model_parallel, partition_dim, partition_stride)."""

    def key(n, p):
        return (
            n,
            tuple(p.shape),
            bool(p.tensor_model_parallel),
            p.partition_dim,
            p.partition_stride,
        )

    real = [key(n, p) for n, p in meta_named_params(cfg, tp, tp_rank)]
    spec = [key(n, p) for n, p in spec_named_params(cfg, tp)]
    if real != spec:
        diff = next((a, b) for a, b in zip(real + [None], spec + [None]) if a != b)
        raise RuntimeError(
            f"planner: spec_named_params is out of date with gpt.py: "
            f"model has {diff[0]}, spec has {diff[1]}"
        )


@dataclass(frozen=True)
class RankShapes:
    """The exact element counts one rank allocates (see ZeroOptimizer)."""

    params: int  # this TP rank's parameters, unpadded (what plain PyTorch would hold)
    sharded: int  # of which split over TP
    replicated: int  # of which held whole by every TP rank
    flat_numel: int  # the padded flat device buffer
    slice_numel: int  # this DP rank's slice: master / m / v / grad, each
    max_bucket: int  # elements of one gradient bucket buffer
    num_buckets: int
    chunks: tuple[int, ...] = ()  # this DP rank's chunk of each bucket, in slice order

    @property
    def numel(self) -> int:
        """The flat buffer, as ``FlatLayout.numel`` (what ``placement`` reads)."""
        return self.flat_numel

    def device_share(self, offload_fraction: float) -> int:
        """Elements of the slice kept on the device at this offload fraction (the
        optimizer's own split, ``split.split_buckets``: the last buckets)."""
        kept = split_buckets(self.chunks, offload_fraction)
        return sum(self.chunks[len(self.chunks) - kept :])


def spec_rank_shapes(cfg: GPTConfig, tp: int, dp: int, bucket_size: int) -> RankShapes:
    """``rank_shapes`` of the written-down shapes, memoised: the planner's searches ask
    for the same few dozen models thousands of times, and each layout takes milliseconds."""
    key = (tuple(vars(cfg).items()), tp, dp, bucket_size)
    if key not in _SPEC_SHAPES:
        _SPEC_SHAPES[key] = rank_shapes(spec_named_params(cfg, tp), dp, bucket_size)
    return _SPEC_SHAPES[key]


_SPEC_SHAPES: dict[tuple, RankShapes] = {}


def rank_shapes(
    named_params, dp: int, bucket_size: int, tp_rank: int = 0, dp_rank: int = 0
) -> RankShapes:
    layout = FlatLayout(list(named_params), dp, dp_rank, tp_rank, bucket_size)
    sharded = sum(p.numel() for _, p in named_params if p.tensor_model_parallel)
    total = sum(p.numel() for _, p in named_params)
    return RankShapes(
        params=total,
        sharded=sharded,
        replicated=total - sharded,
        flat_numel=layout.numel,
        slice_numel=layout.slice_numel,
        max_bucket=max(b.numel for b in layout.buckets),
        num_buckets=len(layout.buckets),
        chunks=tuple(b.chunk for b in layout.buckets),
    )
