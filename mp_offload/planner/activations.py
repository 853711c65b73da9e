"""Activation memory of one micro-batch on one TP rank (an estimate, in bytes).

Notation: s sequence, b micro-batch, h hidden, f ffn (4h), a heads, L layers,
t TP size, V padded vocabulary, e bytes per element of the compute dtype (2 for
fp16/bf16), dropout masks 1 byte per element (torch keeps bool masks).

Per layer, without recomputation (what autograd keeps for backward, this model):
  replicated over TP   sbh*(4e)        LN1 input, QKV input, LN2 input, fc1 input
                       + sbh*2         two residual dropout masks (if hidden dropout)
  split over TP        sb*e*(4h+2f)/t  Q,K,V and the attention output (proj input);
                                       GELU input and output (fc1 out, fc2 in)
  attention core       fused SDPA (flash / memory-efficient, what CUDA runs for fp16/
                       bf16): only a logsumexp, 4*b*s*a/t; the unfused math kernel
                       also keeps the s x s probabilities: b*a*s^2/t*(e [+ e + 1 with
                       attention dropout]).
With e=2, f=4h and dropouts this is sbh*(10 + 24/t) + 5*a*s^2*b/t: Megatron's
"Reducing Activation Recomputation" (Korthikanti et al. 2022) formula for tensor
parallelism *without* sequence parallelism (this code has none: the 10 is not /t).
With sequence parallelism it would be sbh*(34 + 5as/h)/t.

With full recomputation (--recompute-activations, one checkpoint per layer) each
layer keeps only its input, e*sbh (replicated), and backward re-runs one layer at a
time: + one layer's set above + its activation gradients in flight, ~e*sb*(2h + f/t).

Outside the layers: token ids 8*sb, embedding dropout mask sbh, LN_f input and head
input 2*e*sbh, and the loss: vocab-parallel cross entropy keeps the fp32 softmax,
4*sbV/t. Its forward briefly holds the low-precision logits, their fp32 copy and the
shifted logits (vocabulary padding is masked in place in the latter): (e + 8)*sbV/t;
fp32 logits need no copy: 8*sbV/t.
Backward starts with the softmax reused as the logits gradient plus its cast to the
compute dtype, e*sbV/t, and the tied embedding's head gradient, e*Vh/t, which lives
until the embedding's own gradient (another e*Vh/t) is added at the very end.

The peak is the largest of: the end of forward (at the loss), the start of backward,
and (with recomputation) the backward of the first layer. Allocator rounding and
fragmentation are not modelled; tests/test_plan.py holds this against measured CUDA
peaks where a GPU is present.
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

    def as_dict(self) -> dict:
        return dict(per_layer=self.per_layer, kept=self.kept, outside=self.outside,
                    loss_kept=self.loss_kept, peak=self.peak, phase=self.phase)


def estimate_activations(cfg: GPTConfig, tp: int, micro_batch: int, elem_bytes: int = 2,
                         recompute: bool | None = None, flash: bool = True,
                         grads_resident: bool = False) -> ActivationEstimate:
    """Peak activation bytes of one micro-batch on one TP rank (see module docstring).

    ``grads_resident``: the optimizer keeps a full .grad per parameter anyway (plain
    PyTorch Adam), so the tied embedding's head gradient is not extra memory.
    """
    s, b, h, f = cfg.seq_length, micro_batch, cfg.hidden_size, cfg.ffn_hidden_size
    a, t, e, L = cfg.num_attention_heads, tp, elem_bytes, cfg.num_layers
    V = cfg.padded_vocab_size(tp)
    recompute = cfg.recompute_activations if recompute is None else recompute
    sbh = s * b * h
    hid_mask = 1 if cfg.hidden_dropout > 0 else 0
    attn_mask = 1 if cfg.attention_dropout > 0 else 0

    replicated = sbh * 4 * e + sbh * 2 * hid_mask
    split = s * b * e * (4 * h + 2 * f) // t
    if flash:
        core = 4 * b * s * a // t
    else:
        core = b * a * s * s // t * (e + (e + 1 if attn_mask else 0))
    per_layer = replicated + split + core

    outside = 8 * s * b + sbh * hid_mask + 2 * e * sbh
    sbv = s * b * V // t
    loss_kept = 4 * sbv
    loss_forward = (e + 8) * sbv if e < 4 else 8 * sbv  # logits (+ fp32 copy) + shifted
    head_grad = 0 if grads_resident else e * V * h // t

    kept = L * (e * sbh if recompute else per_layer)
    phases = {
        "end of forward (loss)": kept + outside + loss_forward,
        "start of backward": kept + outside + loss_kept + e * sbv + head_grad + e * sbh,
        "end of backward (tied embedding grads)": outside + 3 * head_grad,
    }
    if recompute:
        working = per_layer + s * b * e * (2 * h + f // t)
        phases["backward of a recomputed layer"] = kept + outside + working + head_grad
    phase = max(phases, key=phases.get)
    return ActivationEstimate(per_layer, kept, outside, loss_kept, phases[phase], phase, phases)
