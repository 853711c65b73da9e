"""MMIDIDX writer/reader: round trips, an independent writer, and error messages."""

import os
import struct

import numpy as np
import pytest

from mp_offload.data.indexed_dataset import (
    IndexedDatasetBuilder,
    MMapIndexedDataset,
    best_dtype,
    exists,
)


def _build(prefix, docs, dtype):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for d in docs:
        b.add_item(d)
        b.end_document()
    b.finalize(prefix + ".idx")


def _docs(rng, n, hi):
    # Includes an empty document: the format allows it and the reader must cope.
    docs = [rng.randint(0, hi, size=rng.randint(1, 50)).tolist() for _ in range(n)]
    docs[3] = []
    return docs


@pytest.mark.parametrize("dtype,hi", [(np.uint16, 65535), (np.int32, 2**31 - 1)])
def test_round_trip(tmp_path, dtype, hi):
    rng = np.random.RandomState(0)
    docs = _docs(rng, 20, hi)
    prefix = str(tmp_path / "ds")
    _build(prefix, docs, dtype)
    assert exists(prefix)
    ds = MMapIndexedDataset(prefix)
    assert ds.dtype == dtype
    assert len(ds) == 20 and ds.num_documents == 20
    assert ds.sizes.tolist() == [len(d) for d in docs]
    assert ds.doc_idx.tolist() == list(range(21))
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d
        assert ds[i].dtype == dtype
    assert ds[-1].tolist() == docs[-1]
    assert [a.tolist() for a in ds[2:5]] == docs[2:5]
    assert ds.get(0, offset=1, length=len(docs[0]) - 1).tolist() == docs[0][1:]
    assert ds.get(4, offset=2).tolist() == docs[4][2:]
    with pytest.raises(IndexError):
        ds.get(0, offset=0, length=len(docs[0]) + 1)
    with pytest.raises(IndexError):
        ds[20]


def test_best_dtype_and_overflow(tmp_path):
    assert best_dtype(4096) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    b = IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16)
    with pytest.raises(ValueError, match="do not fit"):
        b.add_item([1, 70000])
    b.close()


def test_merge(tmp_path):
    a, b, m = (str(tmp_path / n) for n in "abm")
    _build(a, [[1, 2], [3]], np.uint16)
    _build(b, [[4, 5, 6]], np.uint16)
    builder = IndexedDatasetBuilder(m + ".bin", np.uint16)
    builder.add_item([9])
    builder.end_document()
    builder.merge_file_(a)
    builder.merge_file_(b)
    builder.finalize(m + ".idx")
    ds = MMapIndexedDataset(m)
    assert [x.tolist() for x in ds[0:4]] == [[9], [1, 2], [3], [4, 5, 6]]
    assert ds.doc_idx.tolist() == [0, 1, 2, 3, 4]


def _independent_writer(prefix, seqs, doc_idx, np_dtype, code):
    """Straight from the format facts, sharing no code with the package."""
    sizes = [len(s) for s in seqs]
    item = np.dtype(np_dtype).itemsize
    pointers, pos = [], 0
    for n in sizes:
        pointers.append(pos)
        pos += n * item
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(np.array(s, dtype=np.dtype(np_dtype).newbyteorder("<")).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


@pytest.mark.parametrize("np_dtype,code", [(np.uint16, 8), (np.int32, 4)])
def test_reads_independently_written_file(tmp_path, np_dtype, code):
    # Two documents of two sequences each and one of a single sequence.
    seqs = [[5, 6, 7], [8], [9, 10], [], [11, 12, 13, 14]]
    doc_idx = [0, 2, 4, 5]
    ref, ours = str(tmp_path / "ref"), str(tmp_path / "ours")
    _independent_writer(ref, seqs, doc_idx, np_dtype, code)
    ds = MMapIndexedDataset(ref)
    assert ds.dtype == np_dtype
    assert [x.tolist() for x in ds[0:5]] == seqs
    assert ds.doc_idx.tolist() == doc_idx
    # And our writer produces byte-identical files for the same content.
    b = IndexedDatasetBuilder(ours + ".bin", np_dtype)
    for i, s in enumerate(seqs):
        b.add_item(s)
        if i + 1 in doc_idx:
            b.end_document()
    b.finalize(ours + ".idx")
    for ext in (".bin", ".idx"):
        assert open(ref + ext, "rb").read() == open(ours + ext, "rb").read()


def test_errors_name_the_file(tmp_path):
    prefix = str(tmp_path / "ds")
    with pytest.raises(FileNotFoundError, match="ds.idx"):
        MMapIndexedDataset(prefix)
    _build(prefix, [[1, 2, 3], [4, 5]], np.uint16)
    idx = open(prefix + ".idx", "rb").read()
    binary = open(prefix + ".bin", "rb").read()

    open(prefix + ".idx", "wb").write(b"NOTMAGIC!" + idx[9:])
    with pytest.raises(ValueError, match=r"ds\.idx.*bad magic"):
        MMapIndexedDataset(prefix)

    open(prefix + ".idx", "wb").write(idx[:9] + struct.pack("<Q", 2) + idx[17:])
    with pytest.raises(ValueError, match=r"ds\.idx.*version 2"):
        MMapIndexedDataset(prefix)

    open(prefix + ".idx", "wb").write(idx[:-4])
    with pytest.raises(ValueError, match=r"ds\.idx.*truncated"):
        MMapIndexedDataset(prefix)

    open(prefix + ".idx", "wb").write(idx)
    open(prefix + ".bin", "wb").write(binary[:-2])
    with pytest.raises(ValueError, match=r"ds\.bin.*truncated"):
        MMapIndexedDataset(prefix)

    open(prefix + ".bin", "wb").write(binary + b"\x00\x00")
    with pytest.raises(ValueError, match=r"ds\.bin.*inconsistent"):
        MMapIndexedDataset(prefix)

    os.remove(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match=r"ds\.bin"):
        MMapIndexedDataset(prefix)


def test_all_empty_dataset(tmp_path):
    prefix = str(tmp_path / "empty")
    _build(prefix, [[], []], np.uint16)
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 2 and ds[0].size == 0 and ds[1].size == 0


def test_pickle_reopens(tmp_path):
    import pickle

    prefix = str(tmp_path / "ds")
    _build(prefix, [[1, 2], [3]], np.int32)
    ds = pickle.loads(pickle.dumps(MMapIndexedDataset(prefix)))
    assert ds[1].tolist() == [3]
