"""Data layer: MMIDIDX datasets, tokenizers, GPT samples, blends, samplers, default corpus.

Pure numpy/python; distributed reading/broadcasting is the training loop's job.
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
from .tokenizer import (
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    train_sentencepiece,
)

__all__ = [
    "BlendedDataset", "build_blending_indices", "prepare_default_corpus", "GPTDataset",
    "build_train_valid_test_datasets", "parse_data_path", "split_bounds", "IndexedDatasetBuilder",
    "MMapIndexedDataset", "best_dtype", "exists", "PreprocessError", "preprocess",
    "PretrainingSampler", "collate", "NullTokenizer", "SentencePieceTokenizer", "build_tokenizer",
    "train_sentencepiece",
]
