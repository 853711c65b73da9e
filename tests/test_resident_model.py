"""A model already on its device: the optimizer built over it equals, in every legal mode,
the one built as pretrain_gpt.py builds it (the model on the CPU, its device handed to
the optimizer), bit for bit; and no CPU-only kernel is ever handed a device tensor on the
way there (``meta`` parameters stand in for a GPU on a machine without one)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import sys

import pytest
import torch
from helpers import tiny_gpt_config
from zero_helpers import mode_id

from mp_offload import OffloadAdamW
from mp_offload import parallel_state as ps
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.ops import cpu_adam, host_ops
from mp_offload.optimizer import host_state
from mp_offload.optimizer.options import MOMENT_DTYPES, OptimizerOptions, legal_modes

DEVICE = torch.device("cpu")  # the only real device here; the trap below uses "meta"
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip_grad=0.5)
MODES = legal_modes(bucket_size=900)  # ~18 buckets: partial offload splits, 8-bit blocks restart
STEPS = 2
_DEFAULTS = OptimizerOptions()
_NAMES = {v: k for k, v in MOMENT_DTYPES.items()}
_DT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "8bit"}
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@functools.cache
def _initial() -> GPTModel:
    """The one fp32 CPU model every run copies (the same weights on every path)."""
    torch.manual_seed(0)
    return GPTModel(GPTConfig(**tiny_gpt_config(num_layers=1)), tp_group=ps.ParallelGroup.single())


def _held(o: OptimizerOptions) -> list[torch.dtype]:
    """The dtypes a user's model may be in when handed over: fp32 (the optimizer casts),
    or already the mode's compute dtype."""
    return [torch.float32] if o.dtype == torch.float32 else [torch.float32, o.dtype]


CASES = [pytest.param(o, h, id=f"{mode_id(o)}-held_{_DT[h]}") for o in MODES for h in _held(o)]


def _every_field(o: OptimizerOptions) -> dict:
    """What pretrain_gpt.py's build_optimizer passes: every field of the options."""
    return {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}


def _user_keywords(o: OptimizerOptions, held: torch.dtype) -> dict:
    """The keywords a user writes for mode ``o``: the non-default ones, by their public
    names; no ``dtype`` where the parameters already are in it (the optimizer reads it)."""
    kw = {k: v for k, v in _every_field(o).items() if v != getattr(_DEFAULTS, k)}
    if held == o.dtype:
        kw.pop("dtype", None)
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if key in kw:
            kw[key] = _NAMES[kw[key]]
    if "micro_batches" in kw:
        kw["gradient_accumulation_steps"] = kw.pop("micro_batches")
    return kw


def _cpu_built(o: OptimizerOptions, held: torch.dtype, device=DEVICE):
    """As pretrain_gpt.py: the model stays on the CPU (in the weights the user holds) and
    the optimizer is told the device, which moves it there. One parameter group, as the
    user's: with ``model=`` the flat buffer follows the model's order, without it the
    groups', and only one group keeps the two layouts (and so the arithmetic) the same."""
    m = copy.deepcopy(_initial()).to(held)
    opt = OffloadAdamW(m.named_parameters(), **HP, **_every_field(o), model=m, device=device)
    return m, opt


def _resident(o: OptimizerOptions, held: torch.dtype, device=DEVICE):
    """As a library user: the model moved to its device first, then the optimizer over its
    parameters (the device read from them)."""
    m = copy.deepcopy(_initial()).to(device, held)
    return m, OffloadAdamW(m.parameters(), **HP, **_user_keywords(o, held))


def _train(m, opt, o: OptimizerOptions, device=DEVICE, steps=STEPS) -> list[torch.Tensor]:
    """The user's loop: ``steps`` steps of ``micro_batches`` backward passes each; the
    losses (on ``device``)."""
    g = torch.Generator().manual_seed(1)
    k, losses = o.micro_batches, []
    for _ in range(steps):
        for _ in range(k):
            t = torch.randint(0, 64, (2, m.cfg.seq_length + 1), generator=g).to(device)
            loss = m(t[:, :-1], t[:, 1:]).float().mean() / k
            opt.backward(loss)  # the loss scaling of fp16; a plain backward otherwise
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return losses


def _stored(opt) -> list[torch.Tensor]:
    """Every tensor of the optimizer's state as it is stored (the remainder halves, the
    8-bit codes and scales), the flat parameter buffer first."""
    z = opt.zero
    out = [z.flat]
    if z.device_side is not None:
        out += [z.device_side.master, z.device_side.exp_avg, z.device_side.exp_avg_sq]
    for st in z.host_side.states if z.host_side is not None else ():
        out += [st.master] + ([st.hi] if st.hi is not None else [])
        for form in (st.exp_avg, st.exp_avg_sq):
            if isinstance(form, host_state.Q8Moment):
                out += [q.codes for q in form.pieces.values()] + [form.scales]
            else:
                out.append(form.t)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits (NaN and -0 compared as bits, not as values)."""
    return t.view(_BITS[t.dtype]) if t.dtype in _BITS else t


def _equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize(("options", "held"), CASES)
def test_a_resident_model_equals_the_cpu_built_one(options, held):
    ma, a = _cpu_built(options, held)
    mb, b = _resident(options, held)
    assert b.options == a.options  # the user's keywords said the same mode
    for x, y in zip(_train(ma, a, options), _train(mb, b, options), strict=True):
        assert _equal_bits(x, y), "losses"
    full_a, full_b = a.state_dict()["state"], b.state_dict()["state"]  # (DPU: flushed)
    for key in full_a:
        for x, y in zip(full_a[key].values(), full_b[key].values(), strict=True):
            assert _equal_bits(x, y), key
    for (na, pa), pb in zip(ma.named_parameters(), mb.parameters(), strict=True):
        assert _equal_bits(pa.detach(), pb.detach()), na
    for x, y in zip(_stored(a), _stored(b), strict=True):
        assert _equal_bits(x, y)


# ---------------------------------------------------------------- the meta-device trap
# Nothing here can be a GPU tensor, so ``meta`` parameters stand in for one: the C++ faces
# (``mp_offload.ops.cpu_adam``, ``host_ops``; the only callers of the extensions, which
# take raw addresses) are wrapped to refuse any tensor not in host memory, and a copy out
# of a meta tensor, which has no data, brings zeros down instead of failing. The build and
# a few steps then run in full in every mode, and a kernel handed a device tensor (the
# rounding of a resident model's weights by the split kernel, say) fails the test.


def _tensors(x):
    """Every tensor in a kernel's argument (a tensor, a Blockwise8, a list, a dict...)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):  # Blockwise8 is a tuple
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


class KernelGuard:
    """Wraps every function of the C++ faces wherever ``mp_offload`` bound it; ``calls``:
    (name, phase) of each call, ``handed``: the non-CPU tensors a kernel was given."""

    FACES = (cpu_adam, host_ops)

    def __init__(self, monkeypatch):
        self.calls, self.handed, self.phase = [], [], "build"
        wrapped = {}
        for face in self.FACES:
            for name, fn in vars(face).items():
                if inspect.isfunction(fn) and fn.__module__ == face.__name__ and name[0] != "_":
                    wrapped[id(fn)] = self._wrap(name, fn)
        for mod in [m for n, m in sys.modules.items() if n.startswith("mp_offload")]:
            for name, fn in list(vars(mod).items()):
                if id(fn) in wrapped:
                    monkeypatch.setattr(mod, name, wrapped[id(fn)])

    def _wrap(self, name, fn):
        # No functools.wraps: a __wrapped__ would tell HostState the kernel is not the C++
        # one (``out_of_place``) and change the overlap's path.
        def guarded(*args, **kwargs):
            self.calls.append((name, self.phase))
            bad = [t.device for t in _tensors((args, kwargs)) if t.device.type != "cpu"]
            if bad:
                self.handed.append((name, self.phase, bad))
                raise AssertionError(f"the CPU-only {name} was handed a tensor on {bad[0]}")
            return fn(*args, **kwargs)

        return guarded

    def called(self, *names, phase=None) -> bool:
        return any(n in names and phase in (None, p) for n, p in self.calls)


def _stub_meta_copies(monkeypatch) -> list[str]:
    """Copies out of a meta tensor bring zeros down (torch has no data to copy); returns
    the list that names each such copy."""
    crossed = []

    def stub(name):
        real = getattr(torch.Tensor, name)

        def method(*args, **kwargs):
            try:
                return real(*args, **kwargs)
            except NotImplementedError as e:
                if "copy out of meta tensor" not in str(e):
                    raise
            crossed.append(name)
            zeros = [torch.zeros(a.shape, dtype=a.dtype) if _is_meta(a) else a for a in args]
            return real(*zeros, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, method)

    for name in ("copy_", "to", "cpu"):
        stub(name)
    return crossed


def _is_meta(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


@pytest.mark.parametrize("options", MODES, ids=mode_id)
def test_no_cpu_kernel_is_handed_a_device_tensor(options, monkeypatch):
    guard = KernelGuard(monkeypatch)
    crossed = _stub_meta_copies(monkeypatch)
    for held in _held(options):
        m = copy.deepcopy(_initial()).to("meta", held)
        opt = OffloadAdamW(m.parameters(), **HP, **_user_keywords(options, held))
        assert opt.zero.device.type == "meta" and opt.zero.flat.is_meta
        assert all(p.is_meta and p.dtype == options.dtype for p in m.parameters())
    assert guard.handed == []
    if options.dtype == torch.bfloat16:  # the first params by the split rule: the trap is live
        assert guard.called("split_fp32")
    if not options.offloaded:  # nothing of the state is on the host, so nothing else crosses
        assert {n for n, _ in guard.calls} <= {"split_fp32"}
        assert bool(crossed) == (options.dtype == torch.bfloat16)
        return
    assert crossed  # the master came down from the device
    # A step (two with DPU, whose second is the delayed one) of the last model built: the
    # gradients come down, the host Adam steps them and the params go back up.
    guard.phase = "train"
    _train(m, opt, options, device="meta", steps=1 + (options.dpu_warmup_steps is not None))
    opt.state_dict()
    assert guard.handed == []
    assert guard.called("adam_step", "adam_step_remainder", phase="train")
