"""The tokenizer of a run as Hugging Face ``AutoTokenizer`` files.

``export_tokenizer(data_args, out_dir)`` writes, for the tokenizer a run trained with
(its data arguments, as recorded in a checkpoint's ``common.pt["args"]["data"]``; see
``data.tokenizer.tokenizer_for``), the files ``AutoTokenizer.from_pretrained(out_dir)``
loads, such that it encodes text to exactly the ids the run trained on:

* SentencePieceTokenizer: ``tokenizer.json`` from ``sentencepiece_to_tokenizer_json``
  (the same ids as SentencePiece; BPE models only).
* HuggingFaceTokenizer: its ``tokenizer.json``, with the settings the project ignores
  removed: truncation, padding and a post-processor that adds tokens (the project
  encodes without special tokens, so the model never saw them).
* GPT2BPETokenizer: ``vocab.json`` and ``merges.txt`` as they are (GPT-2's own format).

Each also gets ``tokenizer_config.json`` and ``special_tokens_map.json``: the run's
end-of-document token is both EOS and BOS, nothing is added on encode
(``add_bos_token``/``add_eos_token`` false), special-token text inside a document is
encoded as text (``split_special_tokens``, as the project does, so a document cannot
forge an EOD), and decoding does not "clean up" spaces.

A mock-data or NullTokenizer run has no text tokenizer: nothing is written, ``[]``.
"""

from __future__ import annotations

import json
import os
import shutil

from .sentencepiece_convert import sentencepiece_to_tokenizer_json
from .tokenizer import _PAD_TOKEN_NAMES, EOD_TOKEN_NAMES, GPT2_EOD, build_tokenizer

# Post-processors that put tokens around the text (BOS/EOS, [CLS]/[SEP]); ByteLevel only
# fixes offsets and is kept.
_ADDING_POST_PROCESSORS = ("TemplateProcessing", "BertProcessing", "RobertaProcessing")


def export_tokenizer(
    data_args: dict, out_dir: str, *, model_max_length: int | None = None
) -> list[str]:
    """Write the run's tokenizer for ``AutoTokenizer`` into ``out_dir``; returns the paths
    written. ``data_args``: the run's DataConfig as a dict (tokenizer_type,
    tokenizer_model, vocab_file, merge_file, mock_data). ``model_max_length``: the
    model's context (max_position_embeddings), recorded when given. Raises ValueError
    (FileNotFoundError) when the tokenizer cannot be rebuilt or converted."""
    kind = data_args.get("tokenizer_type")
    if data_args.get("mock_data") or kind in (None, "NullTokenizer"):
        return []
    os.makedirs(out_dir, exist_ok=True)
    if kind == "SentencePieceTokenizer":
        files, special = _sentencepiece(data_args, out_dir)
        cls = "PreTrainedTokenizerFast"
    elif kind == "HuggingFaceTokenizer":
        files, special = _tokenizer_json(data_args, out_dir)
        cls = "PreTrainedTokenizerFast"
    elif kind == "GPT2BPETokenizer":
        files, special = _gpt2(data_args, out_dir)
        cls = "GPT2Tokenizer"
    else:
        raise ValueError(f"cannot export tokenizer type {kind!r}")
    config = dict(
        tokenizer_class=cls,
        **special,
        add_bos_token=False,
        add_eos_token=False,
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
    )
    if cls == "GPT2Tokenizer":
        config.update(add_prefix_space=False, errors="replace")
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    files.append(_write_json(os.path.join(out_dir, "tokenizer_config.json"), config))
    files.append(_write_json(os.path.join(out_dir, "special_tokens_map.json"), special))
    return files


def _special(eod: str, unk: str | None = None, pad: str | None = None) -> dict:
    out = {"bos_token": eod, "eos_token": eod}
    if unk is not None:
        out["unk_token"] = unk
    if pad is not None:
        out["pad_token"] = pad
    return out


def _sentencepiece(data: dict, out_dir: str) -> tuple[list[str], dict]:
    import sentencepiece as spm

    model = data.get("tokenizer_model")
    tok = build_tokenizer("SentencePieceTokenizer", model)  # checks the file, finds the EOD
    sp = spm.SentencePieceProcessor(model_file=model)
    path = sentencepiece_to_tokenizer_json(model, os.path.join(out_dir, "tokenizer.json"))
    pad = sp.id_to_piece(tok.pad) if tok.pad is not None else None
    return [path], _special(sp.id_to_piece(tok.eod), sp.id_to_piece(tok.unk), pad)


def _tokenizer_json(data: dict, out_dir: str) -> tuple[list[str], dict]:
    tok = build_tokenizer("HuggingFaceTokenizer", data.get("tokenizer_model"))
    with open(tok.model_file, encoding="utf-8") as f:
        spec = json.load(f)
    # What the project never applies would change the ids in transformers.
    spec["truncation"] = None
    spec["padding"] = None
    post = spec.get("post_processor")
    if post and _adds_tokens(post):
        spec["post_processor"] = None
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(tok.model_file).get_vocab(with_added_tokens=True)
    eod = next(n for n in EOD_TOKEN_NAMES if n in vocab)  # as HuggingFaceTokenizer chose
    unk = (spec.get("model") or {}).get("unk_token")
    pad = next((n for n in _PAD_TOKEN_NAMES if n in vocab), None)
    path = _write_json(os.path.join(out_dir, "tokenizer.json"), spec)
    return [path], _special(eod, unk if unk in vocab else None, pad)


def _adds_tokens(post: dict) -> bool:
    if post.get("type") == "Sequence":
        return any(_adds_tokens(p) for p in post.get("processors", []))
    return post.get("type") in _ADDING_POST_PROCESSORS


def _gpt2(data: dict, out_dir: str) -> tuple[list[str], dict]:
    vocab, merges = data.get("vocab_file"), data.get("merge_file")
    build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)  # checks both
    files = []
    for src, name in ((vocab, "vocab.json"), (merges, "merges.txt")):
        dst = os.path.join(out_dir, name)
        if os.path.abspath(src) != os.path.abspath(dst):
            shutil.copyfile(src, dst)
        files.append(dst)
    return files, _special(GPT2_EOD, GPT2_EOD)


def _write_json(path: str, obj) -> str:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)
    return path
