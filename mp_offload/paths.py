"""The closest existing path to a misspelt one, for "did you mean" (no torch here)."""

from __future__ import annotations

import difflib
import os


def closest_existing(path: str, want_dir: bool = True) -> str | None:
    """An existing path (a directory when ``want_dir``) spelt like ``path``: from its
    deepest existing ancestor down, each missing part replaced by the closest name there
    (``runs/tiny/ckp`` -> ``runs/tiny_cpu/ckpt``); None when a part has no close match.
    Written the way ``path`` was (relative stays relative)."""
    parts = os.path.normpath(path).split(os.sep)
    base = os.sep if path.startswith(os.sep) else ""
    i = 0
    while i < len(parts) and os.path.exists(os.path.join(base, *parts[: i + 1]) or "."):
        i += 1
    if i == len(parts):
        return None  # it exists
    found = list(parts[:i])
    for part in parts[i:]:
        here = os.path.join(base, *found) if found else (base or ".")
        try:
            names = [n for n in os.listdir(here) if os.path.isdir(os.path.join(here, n))]
        except OSError:
            return None
        match = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
        if not match:
            return None
        found.append(match[0])
    guess = os.path.join(base, *found)
    return guess if os.path.isdir(guess) or not want_dir else None
