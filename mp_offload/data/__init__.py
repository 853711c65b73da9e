"""Data layer: from text files to the micro-batches of one training run.

  tokenizer.py        SentencePieceTokenizer, HuggingFaceTokenizer (a ``tokenizers``
                      tokenizer.json), GPT2BPETokenizer (vocab.json + merges.txt) and
                      NullTokenizer, chosen by ``build_tokenizer``
  tokenizer_training.py  ``train_sentencepiece``, ``train_bpe_bytelevel``
  sentencepiece_convert.py  SentencePiece BPE -> identical tokenizer.json
  preprocess.py       JSONL / plain text -> MMIDIDX files (tools/preprocess_data.py)
  indexed_dataset.py  Megatron's "MMIDIDX" .bin/.idx format: builder and mmap reader
  gpt_dataset.py      GPT samples over the token stream (cached index arrays),
                      train/valid/test datasets
  data_path.py        --data-path / --split parsing (no torch: read with the flags)
  blended_dataset.py  weighted blends of several datasets
  samplers.py         PretrainingSampler (resumable, one slice per DP rank) and collate
  default_corpus.py   the zero-download default: the Python stdlib's own source
  loader.py           MockGPTDataset, and BatchIterator: TP rank 0 reads, its TP group
                      receives a broadcast
  build.py            a run's datasets and batch iterators from its flags
  checks.py           --data-path prefixes, tokenizer files, token ids vs vocabulary
  hf_tokenizer.py     a run's tokenizer as Hugging Face AutoTokenizer files

Import from the modules themselves (``from mp_offload.data.tokenizer import ...``): the
package re-exports nothing, so importing one module does not load the others (the
``tokenizers`` and ``sentencepiece`` packages are imported only when used).
"""
