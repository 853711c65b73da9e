"""mp_offload: tensor-parallel GPT training with data-parallel ZeRO-Offload."""

__version__ = "0.1.0"
