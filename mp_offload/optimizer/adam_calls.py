"""One step's AdamW hyperparameters and the kernel calls they cut a piece of the slice into.

Each parameter belongs to a param group (its ``lr`` and ``weight_decay``, read at every
step, so LR schedulers drive them) and has its own step count (AdamW's bias correction
counts the steps that parameter took: one that got no gradient anywhere is not stepped,
as ``torch.optim.AdamW`` skips a ``.grad`` of None). A piece of the slice (one bucket's
chunk) is stepped in as few kernel calls as that allows: one call when its parameters
share the learning rate and step and at most one non-zero weight decay (``decay_runs``
marks where it applies), which is every piece of a run with the usual two groups (decay,
no decay). The kernels are elementwise, so any cut is bitwise the same as one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Call:
    lo: int  # relative to the piece
    hi: int
    lr: float
    step: int
    weight_decay: float
    decay_runs: tuple[tuple[int, int], ...]  # relative to lo


@dataclass(frozen=True)
class StepHyper:
    """What one step needs: per slot ``(lr, step, weight_decay)`` or None (not stepped),
    and the step-wide ``betas``, ``eps`` and ``grad_scale`` (unscale x clip)."""

    keys: tuple
    betas: tuple[float, float]
    eps: float
    grad_scale: float

    def kwargs(self, call: Call) -> dict:
        b1, b2 = self.betas
        return dict(
            step=call.step,
            lr=call.lr,
            beta1=b1,
            beta2=b2,
            eps=self.eps,
            weight_decay=call.weight_decay,
            grad_scale=self.grad_scale,
            decay_runs=list(call.decay_runs),
        )

    def calls(self, segments) -> list[Call]:
        """``segments``: (lo, hi, slot or None for padding) covering one piece, relative."""
        out: list[list] = []  # [lo, hi, key or None, decay runs]
        for lo, hi, slot in segments:
            key = None if slot is None else self.keys[slot]
            if slot is not None and key is None:  # not stepped: ends the call before it
                out.append(None)
                continue
            cur = out[-1] if out else None
            if cur is None or not _joins(cur[2], key):
                cur = [lo, hi, key, []]
                out.append(cur)
            elif cur[2] is None or (key is not None and key[2] != 0.0):
                cur[2] = key if key is not None else cur[2]
            cur[1] = hi
            if key is not None and key[2] != 0.0:
                runs, a = cur[3], lo - cur[0]
                if runs and runs[-1][1] == a:
                    runs[-1] = (runs[-1][0], hi - cur[0])
                else:
                    runs.append((a, hi - cur[0]))
        return [_call(c) for c in out if c is not None and c[2] is not None]


def _joins(have, key) -> bool:
    """Can a segment with ``key`` join a call of ``have`` (None: padding only so far)?"""
    if have is None or key is None:
        return True
    lr, step, wd = key
    return lr == have[0] and step == have[1] and (wd == 0.0 or have[2] in (0.0, wd))


def _call(c) -> Call:
    lo, hi, (lr, step, wd), runs = c
    return Call(lo, hi, lr, step, wd, tuple(runs))


def piece_segments(layout, lo: int, hi: int) -> tuple[tuple[int, int, int | None], ...]:
    """The layout's segments cut to the slice range [lo, hi), relative to lo."""
    out = []
    for seg in layout.segments:
        a, z = max(seg.slice_start, lo), min(seg.slice_end, hi)
        if z > a:
            out.append((a - lo, z - lo, seg.slot))
    return tuple(out)


def step_hyper(opt, grad_scale: float, stepped=None) -> StepHyper:
    """``opt``'s (a ZeroOptimizer) hyperparameters as its param groups say now; ``stepped``:
    per slot, whether it is stepped this step (None: all)."""
    keys = []
    for i, g in enumerate(opt.group_of):
        grp = opt.param_groups[g]
        on = stepped is None or stepped[i]
        lr, wd = float(grp["lr"]), float(grp["weight_decay"])
        keys.append((lr, opt.slot_steps[i] + 1, wd) if on else None)
    return StepHyper(tuple(keys), opt.betas, opt.eps, grad_scale)


def stepped_slots(got_grad: torch.Tensor, dp) -> list[bool]:
    """Per slot: did any DP rank produce a gradient for it (a MAX all-reduce of a byte)?"""
    if dp.size > 1:
        got_grad = got_grad.to(torch.int32)
        dist.all_reduce(got_grad, op=dist.ReduceOp.MAX, group=dp.torch_group())
    return [bool(x) for x in got_grad.tolist()]
