"""``OffloadAdamW``: ZeRO-Offload as a one-line swap for ``torch.optim.AdamW``.

    opt = OffloadAdamW(model.parameters(), lr=3e-4, weight_decay=0.1, dtype=torch.bfloat16)
    for batch in data:
        loss = model(batch)
        loss.backward()          # gradients stream to the host as buckets complete
        opt.step()               # exact AdamW on the CPU, new weights back up
        opt.zero_grad()

It takes over the parameters it is given (docs/DESIGN.md §3, "A foreign model"): each
becomes a view of one flat device buffer in ``dtype``, gradient hooks bucket, average
and reduce-scatter the gradients over the data-parallel group as backward produces
them, and the fp32 master and moments of this rank's slice live on the host
(``ZeroOptimizer``). What it asks of the model: every trainable parameter on one
device, no DDP wrapper (it averages the gradients itself), and no swapping of parameter
tensors after construction.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from .. import parallel_state as ps
from . import full_state
from .options import KEYWORDS, MOMENT_DTYPES, IllegalModes, OptimizerOptions

# keyword -> OptimizerOptions field, for what the keywords call differently
_ALIASES = {"gradient_accumulation_steps": "micro_batches", "overlap": "overlap_cpu_optimizer"}
_MODES = {"offload_fraction", "store_param_remainders", "exp_avg_dtype", "exp_avg_sq_dtype",
          "overlap_cpu_optimizer", "dpu_warmup_steps", "micro_batches", "accumulate_on_device",
          "bucket_size", "cpu_offload", "reduce_dtype", "loss_scale",
          "accumulate_dtype"}  # fmt: skip


def _named_groups(params) -> list[dict]:
    """``params`` as torch.optim takes them, as groups whose ``params`` are (name, tensor)
    pairs (a name made up where none was given)."""
    params = list(params)
    if not params:
        raise ValueError("OffloadAdamW got an empty parameter list")
    groups = params if isinstance(params[0], dict) else [{"params": params}]
    out, seen = [], 0
    for g in groups:
        named = []
        for item in g["params"]:
            name, p = item if isinstance(item, tuple) else (f"param{seen}", item)
            named.append((name, p))
            seen += 1
        out.append(dict(g, params=named))
    return out


def _options(dtype, modes: dict) -> OptimizerOptions:
    fields = {_ALIASES.get(k, k): v for k, v in modes.items()}
    dtype = fields.pop("dtype", dtype)
    unknown = sorted(set(fields) - _MODES)
    if unknown:
        raise TypeError(f"OffloadAdamW: unknown keyword {unknown[0]!r}; modes: {sorted(_MODES)}")
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if isinstance(fields.get(key), str):
            fields[key] = MOMENT_DTYPES[fields[key]]
    if dtype == torch.float16 and "loss_scale" not in fields:  # dynamic loss scaling
        fields["loss_scale"] = dict(initial=2.0**16, min=1.0, window=1000, hysteresis=2)
    try:
        return OptimizerOptions(dtype=dtype, **fields)
    except IllegalModes as e:
        raise ValueError("OffloadAdamW: " + "; ".join(e.lines(KEYWORDS))) from None


def _refuse_ddp(params: list[torch.Tensor]) -> None:
    """A DDP-wrapped model would average the gradients a second time (and its own buckets
    would never see them): one line, before anything is touched."""
    if not dist.is_initialized():
        return
    ids = {id(p) for p in params}
    ddp = torch.nn.parallel.DistributedDataParallel
    for obj in gc.get_objects():
        # type(), not isinstance(): an object's __class__ may be a deprecation shim that warns
        if issubclass(type(obj), ddp) and any(id(p) in ids for p in obj.parameters()):
            raise ValueError(
                "OffloadAdamW averages the gradients over the data-parallel ranks itself: "
                "pass the unwrapped model's parameters (model.module.parameters()), not DDP's"
            )


def _groups(groups: list[dict]):
    """The engine's groups (trainable params only) and every trainable (name, param)."""
    named, out = [], []
    for g in groups:
        live = [(n, p) for n, p in g["params"] if p.requires_grad]
        named += live
        out.append(dict(g, params=[p for _, p in live]))
    return out, named


def _world(group):
    if group is not None:
        return group
    if dist.is_initialized():
        return ps.ParallelGroup(dist.get_world_size(), dist.get_rank(), dist.group.WORLD)
    return ps.ParallelGroup.single()


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW whose state is partitioned over the data-parallel ranks and kept and stepped
    on the CPU. ``clip_grad``: clip by the global norm at every step (or call
    ``clip_grad_norm_``); ``dtype``: the device weights' dtype (None: the parameters');
    ``device``: where the weights live (None: theirs, or the GPU for CPU parameters when
    there is one); ``dp_group``/``tp_group``: ``ParallelGroup``s for models built from
    ``mp_offload.tensor_parallel`` layers (default: the whole world is data parallel);
    ``modes``: ``offload_fraction``, ``store_param_remainders``, ``exp_avg_dtype``,
    ``exp_avg_sq_dtype``, ``overlap_cpu_optimizer``, ``dpu_warmup_steps``,
    ``gradient_accumulation_steps``, ``accumulate_on_device``, ``bucket_size``, ...
    (``OptimizerOptions``; combinations are checked against its table)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, *,
                 clip_grad=None, dtype=None, device=None, dp_group=None, tp_group=None,
                 model=None, **modes):  # fmt: skip
        groups = _named_groups(params)
        engine_groups, named = _groups(groups)
        trainable = [p for _, p in named]
        if not trainable:
            raise ValueError("OffloadAdamW: no parameter requires a gradient")
        _refuse_ddp(trainable)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__([dict(g, params=[p for _, p in g["params"]]) for g in groups], defaults)
        for mine, theirs in zip(engine_groups, self.param_groups):
            theirs["params_trainable"] = mine["params"]
        self._check_groups()
        dtype = dtype or trainable[0].dtype
        self.options = _options(dtype, modes)
        from .zero import ZeroOptimizer

        self.zero = ZeroOptimizer(
            model,
            lr=lr,
            weight_decay=weight_decay,
            betas=betas,
            eps=eps,
            clip_grad=clip_grad or 0.0,
            dp=_world(dp_group),
            tp=tp_group or ps.ParallelGroup.single(),
            device=device or self._device(trainable),
            options=self.options,
            param_groups=[_EngineGroup(g) for g in self.param_groups],
            named_params=named,
        )
        self.last_step = None  # the engine's StepResult of the last step (norm, skipped)
        _guard_torch_clipping(self)

    def _check_groups(self) -> None:
        first = self.param_groups[0]
        for g in self.param_groups[1:]:
            for key in ("betas", "eps"):
                if g[key] != first[key]:
                    raise ValueError(
                        f"OffloadAdamW: param groups must share {key} (group 0: {first[key]}, "
                        f"another: {g[key]}); lr and weight_decay may differ"
                    )

    @staticmethod
    def _device(params) -> torch.device:
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(
                f"OffloadAdamW: the parameters are on {sorted(map(str, devices))}; put them all "
                "on one device (model.to(device)) first"
            )
        (d,) = devices
        return torch.device("cuda") if d.type == "cpu" and torch.cuda.is_available() else d

    # ---------------------------------------------------------- torch.optim face
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to zero: the gradients already went to the slice (and the first
        backward of the next step overwrites it)."""

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with the loss scaling of fp16 (needed under fp16 only)."""
        self.zero.backward(loss)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_step = self.zero.step()
        return loss

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm over every rank; returns that norm (FSDP's contract)."""
        return torch.tensor(self.zero.clip_grad_norm_(max_norm))

    def state_dict(self) -> dict:
        """The whole model's state by parameter name (collective: every DP rank calls it);
        it loads at any DP size. Only DP rank 0's holds the tensors (``state`` is None on
        the others, as FSDP's rank-0-only state): save it from there."""
        z = self.zero
        steps = {s.name: n for s, n in zip(z.layout.slots, z.slot_steps)}
        hyper = [
            {k: v for k, v in g.items() if not k.startswith("params")} for g in self.param_groups
        ]
        return dict(state=full_state.gather(z), param_steps=steps, step=z.step_count,
                    scaler=z.scaler.state_dict(), param_groups=hyper)  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Every rank loads the whole state (e.g. the file DP rank 0 saved, memory-mapped)
        and keeps its own pieces."""
        if state.get("state") is None:
            raise ValueError(
                "OffloadAdamW.load_state_dict: this state_dict holds no tensors (it was taken "
                "on a data-parallel rank other than 0); load the one DP rank 0 saved"
            )
        z = self.zero
        z.flush()
        full_state.install(z, state["state"])
        z.step_count = state["step"]
        z.slot_steps = [state["param_steps"][s.name] for s in z.layout.slots]
        z.scaler.load_state_dict(state["scaler"])
        for g, saved in zip(self.param_groups, state["param_groups"]):
            g.update(saved)
        z.publish()

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """The fp32 master weights by name on global rank 0 (None elsewhere; collective)."""
        full = full_state.gather(self.zero, ("master",))
        if full is None or (dist.is_initialized() and dist.get_rank() != 0):
            return None
        return full["master"]

    def memory_report(self) -> dict:
        """Bytes this rank holds: {"device": {buffer: bytes}, "host": {...}}."""
        return self.zero.memory_bytes()


# -------------------------------------------------- torch.nn.utils.clip_grad_norm_
_LIVE: list = []  # weak references to every OffloadAdamW made


def _owner(params) -> tuple:
    """(the OffloadAdamW whose parameters these are, or None; whether they are all of
    them), for ``clip_grad_norm_`` over a model's parameters."""
    ids = {id(p) for p in params}
    for ref in _LIVE:
        opt = ref()
        if opt is not None:
            mine = {id(s.param) for s in opt.zero.layout.slots}
            if ids & mine:
                return opt, mine <= ids
    return None, False


def _guarded(original):
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, *args, **kwargs):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        opt, whole = _owner(params)
        if opt is None:
            return original(params, max_norm, norm_type, *args, **kwargs)
        if not whole or float(norm_type) != 2.0:
            raise RuntimeError(
                "clip_grad_norm_ over OffloadAdamW's parameters: their gradients live in the "
                "optimizer, not in .grad; pass clip_grad= to OffloadAdamW or call "
                "opt.clip_grad_norm_(max_norm) (the L2 norm over all its parameters)"
            )
        return opt.clip_grad_norm_(max_norm)

    clip_grad_norm_.__wrapped__ = original
    clip_grad_norm_.offload_guard = True
    return clip_grad_norm_


def _guard_torch_clipping(opt) -> None:
    """torch.nn.utils.clip_grad_norm_ would find no .grad and silently return 0: route it
    to the optimizer's own clipping (the same norm) or refuse in one line."""
    import weakref

    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_mod

    _LIVE.append(weakref.ref(opt))
    if not getattr(nn_utils.clip_grad_norm_, "offload_guard", False):
        guarded = _guarded(nn_utils.clip_grad_norm_)
        nn_utils.clip_grad_norm_ = clip_mod.clip_grad_norm_ = guarded


class _EngineGroup(dict):
    """A view of one of OffloadAdamW's param groups for the engine: its trainable params,
    and its ``lr``/``weight_decay`` read live, so an LR scheduler drives them."""

    def __init__(self, group: dict):
        super().__init__(params=group["params_trainable"])
        self.group = group

    def __getitem__(self, key):
        return super().__getitem__(key) if key == "params" else self.group[key]

    def __setitem__(self, key, value):
        if key == "params":
            super().__setitem__(key, value)
        else:
            self.group[key] = value
