"""The host's optimizer state in its stored forms (docs/DESIGN.md §3, §5).

``placement.py`` decides the dtypes; ``HostState`` steps the state, and converts it to
and from the fp32 that checkpoints hold:
  * master: fp32; with ``--store-param-remainders`` the int16 remainder ``lo`` beside the
    bf16 param staging ``hi`` (the param that goes up): join_fp32(hi, lo) is the fp32
    master exactly, so the host keeps no fp32 copy and Adam writes no separate bf16 one;
  * each moment: an fp32/bf16 tensor, or 8-bit (``Q8Moment``: one Blockwise8 per Adam
    piece, its blocks restarting at each piece, so no block spans two kernel calls).
bf16 params made from an fp32 master all use split_fp32's rounding when
``Placement.split_bf16`` (bf16 with offload): with or without remainders, the device
gets the same bits.
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


def remainder_kernel():
    """adam_step_remainder: the master as hi + lo needs the C++ kernel."""
    if _kernels() is None:
        raise RuntimeError("--store-param-remainders needs the C++ CPU Adam (mp_offload._cpu_adam)")
    return _kernels().adam_step_remainder


def nbytes(t) -> int:
    if t is None:
        return 0
    if isinstance(t, Q8Moment):
        return t.nbytes
    return t.numel() * t.element_size()


class Q8Moment:
    """A block-wise 8-bit moment of ``numel`` host elements, one Blockwise8 per Adam piece
    (``pieces``: (offset, length)): each piece's codes are their own tensor (a Blockwise8
    view must end on a block or at its storage's end), the scales one tensor."""

    dtype = torch.uint8

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

    def to_fp32(self) -> torch.Tensor:
        out = torch.empty(self._numel)
        for h, q in self.pieces.items():
            _kernels().dequantize_8bit(q, self.kind, out=out[h : h + q.codes.numel()])
        return out

    def load_(self, x: torch.Tensor) -> None:
        for h, q in self.pieces.items():
            _kernels().quantize_8bit(x[h : h + q.codes.numel()].contiguous(), self.kind, out=q)


def allocate_moment(place: Placement, key: str, pieces, allocate):
    """Moment ``key``'s host buffer as placed: a tensor (``allocate(name)``), or a
    Q8Moment over the Adam ``pieces`` when its dtype is 8-bit."""
    buf = place.buffer(key)
    if buf.dtype != torch.uint8:
        return allocate(key)[0]
    return Q8Moment(key, buf.numel, place.buffer(key + ".scales").numel, pieces)


class HostState:
    """The host slice's master, moments and param staging (``hi``; None in fp32, where
    the master goes up), stepped one Adam piece at a time by ``adam`` (adam_step, or the
    device/torch Adam for state on the device)."""

    def __init__(self, master, hi, exp_avg, exp_avg_sq, adam, remainders: bool, split: bool):
        self.master, self.hi, self.exp_avg, self.exp_avg_sq = master, hi, exp_avg, exp_avg_sq
        self.adam, self.remainders, self.split = adam, remainders, split

    def step(self, h: int, n: int, grad: torch.Tensor, dst: HostState | None = None, **hyper):
        """Adam on elements [h, h + n) (one piece), writing their new low-precision params
        into the staging; with ``dst`` (the overlap's other copy) the new state and params
        go there and this copy stays untouched (the kernel's ``*_dst``: in-place bytes)."""
        to, s = dst or self, slice(h, h + n)
        m, v = self.exp_avg[s], self.exp_avg_sq[s]
        if dst is not None and not self.out_of_place:  # torch fallback: copy, then in place
            for k in ("master", "exp_avg", "exp_avg_sq") + ("hi",) * self.remainders:
                getattr(to, k)[s].copy_(getattr(self, k)[s])
            return to.step(h, n, grad, **hyper)
        moved = {}
        if dst is not None:
            moved = dict(exp_avg_dst=to.exp_avg[s], exp_avg_sq_dst=to.exp_avg_sq[s])
        if self.remainders:  # hi and lo: the staging is the master's top half
            if dst is not None:
                moved.update(param_hi_dst=to.hi[s], param_lo_dst=to.master[s])
            self.adam(self.hi[s], self.master[s], grad, m, v, **moved, **hyper)
            return None
        if dst is not None:
            moved["param_dst"] = to.master[s]
        out = None if to.hi is None else to.hi[s]
        rounding = dict(bf16_rounding="split") if self.split and out is not None else {}
        self.adam(self.master[s], grad, m, v, param_out=out, **rounding, **moved, **hyper)
        return None

    @property
    def out_of_place(self) -> bool:
        """The kernel takes ``*_dst`` (the C++ Adam; torch's fallback does not)."""
        k = _kernels()
        fn = getattr(self.adam, "__wrapped__", self.adam)
        return k is not None and fn in (k.adam_step, k.adam_step_remainder)

    def saved(self, key: str) -> torch.Tensor:
        """State ``key`` as a checkpoint holds it: the live tensor, or an fp32 temporary
        (the master joined from hi + lo; an 8-bit moment dequantized)."""
        t = getattr(self, key)
        if key == "master" and self.remainders:
            return _kernels().join_fp32(self.hi, self.master)
        return t.to_fp32() if isinstance(t, Q8Moment) else t

    def target(self, key: str) -> torch.Tensor:
        """Where a load writes ``key``: the live tensor, or an fp32 temporary for ``commit``."""
        t = getattr(self, key)
        converted = isinstance(t, Q8Moment) or (key == "master" and self.remainders)
        return torch.empty(t.numel()) if converted else t

    def commit(self, key: str, t: torch.Tensor) -> None:
        """Store a loaded fp32 ``t`` (from ``target``) into its stored form."""
        live = getattr(self, key)
        if t is live:
            return
        if isinstance(live, Q8Moment):
            live.load_(t)
        else:  # the master as hi + lo: the staging gets its split top half
            _kernels().split_fp32(t, hi=self.hi, lo=self.master)

    def refresh_staging(self) -> None:
        """After a load: the staging's low-precision params from the master (remainders:
        ``commit`` already wrote hi)."""
        if self.hi is None or self.remainders:
            return
        to_low(self.hi, self.master, self.split)
