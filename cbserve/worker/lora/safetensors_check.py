"""A safetensors file checked from its bytes, without torch: its JSON index (tensor names, dtypes, shapes, byte
offsets), the data it indexes (every byte of it, without holes or overlaps, as the format requires) and every
value finite. ``lora_files.py`` checks an adapter's weights with it before anything keeps or runs them.

Only the floating dtypes an adapter may hold are taken (``DTYPE_BYTES``); the finite test reads each value's
exponent bits (all ones: an infinity or a NaN) with numpy, a bounded block at a time.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4}  # the dtypes taken, and their sizes
_EXPONENT = {"F16": 0x7C00, "BF16": 0x7F80, "F32": 0x7F800000}  # the exponent bits of each dtype
MAX_HEADER_BYTES = 100 << 20
_BLOCK = 1 << 22  # values tested at a time (bounds the temporary arrays)

Index = dict[str, dict[str, Any]]  # tensor name -> {"dtype", "shape", "data_offsets"}


class SafetensorsError(ValueError):
    """The bytes are not a safetensors file (its index cannot be read)."""


class TensorError(ValueError):
    """A tensor of a well-formed file cannot be taken: its dtype, its byte range or its values."""


def read_index(data: bytes) -> tuple[Index, int]:
    """The tensor index of a safetensors file's bytes (``__metadata__`` left out) and where its data starts."""
    if len(data) < 8:
        raise SafetensorsError(f"{len(data)} bytes, fewer than the 8 of a header size")
    (size,) = struct.unpack_from("<Q", data)
    if size > MAX_HEADER_BYTES or 8 + size > len(data):
        raise SafetensorsError(f"a header of {size} bytes in a file of {len(data)}")
    try:
        index = json.loads(data[8 : 8 + size])
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise SafetensorsError(f"its header is not JSON: {e}") from e
    if not isinstance(index, dict):
        raise SafetensorsError("its header is not a JSON object")
    index.pop("__metadata__", None)
    for name, entry in index.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str) or not _ints(entry.get("shape")) \
                or not _ints(entry.get("data_offsets")) or len(entry["data_offsets"]) != 2:
            raise SafetensorsError(f"tensor {name!r} has no dtype, shape and data_offsets")
    return index, 8 + size


def check_tensors(data: bytes, index: Index, data_start: int) -> None:
    """For ``read_index``'s index of ``data``: TensorError unless every tensor is float16, bfloat16 or float32,
    its byte range holds exactly its shape, the ranges cover the data without holes or overlaps, and every value
    is finite."""
    spans = []
    for name, entry in index.items():
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_BYTES:
            raise TensorError(f"tensor {name!r} is {dtype}: an adapter's weights are float16, bfloat16 or float32")
        if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise TensorError(f"tensor {name!r} of shape {shape} ({dtype}) has {end - begin} bytes")
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise TensorError(f"tensor {name!r} starts at byte {begin} of the data, not {at} (a hole or an overlap)")
        at = end
    if data_start + at != len(data):
        raise TensorError(f"the tensors index {at} bytes of data, the file holds {len(data) - data_start}")
    for name, entry in index.items():
        begin, end = entry["data_offsets"]
        if not _finite(data, data_start + begin, end - begin, entry["dtype"]):
            raise TensorError(f"tensor {name!r} holds values that are not finite (inf or NaN)")


def _ints(values: Any) -> bool:
    return isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def _finite(data: bytes, offset: int, nbytes: int, dtype: str) -> bool:
    """Whether no value of ``dtype`` in ``data[offset : offset + nbytes]`` has all its exponent bits set."""
    import numpy as np

    item = DTYPE_BYTES[dtype]
    bits = np.frombuffer(data, dtype=np.dtype(f"<u{item}"), count=nbytes // item, offset=offset)
    mask = bits.dtype.type(_EXPONENT[dtype])
    for i in range(0, bits.size, _BLOCK):
        part = bits[i : i + _BLOCK]
        if bool(np.any((part & mask) == mask)):
            return False
    return True
