"""Host work on the gradient chunks, on a worker thread, as their copies land.

On a GPU with offload each reduced bucket chunk is copied down (non-blocking, pinned)
while backward goes on; this thread waits (sleeping) for each copy's event and then runs
the host work for that chunk (add it into the fp32 gradient slice, and on the last
micro-batch its share of the gradient norm; with the overlap, its speculative Adam), so
that work overlaps the rest of backward instead of running after it. Chunks cover
disjoint parts of the slice, and the main thread only reads the slice after ``wait()``,
so no locking is needed. The thread is a real one on the CPU too (the overlap's).
``ticket()``/``wait_for(ticket)`` let the training thread wait for the work queued up
to a point (a staging's last reader) instead of all of it.
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
        self._submitted = self._done = 0  # pieces of work: queued, finished (or refused)
        self._finished = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="host-grad-accumulate", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], None], ready=None) -> None:
        """Run ``work()`` on the thread once ``ready`` (an event, or None) is set."""
        self._submitted += 1  # (only the training thread submits)
        self._queue.put((work, ready))

    def ticket(self) -> int:
        """A mark after the work queued so far, for ``wait_for``."""
        return self._submitted

    def wait_for(self, ticket: int) -> None:
        """Block until the work queued before ``ticket`` is done (FIFO: the thread runs it
        in order); re-raise the worker's failure."""
        with self._finished:
            self._finished.wait_for(lambda: self._done >= ticket)
        self._raise()

    def wait(self) -> None:
        """Block until every queued piece of work is done; re-raise the worker's failure."""
        self._queue.join()
        self._raise()

    def _raise(self) -> None:
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
                with self._finished:
                    self._done += 1
                    self._finished.notify_all()
                self._queue.task_done()
