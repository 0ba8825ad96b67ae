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
import typing as tp

import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
MAX_HEADER = 100_000_000  # the safetensors library refuses bigger headers too


def _dtype(code: str) -> np.dtype:
    if code == "BF16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if code not in DTYPES:
        raise ValueError(f"safetensors dtype {code!r} is not supported here; supported: {[*DTYPES, 'BF16']}")
    return np.dtype(DTYPES[code])


class MappedSafetensors:
    """The tensors of one ``.safetensors`` file, each a read-only view of the mapped file.

    Opening checks the whole header against the file's size, so a file cut short (an interrupted
    download or copy) is refused before any tensor is read, with a ValueError that says so.
    """

    def __init__(self, file: str | os.PathLike):
        self.file = os.fspath(file)
        size = os.path.getsize(self.file)
        again = "download or copy it again, or re-save the checkpoint"
        with open(self.file, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{self.file} is truncated or not a safetensors file: it has {size} bytes, fewer "
                                 f"than the 8 of its header size; {again}")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER:
                raise ValueError(f"{self.file} is not a safetensors file (its first 8 bytes {raw!r} are no header "
                                 f"size; a Git LFS pointer or an HTML page?); {again}")
            if n > size - 8:
                raise ValueError(f"{self.file} is truncated in its header: the header needs {n} bytes after its "
                                 f"8-byte size, the file has {size - 8}; {again}")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{self.file}: the safetensors header is not valid JSON ({err}); {again}") from None
        if not isinstance(header, dict):
            raise ValueError(f"{self.file}: the safetensors header is not a JSON object; {again}")
        header.pop("__metadata__", None)
        self._start = 8 + n
        self._entries = {name: self._entry(name, entry, again) for name, entry in header.items()}
        need = max((begin + math.prod(shape) * dtype.itemsize for dtype, shape, begin in self._entries.values()),
                   default=0)
        if self._start + need > size:
            raise ValueError(f"{self.file} is truncated: its header describes {need} bytes of tensor data, the file "
                             f"holds {size - self._start}; {again}")
        self._data = np.memmap(self.file, dtype=np.uint8, mode="r") if size > self._start else np.zeros(0, np.uint8)

    def _entry(self, name: str, entry: tp.Any, again: str) -> tuple[np.dtype, tuple[int, ...], int]:
        """``(dtype, shape, begin)`` of one header entry, checked against itself."""
        try:
            code, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            ok = all(isinstance(v, int) and v >= 0 for v in (*shape, begin, end))
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{self.file}: the header entry of tensor {name!r} is malformed ({entry!r}); {again}")
        try:
            dtype = _dtype(code)
        except ValueError as err:
            raise ValueError(f"{self.file}: tensor {name!r}: {err}") from None
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{self.file}: tensor {name!r} has inconsistent offsets {begin}..{end} for "
                             f"{dtype} {shape}; the file is damaged ({again})")
        return dtype, shape, begin

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
