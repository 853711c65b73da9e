"""SentencePiece BPE model -> Hugging Face ``tokenizers`` tokenizer.json that encodes
and decodes exactly as SentencePiece does (``sentencepiece_to_tokenizer_json``).

The .model file is read from the protobuf wire format directly (no protobuf package)."""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator

from .tokenizer import _atomic_write, _first_line, _import_tokenizers

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
            value, i = buf[i : i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = buf[i : i + n], i + n
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

    Exactness, and its limits (each checked in tests/test_sentencepiece_convert.py):

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
        vocab=vocab,
        merges=[(left, right) for *_, left, right in ranked],
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=m["byte_fallback"],
        dropout=None,
    )


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
        norm += [
            tk.normalizers.Replace(tk.Regex(r"\A +| +\z"), ""),
            tk.normalizers.Replace(tk.Regex(" {2,}"), " "),
        ]
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
