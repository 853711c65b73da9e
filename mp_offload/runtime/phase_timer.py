"""Per-iteration phase times for the log (``phase_<name>_ms``): CUDA events on a GPU, so
a phase is the device's time from its start to its end (launches that return early are
not mistaken for finished work), and wall time on the CPU."""

from __future__ import annotations

import time

import torch


class PhaseTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str | None, object]] = []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, phase: str | None) -> None:
        """``phase`` starts now (the previous one ends); None ends the last."""
        self.marks.append((phase, self._now()))

    def ms(self) -> dict[str, float]:
        """``{phase_<name>_ms: ...}``; waits for the last event on a GPU."""
        if self.cuda and self.marks:
            self.marks[-1][1].synchronize()
        out = {}
        for (name, a), (_, b) in zip(self.marks, self.marks[1:]):
            if name is not None:
                out[f"phase_{name}_ms"] = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
        return out
