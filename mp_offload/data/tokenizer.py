"""Tokenizers: the types ``--tokenizer-type`` names and ``build_tokenizer``.

Types: SentencePieceTokenizer, HuggingFaceTokenizer (a ``tokenizers``
tokenizer.json), GPT2BPETokenizer (GPT-2 vocab.json + merges.txt) and
NullTokenizer (for tests). All expose ``vocab_size``,
``tokenize(text) -> list[int]``, ``detokenize(ids) -> str``, ``eod``
(end-of-document id) and ``pad`` (or None). The Hugging Face ``tokenizers``
package is imported only when one of its types is built.

Training lives in tokenizer_training.py, the SentencePiece -> tokenizer.json
conversion in sentencepiece_convert.py.
"""

from __future__ import annotations

import os


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
        try:
            ids = [int(t) for t in text.split()]
        except ValueError:
            word = next((t for t in text.split() if not t.lstrip("-").isdigit()), text)
            raise ValueError(
                f"{word!r} is not a token id: the NullTokenizer reads whitespace-separated "
                f"ids 0..{self._base - 1}"
            ) from None
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


TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "NullTokenizer",
)
# End-of-text token names, in the order they are looked for.
EOD_TOKEN_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
_PAD_TOKEN_NAMES = ("<pad>", "<|pad|>", "[PAD]")
GPT2_EOD = "<|endoftext|>"


def _import_tokenizers(flag: str):
    """The ``tokenizers`` module, or a one-line ValueError naming the flag that needs it."""
    try:
        import tokenizers
    except ImportError:
        raise ValueError(
            f"{flag} needs the Hugging Face `tokenizers` package (pip install tokenizers)"
        ) from None
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
            raise FileNotFoundError(
                f"--tokenizer-model {path}: no tokenizer.json file there (HuggingFaceTokenizer)"
            )
        tk = _import_tokenizers("--tokenizer-type HuggingFaceTokenizer")
        try:
            tok = tk.Tokenizer.from_file(file)
        except Exception as e:  # noqa: BLE001 - the Rust side raises a plain Exception
            raise ValueError(
                f"--tokenizer-model {file}: not a tokenizer.json ({_first_line(e)})"
            ) from None
        eod = next((i for i in map(tok.token_to_id, EOD_TOKEN_NAMES) if i is not None), None)
        if eod is None:
            raise ValueError(
                f"--tokenizer-model {file}: no end-of-text token to use as EOD "
                f"(looked for {', '.join(EOD_TOKEN_NAMES)})"
            )
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
            raise ValueError(
                f"--vocab-file {vocab_file} / --merge-file {merge_file}: "
                f"cannot read them ({_first_line(e)})"
            ) from None
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
        raise ValueError(
            f"vocab_extra_ids is only supported by SentencePieceTokenizer, not {tokenizer_type}"
        )
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError(
                "HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json "
                "or a directory holding one)"
            )
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file is None or merge_file is None:
            raise ValueError("GPT2BPETokenizer needs --vocab-file and --merge-file")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(
        f"unknown tokenizer type {tokenizer_type!r} (expected one of {', '.join(TOKENIZER_TYPES)})"
    )


def tokenizer_for(
    saved_args: dict,
    vocab_size: int,
    tokenizer_type: str | None = None,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
):
    """The run's tokenizer, (tokenizer, stops_at_eod): the flags' tokenizer, else the one
    the run trained with (training, generation and export all build it here).

    The run's is rebuilt from its recorded data args (``--tokenizer-type``,
    ``--tokenizer-model``, ``--vocab-file``, ``--merge-file``); a flag given here
    overrides the recorded value. A NullTokenizer gets the model's vocabulary (its EOD
    is the last id). Mock-data runs had no tokenizer and no documents: ids as text,
    and no EOD to stop at.
    """
    data = saved_args.get("data", {})
    mock = tokenizer_type is None and data.get("mock_data", False)
    tokenizer_type = tokenizer_type or ("NullTokenizer" if mock else data.get("tokenizer_type"))
    if tokenizer_type == "NullTokenizer":
        return build_tokenizer("NullTokenizer", vocab_size=vocab_size - 1), not mock
    return build_tokenizer(
        tokenizer_type,
        tokenizer_model or data.get("tokenizer_model"),
        vocab_file=vocab_file or data.get("vocab_file"),
        merge_file=merge_file or data.get("merge_file"),
    ), True


def _atomic_write(path: str, data: bytes) -> None:
    """Written aside, then renamed: a reader never sees a half-written file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
