"""RNG streams for tensor parallelism and activation checkpointing.

Two streams: the default generator is seeded identically on every TP rank, so
dropout on replicated activations (after the row-parallel reductions) draws the
same mask everywhere; the tracker's "model-parallel-rng" stream is seeded per TP
rank, so dropout on split activations (attention probabilities of each rank's own
heads) differs across ranks as if the model were unsplit.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import detach_variable

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"


def get_rng_state(device: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: str) -> None:
    if device == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states that can be swapped in for the device's generator."""

    def __init__(self):
        self.states: dict[str, torch.Tensor] = {}
        self.device = "cpu"

    def reset(self, device: str | None = None) -> None:
        self.states = {}
        self.device = device or _device_type()

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        orig = get_rng_state(self.device)
        if self.device == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = get_rng_state(self.device)
        set_rng_state(orig, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added (call model_parallel_seed)")
        orig = get_rng_state(self.device)
        set_rng_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = get_rng_state(self.device)
            set_rng_state(orig, self.device)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_seed(seed: int, tp_rank: int, device: str | None = None) -> None:
    """Seed the default stream (same on all TP ranks) and the per-TP-rank stream."""
    device = device or _device_type()
    torch.manual_seed(seed)  # also seeds CUDA's default generators
    _TRACKER.reset(device)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)


def _autocast_state(device_types) -> list[dict]:
    """The autocast settings in force for each device type, as torch.autocast arguments."""
    return [
        dict(
            device_type=t,
            enabled=torch.is_autocast_enabled(t),
            dtype=torch.get_autocast_dtype(t),
            cache_enabled=torch.is_autocast_cache_enabled(),
        )
        for t in device_types
    ]


# The SDPA switches (``torch.backends.cuda``; the CPU kernels read them too): the query and
# its setter. ``sdpa_kernel`` sets the first four; the last changes the math kernel's sums.
_SDPA_SWITCHES = (
    ("flash_sdp_enabled", "enable_flash_sdp"),
    ("mem_efficient_sdp_enabled", "enable_mem_efficient_sdp"),
    ("math_sdp_enabled", "enable_math_sdp"),
    ("cudnn_sdp_enabled", "enable_cudnn_sdp"),
    ("fp16_bf16_reduction_math_sdp_allowed", "allow_fp16_bf16_reduction_math_sdp"),
)


def sdpa_state() -> dict:
    """The scaled-dot-product-attention settings in force: which backends may run, the
    math kernel's reduced-precision sums, and the backends' priority order (where this
    torch has them). Which kernel SDPA picks follows from these and the inputs."""
    cuda = torch.backends.cuda
    state = {set_: getattr(cuda, get)() for get, set_ in _SDPA_SWITCHES if hasattr(cuda, get)}
    order = getattr(torch._C, "_get_sdp_priority_order", None)
    if order is not None:
        state["priority"] = list(order())
    return state


def _set_sdpa_state(state: dict) -> None:
    for key, value in state.items():
        if key == "priority":
            torch._C._set_sdp_priority_order(value)
        else:
            getattr(torch.backends.cuda, key)(value)


@contextlib.contextmanager
def sdpa_pinned(state: dict):
    """Run under the SDPA settings ``state`` (from ``sdpa_state``), then restore."""
    before = sdpa_state()
    _set_sdpa_state(state)
    try:
        yield
    finally:
        _set_sdpa_state(before)


class _Checkpoint(torch.autograd.Function):
    """Drop activations in forward, recompute them in backward under the same RNG, the
    same autocast state and the same SDPA backends (backward runs outside the forward's
    autocast and ``sdpa_kernel`` regions: a replay on another attention kernel would draw
    another dropout mask and round differently)."""

    @staticmethod
    def forward(ctx, run_function, *args):
        ctx.run_function = run_function
        ctx.device = _TRACKER.device
        ctx.autocast = _autocast_state(sorted({"cpu", ctx.device}))
        ctx.sdpa = sdpa_state()
        ctx.cpu_state = torch.get_rng_state()
        ctx.device_state = get_rng_state(ctx.device) if ctx.device == "cuda" else None
        ctx.tracker_states = _TRACKER.get_states()
        with torch.no_grad():
            out = run_function(*args)
        ctx.save_for_backward(*args)
        return out

    @staticmethod
    def backward(ctx, *grads):
        inputs = detach_variable(ctx.saved_tensors)
        # Replay forward with the RNG as it was, then put the current RNG back.
        cpu_now = torch.get_rng_state()
        dev_now = get_rng_state(ctx.device) if ctx.device == "cuda" else None
        tracker_now = _TRACKER.get_states()
        torch.set_rng_state(ctx.cpu_state)
        if ctx.device_state is not None:
            set_rng_state(ctx.device_state, ctx.device)
        _TRACKER.set_states(ctx.tracker_states)
        with torch.enable_grad(), contextlib.ExitStack() as stack:
            for state in ctx.autocast:
                stack.enter_context(torch.autocast(**state))
            stack.enter_context(sdpa_pinned(ctx.sdpa))
            out = ctx.run_function(*inputs)
        torch.set_rng_state(cpu_now)
        if dev_now is not None:
            set_rng_state(dev_now, ctx.device)
        _TRACKER.set_states(tracker_now)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, grads)
        return (None,) + tuple(x.grad for x in inputs)


def checkpoint(function, *args):
    """Activation checkpointing that replays under the forward's CPU, device and tracker RNG
    states, autocast and SDPA backends."""
    return _Checkpoint.apply(function, *args)
