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

CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation


def registration_error(nbytes: int, code: int, text: str) -> str:
    """The line for a failed cudaHostRegister: what failed and the CUDA error itself.

    Only an allocation failure can come from the lockable-memory limit; any other code
    (an invalid or already registered range, a broken context) says so instead.
    """
    line = (
        f"cudaHostRegister of {nbytes:,} bytes of host staging failed: CUDA error {code} ({text})"
    )
    if code == CUDA_ERROR_MEMORY_ALLOCATION:
        line += "; the driver could not page-lock them (host memory, or the locked-memory limit)"
    return line


def _cuda_register(t: torch.Tensor, nbytes: int) -> None:
    cudart = torch.cuda.cudart()
    ptr = t.data_ptr()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)  # a cudaError enum
    if int(err) != 0:
        raise RuntimeError(registration_error(nbytes, int(err), cudart.cudaGetErrorString(err)))
    # Unregister before the memory goes back to the allocator; not at interpreter exit,
    # where the CUDA context may already be gone (torch's own host stager does the same).
    weakref.finalize(t, cudart.cudaHostUnregister, ptr).atexit = False


def host_empty(numel: int, dtype: torch.dtype, pin: bool, register=_cuda_register) -> torch.Tensor:
    """An uninitialised CPU tensor of exactly ``numel`` elements, page-locked if ``pin``.

    ``register(tensor, nbytes)`` pins it (the driver call on CUDA; a test passes a fake).
    """
    t = torch.empty(numel, dtype=dtype)
    if pin and numel > 0:
        register(t, numel * t.element_size())
    return t


def resolve_device(device) -> torch.device:
    """``device`` with its index: a bare ``cuda`` means the current CUDA device.

    Resolved once where the device enters (the optimizer) so every thread that binds it
    later names the same GPU; ``torch.cuda.set_device`` refuses a device without an index.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def set_thread_device(device: torch.device) -> None:
    """Bind the calling (new) thread to the rank's GPU before it makes any CUDA call.

    A thread starts on device 0; a CUDA call there creates a context on GPU 0 (~0.3-0.5
    GiB) for every rank of the node that is not rank 0.
    """
    device = resolve_device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
