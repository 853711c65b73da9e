"""A GPT decoder built from the tensor-parallel layers: GPT-2 by default, Llama by options.

Default (GPT-2): learned positions, pre-LayerNorm blocks, causal self-attention through
SDPA, a 4h GELU MLP, biases everywhere, and an output head tied to the input embedding.
The Llama options (each independent, Megatron-LM's flag names; the parts are in
``layers.py``): --normalization RMSNorm, --swiglu, --position-embedding-type rope,
--group-query-attention --num-query-groups G, --untie-embeddings-and-output-weights,
--disable-bias-linear. With TP=k each rank holds 1/k of the attention heads (and of
the K/V groups), of the MLP and of the vocabulary; everything else (norms, positions,
row-parallel biases) is replicated. --sequence-parallel keeps the replicated
activations as sequence shards too (1/k of the tokens per rank).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    checkpoint,
    copy_to_tp_region,
    register_sequence_parallel_grad_hooks,
    scatter_to_sequence_region,
    sequence_parallel_linear,
    vocab_parallel_cross_entropy,
)
from ..tensor_parallel.layers import init_normal, resolve_tp_group
from ..tensor_parallel.utils import set_defaults_if_not_set
from .block import RotaryEmbedding, TransformerBlock, build_norm, dropout
from .gpt_config import POSITION_EMBEDDINGS, GPTConfig


class GPTModel(nn.Module):
    """The whole decoder as TP rank ``tp_group.rank`` of ``tp_group.size`` holds it.

    ``tp_group``: a ``ParallelGroup`` (None: the initialised TP group;
    ``ParallelGroup.single()``: the unsplit model; ``ParallelGroup.planned(T, r)`` with
    ``device="meta"``: rank r's shapes without any process group, for the planner).
    Weights are drawn in fp32 on the CPU from the default generator, the full tensor of
    each layer at a time, so every TP size starts from the same model.
    ``forward(tokens, labels)`` returns per-token fp32 losses; without labels, this
    rank's slice of the logits.
    """

    def __init__(self, cfg: GPTConfig, tp_group=None, dtype=torch.float32, device=None):
        super().__init__()
        self.cfg = cfg
        self.tp_group = resolve_tp_group(tp_group)
        if cfg.position_embedding_type not in (None, *POSITION_EMBEDDINGS):
            raise ValueError(
                f"--position-embedding-type must be one of {POSITION_EMBEDDINGS},"
                f" got {cfg.position_embedding_type!r}"
            )
        sp = self.sequence_parallel = cfg.sequence_parallel and self.tp_group.size > 1
        self.padded_vocab_size = cfg.padded_vocab_size(self.tp_group.size)
        std = cfg.init_method_std
        # With rotary positions and SP the embedding reduce-scatters straight to shards.
        self.wte = VocabParallelEmbedding(
            self.padded_vocab_size,
            cfg.hidden_size,
            init_method=init_normal(std),
            tp_group=self.tp_group,
            params_dtype=dtype,
            device=device,
            num_valid=cfg.vocab_size,
            reduce_scatter=sp and not cfg.learned_positions,
        )
        self.wpe = self._learned_positions(dtype, device) if cfg.learned_positions else None
        self.rotary = (
            None
            if cfg.learned_positions
            else RotaryEmbedding(cfg.hidden_size // cfg.num_attention_heads, *cfg.rotary)
        )
        self.drop = nn.Dropout(cfg.hidden_dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(cfg, self.tp_group, sp, dtype, device) for _ in range(cfg.num_layers)
        )
        self.ln_f = build_norm(cfg, sp, dtype, device)
        self.output_layer = None  # tied: the head is wte.weight
        if cfg.untie_embeddings_and_output_weights:
            self.output_layer = ColumnParallelLinear(
                cfg.hidden_size,
                self.padded_vocab_size,
                bias=False,
                init_method=init_normal(std),
                tp_group=self.tp_group,
                params_dtype=dtype,
                device=device,
                sequence_parallel=sp,
                num_valid=cfg.vocab_size,
            )
        for p in self.parameters():
            set_defaults_if_not_set(p)
        register_sequence_parallel_grad_hooks(self, self.tp_group)

    def _learned_positions(self, dtype, device) -> nn.Embedding:
        cfg = self.cfg
        # _weight: skip nn.Embedding's own draw (the real one follows, the same on every rank).
        wpe = nn.Embedding(
            cfg.max_position_embeddings,
            cfg.hidden_size,
            _weight=torch.empty(
                cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype, device=device
            ),
        )
        if wpe.weight.device.type != "meta":
            with torch.no_grad():  # same draw on every rank: the default CPU generator
                wpe.weight.copy_(
                    init_normal(cfg.init_method_std)(
                        torch.empty_like(wpe.weight, device="cpu", dtype=torch.float32)
                    )
                )
        return wpe

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token (+ learned position) embeddings after dropout; a sequence shard with SP."""
        s, t = tokens.shape[1], self.tp_group.size
        if s > self.cfg.max_position_embeddings:
            raise ValueError(
                f"sequence of {s} tokens exceeds --max-position-embeddings "
                f"{self.cfg.max_position_embeddings}"
            )
        if self.sequence_parallel and s % t:
            raise ValueError(
                f"--sequence-parallel: a sequence of {s} tokens does not split over {t} TP ranks"
            )
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(s, device=tokens.device))
            if self.sequence_parallel:  # replicated full sequence -> this rank's shard
                x = scatter_to_sequence_region(x, self.tp_group)
        return dropout(self.drop, x, self.sequence_parallel)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits, for the whole sequence."""
        if self.output_layer is not None:
            return self.output_layer(x)
        # Tied head: the hidden state (gathered from its shards with SP) meets this rank's
        # vocabulary slice; its gradient is partial on every rank and summed over TP.
        if self.sequence_parallel:
            return sequence_parallel_linear(x, self.wte.weight, None, self.tp_group)
        return F.linear(copy_to_tp_region(x, self.tp_group), self.wte.weight)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token fp32 losses [b, s] when ``labels`` is given, else local logits."""
        x = self.embed(tokens)
        rope = self.rotary(tokens.shape[1], x.dtype, x.device) if self.rotary else None
        for block in self.blocks:
            run = functools.partial(block, rope=rope)
            x = checkpoint(run, x) if self.cfg.recompute_activations and self.training else run(x)
        logits = self.head(self.ln_f(x))
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.tp_group, self.cfg.vocab_size)


def layer_widths(cfg: GPTConfig) -> dict[str, int]:
    """Output rows of each linear layer of a block (unsplit): qkv, proj, fc1, fc2."""
    d = cfg.hidden_size // cfg.num_attention_heads
    fc1 = cfg.ffn_hidden_size * (2 if cfg.swiglu else 1)
    return dict(
        qkv=(cfg.num_attention_heads + 2 * cfg.kv_groups) * d,
        proj=cfg.hidden_size,
        fc1=fc1,
        fc2=cfg.hidden_size,
    )


def num_parameters(cfg: GPTConfig, tp: int = 1) -> int:
    """Total (unsplit) parameter count with the vocabulary padded for ``tp``."""
    h, L, f = cfg.hidden_size, cfg.num_layers, cfg.ffn_hidden_size
    w = layer_widths(cfg)
    norm = h if cfg.rms_norm else 2 * h
    inputs = dict(qkv=h, proj=h, fc1=h, fc2=f)
    bias = 0 if cfg.disable_bias_linear else sum(w.values())
    per_layer = 2 * norm + sum(w[k] * inputs[k] for k in w) + bias
    vocab = cfg.padded_vocab_size(tp) * h
    return (
        L * per_layer
        + vocab * (2 if cfg.untie_embeddings_and_output_weights else 1)
        + (cfg.max_position_embeddings * h if cfg.learned_positions else 0)
        + norm
    )


def flops_per_token(cfg: GPTConfig, recompute: bool = False, tp: int = 1) -> int:
    """Training FLOPs per token, Megatron's way (fwd + bwd = 3x fwd; +1 fwd if recomputing).
    Matmuls: 2 FLOPs per weight element of every linear (GQA's narrower K/V and SwiGLU's
    third matrix included), attention 2 x 2sh, the head 2hV."""
    h, L, s, f = cfg.hidden_size, cfg.num_layers, cfg.seq_length, cfg.ffn_hidden_size
    w = layer_widths(cfg)
    fwd_layer = 2 * (h * (w["qkv"] + w["proj"] + w["fc1"]) + f * w["fc2"]) + 2 * 2 * s * h
    fwd = L * fwd_layer + 2 * h * cfg.padded_vocab_size(tp)
    return (4 if recompute else 3) * fwd
