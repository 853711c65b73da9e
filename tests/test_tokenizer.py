"""data/tokenizer.py: the four tokenizers (SentencePiece, Hugging Face tokenizer.json,
GPT-2 vocab.json + merges.txt, NullTokenizer) and build_tokenizer, on tokenizers trained
in the tests (nothing is downloaded)."""

import itertools
import json
import random

import pytest
from tokenizer_inputs import TEXT, VARIED

from mp_offload.data.tokenizer import (
    EOD_TOKEN_NAMES,
    TOKENIZER_TYPES,
    NullTokenizer,
    build_tokenizer,
)


def test_sentencepiece_round_trip(sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", sp_model)
    assert 300 <= tok.vocab_size <= 400
    for text in (TEXT, "  indented\n\ttabs\n", "unseen ✓ ünïcode 数字 123"):
        ids = tok.tokenize(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text  # byte fallback + identity normalisation: lossless


def test_sentencepiece_eod(sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", sp_model)
    assert tok.eod == 2 and tok.pad == 3
    ids = tok.tokenize(TEXT + "</s>")  # the literal text never maps to the control id
    assert tok.eod not in ids
    assert tok.detokenize(tok.tokenize("x = 1") + [tok.eod]) == "x = 1"


def test_extra_ids(sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", sp_model, vocab_extra_ids=2)
    base = build_tokenizer("SentencePieceTokenizer", sp_model).vocab_size
    assert tok.vocab_size == base + 2
    assert tok.detokenize(tok.tokenize("a") + [base + 1]) == "a<extra_id_1>"


def test_null_tokenizer():
    tok = NullTokenizer(100)
    assert tok.vocab_size == 101 and tok.eod == 100 and tok.pad is None
    assert tok.tokenize("1 2  99") == [1, 2, 99]
    assert tok.detokenize([1, 2]) == "1 2"
    with pytest.raises(ValueError):
        tok.tokenize("100")
    with pytest.raises(ValueError):
        build_tokenizer("NullTokenizer")
    with pytest.raises(ValueError):
        build_tokenizer("GPT2BPETokenizer")


def test_huggingface_tokenizer(bbpe_dir):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(bbpe_dir / "tokenizer.json"))
    for path in (bbpe_dir, bbpe_dir / "tokenizer.json"):  # a directory or the file itself
        tok = build_tokenizer("HuggingFaceTokenizer", str(path))
        assert tok.vocab_size == raw.get_vocab_size() == 330
        assert tok.eod == raw.token_to_id("<|endoftext|>") == 0 and tok.pad is None
    for text in VARIED:
        ids = tok.tokenize(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.eod not in ids  # "<|endoftext|>" in a document never becomes EOD
        assert tok.detokenize(ids) == text  # byte level: lossless
    assert tok.detokenize(tok.tokenize("x = 1") + [tok.eod]) == "x = 1"


def _word_level_json(path, words):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return str(path)


@pytest.mark.parametrize("eod_name", EOD_TOKEN_NAMES)
def test_huggingface_eod_names(tmp_path, eod_name):
    later = list(EOD_TOKEN_NAMES[EOD_TOKEN_NAMES.index(eod_name) + 1 :])
    path = _word_level_json(tmp_path / "t.json", ["<unk>", "a", "<pad>", *later, eod_name])
    tok = build_tokenizer("HuggingFaceTokenizer", path)
    assert tok.eod == 3 + len(later)  # the first name in the list wins
    assert tok.pad == 2 and tok.tokenize("a a") == [1, 1]


def test_huggingface_ignores_truncation_and_padding_settings(tmp_path):
    from tokenizers import Tokenizer

    path = _word_level_json(tmp_path / "t.json", ["<unk>", "a", "<pad>", "</s>"])
    raw = Tokenizer.from_file(path)
    raw.enable_truncation(max_length=2)
    raw.enable_padding(length=8, pad_id=2)
    raw.save(path)
    assert build_tokenizer("HuggingFaceTokenizer", path).tokenize("a a a") == [1, 1, 1]


def test_huggingface_errors(tmp_path, monkeypatch):
    no_eod = _word_level_json(tmp_path / "t.json", ["<unk>", "a"])
    with pytest.raises(ValueError, match="no end-of-text token.*<\\|endoftext\\|>"):
        build_tokenizer("HuggingFaceTokenizer", no_eod)
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))  # a directory without one
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "bad.json"))
    monkeypatch.setitem(__import__("sys").modules, "tokenizers", None)  # not installed
    for kind, kw in (
        ("HuggingFaceTokenizer", {"tokenizer_model": no_eod}),
        ("GPT2BPETokenizer", {"vocab_file": no_eod, "merge_file": no_eod}),
    ):
        with pytest.raises(ValueError, match=f"--tokenizer-type {kind} needs .*tokenizers"):
            build_tokenizer(kind, **kw)


def _gpt2_reference(vocab_file, merge_file):
    """GPT-2's byte-level BPE written out plainly (regex split, byte->char map, rank merges)."""
    regex = pytest.importorskip("regex")
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(merge_file, encoding="utf-8") as f:
        lines = [ln for ln in f.read().split("\n") if ln and not ln.startswith("#version")]
    ranks = {tuple(ln.split(" ")): r for r, ln in enumerate(lines)}
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    byte_char = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(extra)}
    split = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+"""
        r"""| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    )

    def bpe(word):
        parts = list(word)
        while len(parts) > 1:
            pairs = [
                (ranks.get(p, float("inf")), i) for i, p in enumerate(itertools.pairwise(parts))
            ]
            best = min(pairs)[0]
            if best == float("inf"):
                break
            pair, out, i = lines[best].split(" "), [], 0
            while i < len(parts):  # merge every occurrence, left to right
                if i + 1 < len(parts) and [parts[i], parts[i + 1]] == pair:
                    out.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            parts = out
        return parts

    def encode(text):
        return [
            vocab[p]
            for w in split.findall(text)
            for p in bpe("".join(byte_char[b] for b in w.encode("utf-8")))
        ]

    return encode


def test_gpt2_bpe_matches_reference_and_tokenizer_json(bbpe_dir):
    vocab, merges = str(bbpe_dir / "vocab.json"), str(bbpe_dir / "merges.txt")
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    hf = build_tokenizer("HuggingFaceTokenizer", str(bbpe_dir))
    reference = _gpt2_reference(vocab, merges)
    assert tok.vocab_size == 330 and tok.eod == 0 and tok.pad is None
    rng = random.Random(0)
    alphabet = list("abcdefg XYZ_019\t\n'.,(){}=-#✓é数😀") + ["'s", "'ll", "  ", "\n\n"]
    texts = VARIED + [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(200)
    ]
    for text in texts:
        ids = tok.tokenize(text)
        assert ids == reference(text) == hf.tokenize(text), text
        assert tok.detokenize(ids) == text
    assert tok.detokenize(tok.tokenize("y") + [tok.eod]) == "y"


def test_gpt2_bpe_errors(bbpe_dir, tmp_path):
    vocab, merges = str(bbpe_dir / "vocab.json"), str(bbpe_dir / "merges.txt")
    with pytest.raises(ValueError, match="--vocab-file and --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab)
    with pytest.raises(FileNotFoundError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=str(tmp_path / "no.txt"))
    with open(vocab, encoding="utf-8") as f:
        entries = json.load(f)
    del entries["<|endoftext|>"]
    (tmp_path / "vocab.json").write_text(json.dumps(entries))
    with pytest.raises(ValueError, match="--vocab-file .*<\\|endoftext\\|>"):
        build_tokenizer(
            "GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"), merge_file=merges
        )
    with pytest.raises(ValueError, match="unknown tokenizer type"):
        build_tokenizer("BertWordPieceLowerCase")
    assert set(TOKENIZER_TYPES) == {
        "SentencePieceTokenizer",
        "HuggingFaceTokenizer",
        "GPT2BPETokenizer",
        "NullTokenizer",
    }
