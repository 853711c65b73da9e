"""Checks of a run's inputs on every rank before any process group starts.

After the flags (config/flags.py), everything else that can be checked without the other
ranks: the --data-path files, the tokenizer files (the tokenizer is loaded here, once,
and handed to the data pipeline), and the places the run will write its logs. Every
problem is one line naming the flag and the fix; the job prints them once and exits 2.
"""

from __future__ import annotations

import os

from .config import Args, ConfigError
from .data.checks import DataError, load_tokenizer, prefix_problems


def _writable_file_problem(flag: str, path: str) -> str | None:
    """Can ``path`` be created (with its missing directories) or appended to?"""
    if os.path.isdir(path):
        return f"{flag} {path}: is a directory; give a file name"
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            return f"{flag} {path}: cannot write {path} (permission denied)"
        return None
    return _directory_problem(flag, os.path.dirname(os.path.abspath(path)), path)


def _directory_problem(flag: str, path: str, given: str | None = None) -> str | None:
    """Can ``path`` be used (or created) as a directory? ``given``: the flag's value, when
    ``path`` is the directory of a file it names."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{flag} {given or path}: {probe} is a file, not a directory"
    if not os.access(probe, os.W_OK):
        return f"{flag} {given or path}: cannot write {probe} (permission denied)"
    return None


def _output_problems(args: Args) -> list[str]:
    found = []
    if args.log.log_json:
        found.append(_writable_file_problem("--log-json", args.log.log_json))
    for flag, path in (
        ("--tensorboard-dir", args.log.tensorboard_dir),
        ("--data-cache-dir", args.data.data_cache_dir),
    ):
        if path:
            found.append(_directory_problem(flag, path))
    return [p for p in found if p]


def _data_prefixes(args: Args) -> list[str]:
    from .data.gpt_dataset import parse_data_path

    return parse_data_path(args.data.data_path)[0]


def check_inputs(args: Args):
    """ConfigError with one line per problem of the run's files; else the tokenizer of
    --data-path (None for mock data and the default corpus, which brings its own)."""
    from .runtime.stopping import stop_grace_problem

    d = args.data
    found = _output_problems(args) + [p for p in (stop_grace_problem(),) if p]
    tokenizer = None
    if not d.mock_data and d.data_path is not None:
        for prefix in _data_prefixes(args):
            found += prefix_problems(prefix)
        try:
            tokenizer = load_tokenizer(d, args.model.vocab_size)
        except DataError as e:
            found += str(e).splitlines()
    if found:
        raise ConfigError("\n".join(found))
    return tokenizer
