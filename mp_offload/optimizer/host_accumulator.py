"""Host work on the gradient chunks, on a worker thread, as their copies land.

On a GPU with offload each reduced bucket chunk is copied down (non-blocking, pinned)
while backward goes on; this thread waits (sleeping) for each copy's event and then runs
the host work for that chunk (add it into the fp32 gradient slice, and on the last
micro-batch its share of the gradient norm; with the overlap, its speculative Adam), so
that work overlaps the rest of backward instead of running after it. Chunks cover
disjoint parts of the slice, and the main thread only reads the slice after ``wait()``,
so no locking is needed. The thread is a real one on the CPU too (the overlap's).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class HostAccumulator:
    def __init__(self, streams):
        """``streams``: the optimizer's (``streams.py``): the thread binds to the rank's
        device through it and waits for the copies' events with it."""
        self.streams = streams
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="host-grad-accumulate", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], None], ready=None) -> None:
        """Run ``work()`` on the thread once ``ready`` (an event, or None) is set."""
        self._queue.put((work, ready))

    def wait(self) -> None:
        """Block until every queued piece of work is done; re-raise the worker's failure."""
        self._queue.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("host gradient accumulation failed") from err

    def _run(self) -> None:
        try:
            self.streams.bind_thread()
        except BaseException as e:  # noqa: BLE001 - every piece is then refused; wait() raises
            self._error = e
        while True:
            work, ready = self._queue.get()
            try:
                if self._error is None:
                    self.streams.wait(ready)  # the copy down has landed in pinned memory
                    work()
            except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                self._error = e
            finally:
                self._queue.task_done()
