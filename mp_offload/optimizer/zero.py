"""ZeRO-2 with optional CPU offload (ZeRO-Offload) for one TP shard (docs/DESIGN.md §3).

Device: the model's parameters in the compute dtype, as views of one flat buffer
laid out by ``FlatLayout``; the gradient reducer's bucket buffers.
Host (with ``cpu_offload``; on the device otherwise): this DP rank's slice of the
fp32 master weights, Adam moments and fp32 gradients.

Backward (``reducer.py``): gradients are bucketed, reduce-scattered over the DP
group and this rank's chunks added into the fp32 gradient slice. Step: global norm
(overflow check for fp16) -> the Adam pass over the slice, bucket by bucket, that also
writes the new low-precision parameters, each bucket's copy up queued after its piece ->
all-gather of the slices across the DP group. With ``--overlap-cpu-optimizer`` the host
Adam runs during backward, speculatively, into a second state copy (``overlap.py``).
Without offload nothing leaves the device.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.distributed as dist

from ..parallel_state import ParallelGroup
from .adam_math import device_adam, torch_adam_step
from .base import StepResult
from .device_share import DeviceShare, clip_runs
from .grads import clip_coefficient, reduce_norm_squared
from .host_memory import resolve_device, set_thread_device
from .host_state import (
    HostState,
    allocate_moment,
    initial_split,
    nbytes,
    remainder_kernel,
    split_rounding,
    to_low,
)
from .layout import FlatLayout
from .loss_scaler import ConstantLossScaler, DynamicLossScaler
from .options import OptimizerOptions
from .overlap import OverlappedStep
from .placement import STATE, allocate, placement
from .reducer import CopyStream, GradientReducer, GradTargets

# torch >= 2.13 renamed the tensor collectives; keep working on older releases too.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _as_parts(slice_) -> list[torch.Tensor]:
    """A slice as its list of parts (one tensor when unsplit, as format 2 saved every one)."""
    return list(slice_) if isinstance(slice_, (list, tuple)) else [slice_]


def copy_parts(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Copy the concatenation of 1-D ``src`` into that of ``dst`` (same total length), piece
    by overlapping piece: a slice saved at one split loads at another without a whole copy."""
    if sum(t.numel() for t in dst) != sum(t.numel() for t in src):
        raise ValueError("copy_parts: the source and destination slices differ in length")
    i = j = a = b = 0  # part indices and offsets inside them
    while i < len(dst) and j < len(src):
        n = min(dst[i].numel() - a, src[j].numel() - b)
        dst[i][a : a + n].copy_(src[j][b : b + n])
        a, b = a + n, b + n
        if a == dst[i].numel():
            i, a = i + 1, 0
        if b == src[j].numel():
            j, b = j + 1, 0


class ZeroOptimizer:
    """ZeRO-2 over the DP group for one TP shard, its state on the CPU with ``cpu_offload``.

    Implements the ``Optimizer`` contract (``base.py``). It takes over ``model``: the
    fp32 CPU weights become this rank's master slice and the parameters become views of
    one flat device buffer in ``dtype``. ``dp``/``tp`` are ``ParallelGroup`` handles;
    ``options`` (or their fields as keywords: ``OptimizerOptions``) choose the buffers;
    ``placement.py`` decides every one of them, and this class allocates exactly those.
    With partial offload the first buckets, about 1 - F of the slice, stay on the device
    (``device_share.py``).
    """

    checkpoint_kind = "zero"
    autocast_dtype = None  # the parameters themselves are in the compute dtype

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        clip_grad: float,
        dp: ParallelGroup,
        tp: ParallelGroup,
        device: torch.device,
        options: OptimizerOptions | None = None,
        **option_fields,
    ):
        self.model, self.device = model, resolve_device(device)
        o = self.options = options or OptimizerOptions(**option_fields)
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        self.clip_grad, self.dtype, self.dpu_warmup_steps = clip_grad, o.dtype, o.dpu_warmup_steps
        self.dp_group, self.tp_group, self.dp, self.dp_rank = dp, tp, dp.size, dp.rank
        self.scaler = DynamicLossScaler(**o.loss_scale) if o.loss_scale else ConstantLossScaler()
        named = list(model.named_parameters())
        self.layout = FlatLayout(named, self.dp, self.dp_rank, tp.rank, o.bucket_size)
        self.placement = place = placement(self.layout, o, self.device.type)
        self.cpu_offload, self.offload_fraction = place.offloaded, o.offload_fraction
        self.host = torch.device("cpu") if place.offloaded else self.device
        self.step_count = 0  # Adam steps taken (skipped fp16 steps do not count)
        self.step_calls = self.bytes_up = 0
        copier = CopyStream(self.device) if place.pinned else None
        self.reducer = GradientReducer(self.layout, dp, self.device, place, copier=copier)
        self.share = self._make_share()
        self._split = split_rounding(place)  # the bf16 rounding rule of host-made params
        self._pieces, self._adam_calls = self._adam_pieces()
        # The master is filled and the fp32 CPU model freed (params move to the device
        # buffer) before the rest is allocated: start-up peaks at model + master.
        master, masters = self._fp32_master()
        self._place_model(model, master)
        moments = self._moments("exp_avg"), self._moments("exp_avg_sq")
        self.grads, self.grad_staging = self._allocate("grads"), self._allocate("grad_staging")
        staging = self._allocate("param_staging")  # none: the master (fp32) goes up
        staging = [self.flat] * (1 + o.overlap_cpu_optimizer) if place.adam_writes_flat else staging
        # The overlap's speculation writes the next state into the spare (ping-pong).
        self.host_state, self.spare_state = self._host_states(master, masters, staging, moments)
        self.overlap = OverlappedStep(self) if o.overlap_cpu_optimizer else None
        if self.overlap is not None:
            self.reducer.on_final = self.overlap.work
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._uploaded = None  # CUDA event: the last host->device copy of the staging
        self._begin_step()

    # ---------------------------------------------------------------- set-up
    @property
    def share_numel(self) -> int:
        """Elements of the slice updated on the device (partial offload); host buffers
        hold the rest, at slice offset - share_numel."""
        return self.placement.share_numel

    @property
    def device_buckets(self) -> int:
        return self.placement.device_buckets

    @property
    def actual_offload_fraction(self) -> float:
        return self.placement.actual_offload_fraction

    def _allocate(self, name: str) -> list[torch.Tensor]:
        return allocate(self.placement.buffer(name), self.device)

    def _fp32_master(self) -> tuple[torch.Tensor, list | None]:
        """The host's fp32 master and every copy of the "master" buffer; with remainders
        the master is a temporary that ``_host_states`` splits (the copies come later)."""
        if self.options.store_param_remainders:
            return torch.zeros(self.placement.buffer("master").numel), None  # padding 0
        copies = self._allocate("master")
        return copies[0], copies

    def _moments(self, key: str) -> list:
        """Every copy of moment ``key`` (an 8-bit one has one: the overlap refuses it)."""
        pieces = [(h, n) for _, h, n, _ in self._pieces]
        if self.placement.buffer(key).dtype == torch.uint8:
            return [allocate_moment(self.placement, key, pieces, self._allocate)]
        return self._allocate(key)

    def _host_states(self, master, masters, staging, moments):
        """(live, spare or None): the host state's stepping and conversions, one per copy;
        with remainders the fp32 ``master`` becomes hi (the param staging) + lo (the int16
        "master" buffer) and is dropped."""
        remainders = self.options.store_param_remainders
        masters = self._allocate("master") if remainders else masters
        adam = remainder_kernel() if remainders else self._pick_adam(moments[0][0], moments[1][0])
        states = [
            HostState(lo, staging[i] if staging else None, m, v, adam, remainders, self._split)
            for i, (lo, m, v) in enumerate(zip(masters, *moments))
        ]
        states[0].commit("master", master)  # remainders: split into hi + lo (else nothing)
        return states[0], (states[1] if len(states) > 1 else None)

    @property
    def master(self):
        """The live host master (with remainders its int16 low half)."""
        return self.host_state.master

    @property
    def exp_avg(self):
        return self.host_state.exp_avg

    @property
    def exp_avg_sq(self):
        return self.host_state.exp_avg_sq

    @property
    def param_staging(self) -> torch.Tensor | None:
        """The host's new low-precision params (the flat buffer itself where Adam writes the
        params in place; with remainders the master's top half)."""
        return self.host_state.hi

    @param_staging.setter
    def param_staging(self, t: torch.Tensor | None) -> None:
        self.host_state.hi = t

    @property
    def _adam(self):
        """The host's Adam kernel (tests wrap it)."""
        return self.host_state.adam

    @_adam.setter
    def _adam(self, fn) -> None:
        for state in (self.host_state, self.spare_state):
            if state is not None:
                state.adam = fn

    def _make_share(self) -> DeviceShare | None:
        """Partial offload: the device share's state (its buckets' decay runs)."""
        if not self.share_numel:
            return None
        state = {k: self._allocate("share." + k)[0] for k in STATE}
        return DeviceShare(state, clip_runs(self.layout.decay_runs(), 0, self.share_numel))

    def _place_model(self, model: torch.nn.Module, master: torch.Tensor) -> None:
        """fp32 CPU weights -> master slice, then params become views of one flat buffer
        (rounded by the host's rule, ``host_state.to_low``)."""
        for slot, p_off, offset, length in self.layout.owned_pieces():
            src = slot.param.detach().reshape(-1)[p_off : p_off + length]
            # A piece lies inside one bucket's chunk, so wholly on one side of the split.
            dst = (
                self.share.master[offset:]
                if offset < self.share_numel
                else master[offset - self.share_numel :]
            )
            dst[:length].copy_(src)
        (self.flat,) = self._allocate("params")
        for slot in self.layout.slots:
            view = self.flat[slot.start : slot.start + slot.numel].view_as(slot.param)
            to_low(view, slot.param.detach(), initial_split(self.dtype))
            slot.param.data = view
        model.to(self.device)  # any buffers; the parameters already live there

    def _adam_pieces(self) -> tuple[list[tuple], list[tuple]]:
        """(uploads, Adam calls). Uploads: the host buckets as (bucket, host-buffer offset,
        length, weight-decay ranges), in the order forward t+1 uses their parameters: the
        layout is in gradient order, the reverse. With offload the Adam pass takes one
        kernel call per upload, so each bucket's upload can start while the CPU steps the
        next (the kernel is elementwise: bitwise the same as one call over the slice);
        without offload nothing goes up: one (device) call over the whole slice."""
        pieces = []
        for b in reversed(self.layout.buckets[self.device_buckets :]):
            if b.chunk == 0:
                continue
            h = b.slice_offset - self.share_numel
            runs = clip_runs(self.layout.decay_runs(), b.slice_offset, b.slice_offset + b.chunk)
            pieces.append((b, h, b.chunk, [(lo, hi) for lo, hi, decay in runs if decay]))
        if self.cpu_offload:
            return pieces, pieces
        runs = clip_runs(self.layout.decay_runs(), self.share_numel, self.layout.slice_numel)
        n = self.layout.slice_numel - self.share_numel
        return pieces, [(None, 0, n, [(lo, hi) for lo, hi, decay in runs if decay])]

    def _pick_adam(self, exp_avg, exp_avg_sq):
        """The C++ Adam for state on the host; for state on the device (no offload) torch's
        fused AdamW on CUDA (``device_adam``), so offload is compared with a fair ZeRO-2."""
        if self.host.type == "cpu":
            try:
                from ..ops.cpu_adam import adam_step

                return adam_step
            except ImportError:  # extension not built: still correct, just slower
                return torch_adam_step
        return device_adam(self.host, exp_avg.dtype, exp_avg_sq.dtype)

    # --------------------------------------------------------------- backward
    def _adam_grads(self) -> list[torch.Tensor]:
        """The gradient buffers Adam reads (the staging itself, or the fp32 sums)."""
        return self.grad_staging if self.reducer.adam_reads_staging else self.grads

    def _begin_step(self) -> None:
        self.reducer.start_step(
            GradTargets(
                staging=self.grad_staging[0] if self.grad_staging else None,
                grads=self.grads[0] if self.grads else None,
                device_grads=None if self.share is None else self.share.grads,
            )
        )

    def zero_grad(self, lr: float | None = None) -> None:
        """Start a step. Nothing is zeroed: the first micro-batch's chunks overwrite.
        ``lr``: the step's learning rate (the overlap's speculative step needs it)."""
        self._begin_step()
        if self.overlap is not None:
            self.overlap.begin(lr)

    def backward(self, loss: torch.Tensor) -> None:
        if self.overlap is not None:
            self.overlap.check_lr()
        (loss * self.scaler.scale).backward() if self.scaler.scale != 1.0 else loss.backward()
        self.reducer.finish()

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        """Global norm (fp16: overflow -> skip) -> clip -> Adam on the slice -> publish."""
        self.step_calls += 1  # skipped steps moved their gradients too
        if self.overlap is not None:
            self.overlap.wait(lr)  # the end of backward: the speculative pieces are done
        grad = self._adam_grads()[0]
        # One scalar per rank: the reducer summed the squares where the gradient was.
        norm_sq = reduce_norm_squared(self.reducer.norm_squared(), self.dp_group, self.tp_group)
        scale = self.scaler.scale
        overflow = not math.isfinite(norm_sq)
        self.scaler.update(overflow)
        if overflow:  # fp16: skip; every rank sees the same global norm, so all skip
            if self.overlap is not None:
                self.overlap.skip()
            self._begin_step()
            return StepResult(grad_norm=float("nan"), skipped=True, loss_scale=scale)
        norm = math.sqrt(norm_sq) / scale
        grad_scale = clip_coefficient(norm, self.clip_grad) / scale
        self.step_count += 1
        delayed = self.dpu_warmup_steps is not None and self.step_count > self.dpu_warmup_steps
        if delayed:
            self._join_and_publish()  # params of step t-1 go up now; t runs behind forward t+1
            # The device share steps now, from this thread (stream order: before backward
            # t+1 overwrites its gradient); its result is published with the host's, at t+1.
            self._device_step(lr, grad_scale, self.step_count)
            self._thread = threading.Thread(
                target=self._delayed_pass,
                name="dpu-adam",
                args=(grad, lr, grad_scale, self.step_count),
                daemon=True,
            )
            self._thread.start()
            self._adam_grads().reverse()  # backward t+1 writes into the other buffer
        elif self.overlap is not None:
            self._device_step(lr, grad_scale, self.step_count)
            self.overlap.commit(grad_scale, self.step_count)  # or replay, then publish
        else:
            self._device_step(lr, grad_scale, self.step_count)  # queued first: beside the host
            self._adam_pass(grad, lr, grad_scale, self.step_count, upload=True)
            self._publish(uploaded=self.cpu_offload)  # with offload, each after its piece
        self._begin_step()
        return StepResult(grad_norm=norm, skipped=False, loss_scale=scale)

    def _delayed_pass(self, *args) -> None:
        """The DPU thread: its failure is kept and raised by the training thread, before any
        half-updated parameter is published."""
        try:
            set_thread_device(self.device)
            self._adam_pass(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised by _join_and_publish
            self._thread_error = e

    def _device_step(self, lr: float, grad_scale: float, step: int) -> None:
        if self.share is not None:
            self.share.step(**self._hyper(lr, grad_scale, step))

    def _adam_pass(
        self, grad: torch.Tensor, lr: float, grad_scale: float, step: int, upload: bool = False
    ) -> None:
        """Adam over the host slice, one piece (bucket) at a time with offload; with
        ``upload`` each bucket's new params are queued up as soon as its piece is done (the
        synchronous step; DPU publishes after the join, when forward t+1 no longer reads
        them)."""
        if self.master.numel() == 0:  # the whole slice is on the device
            return
        if self._uploaded is not None:  # the last copy up may still be reading the staging
            self._uploaded.synchronize()
        hyper = self.adam_hyper(lr, grad_scale, step)
        for b, h, n, decay in self._adam_calls:
            self.host_state.step(h, n, grad[h : h + n], decay_runs=decay, **hyper)
            if upload and b is not None:
                self._upload(b, h, n)

    def adam_hyper(self, lr: float, grad_scale: float, step: int) -> dict:
        """The host Adam's arguments of one step (the synchronous pass and the overlap's)."""
        return dict(self._hyper(lr, grad_scale, step), adamw=True, bias_correction=True)

    def _hyper(self, lr: float, grad_scale: float, step: int) -> dict:
        """One step's AdamW hyperparameters (the device share's Adam and the host's)."""
        b1, b2 = self.betas
        return dict(
            step=step,
            lr=lr,
            beta1=b1,
            beta2=b2,
            eps=self.eps,
            weight_decay=self.weight_decay,
            grad_scale=grad_scale,
        )

    def _upload(self, b, h: int, n: int) -> None:
        """Queue one host bucket's new params into the flat buffer (asynchronous on CUDA)."""
        src = self.master if self.param_staging is None else self.param_staging
        lo, hi = b.chunk_range(self.dp_rank)
        self.flat[lo:hi].copy_(src[h : h + n], non_blocking=True)
        if self.cpu_offload:
            self.bytes_up += n * self.flat.element_size()

    def _publish(self, uploaded: bool = False) -> None:
        """This rank's new params into the flat buffer (the device share's, then the host
        buckets' unless ``uploaded`` already), then all-gather them."""
        if self.share is not None:
            self.share.publish(self.flat, self.layout.buckets[: self.device_buckets], self.dp_rank)
        if not uploaded:
            for b, h, n, _ in self._pieces:
                self._upload(b, h, n)
        if self.placement.pinned:  # CUDA with offload: the copies up are asynchronous
            self._uploaded = torch.cuda.Event(blocking=True)  # waited on by a (DPU) thread
            self._uploaded.record()
        if self.dp > 1:
            for b in self.layout.buckets:
                lo, hi = b.chunk_range(self.dp_rank)
                # gloo needs a separate input; NCCL gathers in place.
                inp = self.flat[lo:hi] if self.device.type == "cuda" else self.flat[lo:hi].clone()
                _all_gather(self.flat[b.start : b.end], inp, group=self.dp_group.torch_group())

    def _join_and_publish(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self._thread_error is not None:
                err, self._thread_error = self._thread_error, None
                raise RuntimeError(
                    f"the delayed (DPU) optimizer step failed: {type(err).__name__}: {err}"
                ) from err
            self._publish()

    def flush(self) -> None:
        """Apply a delayed (DPU) update still in flight: before saving or at the end."""
        self._join_and_publish()

    # ------------------------------------------------------------ checkpoints
    @property
    def skipped_steps(self) -> int:
        return self.scaler.overflows

    def state_dict(self) -> dict:
        """This rank's optimizer slice and what it needs. Each state key is the slice's
        parts in order (device share, then host part), or one tensor when unsplit: the
        live buffers, never a copy, so a save allocates no second slice (torch.save copies
        a device tensor to the host one storage at a time while writing). Except: the host
        master kept as remainders and 8-bit moments are saved as fp32 temporaries
        (``HostState.saved``), so a checkpoint loads with or without those flags."""
        self.flush()
        return dict(
            master=self._parts("master"),
            exp_avg=self._parts("exp_avg"),
            exp_avg_sq=self._parts("exp_avg_sq"),
            step=self.step_count,
            scaler=self.scaler.state_dict(),
            layout=self.layout.describe(),
        )

    def _parts(self, key: str, host: torch.Tensor | None = None):
        host = self.host_state.saved(key) if host is None else host
        return host if self.share is None else [getattr(self.share, key), host]

    def _install(self, key: str, saved) -> None:
        """Copy a saved slice (one tensor or its parts, at any split) into this run's parts:
        checkpoints do not depend on the offload fraction (nor on the host's stored form)."""
        host = self.host_state.target(key)
        copy_parts(_as_parts(self._parts(key, host)), _as_parts(saved))
        self.host_state.commit(key, host)

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Install a (re-partitioned) slice, then rebuild the device params from it.

        ``state``: ``master`` and optionally ``exp_avg``/``exp_avg_sq``, ``step`` and
        ``scaler`` (a weights-only load gives the master alone). Collective (all-gather).
        """
        self.flush()
        if self._uploaded is not None:  # the last copy up may still read the staging
            self._uploaded.synchronize()  # (which the install of remainders writes)
        self._install("master", state["master"])
        if state.get("exp_avg") is not None:
            self._install("exp_avg", state["exp_avg"])
            self._install("exp_avg_sq", state["exp_avg_sq"])
        self.step_count = state.get("step", 0)
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.host_state.refresh_staging()
        self._publish()

    # ---------------------------------------------------------------- reports
    def stats(self) -> dict:
        steps = max(self.step_calls, 1)
        owned = max(self.layout.slice_numel, 1)
        moved = self.reducer.bytes_down + self.bytes_up
        out = dict(
            host_device_bytes_per_param=moved / steps / owned, pinned_host_bytes=self.pinned_bytes()
        )
        return out if self.overlap is None else dict(out, **self.overlap.stats())

    def memory_bytes(self) -> dict:
        """Bytes this rank holds, by place and category (from the real buffers)."""
        copies = [s for s in (self.host_state, self.spare_state) if s is not None]  # overlap: 2
        state = {k: sum(nbytes(getattr(s, k)) for s in copies) for k in STATE[:3]}
        state["grads"] = sum(nbytes(g) for g in self.grads)
        own = self.param_staging is not self.flat  # else the params' own storage
        staging = sum(nbytes(s.hi) for s in copies) * own
        staging += sum(nbytes(g) for g in self.grad_staging)
        device = dict(params=nbytes(self.flat), grad_buckets=self.reducer.buffer_bytes())
        if self.reducer.acc_buffer is not None:
            device["grad_accumulation"] = nbytes(self.reducer.acc_buffer)
        host = dict(staging=staging)
        (host if self.cpu_offload else device).update(state)
        if self.share is not None:  # partial offload: the device share's own state
            device.update(self.share.memory_bytes())
        return dict(device=device, host=host)

    def pinned_bytes(self) -> int:
        """Host bytes page-locked for asynchronous copies (exactly the staging, on CUDA)."""
        return self.memory_bytes()["host"]["staging"] if self.placement.pinned else 0

    def memory_report(self) -> str:
        rep = self.memory_bytes()
        fmt = lambda d: ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in d.items())  # noqa
        split = (
            f"; offload fraction {self.actual_offload_fraction:.3f} (asked "
            f"{self.offload_fraction:g}): the device updates {self.share_numel} of them"
            if self.cpu_offload and self.offload_fraction < 1
            else ""
        )
        return (
            f"rank memory: device [{fmt(rep['device'])}] host [{fmt(rep['host'])}] "
            f"(owned {self.layout.slice_numel} of {self.layout.numel} elements{split})"
        )
