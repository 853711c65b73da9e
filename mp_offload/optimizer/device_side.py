"""The device side: fp32 master, Adam moments and fp32 gradient kept on the rank's device.

Without offload (ZeRO-2) it owns every bucket; with ``--optimizer-offload-fraction F``
it owns the buckets ``placement.py`` keeps on the device (about 1 - F of the slice) and
the host side the rest. Each reduced chunk is copied (first micro-batch) or added into
its fp32 gradient; the step is one Adam over its whole range (torch's fused AdamW on a
GPU; the C++ Adam where the "device" is the CPU, as the host side steps, so offload and
no offload do the same arithmetic there); the publish rounds its master into the flat
parameter buffer.
"""

from __future__ import annotations

import torch

from .adam_math import device_adam
from .placement import STATE, allocate
from .side import Micro, Side


def _adam(device: torch.device, exp_avg_dtype, exp_avg_sq_dtype):
    if device.type == "cpu":
        try:
            from ..ops.cpu_adam import adam_step

            return adam_step
        except ImportError:  # not built: torch's ops, still correct
            pass
    return device_adam(device, exp_avg_dtype, exp_avg_sq_dtype)


class DeviceSide(Side):
    def __init__(self, layout, place, device: torch.device, streams, prefix: str):
        """``prefix``: the placement's names of its buffers ("" without offload, "share."
        with partial offload)."""
        super().__init__(layout, place.device_range, streams)
        self.names = {k: prefix + k for k in STATE}
        for k in STATE:
            setattr(self, k, allocate(place.buffer(self.names[k]), device)[0])
        self.adam = _adam(device, self.exp_avg.dtype, self.exp_avg_sq.dtype)
        self._segs = self._segments(self.offset, self.numel)

    # ------------------------------------------------------------------ gradients
    def receive(self, b, out: torch.Tensor, token, micro: Micro):
        if micro.last and micro.whole:
            self.chunk_norm(b, out)  # on the device: no pass over the sum later
        lo = b.slice_offset - self.offset
        grad = self.grads[lo : lo + b.chunk]
        grad.copy_(out) if micro.first else grad.add_(out)
        if micro.last and not micro.whole:
            self.chunk_norm(b, grad)
        return None

    # ----------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, hyper) -> None:
        """AdamW over the side (queued on the current stream: asynchronous on a GPU)."""
        with self.phase("Adam (device side)"):
            self._step(hyper)

    def _step(self, hyper) -> None:
        for c in hyper.calls(self._segs):
            s = slice(c.lo, c.hi)
            self.adam(
                self.master[s],
                self.grads[s],
                self.exp_avg[s],
                self.exp_avg_sq[s],
                **hyper.kwargs(c),
            )

    def publish(self, flat: torch.Tensor, dp_rank: int) -> None:
        """Copy (and round) the new master of each bucket into the flat parameter buffer."""
        for b in self.buckets:
            lo, hi = b.chunk_range(dp_rank)
            flat[lo:hi].copy_(self.master[b.slice_offset - self.offset :][: b.chunk])

    # ----------------------------------------------------------------- checkpoint
    def parts(self, key: str) -> torch.Tensor:
        return getattr(self, key)

    def target(self, key: str) -> torch.Tensor:
        return getattr(self, key)

    def commit(self, key: str, t: torch.Tensor) -> None:
        pass  # ``target`` is the live tensor

    def buffers(self) -> list[tuple[str, object]]:
        """(placement name, tensor) of every buffer this side holds."""
        return [(self.names[k], getattr(self, k)) for k in STATE]
