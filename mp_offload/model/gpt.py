"""A GPT-2-style decoder built from the tensor-parallel layers.

Learned positions, pre-LayerNorm blocks, causal self-attention through SDPA, a 4h
GELU MLP, and an output head tied to the input embedding. With TP=k each rank
holds 1/k of the attention heads, of the MLP and of the vocabulary; everything
else (LayerNorms, positions, row-parallel biases) is replicated.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    checkpoint,
    copy_to_tp_region,
    get_rng_tracker,
    pad_vocab_size,
    vocab_parallel_cross_entropy,
)
from ..tensor_parallel.layers import init_normal, resolve_tp_group, scaled_init_normal
from ..tensor_parallel.utils import divide, set_defaults_if_not_set


@dataclass
class GPTConfig:
    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # default 4 * hidden
    seq_length: int = 256
    max_position_embeddings: int | None = None  # default seq_length
    vocab_size: int = 4096  # taken from the tokenizer when one is used
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    recompute_activations: bool = False

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length

    def padded_vocab_size(self, tp: int) -> int:
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)


def _layer_norm(cfg: GPTConfig, dtype, device) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, dtype=dtype, device=device)


class ParallelAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, tp_group, dtype, device):
        super().__init__()
        self.heads = divide(cfg.num_attention_heads, tp_group.size, "--num-attention-heads")
        self.head_dim = divide(cfg.hidden_size, cfg.num_attention_heads, "--hidden-size")
        self.dropout = cfg.attention_dropout
        # Fused [q; k; v] weight, stride 3: each rank gets [q_r; k_r; v_r] of its heads.
        self.qkv = ColumnParallelLinear(cfg.hidden_size, 3 * cfg.hidden_size, stride=3,
                                        init_method=init_normal(cfg.init_method_std),
                                        tp_group=tp_group, params_dtype=dtype, device=device)
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size,
                                      init_method=scaled_init_normal(cfg.init_method_std,
                                                                     cfg.num_layers),
                                      tp_group=tp_group, params_dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).unbind(dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, head_dim]
        p = self.dropout if self.training else 0.0
        # Attention dropout acts on this rank's own heads: use the per-TP-rank stream.
        with get_rng_tracker().fork() if p > 0 else contextlib.nullcontext():
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class ParallelMLP(nn.Module):
    def __init__(self, cfg: GPTConfig, tp_group, dtype, device):
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size,
                                        init_method=init_normal(cfg.init_method_std),
                                        tp_group=tp_group, params_dtype=dtype, device=device)
        self.fc2 = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size,
                                     init_method=scaled_init_normal(cfg.init_method_std,
                                                                    cfg.num_layers),
                                     tp_group=tp_group, params_dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, tp_group, dtype, device):
        super().__init__()
        self.ln1 = _layer_norm(cfg, dtype, device)
        self.attn = ParallelAttention(cfg, tp_group, dtype, device)
        self.ln2 = _layer_norm(cfg, dtype, device)
        self.mlp = ParallelMLP(cfg, tp_group, dtype, device)
        self.dropout = nn.Dropout(cfg.hidden_dropout)  # replicated activations: default RNG

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln1(x)))
        return x + self.dropout(self.mlp(self.ln2(x)))


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
        self.padded_vocab_size = cfg.padded_vocab_size(self.tp_group.size)
        std = cfg.init_method_std
        self.wte = VocabParallelEmbedding(self.padded_vocab_size, cfg.hidden_size,
                                          init_method=init_normal(std), tp_group=self.tp_group,
                                          params_dtype=dtype, device=device,
                                          num_valid=cfg.vocab_size)
        # _weight: skip nn.Embedding's own draw (the real one follows, the same on every rank).
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size,
                                _weight=torch.empty(cfg.max_position_embeddings,
                                                    cfg.hidden_size, dtype=dtype, device=device))
        if self.wpe.weight.device.type != "meta":
            with torch.no_grad():  # same draw on every rank: the default CPU generator
                self.wpe.weight.copy_(init_normal(std)(torch.empty_like(self.wpe.weight,
                                                                        device="cpu",
                                                                        dtype=torch.float32)))
        self.drop = nn.Dropout(cfg.hidden_dropout)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, self.tp_group, dtype, device)
                                    for _ in range(cfg.num_layers))
        self.ln_f = _layer_norm(cfg, dtype, device)
        for p in self.parameters():
            set_defaults_if_not_set(p)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token fp32 losses [b, s] when ``labels`` is given, else local logits."""
        s = tokens.shape[1]
        if s > self.cfg.max_position_embeddings:
            raise ValueError(f"sequence of {s} tokens exceeds --max-position-embeddings "
                             f"{self.cfg.max_position_embeddings}")
        pos = torch.arange(s, device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(pos))
        for block in self.blocks:
            x = checkpoint(block, x) if self.cfg.recompute_activations and self.training \
                else block(x)
        x = self.ln_f(x)
        # Tied head: the replicated hidden state meets this rank's vocabulary slice.
        logits = F.linear(copy_to_tp_region(x, self.tp_group), self.wte.weight)
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.tp_group, self.cfg.vocab_size)


def num_parameters(cfg: GPTConfig, tp: int = 1) -> int:
    """Total (unsplit) parameter count with the vocabulary padded for ``tp``."""
    h, L, f = cfg.hidden_size, cfg.num_layers, cfg.ffn_hidden_size
    per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    return L * per_layer + cfg.padded_vocab_size(tp) * h + cfg.max_position_embeddings * h + 2 * h


def flops_per_token(cfg: GPTConfig, recompute: bool = False, tp: int = 1) -> int:
    """Training FLOPs per token, Megatron's way (fwd + bwd = 3x fwd; +1 fwd if recomputing)."""
    h, L, s, f = cfg.hidden_size, cfg.num_layers, cfg.seq_length, cfg.ffn_hidden_size
    fwd_layer = 2 * (3 * h * h + h * h + 2 * h * f) + 2 * 2 * s * h  # matmuls + attention
    fwd = L * fwd_layer + 2 * h * cfg.padded_vocab_size(tp)
    return (4 if recompute else 3) * fwd
