"""A zero-download default corpus: the Python standard library's own source files.

``prepare_default_corpus(cache_dir)`` collects the stdlib's .py files (sorted,
tests and site-packages excluded), trains a SentencePiece BPE tokenizer on
them and preprocesses them (one document per file, EOD appended) into
``{cache_dir}/stdlib_text_document.bin/.idx``. Results are cached: a stamp
file recording the parameters and Python version is written last, so a
killed run never leaves a cache that looks valid.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import sysconfig
import time

from .indexed_dataset import MMapIndexedDataset, exists
from .preprocess import PreprocessStats, preprocess
from .tokenizer_training import train_sentencepiece

_FORMAT = 2  # bumped: documents are shuffled
_SKIP_DIRS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "lib-dynload",
}
DEFAULT_VOCAB_SIZE = 4096
# The whole 3.11 stdlib minus tests is ~12 MB; 16 MiB keeps all of it and
# tokenises in a few seconds on 2 cores.
DEFAULT_MAX_BYTES = 16 << 20


def _default_log(msg: str) -> None:
    print(f"[default corpus] {msg}", flush=True)


def stdlib_source_files(max_bytes: int) -> list[tuple[str, str]]:
    """(relative path, text) of stdlib .py files in sorted order, up to max_bytes in total."""
    root = sysconfig.get_paths()["stdlib"]
    out, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorted in place so the walk order (and thus the corpus) is deterministic.
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-")
        )
        for name in sorted(filenames):
            # _sysconfigdata* describes this particular build, not the language.
            if not name.endswith(".py") or name.startswith("_sysconfigdata"):
                continue
            path = os.path.join(dirpath, name)
            try:
                with open(path, "rb") as f:
                    raw = f.read()
                text = raw.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if not text.strip():
                continue
            if total + len(raw) > max_bytes:
                return out
            out.append((os.path.relpath(path, root).replace(os.sep, "/"), text))
            total += len(raw)
    return out


@contextlib.contextmanager
def _lock(path: str):
    """Inter-process lock so concurrent first runs do not build the cache twice."""
    try:
        import fcntl
    except ImportError:  # non-POSIX: best effort without a lock
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _params(vocab_size: int, max_bytes: int) -> dict:
    import sentencepiece

    return {
        "format": _FORMAT,
        "vocab_size": int(vocab_size),
        "max_bytes": int(max_bytes),
        "python": sys.version,
        "stdlib": sysconfig.get_paths()["stdlib"],
        "sentencepiece": sentencepiece.__version__,
    }


def _cached(stamp: str, params: dict, prefix: str, model: str) -> bool:
    try:
        with open(stamp) as f:
            if json.load(f).get("params") != params:
                return False
        if not (exists(prefix) and os.path.isfile(model)):
            return False
        MMapIndexedDataset(prefix)  # cheap (memmap) consistency check of .idx/.bin
        return True
    except (OSError, ValueError):
        return False


def prepare_default_corpus(
    cache_dir: str,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_bytes: int = DEFAULT_MAX_BYTES,
    log=_default_log,
) -> tuple[str, str]:
    """Build (or reuse) the stdlib corpus; returns ``(data_prefix, tokenizer_model_path)``.

    data_prefix is ``{cache_dir}/stdlib_text_document`` (pass it as the data
    path); the tokenizer is ``{cache_dir}/stdlib_sp.model`` (SentencePiece).
    """
    cache_dir = os.path.abspath(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    prefix = os.path.join(cache_dir, "stdlib_text_document")
    model_prefix = os.path.join(cache_dir, "stdlib_sp")
    model = model_prefix + ".model"
    stamp = os.path.join(cache_dir, "stdlib_corpus.json")
    params = _params(vocab_size, max_bytes)
    if _cached(stamp, params, prefix, model):
        return prefix, model

    with _lock(os.path.join(cache_dir, ".stdlib_corpus.lock")):
        if _cached(stamp, params, prefix, model):  # another process just built it
            return prefix, model
        with contextlib.suppress(FileNotFoundError):
            os.remove(stamp)  # invalidate before touching any output
        t0 = time.perf_counter()
        log(f"building in {cache_dir} (first use; cached afterwards)")
        files, nbytes = _shuffled_sources(max_bytes, log)
        jsonl = _write_jsonl(os.path.join(cache_dir, "stdlib.jsonl"), files)

        t1 = time.perf_counter()
        train_sentencepiece([t for _, t in files], model_prefix, vocab_size, model_type="bpe")
        log(f"trained SentencePiece BPE (vocab {vocab_size}) in {time.perf_counter() - t1:.1f}s")

        stats = _tokenize(jsonl, os.path.join(cache_dir, "stdlib"), model)
        log(f"tokenized {stats.documents} documents, {stats.tokens} tokens in {stats.seconds:.1f}s")
        _write_stamp(stamp, params, stats, nbytes)  # last: its presence marks a complete cache
        log(f"done in {time.perf_counter() - t0:.1f}s: {prefix}.bin/.idx, {model}")
    return prefix, model


def _shuffled_sources(max_bytes: int, log) -> tuple[list[tuple[str, str]], int]:
    """The stdlib's files (``stdlib_source_files``) in a seeded random order, and their
    size in bytes."""
    files = stdlib_source_files(max_bytes)
    if not files:
        raise RuntimeError(f"no Python sources found under {sysconfig.get_paths()['stdlib']}")
    # Seeded shuffle: the train/valid/test split takes contiguous document ranges, and
    # in path order the validation set would be a few packages at the end of the
    # alphabet (xml, zipfile, ...) rather than a sample of the whole library.
    random.Random(1234).shuffle(files)
    nbytes = sum(len(t.encode("utf-8")) for _, t in files)
    log(f"collected {len(files)} stdlib files, {nbytes / 1e6:.1f} MB")
    return files, nbytes


def _write_jsonl(jsonl: str, files: list[tuple[str, str]]) -> str:
    """One JSON line per file (its path and text), written under a temporary name first."""
    tmp = f"{jsonl}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for rel, text in files:
            f.write(json.dumps({"path": rel, "text": text}, ensure_ascii=False) + "\n")
    os.replace(tmp, jsonl)
    return jsonl


def _tokenize(jsonl: str, output_prefix: str, model: str) -> PreprocessStats:
    """The corpus as a dataset of one document per file, EOD appended; its PreprocessStats."""
    return preprocess(
        [jsonl],
        output_prefix,
        "SentencePieceTokenizer",
        tokenizer_model=model,
        json_keys=["text"],
        append_eod=True,
        workers=1,
        log_interval=0,
        log=_NullLog(),
    )


def _write_stamp(stamp: str, params: dict, stats: PreprocessStats, nbytes: int) -> None:
    """The cache's parameters and what was built, replacing ``stamp`` in one rename."""
    tmp = f"{stamp}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(
            {
                "params": params,
                "documents": stats.documents,
                "tokens": stats.tokens,
                "bytes": nbytes,
            },
            f,
            indent=1,
        )
    os.replace(tmp, stamp)


class _NullLog:
    """File-like sink: the preprocess summary is replaced by our own one-liners."""

    def write(self, _s):
        return 0

    def flush(self):
        pass
