#!/usr/bin/env python
"""Train a SentencePiece tokenizer (byte fallback, </s> as EOD) on JSONL or plain text."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from mp_offload.data.tokenizer import build_tokenizer, train_sentencepiece


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--input", nargs="+", required=True,
                   help="*.json/*.jsonl (one object per line) or plain-text files")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--max-train-bytes", type=int, default=32 << 20,
                   help="read at most this much text (default 32 MiB)")
    p.add_argument("--input-sentence-size", type=int, default=300_000,
                   help="train on a seeded sample of at most this many lines")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--plain-text-normalization", action="store_true",
                   help="NFKC + whitespace collapsing instead of the lossless, code-friendly default")
    args = p.parse_args(argv)

    for path in args.input:
        if not os.path.isfile(path):
            print(f"error: input file not found: {path}", file=sys.stderr)
            return 1
    start = time.perf_counter()
    try:
        model = train_sentencepiece(
            args.input, args.model_prefix, args.vocab_size, model_type=args.model_type,
            json_keys=args.json_keys, max_train_bytes=args.max_train_bytes,
            input_sentence_size=args.input_sentence_size, num_threads=args.num_threads,
            code_friendly=not args.plain_text_normalization,
        )
    except (ValueError, RuntimeError) as e:
        msg = (str(e).splitlines() or [repr(e)])[0].strip("'\"")
        print(f"error: {msg}", file=sys.stderr)
        return 1
    tok = build_tokenizer("SentencePieceTokenizer", model)
    print(f"wrote {model} (vocab {tok.vocab_size}, eod id {tok.eod}) "
          f"in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
