"""Tokenise JSONL / plain-text files into MMIDIDX datasets (logic of tools/preprocess_data.py).

Outputs ``{output_prefix}_{key}_document.bin/.idx`` per JSON key, one sequence
per document. Outputs are written under temporary names and renamed only on
success, so a failed or killed run never leaves files that look complete.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..config.help import DefaultsHelpFormatter
from .indexed_dataset import (
    IndexedDatasetBuilder,
    best_dtype,
    data_file_path,
    index_file_path,
)
from .tokenizer import TOKENIZER_TYPES, build_tokenizer

JSON_SUFFIXES = (".json", ".jsonl")
_MAX_WARNINGS = 20


class PreprocessError(RuntimeError):
    """A fatal input problem; the message is a single line naming the file (and line)."""


@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0
    skipped: int = 0
    first_skip: str = ""  # where and why the first skipped line was skipped
    input_bytes: int = 0
    seconds: float = 0.0
    output_prefixes: list = field(default_factory=list)


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


# ---- worker side -----------------------------------------------------------
_W: dict = {}


def _init_worker(tok_spec: dict, json_keys: tuple, append_eod: bool) -> None:
    _W["tok"] = build_tokenizer(**tok_spec)
    _W["keys"] = json_keys
    _W["eod"] = append_eod
    _W["dtype"] = best_dtype(_W["tok"].vocab_size)


def _encode(task):
    """task = (file_no, line_no, is_json, raw bytes)
    -> (file_no, line_no, nbytes, ids-per-key | error)."""
    file_no, line_no, is_json, raw = task
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return file_no, line_no, len(raw), f"invalid UTF-8 ({e.reason} at byte {e.start})"
    if is_json:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            return file_no, line_no, len(raw), f"bad JSON ({e.msg})"
        if not isinstance(obj, dict):
            return file_no, line_no, len(raw), "JSON line is not an object"
        docs = []
        for key in _W["keys"]:
            if key not in obj:
                return file_no, line_no, len(raw), f"missing key {key!r}"
            if not isinstance(obj[key], str):
                return file_no, line_no, len(raw), f"key {key!r} is not a string"
            docs.append(obj[key])
    else:
        docs = [text]
    out = []
    for key, doc in zip(_W["keys"], docs):
        if not doc.strip():
            return file_no, line_no, len(raw), f"empty document (key {key!r})"
        try:
            ids = _W["tok"].tokenize(doc)
        except Exception as e:  # noqa: BLE001 - the tokenizer rejects the text (e.g. NullTokenizer non-ints)
            return file_no, line_no, len(raw), f"cannot tokenize key {key!r}: {e}"
        if not ids:
            return file_no, line_no, len(raw), f"empty document after tokenization (key {key!r})"
        if _W["eod"]:
            ids.append(_W["tok"].eod)
        out.append(np.asarray(ids, dtype=_W["dtype"]))
    return file_no, line_no, len(raw), out


# ---- reader side -----------------------------------------------------------
def _tasks(inputs: Sequence[str]):
    """JSON files: one task per non-blank line; any other file: one task (whole file)."""
    for file_no, path in enumerate(inputs):
        is_json = path.endswith(JSON_SUFFIXES)
        with open(path, "rb") as f:
            if not is_json:
                yield file_no, 1, False, f.read()
                continue
            for line_no, line in enumerate(f, 1):
                if line.strip():  # blank lines (e.g. a trailing newline) are not documents
                    yield file_no, line_no, True, line


def _results(tasks, tok_spec, json_keys, append_eod, workers, chunksize):
    init = (tok_spec, tuple(json_keys), append_eod)
    if workers <= 1:
        _init_worker(*init)
        yield from map(_encode, tasks)
        return
    # spawn (not fork): the caller may be a training process with torch threads.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=init) as pool:
        # Bounded windows keep memory flat; imap keeps input order, so the output
        # is byte-identical whatever the worker count.
        window = max(1, chunksize) * workers * 32
        tasks = iter(tasks)
        while True:
            batch = list(itertools.islice(tasks, window))
            if not batch:
                break
            yield from pool.imap(_encode, batch, chunksize=max(1, chunksize))


def preprocess(
    inputs: Sequence[str],
    output_prefix: str,
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    on_bad_line: str = "skip",
    log_interval: int = 10000,
    chunksize: int = 32,
    log=None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    progress: str = "auto",
) -> PreprocessStats:
    """Tokenise ``inputs`` into one dataset per JSON key. Raises PreprocessError.

    The tokenizer is ``build_tokenizer(tokenizer_type, tokenizer_model, vocab_size,
    vocab_file=, merge_file=)``; every worker builds its own from the same arguments.
    ``log``: file-like for warnings/progress/summary (default: sys.stderr).
    ``progress``: "bar" (a tqdm bar over the input bytes: rate and ETA), "lines" (a
    line every ``log_interval`` documents) or "auto" (the bar when ``log`` is a
    terminal and tqdm is installed, else lines).
    """
    log = sys.stderr if log is None else log
    _check_arguments(inputs, on_bad_line, progress)
    tok_spec = {
        "tokenizer_type": tokenizer_type,
        "tokenizer_model": tokenizer_model,
        "vocab_size": vocab_size,
        "vocab_file": vocab_file,
        "merge_file": merge_file,
    }
    try:
        tok = build_tokenizer(**tok_spec)
    except (ValueError, FileNotFoundError) as e:
        raise PreprocessError(str(e)) from None
    dtype = best_dtype(tok.vocab_size)
    _make_output_dir(output_prefix)

    prefixes = [output_prefix_for(output_prefix, k) for k in json_keys]
    suffix = f".tmp-{os.getpid()}"
    builders = [IndexedDatasetBuilder(data_file_path(p) + suffix, dtype) for p in prefixes]
    stats = PreprocessStats(output_prefixes=prefixes)
    start = time.perf_counter()
    ok = False
    results = reporter = None
    try:
        results = _results(_tasks(inputs), tok_spec, json_keys, append_eod, workers, chunksize)
        reporter = _Progress(progress, log, log_interval, sum(os.path.getsize(p) for p in inputs))
        _write_documents(results, inputs, builders, stats, on_bad_line, reporter)
        if not stats.documents:
            raise PreprocessError(_nothing_written(inputs, json_keys, stats))
        _publish(builders, prefixes, suffix)
        ok = True
    finally:
        if reporter is not None:
            reporter.close(ok)
        if results is not None:
            results.close()  # stops the worker pool promptly on failure
        if not ok:
            _discard(builders, prefixes, suffix)
    stats.seconds = time.perf_counter() - start
    _summary(stats, log)
    return stats


def _check_arguments(inputs: Sequence[str], on_bad_line: str, progress: str) -> None:
    """Before anything is built: the modes are known and every input is a file."""
    if on_bad_line not in ("skip", "fail"):
        raise ValueError("on_bad_line must be 'skip' or 'fail'")
    if progress not in PROGRESS_MODES:
        raise ValueError(f"progress must be one of {PROGRESS_MODES}, got {progress!r}")
    for path in inputs:
        if not os.path.isfile(path):
            raise PreprocessError(f"input file not found: {path}")


PROGRESS_MODES = ("auto", "bar", "lines")


class _Progress:
    """Progress while documents are written: a tqdm bar over the input bytes (rate,
    ETA, documents and tokens/s after it), or a line every ``log_interval`` documents."""

    def __init__(self, mode: str, log, log_interval: int, total_bytes: int):
        self.log, self.log_interval = log, log_interval
        self.start = time.perf_counter()
        self.bar = None
        if mode == "lines":
            return
        try:
            from tqdm import tqdm
        except ImportError:
            if mode == "bar":
                print(
                    "warning: no progress bar (tqdm is not installed); progress lines instead",
                    file=log,
                )
            return
        isatty = getattr(log, "isatty", None)
        if mode == "bar" or (isatty is not None and isatty()):
            self.bar = tqdm(
                total=total_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="tokenizing",
                file=log,
                mininterval=0.5,
                smoothing=0.1,
                dynamic_ncols=True,
            )

    def warn(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=self.log)
        else:
            print(msg, file=self.log)

    def update(self, stats: PreprocessStats, nbytes: int, document: bool = True) -> None:
        """``nbytes`` more input read; ``document``: it was a document (not a skipped line)."""
        if not document:
            if self.bar is not None:
                self.bar.update(nbytes)
            return
        if self.bar is not None:
            self.bar.update(nbytes)
            if stats.documents % 256 == 0:
                secs = max(time.perf_counter() - self.start, 1e-9)
                self.bar.set_postfix_str(
                    f"{stats.documents:,} docs, {stats.tokens / secs:,.0f} tokens/s", refresh=False
                )
        elif self.log_interval and stats.documents % self.log_interval == 0:
            _progress(stats, time.perf_counter() - self.start, self.log)

    def close(self, ok: bool) -> None:
        if self.bar is not None:
            if ok:  # blank JSON lines are never read as documents: fill the bar
                self.bar.update(max(0, self.bar.total - self.bar.n))
            self.bar.close()


def _write_documents(
    results,
    inputs: Sequence[str],
    builders: list,
    stats: PreprocessStats,
    on_bad_line: str,
    progress: _Progress,
) -> None:
    """Add each encoded document to the builders (one per JSON key); count, skip or fail
    on bad lines."""
    for file_no, line_no, nbytes, out in results:
        stats.input_bytes += nbytes
        if isinstance(out, str):
            where = f"{inputs[file_no]}:{line_no}"
            if on_bad_line == "fail":
                raise PreprocessError(f"{where}: {out}")
            stats.skipped += 1
            stats.first_skip = stats.first_skip or f"{where}: {out}"
            if stats.skipped <= _MAX_WARNINGS:
                progress.warn(f"warning: skipping {where}: {out}")
                if stats.skipped == _MAX_WARNINGS:
                    progress.warn("warning: further skipped lines are only counted")
            progress.update(stats, nbytes, document=False)
            continue
        for builder, ids in zip(builders, out):
            builder.add_item(ids)
            builder.end_document()
            stats.tokens += len(ids)
        stats.documents += 1
        progress.update(stats, nbytes)


def _nothing_written(
    inputs: Sequence[str], json_keys: Sequence[str], stats: PreprocessStats
) -> str:
    """Why no dataset is written: an empty one would only fail later, in training."""
    where = ", ".join(inputs)
    keys = " ".join(json_keys)
    if stats.skipped:
        return (
            f"no documents in {where} under --json-keys {keys}: all {stats.skipped} "
            f"lines were skipped (the first: {stats.first_skip}); nothing written"
        )
    return f"no documents in {where} (the input is empty); nothing written"


def _make_output_dir(output_prefix: str) -> None:
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:  # a regular file on the way, a read-only parent...
        raise PreprocessError(
            f"--output-prefix {output_prefix}: cannot make the directory {out_dir} "
            f"({e.strerror or e}{f': {e.filename}' if e.filename else ''})"
        ) from None


def _publish(builders: list, prefixes: list[str], suffix: str) -> None:
    """Finish the temporary files and rename them to their final names."""
    for builder, p in zip(builders, prefixes):
        builder.finalize(index_file_path(p) + suffix)
    # .bin first, .idx last: a present .idx implies its .bin is complete.
    for p in prefixes:
        os.replace(data_file_path(p) + suffix, data_file_path(p))
        os.replace(index_file_path(p) + suffix, index_file_path(p))


def _discard(builders: list, prefixes: list[str], suffix: str) -> None:
    """After a failure: close the builders and remove their temporary files."""
    for builder, p in zip(builders, prefixes):
        builder.close()
        for path in (data_file_path(p) + suffix, index_file_path(p) + suffix):
            if os.path.exists(path):
                os.remove(path)


def _progress(stats: PreprocessStats, elapsed: float, log) -> None:
    elapsed = max(elapsed, 1e-9)
    print(
        f"processed {stats.documents} documents ({stats.input_bytes / 1e6:.1f} MB, "
        f"{stats.input_bytes / 1e6 / elapsed:.2f} MB/s, {stats.tokens / elapsed:,.0f} tokens/s)",
        file=log,
        flush=True,
    )


def _summary(stats: PreprocessStats, log) -> None:
    secs = max(stats.seconds, 1e-9)
    print(
        f"done: {stats.documents} documents, {stats.tokens} tokens, {stats.skipped} skipped, "
        f"{stats.input_bytes / 1e6:.1f} MB in {stats.seconds:.1f}s "
        f"({stats.tokens / secs:,.0f} tokens/s)",
        file=log,
    )
    for p in stats.output_prefixes:
        print(f"  wrote {data_file_path(p)} and {index_file_path(p)}", file=log)
    log.flush()


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        description="Tokenise documents into Megatron MMIDIDX files "
        "{output-prefix}_{key}_document.bin/.idx.",
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="input files. *.json/*.jsonl: one JSON object per line, one document per line "
        "(blank lines ignored). Any other file is plain text and is ONE document (the whole file).",
    )
    p.add_argument("--output-prefix", required=True, help="prefix of the output files")
    p.add_argument(
        "--json-keys", nargs="+", default=["text"], help="JSON keys to tokenise (default: text)"
    )
    p.add_argument("--tokenizer-type", default="SentencePieceTokenizer", choices=TOKENIZER_TYPES)
    p.add_argument(
        "--tokenizer-model",
        default=None,
        help="SentencePiece .model file, or (HuggingFaceTokenizer) a tokenizer.json file or "
        "a directory holding one",
    )
    p.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: GPT-2 vocab.json")
    p.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: GPT-2 merges.txt")
    p.add_argument("--vocab-size", type=int, default=None, help="vocab size (NullTokenizer)")
    p.add_argument(
        "--append-eod", action="store_true", help="append the EOD token to each document"
    )
    p.add_argument(
        "--workers", type=int, default=1, help="tokenizer processes (default 1: in-process)"
    )
    p.add_argument("--chunksize", type=int, default=32, help="lines per worker task")
    p.add_argument(
        "--log-interval",
        type=int,
        default=10000,
        help="progress line every N documents (--progress lines)",
    )
    p.add_argument(
        "--progress",
        choices=PROGRESS_MODES,
        default="auto",
        help="bar: a progress bar with rate and ETA (tqdm); lines: a line every "
        "--log-interval documents; auto: the bar on a terminal, else lines",
    )
    p.add_argument(
        "--on-bad-line",
        choices=["skip", "fail"],
        default="skip",
        help="bad JSON, missing key or empty document: skip and count (default) "
        "or fail with exit code 1",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = get_parser().parse_args(argv)
    try:
        preprocess(
            args.input,
            args.output_prefix,
            args.tokenizer_type,
            tokenizer_model=args.tokenizer_model,
            vocab_size=args.vocab_size,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            on_bad_line=args.on_bad_line,
            log_interval=args.log_interval,
            chunksize=args.chunksize,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            progress=args.progress,
        )
    except PreprocessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
