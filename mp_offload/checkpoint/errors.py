"""The two errors the checkpoint package raises; both carry a message meant for the user."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the mismatch."""


class ConversionError(ValueError):
    """A source that cannot be converted (GPT-2 import/export); the message says what differs."""
