"""Tokenizers plus tokenizer training and SentencePiece -> tokenizer.json conversion.

Types (``--tokenizer-type``): SentencePieceTokenizer, HuggingFaceTokenizer (a
``tokenizers`` tokenizer.json), GPT2BPETokenizer (GPT-2 vocab.json + merges.txt)
and NullTokenizer (for tests). All expose ``vocab_size``,
``tokenize(text) -> list[int]``, ``detokenize(ids) -> str``, ``eod``
(end-of-document id) and ``pad`` (or None). The Hugging Face ``tokenizers``
package is imported only when one of its types is built.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import struct
from collections.abc import Iterable, Iterator, Sequence

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


TOKENIZER_TYPES = ("SentencePieceTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                   "NullTokenizer")
# End-of-text token names, in the order they are looked for.
EOD_TOKEN_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
_PAD_TOKEN_NAMES = ("<pad>", "<|pad|>", "[PAD]")
GPT2_EOD = "<|endoftext|>"


def _import_tokenizers(flag: str):
    """The ``tokenizers`` module, or a one-line ValueError naming the flag that needs it."""
    try:
        import tokenizers
    except ImportError:
        raise ValueError(f"{flag} needs the Hugging Face `tokenizers` package "
                         "(pip install tokenizers)") from None
    return tokenizers


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class _TokenizersWrapper:
    """Shared by the types built on a ``tokenizers.Tokenizer``.

    ``tokenize`` adds no special tokens (no BOS/EOS post-processing), never
    truncates or pads (whatever the tokenizer.json asks for), and encodes
    special-token strings found in the text as ordinary text, so a document can
    never forge an EOD (as with SentencePiece's control pieces). ``detokenize``
    leaves special tokens (EOD) out, as SentencePiece does with control ids.
    """

    def __init__(self, tok, eod: int):
        tok.encode_special_tokens = True
        tok.no_truncation()
        tok.no_padding()
        self._tok = tok
        self._eod = int(eod)
        vocab = tok.get_vocab(with_added_tokens=True)
        # Added tokens may leave holes: size the vocabulary by the largest id.
        self._vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        self._pad = next((vocab[n] for n in _PAD_TOKEN_NAMES if n in vocab), None)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self):
        return self._pad

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


class HuggingFaceTokenizer(_TokenizersWrapper):
    """A Hugging Face ``tokenizers`` tokenizer.json (``--tokenizer-model`` names the file
    or a directory holding ``tokenizer.json``).

    EOD is the first of EOD_TOKEN_NAMES the tokenizer knows; ``vocab_size`` is
    ``get_vocab_size()`` (or one past the largest id, if added tokens leave holes).
    """

    def __init__(self, path: str):
        file = os.path.join(path, "tokenizer.json") if path and os.path.isdir(path) else path
        if not file or not os.path.isfile(file):
            raise FileNotFoundError(f"--tokenizer-model {path}: no tokenizer.json file there "
                                    "(HuggingFaceTokenizer)")
        tk = _import_tokenizers("--tokenizer-type HuggingFaceTokenizer")
        try:
            tok = tk.Tokenizer.from_file(file)
        except Exception as e:  # noqa: BLE001 - the Rust side raises a plain Exception
            raise ValueError(f"--tokenizer-model {file}: not a tokenizer.json "
                             f"({_first_line(e)})") from None
        eod = next((i for i in map(tok.token_to_id, EOD_TOKEN_NAMES) if i is not None), None)
        if eod is None:
            raise ValueError(f"--tokenizer-model {file}: no end-of-text token to use as EOD "
                             f"(looked for {', '.join(EOD_TOKEN_NAMES)})")
        self.model_file = file
        super().__init__(tok, eod)


class GPT2BPETokenizer(_TokenizersWrapper):
    """GPT-2's byte-level BPE from ``--vocab-file`` (vocab.json) and ``--merge-file``
    (merges.txt), as Megatron's GPT2BPETokenizer: GPT-2's pre-tokenisation regex, no
    prefix space, EOD ``<|endoftext|>``, ``vocab_size`` = the vocab.json entries.
    """

    def __init__(self, vocab_file: str, merge_file: str):
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise FileNotFoundError(f"{flag} {path}: file not found (GPT2BPETokenizer)")
        tk = _import_tokenizers("--tokenizer-type GPT2BPETokenizer")
        try:
            model = tk.models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: "
                             f"cannot read them ({_first_line(e)})") from None
        tok = tk.Tokenizer(model)
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = tk.decoders.ByteLevel()
        eod = tok.token_to_id(GPT2_EOD)
        if eod is None:
            raise ValueError(f"--vocab-file {vocab_file}: no {GPT2_EOD} entry to use as EOD")
        # Special, so that detokenize leaves it out; the text "<|endoftext|>" still
        # encodes as ordinary bytes (encode_special_tokens), as in Megatron's GPT-2 BPE.
        tok.add_special_tokens([tk.AddedToken(GPT2_EOD, special=True, normalized=False)])
        self.vocab_file, self.merge_file = vocab_file, merge_file
        super().__init__(tok, eod)


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    vocab_extra_ids: int = 0,
    vocab_file: str | None = None,
    merge_file: str | None = None,
):
    """One of TOKENIZER_TYPES. SentencePieceTokenizer and HuggingFaceTokenizer need
    ``tokenizer_model``; GPT2BPETokenizer needs ``vocab_file`` and ``merge_file``;
    NullTokenizer needs ``vocab_size``. ``vocab_extra_ids`` is SentencePiece only.
    Errors are one-line ValueError/FileNotFoundError naming the flag."""
    if tokenizer_type == "SentencePieceTokenizer":
        if tokenizer_model is None:
            raise ValueError("SentencePieceTokenizer needs --tokenizer-model")
        return SentencePieceTokenizer(tokenizer_model, vocab_extra_ids=vocab_extra_ids)
    if tokenizer_type in ("HuggingFaceTokenizer", "GPT2BPETokenizer") and vocab_extra_ids:
        raise ValueError(f"vocab_extra_ids is only supported by SentencePieceTokenizer, "
                         f"not {tokenizer_type}")
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json "
                             "or a directory holding one)")
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file is None or merge_file is None:
            raise ValueError("GPT2BPETokenizer needs --vocab-file and --merge-file")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(f"unknown tokenizer type {tokenizer_type!r} (expected one of "
                     f"{', '.join(TOKENIZER_TYPES)})")


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
    lines = _sentencepiece_lines(inputs, json_keys, max_train_bytes, input_sentence_size,
                                 max_sentence_length, seed)
    options = _sentencepiece_options(vocab_size, model_type, max_sentence_length, num_threads,
                                     code_friendly)
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=proto, **options)
    return _write_sentencepiece(model_prefix, proto.getvalue())


def _sentencepiece_lines(inputs, json_keys: Sequence[str], max_train_bytes: int,
                         input_sentence_size: int, max_sentence_length: int,
                         seed: int) -> list[str]:
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


def _sentencepiece_options(vocab_size: int, model_type: str, max_sentence_length: int,
                           num_threads: int | None, code_friendly: bool) -> dict:
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
        raise ValueError(f"vocab_size {vocab_size} leaves no room for merges "
                         f"(256 bytes + {eod_token})")
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
        vocab_size=int(vocab_size), min_frequency=int(min_frequency), show_progress=False,
        special_tokens=[eod_token], initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
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


# ---- SentencePiece BPE -> Hugging Face tokenizer.json ----------------------
# Piece types of sentencepiece_model.proto.
_SP_NORMAL, _SP_UNKNOWN, _SP_CONTROL, _SP_USER_DEFINED, _SP_UNUSED, _SP_BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "\u2581"  # SentencePiece's escaped space


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _proto_fields(buf: bytes) -> Iterator[tuple[int, object]]:
    """(field number, value) of a protobuf message, from the wire format alone."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if i > len(buf):
            raise ValueError("truncated protobuf message")
        yield number, value


def _read_sentencepiece_model(path: str) -> dict:
    """The parts of a SentencePiece ModelProto the conversion needs (proto2 defaults filled in)."""
    with open(path, "rb") as f:
        buf = f.read()
    pieces, trainer, normalizer, denormalizer = [], {}, {}, {}
    try:
        for number, value in _proto_fields(buf):
            if number == 1:  # repeated SentencePiece {1: piece, 2: score, 3: type}
                piece = {1: b"", 2: b"\0\0\0\0", 3: _SP_NORMAL}
                piece.update(_proto_fields(value))
                score = struct.unpack("<f", piece[2])[0]
                pieces.append((piece[1].decode("utf-8"), score, piece[3]))
            elif number in (2, 3, 5):
                target = {2: trainer, 3: normalizer, 5: denormalizer}[number]
                target.update(_proto_fields(value))
    except (IndexError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a SentencePiece model ({_first_line(e)})") from None
    if not pieces:
        raise ValueError(f"{path}: not a SentencePiece model (no pieces)")
    return {
        "pieces": pieces,
        "model_type": trainer.get(3, 1),  # 1 unigram, 2 bpe, 3 word, 4 char
        "byte_fallback": bool(trainer.get(35, 0)),
        "treat_whitespace_as_suffix": bool(trainer.get(24, 0)),
        "unk_surface": trainer.get(44, " \u2047 ".encode()).decode("utf-8"),
        "precompiled_charsmap": normalizer.get(2, b""),
        "add_dummy_prefix": bool(normalizer.get(3, 1)),
        "remove_extra_whitespaces": bool(normalizer.get(4, 1)),
        "escape_whitespaces": bool(normalizer.get(5, 1)),
        "denormalizer_charsmap": denormalizer.get(2, b""),
    }


def sentencepiece_to_tokenizer_json(model_path: str, out_path: str) -> str:
    """Write a Hugging Face ``tokenizers`` tokenizer.json equivalent to a SentencePiece
    BPE model (as trained by train_sentencepiece); returns ``out_path``.

    ``tokenizers.Tokenizer.from_file(out_path).encode(text).ids`` equals
    ``SentencePieceProcessor.encode(text)`` and ``decode`` equals SentencePiece's
    decode, so text round-trips exactly as it does with SentencePiece (limits
    below). How the pieces map onto ``tokenizers``: see ``_sp_bpe_model``,
    ``_sp_normalizers``, ``_sp_pre_tokenizers`` and ``_sp_decoders``.

    Exactness, and its limits (each checked in tests/test_tokenizer.py):

    * The project's default (code-friendly, identity-normalised) models: ids are
      identical for all text. One input class does not round-trip, in
      SentencePiece itself: U+2581 in the text is read as an escaped space, so it
      encodes like " " and decodes as " " - in both tokenizers alike.
    * Models trained with ``code_friendly=False`` (nmt_nfkc charsmap): ``tokenizers``'
      Precompiled normalizer applies the charsmap per grapheme cluster - a cluster
      under 6 UTF-8 bytes is replaced whole by the rule of its shortest matching
      prefix, a longer one character by character - whereas SentencePiece applies
      the longest matching rule at each position. So text in which a character
      is followed by combining marks or conjoining Hangul jamo can normalise
      differently: U+3000 + U+0301 loses the accent, U+1100 U+1161 stays two jamo
      instead of becoming U+AC00, and the ids differ. Text without such clusters
      gives identical ids.
    * ``tokenizers`` cannot give two merges one rank, SentencePiece ranks all
      splits of a piece alike (it orders by the piece's score, then position).
      The order among one piece's splits could only matter if two of them were
      available at once overlapping (symbols s1 s2 s3 with s1+s2 == s2+s3 == the
      piece); reversing that order changes no result in the tests, runs of one
      character included. Splits are ranked shorter-left-first.

    Only BPE models convert; UNUSED pieces, multi-character user-defined symbols,
    whitespace as suffix and a denormalizer (none of which train_sentencepiece
    produces) raise ValueError, as does a unigram model.
    """
    tk = _import_tokenizers("sentencepiece_to_tokenizer_json")
    m = _read_sentencepiece_model(model_path)
    pieces = m["pieces"]
    normal = {p: (score, i) for i, (p, score, kind) in enumerate(pieces) if kind == _SP_NORMAL}
    _check_convertible(m, normal, model_path)
    unk = next(p for p, _, kind in pieces if kind == _SP_UNKNOWN)
    space = _SPACE if m["escape_whitespaces"] else " "

    tok = tk.Tokenizer(_sp_bpe_model(tk, m, normal, unk))
    norm = _sp_normalizers(tk, m, space)
    if norm:
        tok.normalizer = tk.normalizers.Sequence(norm)
    pre = _sp_pre_tokenizers(tk, pieces, normal, space)
    if pre:
        tok.pre_tokenizer = tk.pre_tokenizers.Sequence(pre)
    tok.decoder = tk.decoders.Sequence(_sp_decoders(tk, m, unk))

    out_dir = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(out_dir, exist_ok=True)
    _atomic_write(out_path, tok.to_str(pretty=True).encode("utf-8"))
    return out_path


def _check_convertible(m: dict, normal: dict, model_path: str) -> None:
    """ValueError listing every feature of the model the conversion does not support."""
    problems = []
    if m["model_type"] != 2:
        problems.append("only BPE models convert (this one is unigram/word/char)")
    if m["treat_whitespace_as_suffix"]:
        problems.append("treat_whitespace_as_suffix is not supported")
    if m["denormalizer_charsmap"]:
        problems.append("a denormalizer is not supported")
    kinds = [kind for _, _, kind in m["pieces"]]
    if _SP_UNUSED in kinds:
        problems.append("UNUSED pieces are not supported")
    if kinds.count(_SP_UNKNOWN) != 1:
        problems.append("the model needs exactly one <unk> piece")
    if any(len(p) != 1 for p, _, kind in m["pieces"] if kind == _SP_USER_DEFINED):
        problems.append("multi-character user-defined symbols are not supported")
    missing = sorted({c for p in normal for c in p if c not in normal})
    if missing:
        # SentencePiece could merge such a character; tokenizers spells it in bytes first.
        problems.append(f"normal pieces use characters that are no piece: {missing[:5]}")
    if problems:
        raise ValueError(f"{model_path}: cannot convert: {'; '.join(problems)}")


def _sp_bpe_model(tk, m: dict, normal: dict, unk: str):
    """The BPE model. The vocabulary is the pieces by id. SentencePiece merges, at each
    step, the adjacent pair whose concatenation is the best-scored normal piece (ties:
    leftmost). Every split ``left + right`` of a normal piece into two normal pieces
    becomes a merge, ranked by the piece's score, so ``tokenizers`` (lowest rank, then
    leftmost) merges in the same order. ``byte_fallback`` spells characters that are not
    pieces as ``<0xXX>`` byte pieces, as SentencePiece does; without it they become
    ``<unk>`` (runs fused).
    """
    vocab = {p: i for i, (p, _, _) in enumerate(m["pieces"])}
    ranked = []
    for piece, (score, i) in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-score, i, cut, left, right))
    ranked.sort()
    return tk.models.BPE(
        vocab=vocab, merges=[(left, right) for *_, left, right in ranked], unk_token=unk,
        fuse_unk=True, byte_fallback=m["byte_fallback"], dropout=None)


def _sp_normalizers(tk, m: dict, space: str) -> list:
    """The model's precompiled charsmap (NFKC models) via ``Precompiled``,
    SentencePiece's whitespace trimming/collapsing (spaces only), " " -> "\u2581", and
    the dummy "\u2581" prefix - whichever the model uses. The code-friendly default uses
    none but the escaping.
    """
    norm = []
    if m["precompiled_charsmap"]:
        norm.append(tk.normalizers.Precompiled(m["precompiled_charsmap"]))
    if m["remove_extra_whitespaces"]:  # only " " counts, as in SentencePiece
        norm += [tk.normalizers.Replace(tk.Regex(r"\A +| +\z"), ""),
                 tk.normalizers.Replace(tk.Regex(" {2,}"), " ")]
    if m["escape_whitespaces"]:
        norm.append(tk.normalizers.Replace(" ", _SPACE))
    if m["add_dummy_prefix"]:
        norm.append(tk.normalizers.Prepend(space))  # non-empty text only, as in SentencePiece
    return norm


def _sp_pre_tokenizers(tk, pieces: list, normal: dict, space: str) -> list:
    """Only a speed-up, never a change of result: user-defined symbols (e.g. "\\n") are
    isolated, as SentencePiece never merges them, and the text is cut before each
    "\u2581" that follows another character - only when no piece spans such a boundary,
    so no merge is lost.
    """
    pre = []
    user = [p for p, _, kind in pieces if kind == _SP_USER_DEFINED]
    if user:
        pattern = "|".join(re.escape(p) for p in user)
        pre.append(tk.pre_tokenizers.Split(tk.Regex(pattern), behavior="isolated"))
    if not any(re.search(f"[^{space}]{space}", p) for p in normal):
        # Chunks are a run of spaces plus the non-space run after it: no piece
        # crosses their boundaries, so BPE inside each chunk gives the same result.
        pattern = f"{space}*[^{space}]+|{space}+"
        pre.append(tk.pre_tokenizers.Split(tk.Regex(pattern), behavior="isolated"))
    return pre


def _sp_decoders(tk, m: dict, unk: str) -> list:
    """Control pieces (<s>, </s>, <pad>) are plain vocabulary entries, not added tokens,
    so their text in a document encodes as text, as in SentencePiece (registering them as
    special tokens would turn "</s>" in text into the EOD id). The decoder drops them and
    shows <unk> as SentencePiece's " \u2047 ".
    """
    dec = []
    control = [p for p, _, kind in m["pieces"] if kind == _SP_CONTROL]
    if control:
        pattern = "^(?:" + "|".join(re.escape(p) for p in control) + ")$"
        dec.append(tk.decoders.Replace(tk.Regex(pattern), ""))
    dec.append(tk.decoders.Replace(tk.Regex("^" + re.escape(unk) + "$"), m["unk_surface"]))
    if m["escape_whitespaces"]:
        dec.append(tk.decoders.Replace(_SPACE, " "))
    if m["byte_fallback"]:
        dec.append(tk.decoders.ByteFallback())
    dec.append(tk.decoders.Fuse())
    if m["add_dummy_prefix"]:
        dec.append(tk.decoders.Strip(content=" ", left=1))
    return dec


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
