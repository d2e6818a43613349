"""KServe's BYTES tensor layout, the one codec for every place that carries it (HTTP binary data, gRPC raw
contents, the shared-memory transport): each element is a 4-byte little-endian length, then that many bytes."""
from __future__ import annotations

import struct
from typing import Any

import numpy as np

_LENGTH = struct.Struct("<I")


def encode_bytes_elements(data: Any) -> bytes:
    """Elements in row-major order; str is UTF-8, anything not bytes-like is written as its text (as Triton does)."""
    pack = _LENGTH.pack
    parts: list[bytes] = []
    for item in np.asarray(data, dtype=object).reshape(-1):
        if isinstance(item, str):
            item = item.encode()
        elif not isinstance(item, (bytes, bytearray, memoryview)):
            item = str(item).encode()
        parts.append(pack(len(item)))
        parts.append(bytes(item))
    return b"".join(parts)


def decode_bytes_elements(buf: Any, count: int) -> np.ndarray:
    """A flat object array of `count` bytes elements; ValueError, saying where, for data that is not exactly that."""
    view = memoryview(buf)
    end = len(view)
    items: list[bytes] = []
    pos = 0
    while pos < end:
        if pos + _LENGTH.size > end:
            raise ValueError(f"BYTES data ends inside a 4-byte length prefix at byte {pos}")
        (length,) = _LENGTH.unpack_from(view, pos)
        pos += _LENGTH.size
        if pos + length > end:
            raise ValueError(f"BYTES element {len(items)} claims {length} bytes, only {end - pos} remain")
        items.append(bytes(view[pos:pos + length]))
        pos += length
    if len(items) != count:
        raise ValueError(f"got {len(items)} BYTES elements, expected {count} elements")
    out = np.empty(count, dtype=np.object_)  # not np.array(items): that would try to nest sequences
    out[:] = items
    return out
