"""Read and write the safetensors file format, memory-mapped, with bfloat16 through ml_dtypes.

A file is: an unsigned 64-bit little-endian header length N; N bytes of UTF-8 JSON mapping each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data that
follows the header) plus an optional ``"__metadata__"`` of string pairs; then the tensors'
little-endian bytes in row-major order.

`SafetensorsFile` maps the file read-only and returns each tensor as a numpy view of the map, so
taking a slice of a tensor (the part one device holds) reads only the pages of that slice: a
model larger than host memory can be loaded shard by shard. numpy has no bfloat16; ml_dtypes
(a dependency of jax) provides it, so BF16 tensors are read and written without conversion.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("bool"),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER = 100 * 2**20  # the format's own limit on the JSON header


class SafetensorsError(ValueError):
    """A file that is not valid safetensors, or a tensor it does not hold."""


class SafetensorsFile:
    """One ``*.safetensors`` file, memory-mapped read-only.

    `names` lists the tensors; `shape(name)` and `dtype(name)` describe one without reading it;
    `array(name)` is a read-only numpy view of the map (nothing is read until it is indexed);
    `metadata` is the header's ``__metadata__``. Every inconsistency of the header (offsets out
    of the file, overlapping or with gaps, a size that does not match dtype and shape, an unknown
    dtype) is a `SafetensorsError` naming the file and the tensor.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise SafetensorsError(f"{self.path}: too short for a safetensors header ({size} bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER or 8 + n > size:
                raise SafetensorsError(f"{self.path}: header length {n} does not fit the file ({size} bytes)")
            try:
                header = json.loads(f.read(n).decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                raise SafetensorsError(f"{self.path}: header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: header is not a JSON object")
        self.metadata: dict[str, str] = dict(header.pop("__metadata__", None) or {})
        self._data_start = 8 + n
        data_size = size - self._data_start
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        spans = []
        for name, entry in header.items():
            try:
                dtype_name, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(f"{self.path}: tensor {name!r} has a malformed entry {entry!r}") from None
            if dtype_name not in DTYPES:
                raise SafetensorsError(f"{self.path}: tensor {name!r} has dtype {dtype_name!r}, not one of {sorted(DTYPES)}")
            dtype = DTYPES[dtype_name]
            if any(not isinstance(d, int) or d < 0 for d in shape):
                raise SafetensorsError(f"{self.path}: tensor {name!r} has shape {list(shape)}")
            if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_size):
                raise SafetensorsError(f"{self.path}: tensor {name!r} has offsets {[begin, end]} outside the "
                                       f"data ({data_size} bytes)")
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise SafetensorsError(f"{self.path}: tensor {name!r} holds {end - begin} bytes, its dtype "
                                       f"{dtype_name} and shape {list(shape)} need {math.prod(shape) * dtype.itemsize}")
            self._entries[name] = (dtype, shape, begin, end)
            spans.append((begin, end, name))
        position = 0
        for begin, end, name in sorted(spans):
            if begin != position:
                what = "overlaps the tensor before it" if begin < position else "leaves a gap before it"
                raise SafetensorsError(f"{self.path}: tensor {name!r} {what} (offset {begin}, expected {position})")
            position = end
        if position != data_size:
            raise SafetensorsError(f"{self.path}: {data_size - position} bytes after the last tensor")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _entry(self, name: str):
        if name not in self._entries:
            raise SafetensorsError(f"{self.path} has no tensor {name!r}")
        return self._entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def dtype(self, name: str) -> np.dtype:
        return self._entry(name)[0]

    def array(self, name: str) -> np.ndarray:
        """A read-only view of the tensor in the mapped file (indexing it reads only that part)."""
        dtype, shape, begin, end = self._entry(name)
        start = self._data_start + begin
        return self._map[start:start + end - begin].view(dtype).reshape(shape)


def write_file(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
               metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` (name -> numpy array, any dtype of `DTYPES`) as one safetensors file.

    Tensors are laid out in name order, the header is padded with spaces to a multiple of 8
    bytes (so every tensor starts 8-byte aligned when the offsets are), and the file is written
    under a temporary name and renamed, so a reader never sees half a file.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset, order = 0, []
    for name in sorted(tensors):
        array = np.asarray(tensors[name])
        dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
        if dtype not in NAMES:
            raise SafetensorsError(f"tensor {name!r} has dtype {array.dtype}, which safetensors does not store")
        array = np.asarray(array, dtype=dtype)
        if not array.flags.c_contiguous:  # (np.ascontiguousarray would make a scalar 1-d)
            array = array.copy(order="C")
        header[name] = {"dtype": NAMES[dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        order.append(array)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for array in order:
                f.write(array.reshape(-1).view(np.uint8).data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
