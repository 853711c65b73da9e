"""Tokenizers: a tiny SentencePiece model trained in the test, and NullTokenizer."""

import json

import pytest

from mp_offload.data.tokenizer import (
    NullTokenizer,
    build_tokenizer,
    train_sentencepiece,
)

TEXT = (
    "def greet(name):\n"
    "    \"\"\"Say hello.\"\"\"\n"
    "    return f'Hello, {name}!'\n\n"
    "class Counter:\n"
    "    def __init__(self):\n"
    "        self.count = 0\n\n"
    "    def bump(self, by=1):\n"
    "        self.count += by\n"
    "        return self.count\n"
)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    path = d / "corpus.jsonl"
    with open(path, "w") as f:
        for i in range(40):  # a few KB
            f.write(json.dumps({"text": TEXT.replace("name", f"name{i}")}) + "\n")
    return train_sentencepiece([str(path)], str(d / "tok"), vocab_size=400, model_type="bpe")


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


def test_unigram_trains(tmp_path):
    path = train_sentencepiece([TEXT * 20], str(tmp_path / "uni"), vocab_size=350, model_type="unigram")
    tok = build_tokenizer("SentencePieceTokenizer", path)
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT


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


def _load_tool(name):
    """tools/ is not a package: import the script by path."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text(TEXT * 10)
    train = _load_tool("train_tokenizer")
    assert train.main(["--input", str(src), "--model-prefix", str(tmp_path / "m"),
                       "--vocab-size", "380"]) == 0
    assert (tmp_path / "m.model").exists() and (tmp_path / "m.vocab").exists()
    assert train.main(["--input", str(tmp_path / "missing.txt"), "--model-prefix",
                       str(tmp_path / "m2"), "--vocab-size", "380"]) == 1
