"""GPT pretraining samples from an MMIDIDX dataset (Megatron-style index arrays).

The selected documents are concatenated into one token stream per epoch
(document order reshuffled each epoch); sample ``i`` is the stream slice
``[i*seq_length, i*seq_length + seq_length + 1)``, so consecutive samples
share one token (the last input of one is the first of the next), and the
order in which samples are served is shuffled once more.

Three index arrays describe this and are cached as .npy files whose names hash
every parameter (and the data's sizes), so a later run loads them unchanged.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Sequence

import numpy as np

from ..runtime.logger import log
from .data_path import parse_data_path, parse_split
from .indexed_dataset import MMapIndexedDataset

__all__ = ["parse_data_path", "parse_split"]  # (defined without torch in data_path.py)

_INDEX_FORMAT = 1  # bump when the meaning of the cached arrays changes


def _log(msg: str) -> None:
    log.info(msg)


def num_epochs_needed(tokens_per_epoch: int, num_samples: int, seq_length: int) -> int:
    """Fewest passes whose stream holds num_samples samples (+1 token for the last target)."""
    return max(1, math.ceil((num_samples * seq_length + 1) / tokens_per_epoch))


def build_index_arrays(
    sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int
):
    """(doc_idx, sample_idx, shuffle_idx), deterministic in the arguments.

    doc_idx: document order of the whole multi-epoch stream.
    sample_idx[i] = (position in doc_idx, token offset) where sample i starts.
    shuffle_idx: permutation of range(num_samples), the serving order.
    """
    documents = np.asarray(documents)
    tokens_per_epoch = int(sizes[documents].astype(np.int64).sum())
    if tokens_per_epoch <= 0:
        raise ValueError("the selected documents contain no tokens")
    epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length)
    rng = np.random.RandomState(seed)
    idx_dtype = np.int32 if documents.size == 0 or documents.max() < 2**31 else np.int64
    doc_idx = np.concatenate([rng.permutation(documents) for _ in range(epochs)]).astype(idx_dtype)

    # Start of every document in the stream; a sample starting at token p lies in
    # the last document whose start is <= p ("right" also skips empty documents).
    doc_start = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(sizes[doc_idx], dtype=np.int64, out=doc_start[1:])
    starts = np.arange(num_samples, dtype=np.int64) * seq_length
    pos = np.searchsorted(doc_start, starts, side="right") - 1
    sample_idx = np.stack([pos, starts - doc_start[pos]], axis=1).astype(np.int64)

    shuffle_idx = rng.permutation(num_samples).astype(np.int64)
    return doc_idx, sample_idx, shuffle_idx


def _sha1(arr: np.ndarray) -> str:
    return hashlib.sha1(arr.tobytes()).hexdigest()


def _cache_key(name, prefix, sizes, documents, num_samples, seq_length, seed) -> tuple[str, dict]:
    desc = {
        "format": _INDEX_FORMAT,
        "class": "GPTDataset",
        "name": name,
        "data": os.path.basename(prefix),
        # Content hashes, so re-preprocessed data never reuses stale indices.
        "sizes_sha1": _sha1(np.ascontiguousarray(sizes, dtype=np.int32)),
        "documents_sha1": _sha1(np.ascontiguousarray(documents, dtype=np.int64)),
        "num_documents": int(len(documents)),
        "num_samples": int(num_samples),
        "seq_length": int(seq_length),
        "seed": int(seed),
    }
    digest = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
    return digest, desc


def _check_index_arrays(arrays, paths, num_docs: int) -> None:
    """ValueError naming the file when a cached index points outside what it indexes (a
    damaged or hand-edited cache would otherwise be a bare IndexError mid-training)."""
    doc_idx, sample_idx, shuffle_idx = arrays
    limits = (
        (doc_idx, num_docs),
        (sample_idx[:, 0] if sample_idx.ndim == 2 else sample_idx, len(doc_idx)),
        (shuffle_idx, len(sample_idx)),
    )
    for path, (arr, limit) in zip(paths, limits):
        if sample_idx.ndim != 2 or (len(arr) and (arr.min() < 0 or arr.max() >= limit)):
            raise ValueError(f"{path}: values outside [0, {limit}) (damaged or edited)")


def _save_npy(path: str, arr: np.ndarray) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, arr, allow_pickle=False)
    os.replace(tmp, path)


class GPTDataset:
    """``ds[i] -> {"text": int64[seq_length + 1]}``; ``len(ds) == num_samples``.

    ``documents`` are sequence indices of ``indexed_dataset`` (one sequence per
    document in files written by tools/preprocess_data.py). Index arrays are
    cached in ``cache_dir`` (default: the data's directory); caching is skipped
    with a warning if that directory is not writable.
    """

    def __init__(
        self,
        name: str,
        indexed_dataset: MMapIndexedDataset,
        documents,
        num_samples: int,
        seq_length: int,
        seed: int,
        cache_dir: str | None = None,
    ):
        if num_samples <= 0 or seq_length <= 0:
            raise ValueError("num_samples and seq_length must be positive")
        documents = np.asarray(documents, dtype=np.int64)
        if documents.size == 0:
            raise ValueError(f"{name}: no documents")
        if documents.min() < 0 or documents.max() >= len(indexed_dataset):
            raise ValueError(
                f"{name}: document indices out of range for {len(indexed_dataset)} sequences"
            )
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self._sizes = np.asarray(indexed_dataset.sizes)
        self.cache_hit = False
        self.doc_idx, self.sample_idx, self.shuffle_idx = self._load_or_build(documents, cache_dir)

    def _load_or_build(self, documents, cache_dir):
        prefix = getattr(self.indexed_dataset, "prefix", None)
        paths = None
        if prefix is not None or cache_dir is not None:
            digest, desc = _cache_key(
                self.name,
                prefix or "data",
                self._sizes,
                documents,
                self.num_samples,
                self.seq_length,
                self.seed,
            )
            directory = cache_dir or os.path.dirname(os.path.abspath(prefix))
            base = os.path.basename(prefix or "data")
            stem = os.path.join(directory, f"{base}_{self.name}_{digest}")
            paths = [f"{stem}_{kind}_idx.npy" for kind in ("doc", "sample", "shuffle")]
            if all(os.path.isfile(p) for p in paths):
                try:
                    arrays = tuple(np.load(p, mmap_mode="r", allow_pickle=False) for p in paths)
                    if len(arrays[2]) == self.num_samples:
                        _check_index_arrays(arrays, paths, len(self._sizes))
                        self.cache_hit = True
                        return arrays
                except (OSError, ValueError) as e:
                    _log(f"warning: rebuilding unreadable index cache {stem}_*: {e}")

        t0 = time.perf_counter()
        arrays = build_index_arrays(
            self._sizes, documents, self.num_samples, self.seq_length, self.seed
        )
        _log(
            f"{self.name}: built indices for {self.num_samples} samples "
            f"({len(arrays[0]) // len(documents)} epoch(s) of {len(documents)} documents) "
            f"in {time.perf_counter() - t0:.2f}s"
        )
        if paths is not None:
            try:
                os.makedirs(directory, exist_ok=True)
                for p, arr in zip(paths, arrays):
                    _save_npy(p, arr)
                with open(f"{stem}_desc.json", "w") as f:
                    json.dump(desc, f, indent=1, sort_keys=True)
            except OSError as e:
                _log(f"warning: could not cache dataset indices in {directory}: {e}")
        return arrays

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        n = self.num_samples
        idx = int(idx)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sample {idx} out of range for {n} samples")
        pos, offset = (int(v) for v in self.sample_idx[int(self.shuffle_idx[idx])])
        need = self.seq_length + 1
        pieces = []
        while need > 0:  # the stream was sized so this never runs off the end
            doc = int(self.doc_idx[pos])
            take = min(int(self._sizes[doc]) - offset, need)
            if take > 0:
                pieces.append(self.indexed_dataset.get(doc, offset, take))
                need -= take
            pos += 1
            offset = 0
        return {"text": np.concatenate(pieces).astype(np.int64)}


def split_bounds(split: str, num_documents: int) -> list[int]:
    """Contiguous document ranges: documents [b[k], b[k+1]) belong to split k."""
    cumulative = np.cumsum(parse_split(split))
    bounds = [0] + [int(round(c * num_documents)) for c in cumulative]
    bounds[-1] = num_documents
    return bounds


_SPLIT_NAMES = ("train", "valid", "test")


def _split_documents(indexed: MMapIndexedDataset, split: str) -> list:
    """Sequence indices of each split (None when it has no tokens).

    Splits are contiguous document ranges, mapped to sequences through the
    document index (identical when each document is one sequence).
    """
    bounds = split_bounds(split, indexed.num_documents)
    out = []
    for k in range(3):
        first, last = int(indexed.doc_idx[bounds[k]]), int(indexed.doc_idx[bounds[k + 1]])
        empty = last <= first or int(indexed.sizes[first:last].astype(np.int64).sum()) == 0
        out.append(None if empty else np.arange(first, last, dtype=np.int64))
    return out


def build_train_valid_test_datasets(
    data_path: Sequence,
    split: str,
    train_valid_test_num_samples,
    seq_length: int,
    seed: int,
    cache_dir: str | None = None,
):
    """(train, valid, test); an entry is None when it has 0 samples or an empty split.

    With several weighted prefixes every split is a BlendedDataset over the
    prefixes whose split is non-empty (weights renormalised over those), each
    component built with ceil(weight * n * 1.005) + 1 samples.
    """
    from .blended_dataset import BlendedDataset

    nums = [int(n) for n in train_valid_test_num_samples]
    if len(nums) != 3:
        raise ValueError("train_valid_test_num_samples must have 3 entries")
    prefixes, weights = parse_data_path(data_path)
    indexed = [MMapIndexedDataset(p) for p in prefixes]
    docs = [_split_documents(ds, split) for ds in indexed]
    result = []
    for k, name in enumerate(_SPLIT_NAMES):
        parts = [
            (ds, d[k], w) for ds, d, w in zip(indexed, docs, weights) if d[k] is not None and w > 0
        ]
        if nums[k] <= 0 or not parts:
            result.append(None)
        elif len(prefixes) == 1:
            ds, d, _ = parts[0]
            result.append(GPTDataset(name, ds, d, nums[k], seq_length, seed, cache_dir))
        else:
            total = sum(w for _, _, w in parts)
            comps, ws = [], []
            for ds, d, w in parts:
                n = math.ceil(w / total * nums[k] * 1.005) + 1
                comps.append(GPTDataset(name, ds, d, n, seq_length, seed, cache_dir))
                ws.append(w / total)
            result.append(BlendedDataset(comps, ws, nums[k], seed))
    return tuple(result)
