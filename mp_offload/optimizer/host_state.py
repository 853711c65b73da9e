"""The host's optimizer state in its stored forms, each behind one face (docs/DESIGN.md §3).

``placement.py`` decides the dtypes; here each form steps and converts itself:
  * master: ``Fp32Master`` (fp32, with the low-precision param staging ``hi`` beside it,
    or none in fp32 where the master itself goes up), or ``SplitMaster``
    (``--store-param-remainders``: the int16 remainder ``lo`` beside the bf16 staging
    ``hi``; join_fp32(hi, lo) is the fp32 master exactly, so the host keeps no fp32 copy);
  * each moment: ``DenseMoment`` (fp32/bf16) or ``Q8Moment`` (8-bit: one Blockwise8 per
    Adam piece, its blocks restarting at each piece, so no block spans two kernel calls).
A form's ``saved()`` is what a checkpoint holds (fp32), ``target()``/``commit()`` load it.
A form that ``converts`` (remainders, 8-bit) also gives ``saved_chunks(n)``: its fp32 a
chunk of at most ``n`` elements at a time, so a save never holds the whole of it.
bf16 params made from an fp32 master use split_fp32's rounding when ``split`` (bf16 with
offload), so the device gets the same bits with or without remainders.
"""

from __future__ import annotations

import torch

from .placement import Q8_BLOCK, Placement


def _kernels():
    """The C++ Adam module, or None where the extension is not built."""
    try:
        from ..ops import cpu_adam

        return cpu_adam
    except ImportError:
        return None


def split_rounding(place: Placement) -> bool:
    """Whether bf16 params come from the master by the split rule (it needs the C++
    split; without the extension the torch fallback rounds to nearest even)."""
    return place.split_bf16 and _kernels() is not None


def initial_split(dtype: torch.dtype) -> bool:
    """The first bf16 params of every ZeRO run, offloaded or not, come from the fp32 weights
    by the split rule (where the extension is built): offload, no offload and any F then
    start from the same bits (the device proof compares their first losses exactly)."""
    return dtype == torch.bfloat16 and _kernels() is not None


def to_low(dst: torch.Tensor, src: torch.Tensor, split: bool) -> None:
    """``dst`` (bf16/fp16, any device) = ``src`` (any device, any float dtype) rounded, by
    the split rule when ``split``: the C++ split reads host memory, so a ``src`` already on
    the GPU (a model moved there before the optimizer was built) is brought down first."""
    if not split:
        dst.copy_(src)
        return
    src = src.reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()
    hi, _ = _kernels().split_fp32(src)
    dst.copy_(hi.view(dst.shape))


def nbytes(t) -> int:
    if t is None:
        return 0
    if isinstance(t, (Q8Moment, DenseMoment, Fp32Master, SplitMaster)):
        return t.nbytes
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------- moments
class DenseMoment:
    """An fp32 or bf16 moment: the tensor itself."""

    converts = False  # saved as it is stored

    def __init__(self, t: torch.Tensor):
        self.t = t

    def __getitem__(self, s: slice) -> torch.Tensor:
        return self.t[s]

    def numel(self) -> int:
        return self.t.numel()

    @property
    def nbytes(self) -> int:
        return self.t.numel() * self.t.element_size()

    def saved(self) -> torch.Tensor:
        return self.t

    def target(self) -> torch.Tensor:
        return self.t

    def commit(self, t: torch.Tensor) -> None:
        if t is not self.t:
            self.t.copy_(t)


class Q8Moment:
    """A block-wise 8-bit moment of ``numel`` host elements, one Blockwise8 per Adam piece
    (``pieces``: (offset, length)): each piece's codes are their own tensor (a Blockwise8
    view must end on a block or at its storage's end), the scales one tensor."""

    dtype = torch.uint8
    converts = True

    def __init__(self, kind: str, numel: int, scales: int, pieces):
        from ..ops.adam_args import Blockwise8

        self.kind, self._numel = kind, numel  # kind: "exp_avg" or "exp_avg_sq"
        self.scales = torch.zeros(scales)
        self.pieces: dict[int, Blockwise8] = {}
        at = 0
        for h, n in sorted(pieces):
            blocks = -(-n // Q8_BLOCK)
            codes = torch.zeros(n, dtype=torch.uint8)
            self.pieces[h] = Blockwise8(codes, self.scales[at : at + blocks])
            at += blocks
        if at != scales or sum(n for _, n in pieces) != numel:
            raise ValueError("Q8Moment: the pieces do not tile the placement's buffers")

    def numel(self) -> int:
        return self._numel

    @property
    def nbytes(self) -> int:
        return self._numel + 4 * self.scales.numel()

    def __getitem__(self, piece: slice):
        q = self.pieces[piece.start]
        if piece.stop - piece.start != q.codes.numel():
            raise ValueError(f"Q8Moment: [{piece.start}:{piece.stop}] is not an Adam piece")
        return q

    def saved(self) -> torch.Tensor:
        out = torch.empty(self._numel)
        for h, q in self.pieces.items():
            _kernels().dequantize_8bit(q, self.kind, out=out[h : h + q.codes.numel()])
        return out

    to_fp32 = saved

    def saved_chunks(self, n: int):
        """``saved()`` in order, at most ``n`` elements (rounded down to whole blocks) at a
        time: a chunk's blocks are whole blocks of its piece, so it decodes on its own."""
        from ..ops.adam_args import Blockwise8

        step = max(n // Q8_BLOCK, 1) * Q8_BLOCK
        for q in self.pieces.values():
            for a in range(0, q.codes.numel(), step):
                codes = q.codes[a : a + step]
                first = a // Q8_BLOCK
                part = Blockwise8(codes, q.scales[first : first + -(-codes.numel() // Q8_BLOCK)])
                yield _kernels().dequantize_8bit(part, self.kind)

    def target(self) -> torch.Tensor:
        return torch.zeros(self._numel)

    def commit(self, x: torch.Tensor) -> None:
        for h, q in self.pieces.items():
            _kernels().quantize_8bit(x[h : h + q.codes.numel()].contiguous(), self.kind, out=q)

    load_ = commit


def make_moment(place: Placement, key: str, pieces, tensor_of) -> DenseMoment | Q8Moment:
    """Moment ``key``'s host form as placed: ``tensor_of()`` wrapped, or a Q8Moment over
    the Adam ``pieces`` when its dtype is 8-bit."""
    buf = place.buffer(key)
    if buf.dtype != torch.uint8:
        return DenseMoment(tensor_of())
    return Q8Moment(key, buf.numel, place.buffer(key + ".scales").numel, pieces)


# ----------------------------------------------------------------------------- masters
class Fp32Master:
    """The fp32 master; ``hi``: the low-precision params Adam writes beside it (the staging
    that goes up; None where the master itself goes up)."""

    converts = False  # saved as it is stored

    def __init__(self, master: torch.Tensor, hi: torch.Tensor | None, split: bool):
        self.master, self.hi, self.split = master, hi, split
        k = _kernels()
        self.kernel = k.adam_step if k is not None else None

    @property
    def nbytes(self) -> int:
        return nbytes(self.master)

    def numel(self) -> int:
        return self.master.numel()

    def params(self, s: slice) -> tuple:
        return (self.master[s],)

    def outputs(self, s: slice, to: Fp32Master | None) -> dict:
        """The kernel's keyword outputs: the new low-precision params; with ``to`` (the
        other copy) the new master goes there too."""
        out = {} if to is None else dict(param_dst=to.master[s])
        dst = (to or self).hi
        if dst is not None:
            out["param_out"] = dst[s]
            if self.split:
                out["bf16_rounding"] = "split"
        return out

    @property
    def upload_source(self) -> torch.Tensor:
        return self.master if self.hi is None else self.hi

    def saved(self) -> torch.Tensor:
        return self.master

    def target(self) -> torch.Tensor:
        return self.master

    def commit(self, t: torch.Tensor) -> None:
        if t is not self.master:
            self.master.copy_(t)
        if self.hi is not None:  # the staging's params from the new master
            to_low(self.hi, self.master, self.split)


class SplitMaster:
    """The master as bf16 ``hi`` (the param staging that goes up) + int16 remainder ``lo``."""

    split = True
    converts = True

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor):
        self.lo, self.hi = lo, hi
        k = _kernels()
        if k is None:
            raise RuntimeError(
                "--store-param-remainders needs the C++ CPU Adam (mp_offload._cpu_adam)"
            )
        self.kernel = k.adam_step_remainder

    @property
    def master(self) -> torch.Tensor:
        return self.lo

    @property
    def nbytes(self) -> int:
        return nbytes(self.lo)

    def numel(self) -> int:
        return self.lo.numel()

    def params(self, s: slice) -> tuple:
        return (self.hi[s], self.lo[s])

    def outputs(self, s: slice, to: SplitMaster | None) -> dict:
        return {} if to is None else dict(param_hi_dst=to.hi[s], param_lo_dst=to.lo[s])

    @property
    def upload_source(self) -> torch.Tensor:
        return self.hi

    def saved(self) -> torch.Tensor:
        return _kernels().join_fp32(self.hi, self.lo)

    def saved_chunks(self, n: int):
        """``saved()`` in order, ``n`` elements at a time."""
        for a in range(0, self.lo.numel(), n):
            yield _kernels().join_fp32(self.hi[a : a + n], self.lo[a : a + n])

    def target(self) -> torch.Tensor:
        return torch.zeros(self.lo.numel())  # the padding, never written, stays 0

    def commit(self, t: torch.Tensor) -> None:
        _kernels().split_fp32(t, hi=self.hi, lo=self.lo)


class HostState:
    """One copy of the host slice's state: a master form and two moment forms, stepped one
    Adam call at a time (``kernel``: the form's C++ Adam, or torch's where it is not
    built; tests wrap it)."""

    KEYS = ("master", "exp_avg", "exp_avg_sq")

    def __init__(self, master, exp_avg, exp_avg_sq, kernel=None):
        self.master_form, self.exp_avg, self.exp_avg_sq = master, exp_avg, exp_avg_sq
        self.adam = kernel or master.kernel
        self.uploaded = None  # event: the last copy up that reads this copy's staging

    @property
    def master(self) -> torch.Tensor:
        return self.master_form.master

    @property
    def hi(self) -> torch.Tensor | None:
        return self.master_form.hi

    def form(self, key: str):
        return self.master_form if key == "master" else getattr(self, key)

    def step(self, s: slice, grad: torch.Tensor, dst: HostState | None = None, **hyper):
        """Adam on elements ``s``, writing their new low-precision params into the staging;
        with ``dst`` (the overlap's other copy) the new state and params go there and this
        copy stays untouched (the kernel's ``*_dst``: in-place bytes)."""
        if dst is not None and not self.out_of_place:  # torch fallback: copy, then in place
            for key in self.KEYS:  # (fp32 forms only: the others need the C++ kernels)
                getattr(dst, key)[s].copy_(getattr(self, key)[s])
            return dst.step(s, grad, **hyper)
        out = self.master_form.outputs(s, None if dst is None else dst.master_form)
        if dst is not None:
            out.update(exp_avg_dst=dst.exp_avg[s], exp_avg_sq_dst=dst.exp_avg_sq[s])
        m, v = self.exp_avg[s], self.exp_avg_sq[s]
        self.adam(*self.master_form.params(s), grad, m, v, **out, **hyper)

    @property
    def out_of_place(self) -> bool:
        """The kernel takes ``*_dst`` (the C++ Adam; torch's fallback does not)."""
        fn = getattr(self.adam, "__wrapped__", self.adam)
        return fn is self.master_form.kernel and fn is not None
