"""The run's tokenizer: the checks of the tokenizer flags (config/flags.py) and the tokenizer
rebuilt from the args a checkpoint records (tokenizer_for)."""

import pytest
from tokenizer_inputs import TEXT


@pytest.mark.parametrize(
    "argv,needle",
    [
        (
            ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"],
            "--vocab-file needs --merge-file",
        ),
        (
            ["--tokenizer-type", "GPT2BPETokenizer", "--merge-file", "m.txt"],
            "--merge-file needs --vocab-file",
        ),
        (
            ["--tokenizer-type", "GPT2BPETokenizer"],
            "GPT2BPETokenizer needs --vocab-file and --merge-file",
        ),
        (
            ["--vocab-file", "v.json", "--merge-file", "m.txt"],
            "are for --tokenizer-type GPT2BPETokenizer",
        ),
        (
            ["--tokenizer-type", "HuggingFaceTokenizer"],
            "HuggingFaceTokenizer needs --tokenizer-model",
        ),
    ],
)
def test_tokenizer_flag_validation(argv, needle):
    from mp_offload.config import ConfigError, parse_args, validate

    args = parse_args(["--train-iters", "1", "--data-path", "d", *argv])
    with pytest.raises(ConfigError, match=needle.replace("-", r"\-")):
        validate(args, 1)


def test_hf_types_need_their_own_data_path():
    from mp_offload.config import ConfigError, parse_args, validate

    args = parse_args(
        [
            "--train-iters",
            "1",
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            "t.json",
        ]
    )
    with pytest.raises(ConfigError, match="needs \\-\\-data\\-path"):
        validate(args, 1)  # the default corpus comes with its own SentencePiece model
    validate(
        parse_args(["--train-iters", "1", "--mock-data", "--tokenizer-type", "GPT2BPETokenizer"]), 1
    )  # mock data builds no tokenizer


def test_tokenizer_rebuilt_from_recorded_args(bbpe_dir, sp_model):
    """tokenizer_for rebuilds the run's tokenizer from the args a checkpoint records
    (every config dataclass as a dict, as checkpointing.save writes them)."""
    import dataclasses

    from mp_offload.config import parse_args, validate
    from mp_offload.data.tokenizer import GPT2BPETokenizer, HuggingFaceTokenizer
    from mp_offload.generation import tokenizer_for

    vocab, merges = str(bbpe_dir / "vocab.json"), str(bbpe_dir / "merges.txt")
    runs = {
        GPT2BPETokenizer: [
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            vocab,
            "--merge-file",
            merges,
        ],
        HuggingFaceTokenizer: [
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            str(bbpe_dir),
        ],
    }
    for cls, flags in runs.items():
        args = parse_args(["--train-iters", "1", "--data-path", "d", *flags])
        validate(args, 1)
        saved = {k: dataclasses.asdict(v) for k, v in vars(args).items()}
        tok, stops = tokenizer_for(saved, vocab_size=384)
        assert type(tok) is cls and stops and tok.eod == 0
        assert tok.detokenize(tok.tokenize(TEXT)) == TEXT
    # Flags given to the generator override what the run recorded.
    sp_run = {"data": {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": sp_model}}
    tok, _ = tokenizer_for(sp_run, 384, "GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert type(tok) is GPT2BPETokenizer
    assert tokenizer_for(sp_run, 512)[0].eod == 2
