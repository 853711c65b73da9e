"""``--config run.yaml``: a YAML file of flag values, read as the parser's defaults (so
flags given on the command line win), and the run's resolved configuration written back
in the same form (``write_run_config``: ``<--save>/config.yaml``). Every mistake in a
file is a ConfigError naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing

from .fields import flag_fields, unwrap_optional
from .schema import CONFIG_CLASSES, Args, ConfigError


def _fields_by_name() -> dict[str, tuple[str, dataclasses.Field, object]]:
    """field name -> (group, field, its type without ``| None``), over every group."""
    out = {}
    for group, cls in CONFIG_CLASSES.items():
        hints = typing.get_type_hints(cls)
        for f in flag_fields(cls):
            out[f.name] = (group, f, hints[f.name])
    return out


def _coerce(where: str, value, tp, choices):
    """A YAML value as the flag's type; ConfigError (naming ``where``) if it is not one."""
    optional = unwrap_optional(tp) is not tp
    tp = unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where} cannot be empty (null)")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if typing.get_origin(tp) is list:
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, list) or not items:
            raise ConfigError(f"{where} must be a list (or words), got {value!r}")
        return [str(v) for v in items]
    if isinstance(value, (bool, list, dict)):
        raise ConfigError(f"{where} must be a single {tp.__name__}, got {value!r}")
    try:
        # YAML reads 3e-4 as a string, so numbers are converted as argparse would.
        out = tp(value) if tp is not int or not isinstance(value, float) else value
        if tp is int and not isinstance(out, int):
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(
            f"{where} must be {'an' if tp is int else 'a'} {tp.__name__}, got {value!r}"
        ) from None
    if choices and out not in choices:
        raise ConfigError(f"{where} must be one of {', '.join(choices)}, got {out!r}")
    return out


def load_config_file(path: str) -> dict[str, object]:
    """The ``--config`` file as parser defaults: {"group.field": value}. ConfigError names
    the file and the key: unknown keys, wrong types, a file that is not a YAML mapping."""
    try:
        import yaml
    except ImportError:
        raise ConfigError("--config needs PyYAML (pip install pyyaml)") from None
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        first = (str(e).strip().splitlines() or ["parse error"])[0]
        raise ConfigError(f"--config {path}: not valid YAML ({first})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config {path}: expected a mapping of flag names to values, got "
            f"a {type(data).__name__}"
        )
    fields = _fields_by_name()
    out = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in fields:
            near = difflib.get_close_matches(name, fields, n=1)
            hint = f"; did you mean {near[0].replace('_', '-')!r}?" if near else ""
            raise ConfigError(
                f"--config {path}: unknown key {key!r} (not a flag of pretrain_gpt.py{hint})"
            )
        group, f, tp = fields[name]
        out[f"{group}.{name}"] = _coerce(
            f"--config {path}: key {key!r}", value, tp, f.metadata.get("choices")
        )
    return out


def dump_config(args: Args) -> str:
    """Every field of ``args`` as YAML that ``--config`` reads back: the run's resolved
    configuration (its --config file, then its flags, then derived values)."""
    import yaml

    lines = [
        "# The configuration of this run (its --config file and flags, resolved).",
        "# Rerun it: pretrain_gpt.py --config <this file> [flags that override it]",
    ]
    for group, cls in CONFIG_CLASSES.items():
        values = {f.name: getattr(getattr(args, group), f.name) for f in flag_fields(cls)}
        if group == "train" and values.get("train_samples") is not None:
            values["train_iters"] = None  # derived from train_samples; both would clash
        if group == "model":  # left to follow --hidden-size / --seq-length when they are
            if values["ffn_hidden_size"] == 4 * values["hidden_size"]:  # overridden
                values["ffn_hidden_size"] = None
            if values["max_position_embeddings"] == values["seq_length"]:
                values["max_position_embeddings"] = None
        lines.append(f"# {group}")
        lines.append(
            yaml.safe_dump(
                values, sort_keys=False, default_flow_style=False, allow_unicode=True
            ).rstrip()
        )
    return "\n".join(lines) + "\n"


def write_run_config(args: Args, log=print) -> str | None:
    """``<--save>/config.yaml``: the resolved configuration, readable by ``--config``.
    Returns an error message instead of raising (the caller makes every rank agree)."""
    if not args.ckpt.save:
        return None
    path = os.path.join(args.ckpt.save, "config.yaml")
    try:
        text = dump_config(args)
    except ImportError:
        log("PyYAML is not installed: no config.yaml written (pip install pyyaml)")
        return None
    try:
        os.makedirs(args.ckpt.save, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        return f"--save {args.ckpt.save}: cannot write config.yaml ({e.strerror or e})"
    log(f"configuration written to {path} (rerun: pretrain_gpt.py --config {path})")
    return None
