"""The host side: the offloaded buckets' state on the CPU, stepped by the C++ Adam.

It holds the grad staging (the reduced chunks as they come down), the fp32 gradient
sums (k > 1 micro-batches accumulated on the host), one or two ``HostState`` copies
(master and moments in their stored forms, with the param staging that goes up), the
host worker thread, and the uploads. Its face is the device side's (``side.py``):
- ``launched``/``receive``: each reduced chunk is copied down (on a GPU, queued at the
  reduce-scatter on the copy stream so it overlaps the rest of backward) and, when Adam
  does not read the staging itself, added into the fp32 sum on the worker as it lands;
  between micro-batches the training thread does not wait for the worker: a copy down
  waits only for the sums that still read its bucket's part of the staging (``_reuse``);
- ``step_piece``/``upload``: one bucket's Adam, and its new params queued up right
  after it (the kernel is elementwise: bitwise one call over the slice), in forward
  order, each followed by the bucket's all-gather (``after_upload``); ``ready`` keeps
  each bucket's event, on which the forward's first use of the bucket waits;
- ``parts``/``target``/``commit`` and ``buffers``.
When it steps and publishes is the schedule's (``schedules.py``); the second copies the
schedules use (DPU's second gradient buffer, the overlap's second state) are listed by
the placement and rotated through ``alternate_grads``/``swap_states``.
"""

from __future__ import annotations

import torch

from ..ops.host_ops import accumulate_
from .adam_math import torch_adam_step
from .host_accumulator import HostAccumulator
from .host_state import Fp32Master, HostState, SplitMaster, make_moment, split_rounding, to_low
from .placement import allocate
from .side import Micro, Side

_NOT_COPIED = object()  # ``launched``'s token: the copy down waits for ``receive``
WAIT_SUMS = "wait for the host's gradient sums"  # the training thread's phase


class HostSide(Side):
    def __init__(self, layout, place, streams, flat: torch.Tensor, dp_rank: int):
        super().__init__(layout, place.host_range, streams)
        self.place, self.flat, self.dp_rank = place, flat, dp_rank
        self.reads_staging = place.adam_reads_staging
        self.staging_copies = self._host("grad_staging")
        self.grad_copies = self._host("grads")
        self.staging = self.staging_copies[0] if self.staging_copies else None
        self.grads = self.grad_copies[0] if self.grad_copies else None
        self.states = self._states(place)
        self.q8 = place.buffer("exp_avg").dtype == torch.uint8
        self.q8 = self.q8 or place.buffer("exp_avg_sq").dtype == torch.uint8
        self.by_bucket = {p.bucket.index: p for p in self.pieces}
        self.pieces.reverse()  # the upload order: forward t+1 uses the last buckets first
        self.bytes_down = self.bytes_up = 0
        self.on_final = None  # a schedule's host work once a bucket's gradient is final
        self.after_upload = None  # the optimizer's all-gather of a bucket, after its upload
        self.ready: dict[int, object] = {}  # bucket -> its last upload's (and gather's) event
        self._last_up = None  # covers every upload before it (one stream)
        self.defer_wait = False  # the schedule waits for the worker at the step
        self.worker = None
        if streams.asynchronous and not self.reads_staging:
            self.start_worker()
        # bucket -> the worker's ticket after the last work that reads its staging part
        self.free_after: dict[int, int] = {}

    def _host(self, name: str) -> list[torch.Tensor]:
        return allocate(self.place.buffer(name), self.flat.device)

    def _states(self, place) -> list[HostState]:
        """One HostState per copy of the master (two with the overlap)."""
        masters = self._host("master")
        if place.adam_writes_flat:  # a CPU device, one DP rank: the params are the staging
            staging = [self.flat] * len(masters)
        else:
            staging = self._host("param_staging") or [None] * len(masters)
        pieces = [(p.lo, p.n) for p in self.pieces]
        moments = {k: self._host(k) if not place.buffer(k).dtype == torch.uint8 else None
                   for k in ("exp_avg", "exp_avg_sq")}  # fmt: skip
        split = self.split = split_rounding(place)
        out = []
        for i, lo in enumerate(masters):
            if lo.dtype == torch.int16:
                master = SplitMaster(lo, staging[i])
            else:
                master = Fp32Master(lo, staging[i], split)
            m, v = (
                make_moment(place, k, pieces, lambda k=k, i=i: moments[k][i])
                for k in ("exp_avg", "exp_avg_sq")
            )
            out.append(HostState(master, m, v, master.kernel or torch_adam_step))
        return out

    def start_worker(self) -> None:
        if self.worker is None:
            self.worker = HostAccumulator(self.streams)

    # ------------------------------------------------------------------ gradients
    def launched(self, b, out: torch.Tensor, work, micro: Micro):
        if not self.streams.asynchronous:
            return _NOT_COPIED  # the CPU copies after the collective, at ``receive``
        return self._copy_down(b, out, work, micro)

    def receive(self, b, out: torch.Tensor, token, micro: Micro):
        if micro.last and micro.whole:
            self.chunk_norm(b, out)  # on the device, where the final chunk first exists
        if token is _NOT_COPIED:
            token = self._copy_down(b, out, None, micro)
        return token

    def _copy_down(self, b, out: torch.Tensor, work, micro: Micro):
        """Copy one reduced chunk into the staging (after ``work``, its collective), queue
        its host sum and a schedule's work on it; returns the copy's event."""
        with self.phase("copy down (queued at launch; + host add)"):
            return self._queue_down(b, out, work, micro)

    def _queue_down(self, b, out: torch.Tensor, work, micro: Micro):
        lo = b.slice_offset - self.offset
        self._reuse(b)
        stage = self.staging[lo : lo + b.chunk]
        landed = self.streams.copy_down(stage, out, after=work)
        self.bytes_down += b.chunk * out.element_size()
        if not self.reads_staging:
            job = self._accumulate(b, self.grads[lo : lo + b.chunk], stage, micro)
            self.worker.submit(job, landed) if self.worker is not None else job()
        if self.on_final is not None and micro.last:
            self.worker.submit(self.on_final(b, landed), landed)  # FIFO: after its host sum
        if self.worker is not None:
            self.free_after[b.index] = self.worker.ticket()
        return landed

    def _accumulate(self, b, grad, stage, micro: Micro):
        ranges = self.norm_ranges[b.index] if micro.last else None

        def job():
            # C++ (torch's fp32 += bf16 is slow); the last micro-batch completes the
            # gradient, so its pass also sums the squares for the norm: no second read.
            self.streams.host_access(reads=(stage,), writes=(grad,))
            norm = accumulate_(grad, stage, overwrite=micro.first, norm_ranges=ranges)
            if micro.last:
                self.norm_parts.append(norm)

        return job

    def _reuse(self, b) -> None:
        """Before a copy down rewrites bucket ``b``'s part of the staging: the worker is done
        with what the last one left there (FIFO: and with every bucket queued before it).
        The next micro-batch's forward and backward up to ``b`` usually hide the sums."""
        ticket = self.free_after.pop(b.index, None)
        if ticket is not None:
            with self.phase(WAIT_SUMS):
                self.worker.wait_for(ticket)

    def end_backward(self, micro: Micro) -> None:
        # Between micro-batches nothing waits: the next copies down wait in ``_reuse``.
        if micro.last and not self.defer_wait:
            with self.phase(WAIT_SUMS):
                self.wait()
        if self.reads_staging:
            self.streams.drain()  # Adam reads the staging next

    def wait(self) -> None:
        if self.worker is not None:
            self.worker.wait()

    @property
    def adam_grads(self) -> torch.Tensor:
        """The gradient Adam reads: the staging itself, or the fp32 sums."""
        return self.staging if self.reads_staging else self.grads

    def alternate_grads(self) -> None:
        """DPU: backward t+1 writes the other gradient buffer while Adam reads this one."""
        for copies in (self.staging_copies, self.grad_copies):
            copies.reverse()
        self.staging = self.staging_copies[0] if self.staging_copies else None
        self.grads = self.grad_copies[0] if self.grad_copies else None

    # ----------------------------------------------------------------------- step
    def step(self, hyper, upload: bool, grad: torch.Tensor | None = None) -> None:
        """Adam over every host bucket in place, reading ``grad`` (default: this step's);
        with ``upload`` each bucket's new params are queued up as soon as its piece is
        done."""
        state, grad = self.states[0], self.adam_grads if grad is None else grad
        self.streams.wait(state.uploaded)  # the last copy up may still read the staging
        for p in self.pieces:
            with self.phase("Adam (C++ CPU Adam, own slice)"):
                self.step_piece(p, hyper, state, None, grad)
            if upload:
                self.upload(p, state)

    def step_piece(self, p, hyper, src: HostState, dst: HostState | None, grad) -> None:
        """One bucket's Adam from ``src`` (into ``dst``: out of place)."""
        calls = hyper.calls(p.segments)
        if self.q8 and calls and [(c.lo, c.hi) for c in calls] != [(0, p.n)]:
            raise RuntimeError(
                f"8-bit moments step a bucket's chunk in one call, but bucket "
                f"{p.bucket.index} holds parameters with different learning rates, step "
                f"counts or weight decays this step (or without a gradient): use fp32/bf16 "
                f"moments"
            )
        out = (dst or src).master_form.upload_source
        for c in calls:
            s = slice(p.lo + c.lo, p.lo + c.hi)
            self.streams.host_access(reads=(grad[s],), writes=(out[s],))
            src.step(s, grad[s], dst=dst, **hyper.kwargs(c))

    def open_uploads(self) -> None:
        """The uploads that follow may overwrite the weights the last backward read."""
        self.streams.open_uploads()

    def upload(self, p, state: HostState | None, gather: bool = True, after=None):
        """Queue bucket ``p``'s new params from ``state``'s staging into the flat buffer
        (None: they are there already), then its all-gather (unless not ``gather``); its
        event goes to ``ready`` and is returned. ``after``: see ``streams.copy_up``."""
        lo, hi = p.bucket.chunk_range(self.dp_rank)
        dst = src = None
        if state is not None:
            dst, src = self.flat[lo:hi], state.master_form.upload_source[p.lo : p.lo + p.n]
            self.bytes_up += p.n * self.flat.element_size()
        then = None
        if gather and self.after_upload is not None:
            then = lambda: self.after_upload(p.bucket)  # noqa: E731
        if dst is None and then is None:
            return self.ready.get(p.bucket.index)
        with self.phase("publish: copy up + clone"):
            self._last_up = self.streams.copy_up(dst, src, then=then, after=after)
        self.ready[p.bucket.index] = self._last_up
        return self._last_up

    def publish(self) -> None:
        """Every bucket's params up from the live state (after a DPU join or a load)."""
        self.open_uploads()
        for p in self.pieces:
            self.upload(p, self.states[0])

    def mark_uploaded(self) -> None:
        """The copies up queued so far read the live state's staging until this event."""
        self.states[0].uploaded = self._last_up

    def restore_params(self) -> None:
        """Where Adam writes the params in place (``adam_writes_flat``), put back the ones
        of the committed master, rounded by the rule that made them."""
        if not self.place.adam_writes_flat:
            return
        for p in self.pieces:
            lo, hi = p.bucket.chunk_range(self.dp_rank)
            to_low(self.flat[lo:hi], self.states[0].master[p.lo : p.lo + p.n], self.split)

    def swap_states(self) -> None:
        self.states.reverse()

    # ----------------------------------------------------------------- checkpoint
    def parts(self, key: str) -> torch.Tensor:
        return self.states[0].form(key).saved()

    def converts(self, key: str) -> bool:
        return self.states[0].form(key).converts

    def saved_chunks(self, key: str, n: int):
        form = self.states[0].form(key)
        return form.saved_chunks(n) if form.converts else super().saved_chunks(key, n)

    def target(self, key: str) -> torch.Tensor:
        return self.states[0].form(key).target()

    def commit(self, key: str, t: torch.Tensor) -> None:
        self.streams.wait(self.states[0].uploaded)  # the staging may still be read
        self.states[0].form(key).commit(t)

    def buffers(self) -> list[tuple[str, object]]:
        out = []
        for st in self.states:
            out += [("master", st.master_form), ("exp_avg", st.exp_avg)]
            out += [("exp_avg_sq", st.exp_avg_sq)]
            if st.hi is not None and st.hi is not self.flat:
                out.append(("param_staging", st.hi))
        out += [("grads", g) for g in self.grad_copies]
        return out + [("grad_staging", g) for g in self.staging_copies]
