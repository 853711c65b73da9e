"""The modes against each other on the device, in one process, every variant a copy of one
initial model fed the same batches: bitwise where both sides do the same arithmetic
(deterministic algorithms on), within 1e-5 of the largest element where they do not (the
CPU Adam against the device's fused AdamW: nvcc contracts a*b+c into FMAs, the C++ Adam
is built with -ffp-contract=off). Two processes are never compared bitwise.

Each task yields its lines (``report.check``); the steps are few (3) and nothing is
clipped (``toy.HP``), so a mismatch is the mode's and not the norm's last bit. Where the
arithmetic differs, one step: its gradients are still bit for bit the same on both sides
(the same weights), so the tolerance covers the Adam's rounding and nothing else; after
it, an element whose gradient is almost zero can take the other sign on the other side.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import toy
from .report import check

BF16 = torch.bfloat16
STEPS = 3
CLOSE = 1e-5  # of the largest element, where the arithmetic differs
_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@dataclass
class Section:
    """What every equivalence shares: the device, the one initial model, its config and
    the batches (``batches[s]``: step s's micro-batches, on the device)."""

    device: str
    cfg: dict
    bucket_size: int
    pin_math_sdpa: bool = False

    @property
    def init(self):
        return toy.initial(self.cfg)  # made by the first task that needs it

    def batches(self, step: int, k: int, rows: int = 2) -> list[torch.Tensor]:
        return [toy.tokens(self.cfg, rows, step * k + i, self.device) for i in range(k)]


def bitwise(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    """Bit for bit (a NaN equals the same NaN); the value says how many elements differ."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    view = _INT.get(a.dtype)
    ne = (a.view(view) != b.view(view)) if view else (a != b)
    n = int(ne.sum())
    return n == 0, "bitwise equal" if n == 0 else f"{n} of {a.numel()} elements differ"


def close(a: torch.Tensor, b: torch.Tensor, rel: float = CLOSE) -> tuple[bool, float]:
    """max |a - b| / max |b| <= rel (float64 arithmetic)."""
    a, b = a.double(), b.double()
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    return err <= rel, err


def train(sec: Section, steps: int = STEPS, k: int = 1, dtype=BF16, resident=True, **options):
    """One variant: losses, the device params and the fp32 master after ``steps``."""
    m = toy.model(sec.init, sec.device, dtype, resident)
    opt = toy.zero(m, sec.device, dtype=dtype, bucket_size=sec.bucket_size, **options)
    losses = [toy.step(opt, m, sec.batches(s, k))[0] for s in range(steps)]
    opt.flush()
    return dict(losses=losses, params=toy.flat_params(m).cpu(), master=toy.master(opt), opt=opt)


def compare(name: str, a: dict, b: dict, exact: bool, why: str = ""):
    """Lines for the losses, params and master of two variants."""
    if exact:
        yield check(f"{name}.losses", a["losses"] == b["losses"], a["losses"], "bitwise" + why)
        for key in ("params", "master"):
            ok, value = bitwise(a[key], b[key])
            yield check(f"{name}.{key}", ok, value, "bitwise" + why)
        return
    first = a["losses"][0] == b["losses"][0]  # the same weights and batch: the same forward
    yield check(f"{name}.first_loss", first, a["losses"][0], f"== {b['losses'][0]!r}")
    for key in ("params", "master"):
        ok, err = close(a[key].float(), b[key].float())
        yield check(f"{name}.{key}", ok, err, f"<= {CLOSE:g} of the largest element{why}")


@contextlib.contextmanager
def deterministic(sec: Section):
    """Deterministic kernels (warn where torch has none) and, where the calibration found
    the default SDPA kernel not repeatable, the math kernel."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with contextlib.ExitStack() as stack:
            if sec.pin_math_sdpa:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
            yield
    finally:
        torch.use_deterministic_algorithms(before)


def resident_build(sec: Section):
    """A model moved to its device and cast to bf16 before the optimizer is made (the
    order users follow) against the same bf16 weights handed over on the CPU."""
    a = train(sec, resident=True)
    b = train(sec, resident=False)
    yield from compare("equiv.device_resident_bf16", a, b, exact=True)


def offload_vs_zero2(sec: Section):
    """fp32 ZeRO-Offload against ZeRO-2 on the device (no offload)."""
    cpu = sec.device == "cpu"  # the same C++ Adam on both sides only on a CPU device
    steps = STEPS if cpu else 1
    a = train(sec, steps, dtype=torch.float32)
    b = train(sec, steps, dtype=torch.float32, cpu_offload=False)
    why = " (the same C++ Adam)" if cpu else " (the CPU Adam vs the device's fused AdamW)"
    yield from compare("equiv.offload_vs_zero2", a, b, exact=cpu, why=why)


def overlap(sec: Section):
    """--overlap-cpu-optimizer against the synchronous step, k=2 summed on the host."""
    a = train(sec, k=2, micro_batches=2, overlap_cpu_optimizer=True)
    b = train(sec, k=2, micro_batches=2)
    yield from compare("equiv.overlap_vs_sync", a, b, exact=True)
    st = a["opt"].stats()
    taken = (st.get("overlap_steps"), st.get("overlap_replays"))
    want = f"({STEPS}, 0): every step overlapped, none replayed (no clipping)"
    yield check("equiv.overlap_vs_sync.steps", taken == (STEPS, 0), taken, want)


def accumulation(sec: Section):
    """k=4 summed in fp32 on the device against the same sums on the host."""
    kw = dict(k=4, micro_batches=4, reduce_dtype=torch.float32)
    a = train(sec, accumulate_on_device=True, **kw)
    b = train(sec, **kw)
    yield from compare("equiv.device_vs_host_accumulation", a, b, exact=True)


def remainders(sec: Section):
    """The master kept as the bf16 param plus a 16-bit remainder, against fp32."""
    a = train(sec, store_param_remainders=True)
    b = train(sec)
    yield from compare("equiv.remainders_vs_fp32_master", a, b, exact=True)


def fraction(sec: Section):
    """Half the slice updated on the device (F=0.5) against all of it on the host (F=1),
    in fp32 (with bf16 params the two publishes round alike but not in the same place)."""
    cpu = sec.device == "cpu"
    steps = STEPS if cpu else 1
    a = train(sec, steps, dtype=torch.float32, offload_fraction=0.5)
    b = train(sec, steps, dtype=torch.float32)
    share = a["opt"].share is not None and a["opt"].share_numel > 0
    yield check("equiv.fraction_half_vs_one.split", share, a["opt"].share_numel, "> 0 kept")
    why = " (the same C++ Adam)" if cpu else " (the device share's fused AdamW)"
    yield from compare("equiv.fraction_half_vs_one", a, b, exact=cpu, why=why)


TASKS = (resident_build, offload_vs_zero2, overlap, accumulation, remainders, fraction)
