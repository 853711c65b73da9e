"""Activation memory of one micro-batch on one TP rank (an estimate, in bytes).

Notation: s sequence, b micro-batch, h hidden, f ffn (4h by default), a heads, L layers,
t TP size, V padded vocabulary, e bytes per element of the compute dtype (2 for
fp16/bf16), dropout masks 1 byte per element (torch keeps bool masks); kv = G*h/a, the
key/value width (kv = h without grouped-query attention); r = t with
--sequence-parallel, else 1.

Per layer, without recomputation (what autograd keeps for backward, this model):
  replicated over TP   sbh*(4e)/r      norm1 input, QKV input, norm2 input, fc1 input
                       + sbh*2/r       two residual dropout masks (if hidden dropout)
                       + 16sb/r        the norms' fp32 statistics (mean and rstd per
                                       token; RMSNorm only rstd: 8sb/r)
                       With --sequence-parallel these are sequence shards, hence /t: the
                       column-parallel layers keep their input shard and gather it again
                       in backward (tensor_parallel.layers._SequenceParallelLinear).
  split over TP        sb*e*(2h+2kv+2f)/t  Q, K, V and the attention output (proj
                       input); GELU input and output (fc1 out, fc2 in). SwiGLU keeps
                       4f instead of 2f: fc1's [gate; up] output (2f), silu(gate) and
                       the product (fc2 input). Rotary positions keep nothing more (the
                       rotated q and k replace q and k; one cos/sin table pair is shared).
  attention core       fused SDPA (flash / memory-efficient, what CUDA runs for fp16/
                       bf16): only a logsumexp, 4*b*s*a/t; the unfused math kernel
                       also keeps the s x s probabilities: b*a*s^2/t*(e [+ e + 1 with
                       attention dropout]).
With e=2, f=4h, no GQA, dropouts and the unfused kernel this is, without sequence
parallelism, sbh*(10 + 24/t) + 5*a*s^2*b/t, and with it sbh*(34 + 5as/h)/t: both are
Megatron's "Reducing Activation Recomputation" (Korthikanti et al. 2022) formulas
(which leave out the norm statistics, 16/h of the sbh term).
On the CPU (the tests) two things differ from CUDA: dropout keeps e-byte masks, and
RMSNorm is a composite of ops that also keeps its normalized output (e*sbh/r more per
norm); CUDA's fused kernels keep what is counted above.

With full recomputation (--recompute-activations, one checkpoint per layer) each
layer keeps only its input, e*sbh/r, and backward re-runs one layer at a time: + one
layer's set above + its activation gradients in flight, ~e*sb*(2h/r + fc1 width/t).

Outside the layers: token ids 8*sb, embedding dropout mask sbh/r, final-norm input and
head input 2*e*sbh/r (the head, too, keeps the shard under SP), rotary cos/sin tables
2*e*s*rot, and the loss: vocab-parallel cross entropy keeps the fp32 softmax, 4*sbV/t.
Its forward briefly holds the low-precision logits, their fp32 copy and the shifted
logits (vocabulary padding is masked in place in the latter): (e + 8)*sbV/t; fp32
logits need no copy: 8*sbV/t.
Backward starts with the softmax reused as the logits gradient plus its cast to the
compute dtype, e*sbV/t, the head input's gradient e*sbh, and the head weight's gradient,
e*Vh/t. Tied to the embedding, that one lives until the embedding's own gradient
(another e*Vh/t) is added at the very end; an untied output layer hands it to the
reducer at once, and the embedding gradient comes alone at the end.

The peak is the largest of: the end of forward (at the loss), the start of backward,
the end of backward, and (with recomputation) the backward of the first layer.
Allocator rounding and fragmentation are not modelled; tests/test_cuda.py holds this
against measured CUDA peaks where a GPU is present, and tests/test_llama.py against
the bytes autograd really saves for a block on CPU, with and without SP.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.gpt import GPTConfig


@dataclass
class ActivationEstimate:
    per_layer: int  # kept per layer without recomputation
    kept: int  # all layers as kept through forward (inputs only with recomputation)
    outside: int  # embedding, final LN, head input (not the loss)
    loss_kept: int  # fp32 softmax kept for backward
    peak: int  # the estimate to plan with
    phase: str  # which moment gives the peak
    phases: dict | None = None  # every candidate moment's estimate


def estimate_activations(
    cfg: GPTConfig,
    tp: int,
    micro_batch: int,
    elem_bytes: int = 2,
    recompute: bool | None = None,
    flash: bool = True,
    grads_resident: bool = False,
) -> ActivationEstimate:
    """Peak activation bytes of one micro-batch on one TP rank (see module docstring).

    ``grads_resident``: the optimizer keeps a full .grad per parameter anyway (plain
    PyTorch Adam), so the tied embedding's head gradient is not extra memory.
    """
    s, b, h, f = cfg.seq_length, micro_batch, cfg.hidden_size, cfg.ffn_hidden_size
    a, t, e, L = cfg.num_attention_heads, tp, elem_bytes, cfg.num_layers
    V = cfg.padded_vocab_size(tp)
    kv = cfg.kv_groups * (h // a)
    r = t if cfg.sequence_parallel else 1
    recompute = cfg.recompute_activations if recompute is None else recompute
    sbh = s * b * h
    hid_mask = 1 if cfg.hidden_dropout > 0 else 0
    attn_mask = 1 if cfg.attention_dropout > 0 else 0

    stats = 2 * (4 if cfg.rms_norm else 8) * s * b  # fp32 mean, rstd
    replicated = (sbh * 4 * e + sbh * 2 * hid_mask + stats) // r
    mlp = (4 if cfg.swiglu else 2) * f
    split = s * b * e * (2 * h + 2 * kv + mlp) // t
    if flash:
        core = 4 * b * s * a // t
    else:
        core = b * a * s * s // t * (e + (e + 1 if attn_mask else 0))
    per_layer = replicated + split + core

    rotary = 0 if cfg.learned_positions else 2 * e * s * int(h // a * cfg.rotary[1])
    outside = 8 * s * b + (sbh * hid_mask + 2 * e * sbh) // r + rotary
    sbv = s * b * V // t
    loss_kept = 4 * sbv
    loss_forward = (e + 8) * sbv if e < 4 else 8 * sbv  # logits (+ fp32 copy) + shifted
    head_grad = 0 if grads_resident else e * V * h // t
    tied = not cfg.untie_embeddings_and_output_weights

    kept = L * (e * sbh // r if recompute else per_layer)
    phases = {
        "end of forward (loss)": kept + outside + loss_forward,
        "start of backward": kept + outside + loss_kept + e * sbv + head_grad + e * sbh,
        "end of backward (embedding grads)": outside + (3 if tied else 1) * head_grad,
    }
    if recompute:
        fc1 = f * (2 if cfg.swiglu else 1)
        working = per_layer + s * b * e * (2 * h // r + fc1 // t)
        phases["backward of a recomputed layer"] = (
            kept + outside + working + (head_grad if tied else 0)
        )
    phase = max(phases, key=phases.get)
    return ActivationEstimate(per_layer, kept, outside, loss_kept, phases[phase], phase, phases)
