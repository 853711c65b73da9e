"""Host buffers for the offload path: exact-size pinned memory, and worker threads' device.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator,
which rounds every block up to a power of two: a 13B one-GPU plan would pin ~257 GiB
instead of ~241. Here the tensor is allocated pageable at its exact size and then
registered with the driver (cudaHostRegister), which pins exactly those bytes and lets
copies from and to it run asynchronously.
"""

from __future__ import annotations

import weakref

import torch


def _cuda_register(t: torch.Tensor, nbytes: int) -> None:
    cudart = torch.cuda.cudart()
    ptr = t.data_ptr()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {nbytes} bytes failed (error {int(err)}): "
            f"not enough lockable host memory? (ulimit -l)"
        )
    # Unregister before the memory goes back to the allocator.
    weakref.finalize(t, cudart.cudaHostUnregister, ptr)


def host_empty(numel: int, dtype: torch.dtype, pin: bool, register=_cuda_register) -> torch.Tensor:
    """An uninitialised CPU tensor of exactly ``numel`` elements, page-locked if ``pin``.

    ``register(tensor, nbytes)`` pins it (the driver call on CUDA; a test passes a fake).
    """
    t = torch.empty(numel, dtype=dtype)
    if pin and numel > 0:
        register(t, numel * t.element_size())
    return t


def set_thread_device(device: torch.device) -> None:
    """Bind the calling (new) thread to the rank's GPU before it makes any CUDA call.

    A thread starts on device 0; a CUDA call there creates a context on GPU 0 (~0.3-0.5
    GiB) for every rank of the node that is not rank 0.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
