"""data/tokenizer_training.py (SentencePiece and byte-level BPE training) and its command
line, tools/train_tokenizer.py."""

import json
import os

from helpers import load_tool
from tokenizer_inputs import TEXT, VARIED, small_bpe_bytelevel

from mp_offload.data.tokenizer import build_tokenizer
from mp_offload.data.tokenizer_training import train_sentencepiece


def test_unigram_trains(tmp_path):
    path = train_sentencepiece(
        [TEXT * 20], str(tmp_path / "uni"), vocab_size=350, model_type="unigram"
    )
    tok = build_tokenizer("SentencePieceTokenizer", path)
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT


def test_bpe_bytelevel_training_writes_both_formats(tmp_path):
    bbpe_dir = small_bpe_bytelevel(tmp_path)
    assert sorted(os.listdir(bbpe_dir)) == ["merges.txt", "tokenizer.json", "vocab.json"]
    with open(bbpe_dir / "merges.txt", encoding="utf-8") as f:
        assert f.readline().startswith("#version")
    with open(bbpe_dir / "vocab.json", encoding="utf-8") as f:
        vocab = json.load(f)
    assert vocab["<|endoftext|>"] == 0 and len(vocab) == 330


# ------------------------------------------------------ tools/train_tokenizer.py
def test_cli(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text(TEXT * 10)
    train = load_tool("train_tokenizer")
    assert (
        train.main(
            ["--input", str(src), "--model-prefix", str(tmp_path / "m"), "--vocab-size", "380"]
        )
        == 0
    )
    assert (tmp_path / "m.model").exists() and (tmp_path / "m.vocab").exists()
    assert (
        train.main(
            [
                "--input",
                str(tmp_path / "missing.txt"),
                "--model-prefix",
                str(tmp_path / "m2"),
                "--vocab-size",
                "380",
            ]
        )
        == 1
    )


def test_cli_bpe_bytelevel(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text(TEXT * 10)
    train = load_tool("train_tokenizer")
    out = tmp_path / "bb"
    assert (
        train.main(
            [
                "--type",
                "bpe-bytelevel",
                "--input",
                str(src),
                "--model-prefix",
                str(out),
                "--vocab-size",
                "300",
            ]
        )
        == 0
    )
    tok = build_tokenizer("HuggingFaceTokenizer", str(out))
    assert tok.vocab_size == 300 and tok.detokenize(tok.tokenize(TEXT)) == TEXT
    assert (out / "vocab.json").exists() and (out / "merges.txt").exists()
    assert (
        train.main(
            [
                "--type",
                "bpe-bytelevel",
                "--input",
                str(src),
                "--model-prefix",
                str(tmp_path / "b2"),
                "--vocab-size",
                "200",
            ]
        )
        == 1
    )  # < 256 bytes


def test_cli_sentencepiece_with_tokenizer_json(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text(TEXT * 10)
    train = load_tool("train_tokenizer")
    assert (
        train.main(
            [
                "--input",
                str(src),
                "--model-prefix",
                str(tmp_path / "m"),
                "--vocab-size",
                "380",
                "--tokenizer-json",
            ]
        )
        == 0
    )
    sp = build_tokenizer("SentencePieceTokenizer", str(tmp_path / "m.model"))
    hf = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "m.tokenizer.json"))
    for text in VARIED:
        assert hf.tokenize(text) == sp.tokenize(text)
    assert (
        train.main(
            [
                "--input",
                str(src),
                "--model-prefix",
                str(tmp_path / "u"),
                "--vocab-size",
                "380",
                "--model-type",
                "unigram",
                "--tokenizer-json",
            ]
        )
        == 1
    )
