"""mp_offload: tensor-parallel GPT training with data-parallel ZeRO-Offload."""

from .runtime.cpu_threads import wait_passively

# Before anything imports torch or the C++ extensions: idle OpenMP threads sleep.
wait_passively()

__version__ = "0.1.0"


def __getattr__(name: str):
    """``mp_offload.OffloadAdamW``, imported on first use (``import mp_offload`` stays
    free of torch, so flag errors and the OpenMP policy come first)."""
    if name == "OffloadAdamW":
        from .optimizer.offload_adamw import OffloadAdamW

        return OffloadAdamW
    raise AttributeError(f"module 'mp_offload' has no attribute {name!r}")


__all__ = ["OffloadAdamW", "__version__"]
