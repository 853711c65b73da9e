"""Tokenizer training: SentencePiece (``train_sentencepiece``) and GPT-2 style
byte-level BPE with Hugging Face ``tokenizers`` (``train_bpe_bytelevel``), from JSONL or
plain-text files or document strings (tools/train_tokenizer.py is the command line)."""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from .tokenizer import GPT2_EOD, _atomic_write, _import_tokenizers


def iter_documents(path: str, json_keys: Sequence[str] = ("text",)) -> Iterator[str]:
    """Documents of a file: each key of each JSONL line for .json/.jsonl, else the whole file.

    Lines that are not valid JSON objects or lack a key are skipped (this is
    only used for tokenizer training, where a few lost lines do not matter).
    """
    if path.endswith((".json", ".jsonl")):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(obj, dict):
                    continue
                for key in json_keys:
                    if isinstance(obj.get(key), str):
                        yield obj[key]
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()


def _training_documents(inputs, json_keys: Sequence[str]) -> Iterable[str]:
    """``inputs``: file paths (JSONL via ``json_keys``, else plain text) or document strings."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [os.fspath(inputs)]
    inputs = list(inputs)
    if inputs and all(isinstance(x, (str, os.PathLike)) and os.path.isfile(x) for x in inputs):
        return (d for p in inputs for d in iter_documents(os.fspath(p), json_keys))
    return inputs


def train_sentencepiece(
    inputs,
    model_prefix: str,
    vocab_size: int,
    model_type: str = "bpe",
    json_keys: Sequence[str] = ("text",),
    max_train_bytes: int = 32 << 20,
    input_sentence_size: int = 300_000,
    max_sentence_length: int = 4096,
    num_threads: int | None = None,
    seed: int = 1234,
    code_friendly: bool = True,
) -> str:
    """Train a SentencePiece model and write ``{model_prefix}.model`` (+ ``.vocab``).

    ``inputs``: a list of file paths (JSONL via ``json_keys``, else plain text)
    or an iterable of document strings. Documents are split into lines (the
    trainer's "sentences"); at most ``max_train_bytes`` of text is read and at
    most ``input_sentence_size`` lines (a seeded sample) are trained on, which
    keeps training well under a minute on 2 cores. byte_fallback is on, so any
    text encodes; ids 0..3 are <unk>, <s>, </s> (EOD) and <pad>.

    ``code_friendly`` keeps whitespace exactly (identity normalisation, no
    whitespace collapsing, whitespace-only pieces, "\\n" as its own piece),
    so source code round-trips losslessly. Returns the .model path.
    """
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
    lines = _sentencepiece_lines(
        inputs, json_keys, max_train_bytes, input_sentence_size, max_sentence_length, seed
    )
    options = _sentencepiece_options(
        vocab_size, model_type, max_sentence_length, num_threads, code_friendly
    )
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=proto, **options)
    return _write_sentencepiece(model_prefix, proto.getvalue())


def _sentencepiece_lines(
    inputs,
    json_keys: Sequence[str],
    max_train_bytes: int,
    input_sentence_size: int,
    max_sentence_length: int,
    seed: int,
) -> list[str]:
    """The trainer's "sentences": non-blank lines of the documents, read up to
    ``max_train_bytes`` and sampled down to ``input_sentence_size``."""
    lines: list[str] = []
    total = 0
    for doc in _training_documents(inputs, json_keys):
        for line in doc.split("\n"):
            if line.strip() and len(line.encode("utf-8")) <= max_sentence_length:
                lines.append(line)
                total += len(line) + 1
        if total >= max_train_bytes:
            break
    if not lines:
        raise ValueError("no training text for the tokenizer")
    # Sample ourselves (seeded, order kept) so training is deterministic and
    # bounded; the trainer then sees every line it is given.
    if len(lines) > input_sentence_size:
        rng = np.random.RandomState(seed)
        keep = np.sort(rng.choice(len(lines), input_sentence_size, replace=False))
        lines = [lines[i] for i in keep]
    return lines


def _sentencepiece_options(
    vocab_size: int,
    model_type: str,
    max_sentence_length: int,
    num_threads: int | None,
    code_friendly: bool,
) -> dict:
    """SentencePieceTrainer options; see train_sentencepiece."""
    options = {
        "vocab_size": int(vocab_size),
        "model_type": model_type,
        "byte_fallback": True,
        "unk_id": 0,
        "bos_id": 1,
        "eos_id": 2,
        "pad_id": 3,
        "character_coverage": 0.9995,
        "input_sentence_size": 0,
        "shuffle_input_sentence": False,
        "max_sentence_length": max_sentence_length,
        "num_threads": int(num_threads or min(os.cpu_count() or 1, 8)),
        "hard_vocab_limit": False,  # tiny corpora may not support the full size
        "minloglevel": 2,
    }
    if code_friendly:
        options.update(
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            user_defined_symbols=["\n"],
        )
    return options


def _write_sentencepiece(model_prefix: str, model_proto: bytes) -> str:
    """Write ``{model_prefix}.model`` and ``.vocab``; returns the .model path."""
    import sentencepiece as spm

    out_dir = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(out_dir, exist_ok=True)
    model_path = model_prefix + ".model"
    _atomic_write(model_path, model_proto)
    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    # One "piece<TAB>score" line per id; the newline piece is written escaped.
    rows = []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i).replace("\n", "\\n")
        rows.append(f"{piece}\t{sp.get_score(i):g}\n")
    vocab = "".join(rows)
    _atomic_write(model_prefix + ".vocab", vocab.encode("utf-8"))
    return model_path


def train_bpe_bytelevel(
    inputs,
    output_dir: str,
    vocab_size: int,
    json_keys: Sequence[str] = ("text",),
    max_train_bytes: int = 32 << 20,
    min_frequency: int = 2,
    eod_token: str = GPT2_EOD,
) -> str:
    """Train a GPT-2 style byte-level BPE with ``tokenizers``; returns the tokenizer.json path.

    Writes ``{output_dir}/tokenizer.json`` (for HuggingFaceTokenizer) and the same
    model as ``vocab.json`` + ``merges.txt`` (for GPT2BPETokenizer). ``eod_token``
    is a special token with id 0. ``inputs`` as for train_sentencepiece; whole
    documents (newlines included) are trained on, up to ``max_train_bytes``.
    Every byte is in the vocabulary, so any text encodes without an unknown token.
    """
    tk = _import_tokenizers("--type bpe-bytelevel")
    if int(vocab_size) <= 257:
        raise ValueError(
            f"vocab_size {vocab_size} leaves no room for merges (256 bytes + {eod_token})"
        )
    docs: list[str] = []
    total = 0
    for doc in _training_documents(inputs, json_keys):
        if doc.strip():
            docs.append(doc)
            total += len(doc)
        if total >= max_train_bytes:
            break
    if not docs:
        raise ValueError("no training text for the tokenizer")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=int(vocab_size),
        min_frequency=int(min_frequency),
        show_progress=False,
        special_tokens=[eod_token],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))

    os.makedirs(output_dir, exist_ok=True)
    out = os.path.join(output_dir, "tokenizer.json")
    _atomic_write(out, tok.to_str(pretty=True).encode("utf-8"))
    tmp = os.path.join(output_dir, f".model-{os.getpid()}")
    os.makedirs(tmp, exist_ok=True)
    try:  # written aside, then renamed: never a half-written vocab.json/merges.txt
        for name in tok.model.save(tmp):
            os.replace(name, os.path.join(output_dir, os.path.basename(name)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
