"""Read ``.safetensors`` files without PyTorch: the header, then each tensor as a NumPy array.

The format: an 8-byte little-endian header length, a JSON header mapping each tensor's name to its
``dtype``, ``shape`` and ``data_offsets`` (from the end of the header), then the raw little-endian
bytes. bf16 comes back as ``ml_dtypes.bfloat16`` (the dtype JAX uses). Files are memory-mapped, so a
tensor is read only when asked for.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

__all__ = ["SafetensorsFile", "DTYPES"]

#: safetensors dtype names -> NumPy dtypes (little-endian).
DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}  # fmt: skip


class SafetensorsFile:
    """One ``.safetensors`` file: ``keys()``, ``shape(name)``, ``dtype(name)``, ``get(name)``."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"safetensors: file {self.path!r} is too short for a header ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"safetensors: file {self.path!r}: header length {n} runs past the file ({size} bytes)")
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            where = f"{e.msg} at char {e.pos}" if isinstance(e, json.JSONDecodeError) else str(e)
            raise ValueError(f"safetensors: file {self.path!r}: the header ({n} bytes after the 8-byte length) is not "
                             f"valid JSON: {where}") from None  # fmt: skip
        if not isinstance(header, dict):
            raise ValueError(f"safetensors: file {self.path!r}: the header must be a JSON object, got a "
                             f"{type(header).__name__}")  # fmt: skip
        self.metadata = header.pop("__metadata__", {}) or {}
        self._entries = header
        self._start = 8 + n
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size > self._start else np.zeros(0, np.uint8)
        for name, e in header.items():
            ok = isinstance(e, dict) and {"dtype", "shape", "data_offsets"} <= set(e)
            ok = ok and isinstance(e["shape"], list) and isinstance(e["data_offsets"], list)
            if not ok or len(e["data_offsets"]) != 2:
                raise ValueError(f"safetensors: file {self.path!r}: tensor {name!r} must have 'dtype', 'shape' (a list) "
                                 f"and 'data_offsets' ([begin, end]) in the header, got {repr(e)[:200]}")  # fmt: skip
            if e.get("dtype") not in DTYPES:
                raise ValueError(f"safetensors: file {self.path!r}: tensor {name!r} has dtype {e.get('dtype')!r}, "
                                 f"expected one of {sorted(DTYPES)}")  # fmt: skip
            begin, end = e["data_offsets"]
            want = int(np.prod(e["shape"], dtype=np.int64)) * DTYPES[e["dtype"]].itemsize
            if end - begin != want or self._start + end > size:
                raise ValueError(f"safetensors: file {self.path!r}: tensor {name!r} of shape {e['shape']} "
                                 f"{e['dtype']} needs {want} bytes at offsets {begin}..{end} "
                                 f"(data section {size - self._start} bytes)")  # fmt: skip

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return DTYPES[self._entries[name]["dtype"]]

    def get(self, name: str) -> np.ndarray:
        """The tensor (a read-only view of the mapped file)."""
        e = self._entries[name]
        begin, end = e["data_offsets"]
        raw = self._map[self._start + begin : self._start + end]
        return raw.view(DTYPES[e["dtype"]]).reshape(e["shape"])
