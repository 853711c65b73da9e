"""A flag's facts kept on its dataclass field: help, choices, valid range, and the field a
default is derived from. The parser (``config.build_parser``), the ``--config`` reader
and the range checks all read them from here, so each fact is written once.

Ranges: "lo.." means >= lo, "lo<.." means > lo, "lo..hi)" means lo <= x < hi,
"lo..hi]" means lo <= x <= hi.
"""

from __future__ import annotations

import dataclasses
import types
import typing


def flag_field(
    default,
    help: str,
    *,
    range: str | None = None,
    choices: tuple | None = None,
    derived_from: str | None = None,
):
    """A dataclass field that is also a ``--flag``. ``derived_from``: the field whose value
    fills this one's default, so an out-of-range value here is reported only when it is
    not caused by that one."""
    meta = {"help": help}
    for key, value in (("range", range), ("choices", choices), ("derived_from", derived_from)):
        if value is not None:
            meta[key] = value
    return dataclasses.field(default=default, metadata=meta)


def derived_field(help: str):
    """A field no flag sets: ``resolve`` computes it from the flags (and the world size)."""
    return dataclasses.field(default=None, metadata={"help": help, "derived": True})


def flag_fields(cls) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are flags (all but the derived ones)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("derived")]


def unwrap_optional(tp):
    """``X | None`` as ``X`` (any other type unchanged)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def range_problem(name: str, value, spec: str) -> str | None:
    """The line naming ``--name`` when ``value`` is outside ``spec``, else None."""
    lo_part, _, hi_part = spec.partition("..")
    strict = lo_part.endswith("<")
    lo = float(lo_part.rstrip("<"))
    hi = float(hi_part.rstrip(")]")) if hi_part else None
    closed = hi_part.endswith("]")
    ok = (value > lo if strict else value >= lo) and (
        hi is None or (value <= hi if closed else value < hi)
    )
    if ok:
        return None
    want = f"> {lo:g}" if strict else f">= {lo:g}"
    if hi is not None:
        want += f" and {'<=' if closed else '<'} {hi:g}"
    return f"--{name.replace('_', '-')} must be {want}, got {value}"


def field_problems(obj) -> list[str]:
    """Every field of dataclass ``obj`` outside its range or choices, one line each."""
    found = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None or isinstance(value, bool):
            continue
        spec, choices = f.metadata.get("range"), f.metadata.get("choices")
        if spec is not None:
            found[f.name] = range_problem(f.name, value, spec)
        elif choices and value not in choices:
            flag = "--" + f.name.replace("_", "-")
            found[f.name] = f"{flag} must be one of {', '.join(choices)}, got {value!r}"
    derived = {f.name: f.metadata.get("derived_from") for f in dataclasses.fields(obj)}
    return [p for name, p in found.items() if p and not found.get(derived[name])]
