"""The safetensors codec: write a file one tensor at a time, read tensors by name.

Uses the ``safetensors`` package when it is installed; otherwise this module's own
reader and streaming writer (the format is small enough to write by hand).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from .errors import ConversionError

# Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape,
# data_offsets: [begin, end]} (offsets relative to the data), optional "__metadata__"},
# then the raw little-endian bytes. Written by hand when the package is missing.
_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ST_TORCH = {v: k for k, v in _ST_DTYPES.items()}


def _have_safetensors() -> bool:
    try:
        import safetensors.torch  # noqa: F401

        return True
    except ImportError:
        return False


def write_safetensors(
    path: str, entries, produce, metadata: dict | None = None, use_package: bool | None = None
) -> None:
    """Write ``entries`` [(name, shape, dtype)], each tensor made by ``produce(name)``.

    With the ``safetensors`` package (default when installed) the tensors are collected
    and saved by it; without it they are streamed to the file one at a time.
    """
    if use_package is None:
        use_package = _have_safetensors()
    tmp = path + ".tmp"
    if use_package:
        from safetensors.torch import save_file

        tensors = {}
        for name, shape, dtype in entries:
            tensors[name] = _checked(produce(name), name, shape, dtype)
        save_file(tensors, tmp, metadata=metadata)
    else:
        if sys.byteorder != "little":
            raise ConversionError("the safetensors writer assumes a little-endian host")
        header, offset = {}, 0
        for name, shape, dtype in entries:
            size = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": _ST_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # pad so the data starts 8-byte aligned
        with open(tmp, "wb") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            for name, shape, dtype in entries:
                t = _checked(produce(name), name, shape, dtype)
                f.write(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
    umask = os.umask(0)  # the package creates its file private; give it the usual mode
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


def _checked(t: torch.Tensor, name: str, shape, dtype) -> torch.Tensor:
    t = t.detach().to("cpu", dtype).contiguous()
    if list(t.shape) != list(shape):
        raise ConversionError(f"{name}: produced shape {list(t.shape)}, declared {list(shape)}")
    return t


class SafeTensorsFile:
    """Read-only access by name; the package if installed, else this module's reader."""

    def __init__(self, path: str, use_package: bool | None = None):
        self.path = path
        if use_package is None:
            use_package = _have_safetensors()
        self._st = None
        if use_package:
            from safetensors import safe_open

            self._st = safe_open(path, framework="pt")
            self.names = list(self._st.keys())
            return
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self._header, self._base = header, 8 + n
        self._bytes = torch.from_file(
            path, shared=False, size=os.path.getsize(path), dtype=torch.uint8
        )  # private mmap: pages load lazily
        self.names = list(header)

    def get(self, name: str) -> torch.Tensor:
        if self._st is not None:
            return self._st.get_tensor(name)
        h = self._header[name]
        a, b = h["data_offsets"]
        raw = self._bytes[self._base + a : self._base + b].clone()  # clone: aligned storage
        return raw.view(_ST_TORCH[h["dtype"]]).reshape(h["shape"])
