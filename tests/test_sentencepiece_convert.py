"""data/sentencepiece_convert.py: a SentencePiece BPE model as an identical tokenizer.json."""

import json
import random

import pytest
from tokenizer_inputs import TEXT

from mp_offload.data.sentencepiece_convert import sentencepiece_to_tokenizer_json
from mp_offload.data.tokenizer import build_tokenizer
from mp_offload.data.tokenizer_training import train_sentencepiece

PROSE = (
    "Zoë's café serves crème brûlée — naïve façades, ½ price! 数字と日本語のテキスト。"
    " Ελληνικά κείμενα. Привет, мир! ﬁne ①②  ＡＢＣ\u3000full\u00a0width.\n"
)


def _corpus():
    import inspect
    import json.encoder
    import string
    import textwrap

    code = [inspect.getsource(m) for m in (textwrap, json.encoder, string)]
    return code + [PROSE * 30, "tab\tseparated\tvalues" * 50]


def _varied_strings(corpus, n, seed=0):
    """Code fragments, runs of spaces/tabs/newlines, characters the model never saw."""
    rng = random.Random(seed)
    text = "".join(corpus)
    soup = list("abcxyzABC_019 \t\n\r(){}[]=+-*/#\"'.,:;<>!@$%^&|~`\\") + list(
        "éüß数字日本€✓😀Ωж\u200b\u00a0\u3000\x00\x07\x1b\u0301ﬁ①ＡＢ𝔘"
    )
    specials = ["</s>", "<s>", "<unk>", "<pad>", "<0x41>", "\n", "  ", "\t\t"]
    out = ["", " ", "   ", "\n", "\t", "a", "</s>", "x  </s>  y"]
    while len(out) < n:
        kind = rng.randrange(6)
        start = rng.randrange(len(text) - 400)
        frag = text[start : start + rng.randint(1, 400)]
        if kind == 0:
            out.append(frag)
        elif kind == 1:
            out.append("".join(rng.choice(soup) for _ in range(rng.randint(1, 60))))
        elif kind == 2:
            out.append(
                " " * rng.randint(1, 40)
                + frag[:80]
                + " " * rng.randint(0, 9)
                + "\n" * rng.randint(0, 3)
            )
        elif kind == 3:
            out.append(
                "".join(
                    rng.choice([frag[:15], *specials, " " * rng.randint(1, 24)]) for _ in range(8)
                )
            )
        elif kind == 4:
            out.append(rng.choice("= -#*\t0a") * rng.randint(1, 70) + frag[:30])
        else:
            out.append("".join(rng.choice(soup) for _ in range(5)).join(frag.split(" ")))
    return out


@pytest.fixture(scope="module")
def sp_converted(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp2hf")
    model = train_sentencepiece(_corpus(), str(d / "sp"), vocab_size=1500)
    return model, sentencepiece_to_tokenizer_json(model, str(d / "tokenizer.json"))


def test_sentencepiece_to_tokenizer_json_is_exact(sp_converted):
    """Same ids as SentencePiece on 600 varied strings; decoding gives the text back.

    U+2581 is SentencePiece's escaped space: SentencePiece itself reads it as " " (same
    ids as a space) and decodes it as " ", so for text holding it only the ids and
    SentencePiece's own decode can be compared, not the original text.
    """
    import sentencepiece as spm
    from tokenizers import Tokenizer

    model, out = sp_converted
    sp = spm.SentencePieceProcessor(model_file=model)
    hf = Tokenizer.from_file(out)
    assert hf.get_vocab_size() == sp.get_piece_size()
    texts = _varied_strings(_corpus(), 600)
    texts += ["a\u2581b", "\u2581\u2581 x", " \u2581"]
    byte_pieces = 0
    for text in texts:
        ids = sp.encode(text)
        assert hf.encode(text).ids == ids, text
        byte_pieces += sum(sp.is_byte(i) for i in ids)
        decoded = hf.decode(ids)
        assert decoded == sp.decode(ids), text
        assert decoded == text.replace("\u2581", " "), text  # lossless but for U+2581
    assert byte_pieces > 100  # byte fallback was exercised
    # Control ids decode to nothing, <unk> to SentencePiece's " \u2047 ".
    assert hf.decode([1, 2, 3]) == sp.decode([1, 2, 3]) == ""
    assert hf.decode([0]) == sp.decode([0])


def test_converted_merge_order_within_a_piece_does_not_matter(sp_converted):
    """tokenizers ranks every merge apart, SentencePiece ranks a piece's splits alike.

    The rank order among one piece's splits could only matter when two of them
    overlap (symbols s1 s2 s3 with s1+s2 == s2+s3 == the piece); reversing that order
    changes no result here, where runs of one character (the likeliest case) abound.
    """
    import itertools as it

    import sentencepiece as spm
    from tokenizers import Tokenizer

    model, out = sp_converted
    with open(out, encoding="utf-8") as f:
        spec = json.load(f)
    groups = it.groupby(spec["model"]["merges"], key=lambda m: m[0] + m[1])
    spec["model"]["merges"] = [m for _, g in groups for m in reversed(list(g))]
    reordered = Tokenizer.from_str(json.dumps(spec))
    sp = spm.SentencePieceProcessor(model_file=model)
    runs = [
        p + c * n + q
        for c in " =-#\t0a"
        for n in range(1, 41)
        for p in ("", "x", "\n", "    def")
        for q in ("", "y", "\n", "self")
    ]
    for text in runs + _varied_strings(_corpus(), 200, seed=1):
        assert reordered.encode(text).ids == sp.encode(text), text


def test_converted_json_in_transformers_and_as_tokenizer_type(sp_converted):
    import transformers

    model, out = sp_converted
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=out)
    sp_tok = build_tokenizer("SentencePieceTokenizer", model)
    hf_tok = build_tokenizer("HuggingFaceTokenizer", out)
    assert (hf_tok.vocab_size, hf_tok.eod) == (sp_tok.vocab_size, sp_tok.eod)  # eod: </s>
    for text in _varied_strings(_corpus(), 150, seed=2):
        ids = sp_tok.tokenize(text)
        assert fast(text)["input_ids"] == fast.encode(text) == hf_tok.tokenize(text) == ids
        assert fast.decode(ids) == hf_tok.detokenize(ids) == sp_tok.detokenize(ids)


def test_converted_plain_text_normalization(tmp_path):
    """NFKC (the model's precompiled charsmap), whitespace trimming and collapsing and
    the dummy prefix match too; such a model is lossy by design, so decoding is
    compared with SentencePiece's decode.

    Except for grapheme clusters of several code points (a character plus combining
    marks, conjoining Hangul jamo): tokenizers' Precompiled normalizer rewrites a
    cluster under 6 bytes whole by its shortest matching rule and a longer one
    character by character, SentencePiece by the longest rule at each position.
    The random strings leave combining marks out; the two cases are checked apart.
    """
    import unicodedata

    import sentencepiece as spm
    from tokenizers import Tokenizer

    model = train_sentencepiece(
        _corpus(), str(tmp_path / "plain"), vocab_size=800, code_friendly=False
    )
    hf = Tokenizer.from_file(sentencepiece_to_tokenizer_json(model, str(tmp_path / "p.json")))
    sp = spm.SentencePieceProcessor(model_file=model)
    for text in _varied_strings(_corpus(), 300, seed=3):
        text = "".join(c for c in text if not unicodedata.category(c).startswith("M"))
        ids = sp.encode(text)
        assert hf.encode(text).ids == ids, text
        assert hf.decode(ids) == sp.decode(ids), text
    # The documented differences (a fix in tokenizers would show up here).
    assert sp.normalize("x\u3000\u0301y") == "\u2581x\u2581\u0301y"  # U+3000 -> " ", accent kept
    assert hf.normalizer.normalize_str("x\u3000\u0301y") == "\u2581x\u2581y"  # accent lost
    assert sp.normalize("\u1100\u1161") == "\u2581\uac00"  # jamo L+V composed
    assert hf.normalizer.normalize_str("\u1100\u1161") == "\u2581\u1100\u1161"  # not composed
    assert hf.encode("x\u3000\u0301y").ids != sp.encode("x\u3000\u0301y")


def test_conversion_refuses_what_it_cannot_match(tmp_path):
    unigram = train_sentencepiece(
        [TEXT * 20], str(tmp_path / "uni"), vocab_size=350, model_type="unigram"
    )
    with pytest.raises(ValueError, match="only BPE models convert"):
        sentencepiece_to_tokenizer_json(unigram, str(tmp_path / "u.json"))
    (tmp_path / "junk.model").write_bytes(b"\xff\xff\xff")
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        sentencepiece_to_tokenizer_json(str(tmp_path / "junk.model"), str(tmp_path / "j.json"))
    assert not (tmp_path / "u.json").exists()
