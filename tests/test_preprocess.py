"""tools/preprocess_data.py logic (in-process) and the cached default corpus."""

import json
import os

import numpy as np
import pytest

from mp_offload.data.indexed_dataset import MMapIndexedDataset
from mp_offload.data.preprocess import main


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")


@pytest.fixture
def messy_jsonl(tmp_path):
    path = tmp_path / "in.jsonl"
    _write_jsonl(
        path,
        [
            {"text": "1 2 3"},
            "{not json",  # line 2: bad JSON
            {"text": "   "},  # line 3: empty document
            {"other": "4 5"},  # line 4: missing key
            "",  # line 5: blank line, silently ignored
            {"text": "6 7"},
        ],
    )
    return str(path)


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _null_args(inp, out, *extra):
    return [
        "--input",
        inp,
        "--output-prefix",
        out,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "100",
        *extra,
    ]


def test_skip_bad_lines(messy_jsonl, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert main(_null_args(messy_jsonl, out, "--append-eod")) == 0
    err = capsys.readouterr().err
    for line_no, what in ((2, "bad JSON"), (3, "empty document"), (4, "missing key 'text'")):
        assert f"in.jsonl:{line_no}: {what}" in err
    assert "in.jsonl:5" not in err
    assert "2 documents" in err and "3 skipped" in err
    ds = MMapIndexedDataset(out + "_text_document")
    assert [x.tolist() for x in ds[0:2]] == [[1, 2, 3, 100], [6, 7, 100]]  # EOD = 100
    assert ds.dtype == np.uint16


def test_fail_mode(messy_jsonl, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert main(_null_args(messy_jsonl, out, "--on-bad-line", "fail")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "in.jsonl:2: bad JSON" in err[-1]
    assert not any(n.startswith("out") for n in os.listdir(tmp_path))  # no partial outputs


def test_missing_input(tmp_path, capsys):
    missing = str(tmp_path / "nope.jsonl")
    assert main(_null_args(missing, str(tmp_path / "o"))) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: input file not found: {missing}"


def test_no_documents_is_an_error_naming_input_and_key(messy_jsonl, tmp_path, capsys):
    """A wrong --json-keys skips every line: exit 1 naming the input and the key, instead
    of an empty dataset that fails later, in training."""
    out = str(tmp_path / "out")
    assert main(_null_args(messy_jsonl, out, "--json-keys", "content")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"error: no documents in {messy_jsonl} under --json-keys content: all 5 "
        f"lines were skipped (the first: {messy_jsonl}:1: missing key "
        f"'content'); nothing written"
    ), err[-1]
    assert not any(n.startswith("out") for n in os.listdir(tmp_path))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(_null_args(str(empty), out)) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: no documents in {empty} (the input is empty); nothing written"
    )


@pytest.mark.slow  # --workers 2: a spawned process pool
def test_workers_identical(tmp_path):
    rng = np.random.RandomState(0)
    path = str(tmp_path / "big.jsonl")
    _write_jsonl(
        path,
        [
            {
                "text": " ".join(map(str, rng.randint(0, 100, rng.randint(1, 30)))),
                "title": str(i % 100),
            }
            for i in range(500)
        ],
    )
    outs = []
    for workers in (1, 2):
        out = str(tmp_path / f"w{workers}")
        assert (
            main(
                _null_args(
                    path,
                    out,
                    "--workers",
                    str(workers),
                    "--chunksize",
                    "7",
                    "--json-keys",
                    "text",
                    "title",
                    "--append-eod",
                )
            )
            == 0
        )
        outs.append(out)
    for key in ("text", "title"):
        for ext in (".bin", ".idx"):
            a, b = (_read(f"{o}_{key}_document{ext}") for o in outs)
            assert a == b
    assert len(MMapIndexedDataset(outs[0] + "_title_document")) == 500


def test_plain_text_is_one_document_per_file(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("1 2\n\n3\n")
    b.write_text("4")
    out = str(tmp_path / "pt")
    assert (
        main(
            [
                "--input",
                str(a),
                str(b),
                "--output-prefix",
                out,
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "10",
            ]
        )
        == 0
    )
    ds = MMapIndexedDataset(out + "_text_document")
    assert [x.tolist() for x in ds[0:2]] == [[1, 2, 3], [4]]


def test_sentencepiece_path(tmp_path):
    from mp_offload.data.tokenizer import build_tokenizer
    from mp_offload.data.tokenizer_training import train_sentencepiece

    text = "import os\nprint(os.getcwd())\n" * 30
    model = train_sentencepiece([text], str(tmp_path / "sp"), vocab_size=300)
    path = str(tmp_path / "d.jsonl")
    _write_jsonl(path, [{"text": text}, {"text": "x = 1\n"}])
    out = str(tmp_path / "sp_out")
    assert (
        main(["--input", path, "--output-prefix", out, "--tokenizer-model", model, "--append-eod"])
        == 0
    )
    tok = build_tokenizer("SentencePieceTokenizer", model)
    ds = MMapIndexedDataset(out + "_text_document")
    assert ds[1][-1] == tok.eod
    assert tok.detokenize(ds[1][:-1].tolist()) == "x = 1\n"


def test_default_corpus_small(tmp_path, capsys):
    from mp_offload.data.default_corpus import prepare_default_corpus
    from mp_offload.data.tokenizer import build_tokenizer

    cache = str(tmp_path / "corpus")
    prefix, model = prepare_default_corpus(cache, vocab_size=512, max_bytes=150_000)
    assert prefix == os.path.join(cache, "stdlib_text_document")
    assert "[default corpus]" in capsys.readouterr().out
    ds = MMapIndexedDataset(prefix)
    tok = build_tokenizer("SentencePieceTokenizer", model)
    assert len(ds) > 3 and int(ds.sizes.sum()) > 10_000
    assert all(int(ds[i][-1]) == tok.eod for i in range(len(ds)))
    assert os.path.getsize(os.path.join(cache, "stdlib.jsonl")) <= 150_000 * 1.1

    mtime = os.path.getmtime(prefix + ".bin")
    assert prepare_default_corpus(cache, vocab_size=512, max_bytes=150_000) == (prefix, model)
    assert capsys.readouterr().out == ""  # cache hit: silent, nothing rebuilt
    assert os.path.getmtime(prefix + ".bin") == mtime

    # A missing stamp (e.g. a run killed before finishing) forces a rebuild.
    os.remove(os.path.join(cache, "stdlib_corpus.json"))
    prepare_default_corpus(cache, vocab_size=512, max_bytes=150_000)
    assert "building" in capsys.readouterr().out


# ------------------------------------------- Hugging Face tokenizer.json and GPT-2 BPE
CODE = "def f(x):\n    return x * 2  # ✓ ünï 数字\n\n\tclass A:\n        pass\n"


@pytest.fixture(scope="module")
def hf_files(tmp_path_factory):
    """A byte-level BPE (tokenizer.json + vocab.json/merges.txt) and a SentencePiece
    model with its tokenizer.json conversion, all trained here."""
    from mp_offload.data.sentencepiece_convert import sentencepiece_to_tokenizer_json
    from mp_offload.data.tokenizer_training import train_bpe_bytelevel, train_sentencepiece

    d = tmp_path_factory.mktemp("hf")
    docs = [CODE.replace("x", f"x{i}") for i in range(60)]
    train_bpe_bytelevel(docs, str(d / "bbpe"), vocab_size=300)
    sp = train_sentencepiece(docs, str(d / "sp"), vocab_size=300)
    sentencepiece_to_tokenizer_json(sp, str(d / "sp.tokenizer.json"))
    path = str(d / "docs.jsonl")
    rng = np.random.RandomState(0)
    _write_jsonl(
        path, [{"text": CODE[rng.randint(0, 20) :] * rng.randint(1, 4)} for _ in range(300)]
    )
    return d, path


TOKENIZER_FLAGS = {
    "HuggingFaceTokenizer": lambda d: ["--tokenizer-model", str(d / "bbpe")],
    "GPT2BPETokenizer": lambda d: [
        "--vocab-file",
        str(d / "bbpe" / "vocab.json"),
        "--merge-file",
        str(d / "bbpe" / "merges.txt"),
    ],
}


@pytest.mark.slow  # --workers 2: a spawned process pool
@pytest.mark.parametrize("kind", sorted(TOKENIZER_FLAGS))
def test_hf_types_workers_identical(hf_files, tmp_path, kind):
    from mp_offload.data.tokenizer import build_tokenizer

    d, path = hf_files
    outs = []
    for workers in (1, 2):
        out = str(tmp_path / f"w{workers}")
        assert (
            main(
                [
                    "--input",
                    path,
                    "--output-prefix",
                    out,
                    "--tokenizer-type",
                    kind,
                    *TOKENIZER_FLAGS[kind](d),
                    "--workers",
                    str(workers),
                    "--chunksize",
                    "9",
                    "--append-eod",
                ]
            )
            == 0
        )
        outs.append(out + "_text_document")
    for ext in (".bin", ".idx"):
        assert _read(outs[0] + ext) == _read(outs[1] + ext)
    tok = build_tokenizer("HuggingFaceTokenizer", str(d / "bbpe"))
    ds = MMapIndexedDataset(outs[0])
    assert len(ds) == 300 and ds.dtype == np.uint16
    with open(path) as f:
        first = json.loads(f.readline())["text"]
    assert ds[0][-1] == tok.eod == 0 and tok.detokenize(ds[0][:-1].tolist()) == first


@pytest.mark.slow  # --workers 2: a spawned process pool
def test_converted_sentencepiece_gives_the_same_dataset(hf_files, tmp_path):
    """The SentencePiece model and its tokenizer.json write byte-identical datasets."""
    d, path = hf_files
    sp_out, hf_out = str(tmp_path / "sp"), str(tmp_path / "hf")
    assert (
        main(
            [
                "--input",
                path,
                "--output-prefix",
                sp_out,
                "--tokenizer-model",
                str(d / "sp.model"),
                "--append-eod",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "--input",
                path,
                "--output-prefix",
                hf_out,
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--tokenizer-model",
                str(d / "sp.tokenizer.json"),
                "--append-eod",
                "--workers",
                "2",
            ]
        )
        == 0
    )
    for ext in (".bin", ".idx"):
        assert _read(f"{sp_out}_text_document{ext}") == _read(f"{hf_out}_text_document{ext}")


@pytest.mark.parametrize(
    "flags,needle",
    [
        (
            ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"],
            "GPT2BPETokenizer needs --vocab-file and --merge-file",
        ),
        (
            [
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                "v.json",
                "--merge-file",
                "m.txt",
            ],
            "--vocab-file v.json: file not found",
        ),
        (
            ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "nowhere"],
            "--tokenizer-model nowhere: no tokenizer.json",
        ),
    ],
)
def test_hf_types_flag_errors(messy_jsonl, tmp_path, capsys, flags, needle):
    assert main(["--input", messy_jsonl, "--output-prefix", str(tmp_path / "o"), *flags]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err


def test_progress_bar_shows_rate_and_eta(messy_jsonl, tmp_path):
    """--progress bar: a tqdm bar over the input bytes (rate, ETA), warnings above it,
    filled at the end (blank lines are never documents); the same dataset as lines."""
    import io

    from mp_offload.data.preprocess import preprocess

    outs = {}
    for mode in ("bar", "lines"):
        log = io.StringIO()
        prefix = str(tmp_path / mode)
        stats = preprocess(
            [messy_jsonl],
            prefix,
            "NullTokenizer",
            vocab_size=100,
            append_eod=True,
            log=log,
            log_interval=1,
            progress=mode,
        )
        assert stats.documents == 2 and stats.skipped == 3
        outs[mode] = (log.getvalue(), _read(prefix + "_text_document.bin"))
    bar, lines = outs["bar"][0], outs["lines"][0]
    assert outs["bar"][1] == outs["lines"][1]
    size = os.path.getsize(messy_jsonl)
    assert f"tokenizing: 100%|##########| {size:.1f}/{size:.1f} [" in bar
    assert "B/s" in bar and "<" in bar  # rate, and the elapsed<remaining ETA field
    assert "warning: skipping" in bar and "processed 1 documents" not in bar
    assert "processed 1 documents" in lines and "processed 2 documents" in lines
    assert "tokenizing" not in lines
