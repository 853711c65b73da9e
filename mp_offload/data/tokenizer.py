"""Tokenizers (SentencePiece, and a NullTokenizer for tests) plus SentencePiece training.

All tokenizers expose ``vocab_size``, ``tokenize(text) -> list[int]``,
``detokenize(ids) -> str``, ``eod`` (end-of-document id) and ``pad`` (or None).
"""

from __future__ import annotations

import io
import json
import os
from typing import Iterable, Iterator, Sequence

import numpy as np


class NullTokenizer:
    """Text is whitespace-separated integer ids; id ``vocab_size`` is EOD (Megatron's convention).

    So ``NullTokenizer(100).vocab_size == 101`` and ``.eod == 100``.
    """

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError("NullTokenizer needs a positive vocab_size")
        self._base = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._base + 1

    @property
    def eod(self) -> int:
        return self._base

    @property
    def pad(self):
        return None

    def tokenize(self, text: str) -> list[int]:
        ids = [int(t) for t in text.split()]
        for t in ids:
            if not 0 <= t < self._base:
                raise ValueError(f"token id {t} outside [0, {self._base})")
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


class SentencePieceTokenizer:
    """Wraps a SentencePiece model; EOD is its ``</s>`` (eos) piece.

    ``vocab_extra_ids`` appends ``<extra_id_k>`` ids after the model's own vocab
    (never produced by ``tokenize``; shown by name in ``detokenize``).
    """

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        import sentencepiece as spm

        if not model_file or not os.path.isfile(model_file):
            raise FileNotFoundError(f"SentencePiece model not found: {model_file}")
        self.model_file = model_file
        self._sp = spm.SentencePieceProcessor(model_file=model_file)
        self._n = int(self._sp.get_piece_size())
        self._extra = int(vocab_extra_ids)
        eos = int(self._sp.eos_id())
        if eos < 0:
            eos = int(self._sp.piece_to_id("</s>"))
            if eos == self._sp.unk_id():
                raise ValueError(f"{model_file}: model has no </s> (eos) piece to use as EOD")
        self._eod = eos
        pad = int(self._sp.pad_id())
        self._pad = pad if pad >= 0 else None

    @property
    def vocab_size(self) -> int:
        return self._n + self._extra

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self):
        return self._pad

    @property
    def unk(self) -> int:
        return int(self._sp.unk_id())

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids) -> str:
        # Decode runs of model ids together so multi-piece bytes reassemble.
        out, run = [], []
        for i in ids:
            i = int(i)
            if i >= self._n:
                if run:
                    out.append(self._sp.decode(run))
                    run = []
                out.append(f"<extra_id_{i - self._n}>")
            else:
                run.append(i)
        if run:
            out.append(self._sp.decode(run))
        return "".join(out)


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    vocab_extra_ids: int = 0,
):
    """``tokenizer_type``: "SentencePieceTokenizer" (needs tokenizer_model) or
    "NullTokenizer" (needs vocab_size)."""
    if tokenizer_type == "SentencePieceTokenizer":
        if tokenizer_model is None:
            raise ValueError("SentencePieceTokenizer needs --tokenizer-model")
        return SentencePieceTokenizer(tokenizer_model, vocab_extra_ids=vocab_extra_ids)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(
        f"unknown tokenizer type {tokenizer_type!r} (expected SentencePieceTokenizer or NullTokenizer)"
    )


def iter_documents(path: str, json_keys: Sequence[str] = ("text",)) -> Iterator[str]:
    """Documents of a file: each key of each JSONL line for .json/.jsonl, else the whole file.

    Lines that are not valid JSON objects or lack a key are skipped (this is
    only used for tokenizer training, where a few lost lines do not matter).
    """
    if path.endswith((".json", ".jsonl")):
        with open(path, "r", encoding="utf-8", errors="replace") as f:
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
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            yield f.read()


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
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [os.fspath(inputs)]
    inputs = list(inputs)
    if inputs and all(isinstance(x, (str, os.PathLike)) and os.path.isfile(x) for x in inputs):
        docs: Iterable[str] = (d for p in inputs for d in iter_documents(os.fspath(p), json_keys))
    else:
        docs = inputs

    lines: list[str] = []
    total = 0
    for doc in docs:
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
        keep = np.sort(np.random.RandomState(seed).choice(len(lines), input_sentence_size, replace=False))
        lines = [lines[i] for i in keep]

    options = dict(
        vocab_size=int(vocab_size),
        model_type=model_type,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        character_coverage=0.9995,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        max_sentence_length=max_sentence_length,
        num_threads=int(num_threads or min(os.cpu_count() or 1, 8)),
        hard_vocab_limit=False,  # tiny corpora may not support the full size
        minloglevel=2,
    )
    if code_friendly:
        options.update(
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            user_defined_symbols=["\n"],
        )
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=proto, **options)

    out_dir = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(out_dir, exist_ok=True)
    model_path = model_prefix + ".model"
    _atomic_write(model_path, proto.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    # One "piece<TAB>score" line per id; the newline piece is written escaped.
    rows = []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i).replace("\n", "\\n")
        rows.append(f"{piece}\t{sp.get_score(i):g}\n")
    vocab = "".join(rows)
    _atomic_write(model_prefix + ".vocab", vocab.encode("utf-8"))
    return model_path


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
