"""The texts and the small tokenizers the tokenizer tests train (nothing is downloaded),
shared by tests/test_tokenizer*.py, test_sentencepiece_convert.py, test_run_tokenizer.py."""

import json

from mp_offload.data.tokenizer_training import train_bpe_bytelevel, train_sentencepiece

TEXT = (
    "def greet(name):\n"
    '    """Say hello."""\n'
    "    return f'Hello, {name}!'\n\n"
    "class Counter:\n"
    "    def __init__(self):\n"
    "        self.count = 0\n\n"
    "    def bump(self, by=1):\n"
    "        self.count += by\n"
    "        return self.count\n"
)

VARIED = [
    TEXT,
    "  indented\n\ttabs\t\tand  double  spaces \n\n\n",
    "unseen ✓ ünïcode 数字 123 😀 Ωмега",
    "x = {'a': [1, 2.5e-3]}  # comment\r\n",
    "the literal <|endoftext|> and </s> are plain text",
    " ",
    "",
]


def small_sentencepiece(d) -> str:
    """A SentencePiece BPE (vocabulary 400) trained in directory ``d``; its model path."""
    path = d / "corpus.jsonl"
    with open(path, "w") as f:
        f.writelines(
            json.dumps({"text": TEXT.replace("name", f"name{i}")}) + "\n" for i in range(40)
        )  # a few KB
    return train_sentencepiece([str(path)], str(d / "tok"), vocab_size=400, model_type="bpe")


def small_bpe_bytelevel(d):
    """A byte-level BPE (vocabulary 330) trained into directory ``d``; ``d``."""
    docs = [TEXT.replace("name", f"name{i}") for i in range(40)]
    docs.append("prose about cafés, naïve résumés")
    train_bpe_bytelevel(docs, str(d), vocab_size=330)
    return d
