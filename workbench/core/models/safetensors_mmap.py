"""A safetensors file as memory-mapped NumPy views: reading a tensor copies nothing.

``safetensors.safe_open(framework="np")`` copies every tensor it returns; a loader that converts
and places each parameter itself (transposing, stacking layers) only needs to read the bytes once,
so it maps the file and takes views (the format: a little-endian u64 header size, a JSON header
``{name: {dtype, shape, data_offsets}}``, then the raw data).
"""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _dtype(code: str) -> np.dtype:
    if code == "BF16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if code not in DTYPES:
        raise ValueError(f"safetensors dtype {code!r} is not supported here; supported: {[*DTYPES, 'BF16']}")
    return np.dtype(DTYPES[code])


class MappedSafetensors:
    """The tensors of one ``.safetensors`` file, each a read-only view of the mapped file."""

    def __init__(self, file: str | os.PathLike):
        self.file = os.fspath(file)
        size = os.path.getsize(self.file)
        with open(self.file, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{self.file} is not a safetensors file (shorter than its 8-byte header size)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"{self.file} is not a safetensors file (header size {n} > file size {size})")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{self.file}: the safetensors header is not valid JSON ({err})") from None
        header.pop("__metadata__", None)
        self._start = 8 + n
        self._data = np.memmap(self.file, dtype=np.uint8, mode="r") if size > self._start else np.zeros(0, np.uint8)
        self._entries = {}
        for name, entry in header.items():
            dtype, shape = _dtype(entry["dtype"]), tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            if end - begin != math.prod(shape) * dtype.itemsize or self._start + end > size:
                raise ValueError(f"{self.file}: tensor {name!r} has inconsistent offsets {begin}..{end} for "
                                 f"{dtype} {shape}; the file is damaged (re-save it)")
            self._entries[name] = (dtype, shape, begin)

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get_tensor(self, name: str) -> np.ndarray:
        dtype, shape, begin = self._entries[name]
        start = self._start + begin
        nbytes = math.prod(shape) * dtype.itemsize
        return self._data[start:start + nbytes].view(dtype).reshape(shape)

    def close(self) -> None:
        self._entries, self._data = {}, np.zeros(0, np.uint8)  # views handed out keep the mapping alive

    def __enter__(self) -> MappedSafetensors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
