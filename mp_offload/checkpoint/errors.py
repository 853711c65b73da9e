"""The errors the checkpoint package raises, and how the ranks agree on one.

Both errors carry a one-line message meant for the user, naming the file or flag.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the mismatch."""


class ConversionError(ValueError):
    """A source that cannot be converted (GPT-2 import/export); the message says what differs."""


def raise_agreed(error: str | None) -> None:
    """Collective: raise the first rank's error (if any rank has one) on every rank.

    Checks run on every rank before this one collective, so a failure on one rank
    stops all of them with the same message instead of leaving the others hanging.
    """
    from ..runtime.distributed import first_error  # deferred: the offline tools never need it

    first = first_error(error)
    if first:
        raise CheckpointError(first)
