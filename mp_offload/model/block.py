"""The parts of a decoder block, each one a GPTConfig option (Megatron-LM's flag names).

  norm        LayerNorm (GPT-2) | RMSNorm (Llama)             --normalization
  positions   learned table (GPTModel) | rotary, here         --position-embedding-type
  attention   a K/V head per query head | per query group     --group-query-attention
  MLP         GELU | SwiGLU, gate and up in one weight        --swiglu
  biases      on every linear | none                          --disable-bias-linear
With --sequence-parallel the block's input and output, its norms, dropout and
residual adds are sequence shards [b, s/T, h]; only attention and the MLP's inside
see the whole sequence (the column-parallel layers gather it).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear, get_rng_tracker
from ..tensor_parallel.layers import init_normal, scaled_init_normal
from ..tensor_parallel.utils import divide
from .gpt_config import NORMALIZATIONS, GPTConfig, rotary_problem


def build_norm(cfg: GPTConfig, sequence_parallel: bool, dtype, device) -> nn.Module:
    """LayerNorm (weight, bias) or RMSNorm (weight only), over the hidden size."""
    if cfg.normalization in (None, "LayerNorm"):
        norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, dtype=dtype, device=device)
    elif cfg.normalization == "RMSNorm":
        norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, dtype=dtype, device=device)
    else:
        raise ValueError(
            f"--normalization must be one of {NORMALIZATIONS}, got {cfg.normalization!r}"
        )
    for p in norm.parameters():  # on a sequence shard: gradients summed over TP
        p.sequence_parallel = sequence_parallel
    return norm


def dropout(module: nn.Dropout, x: torch.Tensor, sharded: bool) -> torch.Tensor:
    """``module(x)``; a sequence shard draws from the per-TP-rank stream, so the ranks'
    tokens get independent masks (replicated activations keep the default stream, the
    same mask on every rank)."""
    if not sharded or not module.training or module.p == 0:
        return module(x)
    with get_rng_tracker().fork():
        return module(x)


class RotaryEmbedding:
    """Rotary position embedding (Su et al., RoFormer) in the rotate-half layout of
    Llama in HF transformers and of Megatron's default: of each head's first ``dim``
    channels (``--rotary-percent`` of the head), channel i and i + dim/2 form a pair,
    rotated by the angle pos * base^(-2i/dim); the other channels pass unchanged.
    No parameters and no buffers: the tables are computed per forward (in fp32, then
    cast), so meta builds and ``to_empty`` need nothing special."""

    def __init__(self, head_dim: int, base: float, percent: float):
        problem = rotary_problem(head_dim, percent)
        if problem:
            raise ValueError(problem)
        self.dim = int(head_dim * percent)
        self.base = base

    def __call__(self, seq_len: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [seq_len, dim]."""
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        inv_freq = 1.0 / (self.base**exponent)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [b, heads, s, head_dim] by the tables of ``RotaryEmbedding``."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    first, second = rot.chunk(2, dim=-1)
    rotated = rot * cos + torch.cat((-second, first), dim=-1) * sin
    return rotated if rest.shape[-1] == 0 else torch.cat((rotated, rest), dim=-1)


def sdpa_takes_groups(q: torch.Tensor) -> bool:
    """Whether SDPA's ``enable_gqa`` runs a fused kernel for ``q``: on the CPU yes; on
    CUDA only the flash kernel takes K/V heads shared by groups (fp16/bf16, sm80+), and
    elsewhere ``enable_gqa`` falls back to the math kernel and its s x s scores. There,
    repeating the K/V heads keeps the memory-efficient kernel (V100s, fp32)."""
    if not q.is_cuda:
        return True
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and torch.cuda.get_device_capability(q.device)[0] >= 8
    )


class ParallelAttention(nn.Module):
    """Causal self-attention over this rank's heads.

    The fused QKV weight's rows, and how TP splits them (``split_for_rank``):
    - without --group-query-attention: [q; k; v], each h rows, stride 3 (GPT-2's layout):
      rank r holds [q_r; k_r; v_r], the q, k and v of its own heads.
    - with G query groups: one block per group, [q_1 .. q_{a/G}, k, v] (head_dim rows
      each), the groups one after another (Megatron-core's layout); stride 1, so rank r
      holds the contiguous groups r*G/T .. (r+1)*G/T - 1 with all their query heads.
      Query head i uses key/value head i // (a/G), as HF's repeat_kv. G must be a
      multiple of T: K/V heads are split across TP, never replicated (config.validate
      says so naming --num-query-groups).
    """

    def __init__(self, cfg: GPTConfig, tp_group, sequence_parallel: bool, dtype, device):
        super().__init__()
        t = tp_group.size
        self.head_dim = divide(cfg.hidden_size, cfg.num_attention_heads, "--hidden-size")
        self.heads = divide(cfg.num_attention_heads, t, "--num-attention-heads")
        self.grouped = cfg.group_query_attention
        groups = cfg.kv_groups
        divide(cfg.num_attention_heads, groups, "--num-attention-heads")
        self.groups = divide(groups, t, "--num-query-groups")
        self.dropout = cfg.attention_dropout
        bias = not cfg.disable_bias_linear
        width = (cfg.num_attention_heads + 2 * groups) * self.head_dim
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size,
            width,
            stride=1 if self.grouped else 3,
            bias=bias,
            init_method=init_normal(cfg.init_method_std),
            tp_group=tp_group,
            params_dtype=dtype,
            device=device,
            sequence_parallel=sequence_parallel,
        )
        self.proj = RowParallelLinear(
            cfg.num_attention_heads * self.head_dim,
            cfg.hidden_size,
            bias=bias,
            init_method=scaled_init_normal(cfg.init_method_std, cfg.num_layers),
            tp_group=tp_group,
            params_dtype=dtype,
            device=device,
            sequence_parallel=sequence_parallel,
        )

    def _split_heads(self, qkv: torch.Tensor):
        """q [b, heads, s, d]; k, v [b, groups, s, d] (groups == heads without GQA)."""
        b, s, _ = qkv.shape
        if self.grouped:
            per = self.heads // self.groups
            qkv = qkv.view(b, s, self.groups, per + 2, self.head_dim)
            q = qkv[:, :, :, :per].reshape(b, s, self.heads, self.head_dim)
            k, v = qkv[:, :, :, per], qkv[:, :, :, per + 1]
        else:
            q, k, v = qkv.view(b, s, 3, self.heads, self.head_dim).unbind(dim=2)
        return (t.transpose(1, 2) for t in (q, k, v))

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        q, k, v = self._split_heads(self.qkv(x))
        if rope is not None:  # q and k become new tensors; so must v, or its view would
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)  # keep the whole fused
            v = v.contiguous()  # QKV output alive for backward (e*sb*(h + kv)/t more)
        grouped = self.groups < self.heads
        if grouped and not sdpa_takes_groups(q):
            k, v = (t.repeat_interleave(self.heads // self.groups, dim=1) for t in (k, v))
            grouped = False
        p = self.dropout if self.training else 0.0
        # Attention dropout acts on this rank's own heads: use the per-TP-rank stream.
        with get_rng_tracker().fork() if p > 0 else contextlib.nullcontext():
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=p, is_causal=True, enable_gqa=grouped
            )
        b, _, s, _ = y.shape
        return self.proj(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class ParallelMLP(nn.Module):
    """fc2(act(fc1(x))): GELU over f columns, or SwiGLU, silu(gate) * up, with fc1 the
    fused [gate; up] weight (2f rows, stride 2: rank r holds [gate_r; up_r], matching
    halves). fc1 is column-parallel, fc2 row-parallel."""

    def __init__(self, cfg: GPTConfig, tp_group, sequence_parallel: bool, dtype, device):
        super().__init__()
        self.gated = cfg.swiglu
        bias = not cfg.disable_bias_linear
        f = cfg.ffn_hidden_size
        self.fc1 = ColumnParallelLinear(
            cfg.hidden_size,
            2 * f if self.gated else f,
            stride=2 if self.gated else 1,
            bias=bias,
            init_method=init_normal(cfg.init_method_std),
            tp_group=tp_group,
            params_dtype=dtype,
            device=device,
            sequence_parallel=sequence_parallel,
        )
        self.fc2 = RowParallelLinear(
            f,
            cfg.hidden_size,
            bias=bias,
            init_method=scaled_init_normal(cfg.init_method_std, cfg.num_layers),
            tp_group=tp_group,
            params_dtype=dtype,
            device=device,
            sequence_parallel=sequence_parallel,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        if self.gated:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate="tanh")
        return self.fc2(y)


class TransformerBlock(nn.Module):
    """Pre-norm: x + drop(attn(ln1(x))), then + drop(mlp(ln2(x)))."""

    def __init__(self, cfg: GPTConfig, tp_group, sequence_parallel: bool, dtype, device):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.ln1 = build_norm(cfg, sequence_parallel, dtype, device)
        self.attn = ParallelAttention(cfg, tp_group, sequence_parallel, dtype, device)
        self.ln2 = build_norm(cfg, sequence_parallel, dtype, device)
        self.mlp = ParallelMLP(cfg, tp_group, sequence_parallel, dtype, device)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        x = x + dropout(self.dropout, self.attn(self.ln1(x), rope), self.sequence_parallel)
        return x + dropout(self.dropout, self.mlp(self.ln2(x)), self.sequence_parallel)
