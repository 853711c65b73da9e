"""--data-path and --split as numbers, without torch or numpy (the flags are checked
before pretrain_gpt.py imports torch; ``gpt_dataset`` uses and re-exports them)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def _number(text: str, what: str) -> float:
    """A finite, non-negative float, or ValueError saying what ``text`` was for."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} {text!r} must be a finite number >= 0")
    return value


def parse_split(split: str) -> list[float]:
    """ "969,30,1" or "0.9/0.05/0.05" -> normalised [train, valid, test] fractions
    (missing parts are 0). ValueError says which part is wrong."""
    texts = [s.strip() for s in split.replace("/", ",").split(",")]
    if len(texts) > 3:
        raise ValueError(f"{len(texts)} parts, at most 3 (train,valid,test)")
    parts = [_number(t, "part") for t in texts]
    if sum(parts) <= 0:
        raise ValueError("the parts sum to 0")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def parse_data_path(data_path: Sequence) -> tuple[list[str], list[float]]:
    """``[prefix]`` or ``[w1, prefix1, w2, prefix2, ...]`` -> (prefixes, normalised weights)."""
    data_path = list(data_path)
    if len(data_path) == 1:
        return [str(data_path[0])], [1.0]
    if not data_path or len(data_path) % 2:
        raise ValueError(f"data_path must be [prefix] or [weight, prefix, ...], got {data_path}")
    weights = [_number(str(w), "weight") for w in data_path[0::2]]
    prefixes = [str(p) for p in data_path[1::2]]
    if sum(weights) <= 0:
        raise ValueError(f"the weights sum to 0: {weights}")
    total = sum(weights)
    return prefixes, [w / total for w in weights]
