"""mp_offload: tensor-parallel GPT training with data-parallel ZeRO-Offload."""

from .cpu_threads import wait_passively

# Before anything imports torch or the C++ extensions: idle OpenMP threads sleep.
wait_passively()

__version__ = "0.1.0"
