"""Megatron-compatible "MMIDIDX" indexed dataset: writer and memory-mapped reader.

Layout of ``{prefix}.idx`` (all little-endian)::

    b"MMIDIDX\\x00\\x00"          9-byte magic
    <Q  version (= 1)
    <B  dtype code               (see DTYPE_CODES)
    <Q  sequence count           N
    <Q  document-index length    D (= documents + 1)
    int32[N]  sequence lengths (in tokens)
    int64[N]  byte offset of each sequence in .bin
    int64[D]  document index: sequence index at each document boundary, starts at 0

``{prefix}.bin`` is the raw concatenation of all sequences in that dtype.

Empty sequences are allowed by the format and by this writer/reader (length 0,
offset equal to the next one); the preprocessing tool chooses to skip empty
documents instead of writing them.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterable

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Header: magic, version, dtype code, sequence count, document-index length.
_HEADER = struct.Struct("<9sQBQQ")

DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def dtype_code(dtype) -> int:
    """The format's code for a numpy dtype (ValueError if it has none)."""
    dt = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == dt:
            return code
    raise ValueError(f"dtype {dt} cannot be stored in an MMIDIDX dataset")


def best_dtype(vocab_size: int | None):
    """uint16 when every id fits comfortably (Megatron's < 65500 rule), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def exists(prefix: str) -> bool:
    """True when both the .idx and the .bin file of `prefix` exist."""
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def _write_index(idx_path: str, dtype, sizes: np.ndarray, doc_idx: np.ndarray) -> None:
    dt = np.dtype(dtype)
    sizes = np.asarray(sizes, dtype=np.int32)
    # Exclusive prefix sum of byte lengths = where each sequence starts in .bin.
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1].astype(np.int64) * dt.itemsize, out=pointers[1:])
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    with open(idx_path, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, dtype_code(dt), len(sizes), len(doc_idx)))
        f.write(sizes.astype("<i4", copy=False).tobytes(order="C"))
        f.write(pointers.astype("<i8", copy=False).tobytes(order="C"))
        f.write(doc_idx.astype("<i8", copy=False).tobytes(order="C"))


class IndexedDatasetBuilder:
    """Streams sequences into a .bin file; ``finalize`` writes the matching .idx."""

    def __init__(self, bin_path: str, dtype=np.int32):
        self._dtype = np.dtype(dtype)
        dtype_code(self._dtype)  # fail early on unsupported dtypes
        self._bin_path = bin_path
        self._file = open(bin_path, "wb")
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]
        if np.issubdtype(self._dtype, np.integer):
            info = np.iinfo(self._dtype)
            self._range = (int(info.min), int(info.max))
        else:
            self._range = None

    @property
    def dtype(self):
        return self._dtype

    def add_item(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one sequence (tokens must fit the dtype: no silent wrap-around)."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if arr.size and self._range is not None and arr.dtype != self._dtype:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._range[0] or hi > self._range[1]:
                raise ValueError(
                    f"token ids in [{lo}, {hi}] do not fit {self._dtype} (writing {self._bin_path})"
                )
        self._file.write(arr.astype(self._dtype, copy=False).tobytes(order="C"))
        self._sizes.append(int(arr.size))

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def merge_file_(self, prefix: str) -> None:
        """Append every sequence/document of another dataset with the same dtype."""
        other = MMapIndexedDataset(prefix)
        if np.dtype(other.dtype) != self._dtype:
            raise ValueError(
                f"cannot merge {index_file_path(prefix)}: dtype {np.dtype(other.dtype)} "
                f"!= builder dtype {self._dtype}"
            )
        offset = len(self._sizes)
        self._sizes.extend(int(s) for s in other.sizes)
        self._doc_idx.extend(int(d) + offset for d in other.doc_idx[1:])
        del other  # release the memmaps before copying the raw bytes
        with open(data_file_path(prefix), "rb") as src:
            shutil.copyfileobj(src, self._file, 16 << 20)

    def finalize(self, idx_path: str) -> None:
        self._file.close()
        # A trailing sequence that was never closed with end_document still
        # belongs to a document; close it so the index stays consistent.
        if self._doc_idx[-1] != len(self._sizes):
            self._doc_idx.append(len(self._sizes))
        _write_index(idx_path, self._dtype, np.asarray(self._sizes, dtype=np.int64), self._doc_idx)

    def close(self) -> None:
        """Abandon the build (closes the .bin; the caller removes partial files)."""
        if not self._file.closed:
            self._file.close()


class MMapIndexedDataset:
    """Read-only view of ``{prefix}.idx`` / ``{prefix}.bin`` through np.memmap.

    ``ds[i]`` / ``ds.get(i, offset, length)`` return read-only array views in the
    file's dtype; copy (or ``astype``) before modifying.
    """

    def __init__(self, prefix: str):
        self._prefix = prefix
        self._open()

    # Pickle by path so DataLoader workers reopen their own mappings.
    def __getstate__(self):
        return {"prefix": self._prefix}

    def __setstate__(self, state):
        self._prefix = state["prefix"]
        self._open()

    def _open(self) -> None:
        idx_path, bin_path = index_file_path(self._prefix), data_file_path(self._prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file not found: {path}")

        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < len(MAGIC) or head[: len(MAGIC)] != MAGIC:
            raise ValueError(f"{idx_path}: bad magic (not an MMIDIDX index file)")
        if len(head) < _HEADER.size:
            raise ValueError(f"{idx_path}: truncated index header ({idx_size} bytes)")
        _, version, code, n_seq, n_doc = _HEADER.unpack(head)
        if version != VERSION:
            raise ValueError(
                f"{idx_path}: unsupported index version {version} (expected {VERSION})"
            )
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path}: unknown dtype code {code}")
        self._dtype = DTYPE_CODES[code]
        expected = _HEADER.size + n_seq * (4 + 8) + n_doc * 8
        if idx_size != expected:
            raise ValueError(
                f"{idx_path}: truncated or corrupt index: header says {n_seq} sequences and "
                f"{n_doc} document-index entries ({expected} bytes) but the file has "
                f"{idx_size} bytes"
            )

        idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
        off = _HEADER.size
        self._sizes = np.frombuffer(idx, dtype="<i4", count=n_seq, offset=off)
        off += n_seq * 4
        self._pointers = np.frombuffer(idx, dtype="<i8", count=n_seq, offset=off)
        off += n_seq * 8
        self._doc_idx = np.frombuffer(idx, dtype="<i8", count=n_doc, offset=off)
        self._idx_mmap = idx

        if (
            n_doc == 0
            or self._doc_idx[0] != 0
            or self._doc_idx[-1] != n_seq
            or (n_doc > 1 and np.any(np.diff(self._doc_idx) < 0))
        ):
            raise ValueError(
                f"{idx_path}: corrupt document index (must start at 0, be non-decreasing "
                f"and end at the sequence count {n_seq})"
            )

        itemsize = np.dtype(self._dtype).itemsize
        nbytes = self._sizes.astype(np.int64) * itemsize
        if n_seq and (
            self._pointers[0] != 0 or np.any(self._pointers[1:] != np.cumsum(nbytes)[:-1])
        ):
            raise ValueError(
                f"{idx_path}: corrupt index (byte offsets do not match sequence lengths)"
            )
        bin_expected = int(nbytes.sum())
        bin_size = os.path.getsize(bin_path)
        if bin_size != bin_expected:
            what = "truncated" if bin_size < bin_expected else "size inconsistent with"
            raise ValueError(
                f"{bin_path}: data file {what} its index: expected {bin_expected} bytes "
                f"({n_seq} sequences of {np.dtype(self._dtype)}), found {bin_size}"
            )
        # np.memmap refuses empty files; an all-empty dataset is still valid.
        if bin_size:
            self._bin = np.memmap(bin_path, dtype=self._dtype, mode="r")
        else:
            self._bin = np.zeros(0, dtype=self._dtype)

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def dtype(self):
        return self._dtype

    @property
    def sizes(self) -> np.ndarray:
        """int32 token count of every sequence."""
        return self._sizes

    @property
    def pointers(self) -> np.ndarray:
        return self._pointers

    @property
    def doc_idx(self) -> np.ndarray:
        """int64 sequence index at each document boundary (length = documents + 1)."""
        return self._doc_idx

    @property
    def num_documents(self) -> int:
        return len(self._doc_idx) - 1

    def __len__(self) -> int:
        return len(self._sizes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            return [self.get(j) for j in range(start, stop, step)]
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset+length`` of sequence ``i`` (to its end if length is None)."""
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sequence index {i} out of range for {n} sequences")
        size = int(self._sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"slice [{offset}, {offset + length}) out of range for sequence {i} "
                f"of length {size}"
            )
        start = int(self._pointers[i]) // np.dtype(self._dtype).itemsize + offset
        return np.asarray(self._bin[start : start + length]).view(np.ndarray)
