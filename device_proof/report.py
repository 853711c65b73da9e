"""The proof's one output: ``summary.txt``, one line per check, appended and fsynced as the
check finishes, so a run stopped at any point has the lines of everything that ran.

A line is five tab-separated fields: ``KIND name value expected seconds``. KIND is PASS or
FAIL (a check), FIG (a figure: measured and recorded, not judged) or SKIP (the global
deadline would have passed before it finished; ``value`` says why). ``seconds``: the wall
time of the check's task up to that line.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from dataclasses import dataclass

KINDS = ("PASS", "FAIL", "FIG", "SKIP")


def fmt_value(v) -> str:
    """A field: floats to 4 significant digits, no tab or newline inside."""
    if isinstance(v, float):
        text = f"{v:.4g}" if math.isfinite(v) else str(v)
    else:
        text = str(v)
    return " ".join(text.split()) or "-"


@dataclass(frozen=True)
class Line:
    kind: str
    name: str
    value: str
    expected: str
    seconds: float

    def text(self) -> str:
        fields = (self.kind, self.name, self.value, self.expected, f"{self.seconds:.1f}")
        return "\t".join(fields)


def parse_line(text: str) -> Line:
    kind, name, value, expected, seconds = text.rstrip("\n").split("\t")
    if kind not in KINDS:
        raise ValueError(f"summary line of unknown kind {kind!r}")
    return Line(kind, name, value, expected, float(seconds))


def read_summary(path: str) -> list[Line]:
    with open(path) as f:
        return [parse_line(t) for t in f if t.strip()]


class Summary:
    """Appends lines to ``path`` (each one flushed and fsynced) and echoes them."""

    def __init__(self, path: str, echo=print):
        self.path, self.echo = path, echo
        self.lines: list[Line] = []

    def add(self, kind: str, name: str, value, expected, seconds: float) -> Line:
        line = Line(kind, name, fmt_value(value), fmt_value(expected), seconds)
        with open(self.path, "a") as f:
            f.write(line.text() + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.lines.append(line)
        self.echo(f"device_proof: {line.text()}")
        return line

    def count(self, kind: str) -> int:
        return sum(line.kind == kind for line in self.lines)


# What a task yields: (kind, name, value, expected); check() and fig() build them.
def check(name: str, ok: bool, value, expected) -> tuple:
    return ("PASS" if ok else "FAIL", name, value, expected)


def fig(name: str, value, expected="recorded (not judged)") -> tuple:
    return ("FIG", name, value, expected)


class Budget:
    """The global deadline: a task runs only if its estimate fits in what is left."""

    def __init__(self, seconds: float, clock=time.monotonic):
        self.clock = clock
        self.deadline = clock() + seconds

    def left(self) -> float:
        return self.deadline - self.clock()

    def fits(self, estimate_s: float) -> bool:
        return estimate_s <= self.left()


def run_task(summary: Summary, budget: Budget, name: str, estimate_s: float, task) -> bool:
    """Run ``task()`` (an iterable of check/fig tuples, written as each comes) if its
    estimate fits the deadline, else one SKIP line. An exception ends the task with a
    FAIL line named ``<name>.error``. Returns False when it was skipped."""
    left = budget.left()
    if not budget.fits(estimate_s):
        why = f"needs ~{estimate_s:.0f} s, {max(left, 0):.0f} s left before the deadline"
        summary.add("SKIP", name, why, "runs when the deadline allows", 0.0)
        return False
    t0 = time.monotonic()
    try:
        for kind, line_name, value, expected in task():
            summary.add(kind, line_name, value, expected, time.monotonic() - t0)
    except Exception as e:  # the task's own failure is a failed line, not a lost summary
        summary.echo(traceback.format_exc())
        error = f"{type(e).__name__}: {e}"
        summary.add("FAIL", f"{name}.error", error, "no exception", time.monotonic() - t0)
    return True
