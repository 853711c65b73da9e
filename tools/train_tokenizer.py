#!/usr/bin/env python
"""Train a tokenizer on JSONL or plain text.

--type sentencepiece (default): a SentencePiece model, PREFIX.model (+ .vocab), with
byte fallback and </s> as EOD (--tokenizer-type SentencePieceTokenizer); with
--tokenizer-json a BPE model is also written as PREFIX.tokenizer.json, which encodes
identically (--tokenizer-type HuggingFaceTokenizer).

--type bpe-bytelevel: a GPT-2 style byte-level BPE trained with Hugging Face
`tokenizers`, written to the directory PREFIX as tokenizer.json (--tokenizer-type
HuggingFaceTokenizer --tokenizer-model PREFIX) and vocab.json + merges.txt
(--tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ...), with
<|endoftext|> as EOD.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from mp_offload.data.sentencepiece_convert import sentencepiece_to_tokenizer_json
from mp_offload.data.tokenizer import build_tokenizer
from mp_offload.data.tokenizer_training import train_bpe_bytelevel, train_sentencepiece


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="*.json/*.jsonl (one object per line) or plain-text files",
    )
    p.add_argument(
        "--type",
        choices=["sentencepiece", "bpe-bytelevel"],
        default="sentencepiece",
        help="tokenizer to train (default: sentencepiece)",
    )
    p.add_argument(
        "--model-prefix",
        required=True,
        help="sentencepiece: writes PREFIX.model and PREFIX.vocab; "
        "bpe-bytelevel: the directory for tokenizer.json, vocab.json, merges.txt",
    )
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument(
        "--model-type", choices=["bpe", "unigram"], default="bpe", help="sentencepiece only"
    )
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument(
        "--max-train-bytes",
        type=int,
        default=32 << 20,
        help="read at most this much text (default 32 MiB)",
    )
    p.add_argument(
        "--input-sentence-size",
        type=int,
        default=300_000,
        help="sentencepiece: train on a seeded sample of at most this many lines",
    )
    p.add_argument("--num-threads", type=int, default=None, help="sentencepiece only")
    p.add_argument(
        "--plain-text-normalization",
        action="store_true",
        help="sentencepiece: NFKC + whitespace collapsing instead of the lossless, "
        "code-friendly default",
    )
    p.add_argument(
        "--tokenizer-json",
        action="store_true",
        help="sentencepiece (bpe): also write the model as PREFIX.tokenizer.json",
    )
    p.add_argument(
        "--min-frequency",
        type=int,
        default=2,
        help="bpe-bytelevel: merge only pairs seen at least this often",
    )
    args = p.parse_args(argv)

    for path in args.input:
        if not os.path.isfile(path):
            print(f"error: input file not found: {path}", file=sys.stderr)
            return 1
    if args.tokenizer_json and (args.type != "sentencepiece" or args.model_type != "bpe"):
        print(
            "error: --tokenizer-json needs --type sentencepiece --model-type bpe", file=sys.stderr
        )
        return 1
    start = time.perf_counter()
    try:
        if args.type == "bpe-bytelevel":
            out = train_bpe_bytelevel(
                args.input,
                args.model_prefix,
                args.vocab_size,
                json_keys=args.json_keys,
                max_train_bytes=args.max_train_bytes,
                min_frequency=args.min_frequency,
            )
            tok = build_tokenizer("HuggingFaceTokenizer", out)
            written = f"{out} (+ vocab.json, merges.txt)"
        else:
            out = train_sentencepiece(
                args.input,
                args.model_prefix,
                args.vocab_size,
                model_type=args.model_type,
                json_keys=args.json_keys,
                max_train_bytes=args.max_train_bytes,
                input_sentence_size=args.input_sentence_size,
                num_threads=args.num_threads,
                code_friendly=not args.plain_text_normalization,
            )
            tok = build_tokenizer("SentencePieceTokenizer", out)
            written = out
            if args.tokenizer_json:
                written += " and " + sentencepiece_to_tokenizer_json(
                    out, args.model_prefix + ".tokenizer.json"
                )
    except (ValueError, RuntimeError, OSError) as e:
        msg = (str(e).splitlines() or [repr(e)])[0].strip("'\"")
        print(f"error: {msg}", file=sys.stderr)
        return 1
    print(
        f"wrote {written} (vocab {tok.vocab_size}, eod id {tok.eod}) "
        f"in {time.perf_counter() - start:.1f}s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
