"""Checks of a run's data and tokenizer, each problem one line that names the flag.

``prefix_problems`` (is --data-path a usable .bin/.idx pair?) and ``load_tokenizer``
run on every rank before any process group starts; ``check_token_ids`` (does every
token id of the data fit the tokenizer's vocabulary?) reads the whole .bin once, so
one rank runs it after start-up and its answer is cached next to the index cache,
keyed by the .bin's size and modification time.
"""

from __future__ import annotations

import difflib
import json
import os

import numpy as np

from ..runtime.distributed import StartupError
from .indexed_dataset import MMapIndexedDataset, data_file_path, index_file_path


class DataError(StartupError):
    """The data or tokenizer cannot be used as given; the message names file and flag."""


def _near_prefix(prefix: str) -> str:
    """ ": did you mean X?" for a prefix with no files, from the .idx files beside it."""
    directory = os.path.dirname(prefix) or "."
    if not os.path.isdir(directory):
        return f" (there is no directory {directory})"
    base = os.path.basename(prefix)
    stems = sorted(f[:-4] for f in os.listdir(directory) if f.endswith(".idx"))
    close = [s for s in stems if s.startswith(base)] or difflib.get_close_matches(base, stems, 1)
    return f": did you mean {os.path.join(os.path.dirname(prefix), close[0])}?" if close else ""


def prefix_problems(prefix: str) -> list[str]:
    """What is wrong with one --data-path prefix (empty: nothing): the pair of files, their
    permissions, and the index's consistency with the data (a cheap memory map)."""
    flag = f"--data-path {prefix}"
    if prefix.endswith((".bin", ".idx")):
        return [f"{flag}: give the prefix {prefix[:-4]} (without {prefix[-4:]})"]
    if os.path.isdir(prefix):
        stems = sorted(f[:-4] for f in os.listdir(prefix) if f.endswith(".idx"))
        hint = f", e.g. {os.path.join(prefix, stems[0])}" if stems else "; it holds no .idx files"
        return [f"{flag}: is a directory; give the prefix of a .bin/.idx pair{hint}"]
    paths = (data_file_path(prefix), index_file_path(prefix))
    missing = [p for p in paths if not os.path.isfile(p)]
    if len(missing) == 2:
        return [
            f"{flag}: no {paths[0]} or {paths[1]} (tools/preprocess_data.py writes "
            f"them){_near_prefix(prefix)}"
        ]
    if missing:
        return [
            f"{flag}: {missing[0]} is missing (the .bin and .idx of "
            f"tools/preprocess_data.py belong together)"
        ]
    unreadable = [p for p in paths if not os.access(p, os.R_OK)]
    if unreadable:
        return [f"{flag}: cannot read {unreadable[0]} (permission denied)"]
    try:
        ds = MMapIndexedDataset(prefix)
    except (OSError, ValueError) as e:
        return [f"{flag}: {e}"]
    if not int(ds.sizes.astype(np.int64).sum()):
        return [f"{flag}: the dataset holds no tokens"]
    return []


def tokenizer_description(d, vocab_size: int | None = None) -> str:
    """The flags that chose the tokenizer (``vocab_size``: NullTokenizer's --vocab-size)."""
    if d.tokenizer_type == "NullTokenizer":
        return f"--tokenizer-type NullTokenizer --vocab-size {vocab_size}"
    if d.tokenizer_type == "GPT2BPETokenizer":
        return f"--vocab-file {d.vocab_file} --merge-file {d.merge_file}"
    return f"--tokenizer-type {d.tokenizer_type} --tokenizer-model {d.tokenizer_model}"


def _tokenizer_file_problems(d) -> list[str]:
    files = {
        "SentencePieceTokenizer": [("--tokenizer-model", d.tokenizer_model)],
        "HuggingFaceTokenizer": [("--tokenizer-model", d.tokenizer_model)],
        "GPT2BPETokenizer": [("--vocab-file", d.vocab_file), ("--merge-file", d.merge_file)],
    }.get(d.tokenizer_type, [])
    out = []
    for flag, path in files:
        if path is None:
            continue  # the flag checks say which flag is needed
        if d.tokenizer_type == "HuggingFaceTokenizer" and os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.exists(path):
            out.append(f"{flag} {path}: no such file")
        elif not os.path.isfile(path):
            out.append(f"{flag} {path}: is not a file")
        elif not os.access(path, os.R_OK):
            out.append(f"{flag} {path}: cannot read it (permission denied)")
    return out


def load_tokenizer(d, vocab_size: int):
    """The run's tokenizer from its DataConfig (``vocab_size``: NullTokenizer's); DataError
    naming the flag and the file when it is missing or is not what the type reads."""
    from .tokenizer import build_tokenizer

    problems = _tokenizer_file_problems(d)
    if problems:
        raise DataError("\n".join(problems))
    try:
        return build_tokenizer(
            d.tokenizer_type,
            d.tokenizer_model,
            vocab_size=vocab_size,
            vocab_file=d.vocab_file,
            merge_file=d.merge_file,
        )
    except Exception as e:  # noqa: BLE001 - sentencepiece/tokenizers raise anything
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if text.startswith("--"):
            raise DataError(text) from None
        raise DataError(
            f"{tokenizer_description(d, vocab_size)}: cannot load it as a "
            f"{d.tokenizer_type} ({text})"
        ) from None


def _cache_path(prefix: str, cache_dir: str | None) -> str:
    directory = cache_dir or os.path.dirname(os.path.abspath(prefix))
    return os.path.join(directory, f"{os.path.basename(prefix)}_token_range.json")


def token_range(prefix: str, cache_dir: str | None = None) -> tuple[int, int]:
    """(smallest, largest) token id of ``prefix``'s .bin ((0, -1) when empty): one pass over
    the memory map, cached under ``cache_dir`` (default: beside the data) and keyed by the
    .bin's size and modification time, so a rewritten file is read again."""
    bin_path = data_file_path(prefix)
    st = os.stat(bin_path)
    key = {"bin_size": st.st_size, "bin_mtime_ns": st.st_mtime_ns}
    cache = _cache_path(prefix, cache_dir)
    try:
        with open(cache) as f:
            rec = json.load(f)
        if {k: rec[k] for k in key} == key:
            return int(rec["min_id"]), int(rec["max_id"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    dtype = MMapIndexedDataset(prefix).dtype
    lo, hi = 0, -1
    if st.st_size:
        tokens = np.memmap(bin_path, dtype=dtype, mode="r")
        step = 1 << 26  # bounded temporaries whatever the file size
        chunks = [tokens[i : i + step] for i in range(0, len(tokens), step)]
        lo = int(min(c.min() for c in chunks))
        hi = int(max(c.max() for c in chunks))
        del tokens, chunks
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = f"{cache}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(dict(key, min_id=lo, max_id=hi), f)
        os.replace(tmp, cache)
    except OSError:
        pass  # an unwritable cache directory only costs the pass next time
    return lo, hi


def check_token_ids(
    prefixes,
    vocab_size: int,
    tokenizer: str,
    cache_dir: str | None = None,
    null_eod: int | None = None,
) -> list[str]:
    """DataError when a prefix holds a token id outside [0, vocab_size): data made with
    another tokenizer (at TP=1 the embedding would raise an IndexError; at TP>1 the
    vocabulary-parallel embedding would silently read zeros). Returns warnings: with a
    NullTokenizer (``null_eod``: its EOD id), data whose largest id is not that EOD was
    made with another tokenizer or another --vocab-size (NullTokenizer data ends each
    document with its EOD), and would train on a vocabulary it does not use."""
    warnings = []
    for prefix in prefixes:
        lo, hi = token_range(prefix, cache_dir)
        if null_eod is not None and 0 <= hi < null_eod:
            warnings.append(
                f"warning: {data_file_path(prefix)}: its largest token id is {hi}, not "
                f"{null_eod}, the end-of-document id of {tokenizer}: made with another "
                f"tokenizer or --vocab-size? (give that tokenizer, or --vocab-size {hi} "
                f"for NullTokenizer data)"
            )
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise DataError(
                f"{data_file_path(prefix)}: token id {bad} is outside the vocabulary of "
                f"{vocab_size} ids of {tokenizer}: the data was made with another tokenizer "
                f"(give that one, or run tools/preprocess_data.py again with this one)"
            )
    return warnings
