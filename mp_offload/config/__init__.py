"""A run's configuration: every flag of ``pretrain_gpt.py`` and its checks, without torch.

schema.py   the dataclasses (``Args`` and one per area), each field with its flag's
            help, choices and range beside it
fields.py   how a field carries its flag (``flag_field``), read by argparse and the checks
flags.py    argparse built from the schema; did-you-mean; the cross-field checks
            (``config_problems``, ``validate``) and ``resolve`` (the final values)
file.py     ``--config`` YAML/JSON files: unknown keys and bad values named
help.py     the ``--help`` formatter
"""

import importlib

# The public names, each from its module. Loaded on first use: the model's config
# (model/gpt_config.py) reads fields.py of this package, and flags.py reads the model's
# config, so importing flags.py here would close a circle.
_PUBLIC = {
    "flags": (
        "build_parser",
        "checked",
        "config_problems",
        "config_warnings",
        "given_flags",
        "parse",
        "parse_args",
        "parse_with_config",
        "resolve",
        "unknown_flag_problems",
        "validate",
    ),
    "schema": ("CONFIG_CLASSES", "Args", "ConfigError", "LoggingConfig"),
}
_WHERE = {name: module for module, names in _PUBLIC.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
