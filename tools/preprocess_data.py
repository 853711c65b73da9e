#!/usr/bin/env python
"""Tokenise JSONL / plain-text files into Megatron MMIDIDX .bin/.idx files.

Thin wrapper: the logic lives in mp_offload.data.preprocess (so tests can call
it in-process). Run with --help for the flags.
"""

import sys

from mp_offload.data.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
