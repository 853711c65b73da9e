"""ZeRO-2 with optional CPU offload (ZeRO-Offload) for one TP shard (docs/DESIGN.md §3).

The parameters become views of one flat device buffer in the compute dtype, laid out by
``FlatLayout`` (buckets, this DP rank's slice); ``placement.py`` decides every buffer.
The slice's optimizer state lives on two sides with one face (``side.py``): the
``DeviceSide`` (fp32 master, moments and gradient on the device: no offload, or the
device share of a partial offload) and the ``HostSide`` (the offloaded state on the CPU,
stepped by the C++ Adam). The ``GradientReducer`` reduce-scatters each bucket and hands
the chunk to its side; the schedule (``schedules.py``) says when the host steps and
publishes; ``streams.py`` is the one seam to the device's copies and events.
"""

from __future__ import annotations

import math

import torch

from ..parallel_state import ParallelGroup, all_gather_tensor
from .adam_calls import StepHyper, step_hyper, stepped_slots
from .base import StepResult
from .checkpoint_parts import install_slice, memory_bytes, memory_line, slice_state, stats
from .grads import clip_coefficient, reduce_norm_squared
from .host_memory import resolve_device
from .host_state import initial_split, to_low
from .layout import FlatLayout
from .loss_scaler import ConstantLossScaler, DynamicLossScaler
from .options import OptimizerOptions
from .param_waits import ParamWaits
from .placement import allocate, placement
from .reducer import GradientReducer
from .schedules import schedule_for
from .side import no_phase
from .sides import fill, make_sides
from .streams import streams_for


def default_groups(model: torch.nn.Module, lr: float, weight_decay: float) -> list[dict]:
    """Megatron's two groups: weight decay on matrices, none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        dict(params=[p for p in params if p.ndim > 1], lr=lr, weight_decay=weight_decay),
        dict(params=[p for p in params if p.ndim <= 1], lr=lr, weight_decay=0.0),
    ]


class ZeroOptimizer:
    """ZeRO-2 over the DP group for one TP shard, its state on the CPU with offload.

    Implements the ``Optimizer`` contract (``base.py``). It takes over ``model``: the
    trainable parameters' weights become this rank's master slice and the parameters
    views of one flat device buffer in ``options.dtype``. ``param_groups``: dicts with
    ``params``, ``lr`` and ``weight_decay`` (read at every step; default: decay on
    matrices only); ``dp``/``tp``: ``ParallelGroup`` handles; ``streams``: the copy/event
    seam (default: the device's own).
    """

    checkpoint_kind = "zero"
    autocast_dtype = None  # the parameters themselves are in the compute dtype
    phase = staticmethod(no_phase)  # a benchmark's timer (``set_phase_timer``)

    def __init__(self, model, *, lr, weight_decay, betas, eps, clip_grad, dp: ParallelGroup,
                 tp: ParallelGroup, device, options: OptimizerOptions | None = None,
                 param_groups: list[dict] | None = None, named_params=None,
                 streams=None):  # fmt: skip
        self.model, self.device = model, resolve_device(device)
        o = self.options = options or OptimizerOptions()
        self.betas, self.eps, self.clip_grad, self.dtype = tuple(betas), eps, clip_grad, o.dtype
        self.dp_group, self.tp_group, self.dp_rank = dp, tp, dp.rank
        self.scaler = DynamicLossScaler(**o.loss_scale) if o.loss_scale else ConstantLossScaler()
        self.param_groups = param_groups or default_groups(model, lr, weight_decay)
        group_of = {id(p): g for g, grp in enumerate(self.param_groups) for p in grp["params"]}
        # ``named_params`` (no module: OffloadAdamW over a parameter list): in model order
        named = named_params if model is None else model.named_parameters()
        named = [(n, p) for n, p in named if id(p) in group_of]
        self.layout = FlatLayout(named, dp.size, dp.rank, tp.rank, o.bucket_size)
        self.group_of = [group_of[id(s.param)] for s in self.layout.slots]
        self.slot_steps = [0] * len(self.layout.slots)  # AdamW's per-parameter step counts
        self.placement = place = placement(self.layout, o, self.device.type)
        self.streams = streams or streams_for(self.device, place.pinned)
        self.step_count = self.step_calls = 0  # steps taken (skipped fp16 ones do not count)
        (self.flat,) = allocate(place.buffer("params"), self.device)
        self.device_side, self.host_side, self.sides = make_sides(
            self.layout, place, self.device, self.streams, self.flat, self.dp_rank
        )
        self._place_model(model, group_of)
        routes = [next(s for s in self.sides if s.owns(b.slice_offset) or not b.chunk)
                  for b in self.layout.buckets]  # fmt: skip
        self.reducer = GradientReducer(self.layout, dp, self.device, place, routes, self.streams)
        self.schedule = schedule_for(o, self.device_side, self.host_side, self.publish, self.hyper)
        if self.host_side is not None and dp.size > 1:
            self.host_side.after_upload = self._gather
        self.waits = None if self.host_side is None else (
            ParamWaits(self.layout, self.streams, self.host_side.ready, model)
        )  # fmt: skip
        self._begin_step()

    def _place_model(self, model: torch.nn.Module, group_of: dict) -> None:
        """Weights -> the sides' masters, then the parameters become views of the flat buffer
        (rounded by the host's rule, ``host_state.to_low``); frozen ones are only cast."""
        fill(
            self.sides, self.layout, "master", lambda s, a, n: s.param.detach().view(-1)[a : a + n]
        )
        for slot in self.layout.slots:
            view = self.flat[slot.start : slot.start + slot.numel].view_as(slot.param)
            to_low(view, slot.param.detach(), initial_split(self.dtype))
            slot.param.data = view
        if model is None:  # a parameter list: the module and its buffers are the user's
            return
        for p in model.parameters():  # frozen: untouched but for the device and dtype
            if id(p) not in group_of and p.is_floating_point():
                p.data = p.data.to(self.device, self.dtype)
        model.to(self.device)  # buffers; the trainable parameters already live there

    def params_ready(self) -> None:
        """On a GPU, the uploads of a step land as the next forward reaches each bucket:
        call this before reading the parameters any other way (the current stream then
        waits for all of them). ``flush`` and the model's ``state_dict`` call it."""
        if self.waits is not None:
            self.waits.all()

    # -------------------------------------------------------------------- backward
    def _begin_step(self) -> None:
        self._norm_sq = self._clip_now = None  # this step's global norm, a clip asked for it
        self.reducer.start_step()
        self.schedule.begin(self.step_count, self.scaler.scale)

    def zero_grad(self, lr: float | None = None, set_to_none: bool = True) -> None:
        """Start a step (nothing is zeroed: the first micro-batch's chunks overwrite);
        ``lr``: set every group's learning rate (the training loop's schedule)."""
        if lr is not None:
            self.set_lr(lr)

    def set_lr(self, lr: float) -> None:
        for g in self.param_groups:
            g["lr"] = lr

    def backward(self, loss: torch.Tensor) -> None:
        self.reducer.driving = True
        try:
            with self.phase("backward: autograd compute"):
                scale = self.scaler.scale
                (loss * scale if scale != 1.0 else loss).backward()
        finally:
            self.reducer.driving = False
        with self.phase("finish backward"):
            self.reducer.finish()

    def set_phase_timer(self, phase) -> None:
        """``phase(name)`` (a context manager) times each named piece of the step."""
        for part in (self, self.reducer, *self.sides):
            part.phase = phase

    # ------------------------------------------------------------------------ step
    def hyper(self, grad_scale: float, stepped=None) -> StepHyper:
        """One step's hyperparameters as the groups say now (``adam_calls.step_hyper``)."""
        return step_hyper(self, grad_scale, stepped)

    @torch.no_grad()
    def step(self, lr: float | None = None) -> StepResult:
        """Global norm (fp16: overflow -> skip) -> clip -> Adam on both sides -> publish."""
        if lr is not None:
            self.set_lr(lr)
        self.step_calls += 1  # skipped steps moved their gradients too
        norm_sq = self.norm_squared()
        stepped = stepped_slots(self.reducer.got_grad, self.dp_group)
        scale = self.scaler.scale
        overflow = not math.isfinite(norm_sq)
        self.scaler.update(overflow)
        if overflow:  # fp16: skip; every rank sees the same global norm, so all skip
            self.schedule.skip()
            self._begin_step()
            return StepResult(grad_norm=float("nan"), skipped=True, loss_scale=scale)
        norm = math.sqrt(norm_sq) / scale
        clip = self.clip_grad if self._clip_now is None else self._clip_now
        hyper = self.hyper(clip_coefficient(norm, clip or 0.0) / scale, stepped)
        self.step_count += 1
        if self.host_side is not None:
            self.host_side.open_uploads()  # before the device side's Adam is queued
        self.schedule.step(hyper, self.step_count)
        self.slot_steps = [n + on for n, on in zip(self.slot_steps, stepped)]
        self._begin_step()
        return StepResult(grad_norm=norm, skipped=False, loss_scale=scale)

    def norm_squared(self) -> float:
        """This step's squared global norm (loss-scaled, over DP and TP; collective, once)."""
        if self._norm_sq is None:
            self.schedule.end_backward()
            with self.phase("grad norm all-reduce"):
                local = self.reducer.norm_squared()
                self._norm_sq = reduce_norm_squared(local, self.dp_group, self.tp_group)
        return self._norm_sq

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip this step's gradients by their global norm over every rank (applied in the
        step, fused into the Adam pass); returns the norm before clipping."""
        self._clip_now = float(max_norm)
        return math.sqrt(self.norm_squared()) / self.scaler.scale

    def publish(self, uploaded: bool = False, device: bool = True, host: bool = True) -> None:
        """This rank's new params into the flat buffer, each bucket all-gathered over the DP
        group as soon as its chunk is there: the device side's (the forward's first
        buckets), then the host's (uploaded already when ``uploaded``, each gathered behind
        its upload). ``device``/``host``: which sides (a schedule publishes the device
        side's before the host's Adam, so that its gathers are first in line)."""
        if self.device_side is not None and device:
            self.device_side.publish(self.flat, self.dp_rank)
            for b in self.device_side.buckets:
                self._gather(b)
        if self.host_side is not None and host:
            if not uploaded:
                self.host_side.publish()
            self.host_side.mark_uploaded()
            if not self.waits.in_forward:
                self.waits.all()

    def _gather(self, b) -> None:
        """Bucket ``b``'s all-gather over the DP group (on the current stream)."""
        if self.dp_group.size == 1 or not b.chunk:
            return
        with self.phase("all-gather params"):
            lo, hi = b.chunk_range(self.dp_rank)
            # gloo needs a separate input; NCCL gathers in place.
            inp = self.flat[lo:hi] if self.device.type == "cuda" else self.flat[lo:hi].clone()
            all_gather_tensor(self.flat[b.start : b.end], inp, group=self.dp_group.torch_group())

    def flush(self) -> None:
        """Apply a delayed (DPU) update still in flight, and order the current stream after
        every upload: before saving, reading the weights, or at the end."""
        self.schedule.flush()
        self.params_ready()

    # ----------------------------------------------------------------- checkpoints
    @property
    def skipped_steps(self) -> int:
        return self.scaler.overflows

    def state_dict(self) -> dict:
        """This rank's slice (``checkpoint_parts.slice_state``): the live buffers where the
        stored form is fp32, so a save allocates no second slice."""
        return slice_state(self)

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Install a (re-partitioned) slice, then rebuild the device params from it.
        ``state``: ``master`` and optionally the moments, ``step``, ``param_steps`` and
        ``scaler`` (a weights-only load gives the master alone). Collective."""
        self.flush()
        install_slice(self, state)
        self.publish()

    # --------------------------------------------------------------------- reports
    def stats(self) -> dict:
        return stats(self)

    def memory_bytes(self) -> dict:
        """Bytes this rank holds, by place and category (from the real buffers)."""
        return memory_bytes(self)

    def pinned_bytes(self) -> int:
        """Host bytes page-locked for asynchronous copies (exactly the staging, on CUDA)."""
        return self.memory_bytes()["host"].get("staging", 0) if self.placement.pinned else 0

    def memory_report(self) -> str:
        return memory_line(self)
