"""Data layer: from text files to the micro-batches of one training run.

  tokenizer.py        SentencePieceTokenizer, HuggingFaceTokenizer (a ``tokenizers``
                      tokenizer.json), GPT2BPETokenizer (vocab.json + merges.txt) and
                      NullTokenizer, chosen by ``build_tokenizer``
  tokenizer_training.py  ``train_sentencepiece``, ``train_bpe_bytelevel``
  sentencepiece_convert.py  SentencePiece BPE -> identical tokenizer.json
  preprocess.py       JSONL / plain text -> MMIDIDX files (tools/preprocess_data.py)
  indexed_dataset.py  Megatron's "MMIDIDX" .bin/.idx format: builder and mmap reader
  gpt_dataset.py      GPT samples over the token stream (cached index arrays),
                      --data-path / --split parsing, train/valid/test datasets
  blended_dataset.py  weighted blends of several datasets
  samplers.py         PretrainingSampler (resumable, one slice per DP rank) and collate
  default_corpus.py   the zero-download default: the Python stdlib's own source
  loader.py           MockGPTDataset, and BatchIterator: TP rank 0 reads, its TP group
                      receives a broadcast
  build.py            a run's datasets and batch iterators from its flags

The package re-exports the main names of every module but loader.py and build.py,
which the training loop imports itself (they need torch.distributed and
parallel_state); the ``tokenizers`` and ``sentencepiece`` packages are imported only
when used.
"""

from .blended_dataset import BlendedDataset, build_blending_indices
from .default_corpus import prepare_default_corpus
from .gpt_dataset import (
    GPTDataset,
    build_train_valid_test_datasets,
    parse_data_path,
    split_bounds,
)
from .indexed_dataset import (
    IndexedDatasetBuilder,
    MMapIndexedDataset,
    best_dtype,
    exists,
)
from .preprocess import PreprocessError, preprocess
from .samplers import PretrainingSampler, collate
from .sentencepiece_convert import sentencepiece_to_tokenizer_json
from .tokenizer import (
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
)
from .tokenizer_training import train_bpe_bytelevel, train_sentencepiece

__all__ = [
    "BlendedDataset",
    "build_blending_indices",
    "prepare_default_corpus",
    "GPTDataset",
    "build_train_valid_test_datasets",
    "parse_data_path",
    "split_bounds",
    "IndexedDatasetBuilder",
    "MMapIndexedDataset",
    "best_dtype",
    "exists",
    "PreprocessError",
    "preprocess",
    "PretrainingSampler",
    "collate",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "build_tokenizer",
    "train_sentencepiece",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "train_bpe_bytelevel",
    "sentencepiece_to_tokenizer_json",
]
