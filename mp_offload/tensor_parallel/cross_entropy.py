"""Cross entropy over vocab-split logits, never gathering the full vocabulary.

Per token: loss = log(sum_j exp(z_j - m)) - (z_target - m), with the max m, the sum
and the target logit each reduced across the TP group (three small all-reduces of
[tokens] tensors instead of one all-gather of [tokens, vocab]).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel_state import ParallelGroup


def _all_reduce(x: torch.Tensor, op, group: ParallelGroup) -> None:
    if group.size > 1:
        dist.all_reduce(x, op=op, group=group.torch_group())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, vocab_size):
        # Work in fp32: the softmax of low-precision logits loses too much. (For fp32
        # logits .float() is the input itself: it is only read, never written.)
        logits = logits.float()
        per = logits.shape[-1]
        start = group.rank * per
        # Padding columns (past the real vocabulary) get no probability, so the loss does
        # not depend on the padding: left out of the max, set to -inf once shifted (in
        # place, in the tensor this function owns: no masked copy of the logits).
        valid = per if vocab_size is None else min(max(vocab_size - start, 0), per)
        if valid > 0:
            logits_max = logits[..., :valid].max(dim=-1).values
        else:
            logits_max = logits.new_full(logits.shape[:-1], float("-inf"))
        _all_reduce(logits_max, dist.ReduceOp.MAX, group)
        shifted = logits - logits_max.unsqueeze(-1)
        del logits
        if valid < per:
            shifted[..., valid:] = float("-inf")

        outside = (target < start) | (target >= start + per)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted = predicted.masked_fill(outside, 0.0)
        _all_reduce(predicted, dist.ReduceOp.SUM, group)

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        loss = sum_exp.log() - predicted

        exp.div_(sum_exp.unsqueeze(-1))  # now this rank's slice of the softmax
        ctx.save_for_backward(exp, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # reuse the buffer: d loss / d z = softmax - onehot(target)
        inside = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -inside)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: ParallelGroup, vocab_size: int | None = None
) -> torch.Tensor:
    """Per-token loss (fp32, shape of ``target``) for logits split over the vocabulary.

    ``vocab_size``: the real (unpadded) vocabulary; columns past it are masked out.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size)
