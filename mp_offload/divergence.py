"""When a run must stop on its own: a non-finite loss (every precision), too many fp16 steps
skipped for overflow in a row, or a run that skipped most of its steps; and which checkpoint
the rotation must keep while steps are being skipped. Every rank sees the same global loss
and overflow flag, so all of them stop together."""

from __future__ import annotations

import math

from .runtime.logger import log


class TrainingError(RuntimeError):
    """Stops the run with a message (NaN loss, data exhausted...)."""


def _check_skipped(in_a_row: int, limit: int, iteration: int, out) -> None:
    """fp16: every rank skips the same steps (the overflow test is on the global norm), so
    all of them stop here together, before the step's checkpoint could be saved."""
    if in_a_row >= limit:
        raise TrainingError(
            f"{in_a_row} consecutive steps skipped for fp16 gradient overflow (iterations "
            f"{iteration - in_a_row + 1}-{iteration}, loss {out.loss:.4g}, loss scale "
            f"{out.result.loss_scale:g}): the run is diverging; stopping without saving (lower "
            f"--lr, check the data, or use --bf16; --max-consecutive-skipped-steps sets the "
            f"limit)"
        )


def check_loss(loss: float, iteration: int) -> None:
    """A non-finite loss stops the run in every precision, before the step's checkpoint
    (under fp16 too: an overflow shows in the gradients, a diverged model in the loss)."""
    if not math.isfinite(loss):
        raise TrainingError(
            f"loss is {loss} at iteration {iteration}: the run is diverging; stopping "
            f"without saving (lower --lr, check the data, or use --bf16)"
        )


def _check_session(skipped: int, steps: int, start: int) -> None:
    """fp16: a run whose steps were all skipped trained nothing (an error); one that
    skipped most of them says so (a run that never learns must not end silently)."""
    if not steps or 2 * skipped <= steps:
        return
    what = (
        f"{skipped} of the {steps} steps of this run (iterations {start + 1}-{start + steps}) "
        f"were skipped for fp16 gradient overflow"
    )
    if skipped == steps:
        raise TrainingError(
            f"{what}: nothing was trained (lower --lr or --initial-loss-scale, or use --bf16)"
        )
    log.info(f"WARNING: {what} (lower --lr or --initial-loss-scale, or use --bf16)")


class Skips:
    """The fp16 steps skipped for overflow, as the loop counts them: the limit in a row,
    the run's share, and ``good``, the last checkpoint before the current run of skipped
    steps, which the checkpoints taken during that run must not rotate out."""

    def __init__(self, limit: int, start: int):
        self.limit, self.start, self.in_a_row, self.total = limit, start, 0, 0
        self.good = start or None

    def step(self, out, iteration: int) -> None:
        self.in_a_row = self.in_a_row + 1 if out.result.skipped else 0
        self.total += bool(out.result.skipped)
        _check_skipped(self.in_a_row, self.limit, iteration, out)

    def protect(self) -> int | None:
        return self.good if self.in_a_row else None

    def saved(self, iteration: int) -> None:
        if not self.in_a_row:
            self.good = iteration

    def check_run(self, iteration: int) -> None:
        _check_session(self.total, iteration - self.start, self.start)
