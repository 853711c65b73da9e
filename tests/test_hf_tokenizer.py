"""export_tokenizer: AutoTokenizer.from_pretrained on the written files encodes text to
exactly the ids of the project's tokenizer, for each tokenizer type."""

import json
import os

import pytest
import transformers

from mp_offload.data.hf_tokenizer import export_tokenizer
from mp_offload.data.tokenizer import build_tokenizer
from mp_offload.data.tokenizer_training import train_bpe_bytelevel, train_sentencepiece

CODE = (
    'def parse(text, *, strict=False):\n    """Split ``text``."""\n'
    "    for i, line in enumerate(text.splitlines()):\n"
    "        if not line.strip():\n            continue  # blank\n"
    '        yield i, line.split("=", 1)\n\nclass Parser:\n\tpass\n'
)
STRINGS = [
    "def parse(",
    CODE,
    "x = {'a': 1, \"b\": [2, 3]}  # dict\n\n\n",
    "    indented\twith\ttabs   and  runs   of spaces  ",
    "naïve café résumé, 数字, emoji 🙂 and ✓",
    "</s> and <|endoftext|> and <s> in a document are text",
    "\n",
    "",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A SentencePiece BPE and a byte-level BPE (tokenizer.json + vocab/merges), trained
    on a little code."""
    d = tmp_path_factory.mktemp("tok")
    docs = [CODE.replace("text", f"text{i}").replace("line", f"ln{i % 7}") for i in range(50)]
    docs += ["prose about cafés, naïve résumés and 数字"] * 5
    sp = train_sentencepiece(docs, str(d / "sp"), vocab_size=400)
    train_bpe_bytelevel(docs, str(d / "bbpe"), vocab_size=400)
    return d, sp


def _data_args(kind, d, sp):
    return {
        "SentencePieceTokenizer": dict(tokenizer_type=kind, tokenizer_model=sp),
        "HuggingFaceTokenizer": dict(tokenizer_type=kind, tokenizer_model=str(d / "bbpe")),
        "GPT2BPETokenizer": dict(
            tokenizer_type=kind,
            vocab_file=str(d / "bbpe" / "vocab.json"),
            merge_file=str(d / "bbpe" / "merges.txt"),
        ),
    }[kind]


KINDS = ("SentencePieceTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer")


@pytest.mark.parametrize("kind", KINDS)
def test_auto_tokenizer_gives_the_projects_ids(trained, tmp_path, kind):
    d, sp = trained
    data = dict(_data_args(kind, d, sp), mock_data=False, data_path=["x"])  # as recorded
    out = str(tmp_path / "hf")
    files = export_tokenizer(data, out, model_max_length=256)
    model_files = ["vocab.json", "merges.txt"] if kind == "GPT2BPETokenizer" else ["tokenizer.json"]
    assert sorted(os.path.basename(f) for f in files) == sorted(
        model_files + ["special_tokens_map.json", "tokenizer_config.json"]
    )
    assert all(os.path.isfile(f) and os.path.dirname(f) == out for f in files)
    ours = build_tokenizer(
        kind,
        data.get("tokenizer_model"),
        vocab_file=data.get("vocab_file"),
        merge_file=data.get("merge_file"),
    )
    hf = transformers.AutoTokenizer.from_pretrained(out)
    eod_name = "</s>" if kind == "SentencePieceTokenizer" else "<|endoftext|>"
    assert hf.eos_token == hf.bos_token == eod_name and hf.eos_token_id == ours.eod
    assert hf.model_max_length == 256
    for text in STRINGS:
        ids = ours.tokenize(text)
        assert hf(text)["input_ids"] == hf.encode(text) == ids, text  # nothing added
        assert hf.decode(ids) == ours.detokenize(ids), text
    # The end-of-document id decodes to nothing, as the project's detokenize does.
    assert hf.decode([ours.eod], skip_special_tokens=True) == ours.detokenize([ours.eod]) == ""


def test_a_post_processor_that_adds_tokens_is_dropped(trained, tmp_path):
    """The run never saw BOS/EOS around its documents; a tokenizer.json that asks for them
    (and truncation, padding) exports without them."""
    d, _ = trained
    with open(d / "bbpe" / "tokenizer.json") as f:
        spec = json.load(f)
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}
        },
    }
    spec["truncation"] = {
        "direction": "Right",
        "max_length": 3,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    src = tmp_path / "with_bos.json"
    src.write_text(json.dumps(spec))
    out = str(tmp_path / "hf")
    export_tokenizer({"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(src)}, out)
    hf = transformers.AutoTokenizer.from_pretrained(out)
    ours = build_tokenizer("HuggingFaceTokenizer", str(src))
    assert hf.encode(CODE) == ours.tokenize(CODE) and len(ours.tokenize(CODE)) > 3


def test_no_text_tokenizer_writes_nothing(tmp_path):
    out = str(tmp_path / "hf")
    assert (
        export_tokenizer({"tokenizer_type": "SentencePieceTokenizer", "mock_data": True}, out) == []
    )
    assert export_tokenizer({"tokenizer_type": "NullTokenizer"}, out) == []
    assert not os.path.exists(out)
    with pytest.raises(FileNotFoundError, match="nope.model"):
        export_tokenizer(
            {
                "tokenizer_type": "SentencePieceTokenizer",
                "tokenizer_model": str(tmp_path / "nope.model"),
            },
            out,
        )
