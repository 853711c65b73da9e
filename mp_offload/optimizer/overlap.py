"""``--overlap-cpu-optimizer``: the CPU Adam runs on each host chunk during backward.

When a host bucket's gradient is final (last micro-batch: its copy down landed, or its
last host sum is done), the host worker (the reducer's ``HostAccumulator`` thread, FIFO
after that chunk's sum) steps it speculatively: clip coefficient 1 and no overflow
assumed (``grad_scale = 1/loss_scale``), step ``step_count + 1`` and the learning rate
given to ``zero_grad(lr=...)``. It reads the committed state (master, moments) and writes
the next one, with the new low-precision params, into the second copy (ping-pong), so
backward goes on while Adam (which releases the GIL) runs on another core.

At the step the global norm is known (reduced over TP x DP):
- commit: the real ``grad_scale`` is the assumed one (no clipping): the speculation *is*
  the synchronous step, bit for bit; the copies swap and each bucket goes up;
- replay: clipping applies: the copies swap and the step is recomputed from the old copy
  with the real ``grad_scale`` (one extra Adam pass), each bucket going up after its piece;
- skip: fp16 overflow: the second copy is dropped (the next speculation overwrites it).
The device share (F < 1) is stepped at step time as without the overlap.
The two copies are whole ``HostState``s, so remainders (hi and lo swap together) and
bf16 moments compose; 8-bit moments do not yet (their kernel steps in place).
docs/DESIGN.md §3 ("The overlapped CPU Adam").
"""

from __future__ import annotations

import time

from .host_state import to_low


class OverlappedStep:
    """The speculation of one ``ZeroOptimizer`` (``opt``): its host state's two copies are
    ``opt.host_state`` (committed) and ``opt.spare_state`` (the next step's), each a
    ``HostState`` (master or remainder, moments, param staging), so remainders and bf16
    moments compose; the step goes out of place (``HostState.step(dst=...)``)."""

    def __init__(self, opt):
        self.opt = opt
        self.pieces = {b.index: (b, h, n, decay) for b, h, n, decay in opt._pieces}
        self.spare_uploaded = None  # CUDA event: the last copy up from the spare staging
        self.lr = None  # of the step under way, from zero_grad(lr=...)
        self.replays = self.steps = 0  # steps recomputed / steps taken, this session
        self.record = {}
        self._spans: list[tuple[float, float]] = []  # speculative Adam (start, end) times
        self._done: set[int] = set()

    # ------------------------------------------------------------ backward
    def begin(self, lr: float | None) -> None:
        """A new step (``zero_grad``): what the speculation assumes."""
        self.lr, self.step, self.scale = lr, self.opt.step_count + 1, self.opt.scaler.scale
        self._spans, self._done, self._synced = [], set(), False

    def check_lr(self) -> None:
        if self.lr is None:
            raise RuntimeError(
                "--overlap-cpu-optimizer: give the step's learning rate before backward, "
                "optimizer.zero_grad(lr=...)"
            )

    def work(self, b):
        """The worker's job once bucket ``b``'s gradient is final: its speculative step."""
        piece = self.pieces.get(b.index)
        if piece is None:  # an empty chunk: nothing to step
            return lambda: None

        def run():
            t0 = time.perf_counter()
            if not self._synced:  # the spare staging's last copy up may still read it
                if self.spare_uploaded is not None:
                    self.spare_uploaded.synchronize()
                self._synced = True
            live, spare = self._copies()
            try:
                self._piece(piece, live, spare, 1.0 / self.scale, self.step, self.lr)
            except Exception as e:  # raised by the step's wait, named
                raise RuntimeError(f"the speculative CPU Adam of bucket {b.index} failed") from e
            self._spans.append((t0, time.perf_counter()))
            self._done.add(b.index)

        return run

    def _copies(self) -> tuple:
        return self.opt.host_state, self.opt.spare_state

    def _piece(self, piece, src, dst, grad_scale: float, step: int, lr: float):
        o, (_, h, n, decay) = self.opt, piece
        grad = o._adam_grads()[0][h : h + n]
        src.step(h, n, grad, dst=dst, decay_runs=decay, **o.adam_hyper(lr, grad_scale, step))

    # ---------------------------------------------------------------- step
    def wait(self, lr: float) -> None:
        """The end of backward (``step``): wait for the worker; ``lr`` must be the one
        the speculation assumed."""
        if lr != self.lr:
            raise ValueError(
                f"--overlap-cpu-optimizer: step(lr={lr!r}) differs from the learning rate "
                f"the speculative step used, zero_grad(lr={self.lr!r})"
            )
        t0 = time.perf_counter()
        self.opt.reducer.wait_host()
        self._end, self._wait_ms = t0, (time.perf_counter() - t0) * 1e3

    def skip(self) -> None:
        """fp16 overflow: the spare copy is dropped (the next step overwrites it). Where the
        speculation wrote the model's params in place (``adam_writes_flat``: a CPU device,
        one DP rank), the old ones are put back, rounded from the committed master by the
        rule that made them."""
        o = self.opt
        if o.placement.adam_writes_flat:
            for b, h, n, _ in o._pieces:
                lo, hi = b.chunk_range(o.dp_rank)
                to_low(o.flat[lo:hi], o.host_state.master[h : h + n], o._split)
        self._report(replayed=False, replay_ms=0.0)

    def commit(self, grad_scale: float, step: int) -> None:
        """Swap the copies (recomputing the new one when the real ``grad_scale`` is not
        the assumed one), queue every host bucket's upload, then the publish."""
        o = self.opt
        missing = set(self.pieces) - self._done
        if missing:  # every host bucket's chunk is delivered each step: a bug otherwise
            raise RuntimeError(f"overlap: buckets {sorted(missing)} were never stepped")
        self._swap()
        replayed = grad_scale != 1.0 / self.scale or step != self.step
        t0 = time.perf_counter()
        if replayed:  # clipping: from the old copy (now the spare) with the real factor
            new, old = self._copies()
            for piece in o._pieces:
                self._piece(piece, old, new, grad_scale, step, self.lr)
                o._upload(*piece[:3])
        else:
            for b, h, n, _ in o._pieces:
                o._upload(b, h, n)
        self._report(replayed, (time.perf_counter() - t0) * 1e3 if replayed else 0.0)
        self.steps += 1
        self.replays += replayed
        o._publish(uploaded=True)

    def _swap(self) -> None:
        o = self.opt
        o.host_state, o.spare_state = o.spare_state, o.host_state
        o._uploaded, self.spare_uploaded = self.spare_uploaded, o._uploaded

    def _report(self, replayed: bool, replay_ms: float) -> None:
        hidden = sum(max(0.0, min(e, self._end) - s) for s, e in self._spans) * 1e3
        self.record = dict(
            replayed=int(replayed),
            host_hidden_ms=hidden,
            host_exposed_ms=self._wait_ms + replay_ms,
        )
        self.lr = None  # the next step gives its own

    def stats(self) -> dict:
        """The last step's record and this session's counts (the run summary's rate)."""
        return dict(self.record, overlap_steps=self.steps, overlap_replays=self.replays)
