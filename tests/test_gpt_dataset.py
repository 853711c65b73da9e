"""GPTDataset index building, splits, blends, and the pretraining sampler."""

import numpy as np
import pytest

from mp_offload.data.blended_dataset import BlendedDataset, build_blending_indices
from mp_offload.data.gpt_dataset import (
    GPTDataset,
    build_train_valid_test_datasets,
    split_bounds,
)
from mp_offload.data.indexed_dataset import IndexedDatasetBuilder, MMapIndexedDataset
from mp_offload.data.samplers import PretrainingSampler, collate


def _make(prefix, n_docs, lo, hi, seed=0):
    rng = np.random.RandomState(seed)
    b = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for d in range(n_docs):
        n = 0 if d == 5 else rng.randint(1, 40)  # one empty document
        b.add_item(rng.randint(lo, hi, n))
        b.end_document()
    b.finalize(prefix + ".idx")
    return prefix


@pytest.fixture
def data(tmp_path):
    return _make(str(tmp_path / "a_text_document"), 60, 0, 50)


def _stream(ds, doc_idx):
    return np.concatenate([ds.get(int(d)) for d in doc_idx]).astype(np.int64)


def test_samples_cover_stream(data, tmp_path):
    indexed = MMapIndexedDataset(data)
    docs = np.arange(10, 50)
    seq, n = 16, 300  # needs several epochs of ~800 tokens
    ds = GPTDataset("train", indexed, docs, n, seq, seed=7, cache_dir=str(tmp_path / "c"))
    assert len(ds) == n
    epochs = len(ds.doc_idx) // len(docs)
    assert epochs > 1 and len(ds.doc_idx) == epochs * len(docs)
    for e in range(epochs):  # each epoch is a permutation of the documents
        assert sorted(ds.doc_idx[e * len(docs) : (e + 1) * len(docs)]) == list(docs)
    stream = _stream(indexed, ds.doc_idx)
    assert len(stream) >= n * seq + 1
    seen = set()
    for i in range(n):
        text = ds[i]["text"]
        assert text.dtype == np.int64 and text.shape == (seq + 1,)
        j = int(ds.shuffle_idx[i])
        seen.add(j)
        # Sample j is stream[j*seq : j*seq+seq+1]: neighbours share one token.
        np.testing.assert_array_equal(text, stream[j * seq : j * seq + seq + 1])
    assert seen == set(range(n))
    assert ds[-1]["text"].shape == (seq + 1,)
    with pytest.raises(IndexError):
        ds[n]


def test_deterministic_and_cached(data, tmp_path):
    indexed = MMapIndexedDataset(data)
    docs = np.arange(0, 60)
    a = GPTDataset("train", indexed, docs, 500, 8, seed=3, cache_dir=str(tmp_path / "c1"))
    b = GPTDataset("train", indexed, docs, 500, 8, seed=3, cache_dir=str(tmp_path / "c2"))
    c = GPTDataset("train", indexed, docs, 500, 8, seed=3, cache_dir=str(tmp_path / "c1"))
    assert not a.cache_hit and not b.cache_hit and c.cache_hit
    for x, y, z in zip(
        (a.doc_idx, a.sample_idx, a.shuffle_idx),
        (b.doc_idx, b.sample_idx, b.shuffle_idx),
        (c.doc_idx, c.sample_idx, c.shuffle_idx),
    ):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(x, z)
    for i in (0, 17, 499):
        np.testing.assert_array_equal(a[i]["text"], c[i]["text"])
    # Default cache location: next to the data; other parameters -> other files.
    d = GPTDataset("train", indexed, docs, 500, 8, seed=4)
    assert not d.cache_hit and not np.array_equal(d.shuffle_idx, a.shuffle_idx)
    assert GPTDataset("train", indexed, docs, 500, 8, seed=4).cache_hit


def test_split_ranges(data, tmp_path):
    assert split_bounds("969,30,1", 1000) == [0, 969, 999, 1000]
    assert split_bounds("0.8/0.2", 10) == [0, 8, 10, 10]
    train, valid, test = build_train_valid_test_datasets(
        [data], "80,10,10", (200, 50, 0), 8, seed=1, cache_dir=str(tmp_path / "c")
    )
    assert test is None  # 0 samples requested
    assert set(train.doc_idx.tolist()) == set(range(0, 48))
    assert set(valid.doc_idx.tolist()) == set(range(48, 54))
    assert len(train) == 200 and len(valid) == 50
    _, valid, _ = build_train_valid_test_datasets(
        [data], "100,0,0", (10, 10, 10), 8, seed=1, cache_dir=str(tmp_path / "c")
    )
    assert valid is None  # empty split


def test_blend_follows_weights(tmp_path):
    a = _make(str(tmp_path / "a"), 40, 0, 50, seed=1)
    b = _make(str(tmp_path / "b"), 40, 50, 100, seed=2)
    size = 301
    train, valid, _ = build_train_valid_test_datasets(
        ["2", a, "1", b], "90,10,0", (size, 20, 0), 8, seed=5, cache_dir=str(tmp_path / "c")
    )
    assert isinstance(train, BlendedDataset) and len(train) == size
    counts = np.bincount(train.dataset_index, minlength=2)
    for c, w in zip(counts, (2 / 3, 1 / 3)):
        assert abs(c - w * size) <= 1
    for i in range(size):
        text = train[i]["text"]
        assert text.shape == (9,)
        from_b = text.min() >= 50
        assert from_b == (train.dataset_index[i] == 1) and (from_b or text.max() < 50)
    assert len(valid) == 20


def test_blending_indices_track_every_prefix():
    rng = np.random.RandomState(0)
    for _ in range(50):
        k = rng.randint(1, 6)
        w = rng.rand(k) + 0.01
        w /= w.sum()
        n = rng.randint(1, 400)
        idx, sample = build_blending_indices(w, n)
        onehot = np.zeros((n, k))
        onehot[np.arange(n), idx] = 1
        running = np.cumsum(onehot, axis=0)
        assert np.abs(running - np.outer(np.arange(1, n + 1), w)).max() < 1
        for d in range(k):  # each component is read in order 0, 1, 2, ...
            assert sample[idx == d].tolist() == list(range(int((idx == d).sum())))


def test_sampler_resume_and_partition():
    total, mbs, dp = 103, 4, 3
    full = {r: list(PretrainingSampler(total, 0, mbs, r, dp)) for r in range(dp)}
    assert len(full[0]) == total // (mbs * dp) == len(PretrainingSampler(total, 0, mbs, 0, dp))
    for step in range(len(full[0])):  # ranks partition each global batch in order
        merged = sum((full[r][step] for r in range(dp)), [])
        assert merged == list(range(step * mbs * dp, (step + 1) * mbs * dp))
    for consumed_steps in (0, 3, 8):
        consumed = consumed_steps * mbs * dp
        for r in range(dp):
            resumed = list(PretrainingSampler(total, consumed, mbs, r, dp))
            assert resumed == full[r][consumed_steps:]
    tail = list(PretrainingSampler(total, 96, mbs, 1, dp, drop_last=False))
    assert tail == [[100, 101, 102]]
    assert list(PretrainingSampler(total, 96, mbs, 2, dp, drop_last=False)) == []
    with pytest.raises(ValueError):
        PretrainingSampler(total, 0, mbs, 3, dp)


def test_collate():
    batch = collate([{"text": np.arange(5, dtype=np.uint16)}, {"text": np.arange(5) + 1}])
    assert batch["text"].dtype == np.int64 and batch["text"].shape == (2, 5)
