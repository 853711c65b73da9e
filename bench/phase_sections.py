"""Time per named phase of the training thread, through the optimizer's own hook
(``ZeroOptimizer.set_phase_timer``): nothing patched. Shared by the benchmarks."""

from __future__ import annotations

import contextlib
import threading
import time


class Sections:
    """Seconds per named phase of the training thread; a phase's time includes the phases
    inside it. Phases entered on other threads (the overlap's worker) are not counted."""

    def __init__(self):
        self.total: dict[str, float] = {}
        self._main = threading.main_thread()

    @contextlib.contextmanager
    def section(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if threading.current_thread() is self._main:
                self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - t0

    def take(self) -> dict[str, float]:
        out, self.total = self.total, {}
        return out
