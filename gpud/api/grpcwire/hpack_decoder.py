"""HPACK header decoding (RFC 7541) for the gRPC server, one decoder per connection.

A gRPC client sends the same headers with every call; after the first call they are indexed references into the
connection's dynamic table (8-12 bytes). The decoder keeps the headers of such a block, keyed by its bytes and the
table's generation (bumped on every change to the table), so a repeated call decodes with one dictionary lookup.
Huffman decoding and the static table come from the `hpack` package (python-hyper), whose own decoder costs ~40 µs
for a block that is all references.
"""
from __future__ import annotations

from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

STATIC_TABLE: tuple[tuple[str, str], ...] = tuple((n.decode("latin-1"), v.decode("latin-1"))
                                                   for n, v in HeaderTable.STATIC_TABLE)
_STATIC_COUNT = len(STATIC_TABLE)
_ENTRY_OVERHEAD = 32  # RFC 7541 4.1: an entry's size is its name and value lengths plus 32
_CACHE_ENTRIES = 256


class HpackError(ValueError):
    """A header block that cannot be decoded: a connection error (COMPRESSION_ERROR)."""


class Decoder:
    def __init__(self, max_table_bytes: int = 4096):
        self._max_allowed = max_table_bytes  # the SETTINGS_HEADER_TABLE_SIZE this side advertised
        self._max = max_table_bytes
        self._entries: list[tuple[str, str]] = []  # newest first
        self._size = 0
        self._generation = 0
        self._cache: dict[bytes, tuple[int, list[tuple[str, str]]]] = {}

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        """The block's (name, value) pairs, in order; HpackError when it is malformed."""
        hit = self._cache.get(block)
        if hit is not None and hit[0] == self._generation:
            return hit[1]
        before = self._generation
        headers = self._decode(block)
        if self._generation == before:  # decoding changed nothing in the table: the same bytes mean the same headers
            if len(self._cache) >= _CACHE_ENTRIES:
                self._cache.clear()
            self._cache[block] = (before, headers)
        return headers

    def _decode(self, data: bytes) -> list[tuple[str, str]]:
        headers: list[tuple[str, str]] = []
        i, n = 0, len(data)
        first = True  # a table size update may only start a block
        while i < n:
            b = data[i]
            if b & 0x80:  # indexed header field
                index, i = _integer(data, i, 7)
                headers.append(self._entry(index))
            elif b & 0x40:  # literal with incremental indexing
                name, value, i = self._literal(data, i, 6)
                headers.append((name, value))
                self._add(name, value)
            elif b & 0x20:  # dynamic table size update
                if not first:
                    raise HpackError("a table size update after the first header of a block")
                size, i = _integer(data, i, 5)
                if size > self._max_allowed:
                    raise HpackError(f"table size update to {size} over the {self._max_allowed} allowed")
                self._max = size
                self._evict()
                self._generation += 1
                continue
            else:  # literal without indexing (0000) or never indexed (0001)
                name, value, i = self._literal(data, i, 4)
                headers.append((name, value))
            first = False
        return headers

    def _entry(self, index: int) -> tuple[str, str]:
        if index == 0:
            raise HpackError("header index 0")
        if index <= _STATIC_COUNT:
            return STATIC_TABLE[index - 1]
        dynamic = index - _STATIC_COUNT - 1
        if dynamic >= len(self._entries):
            raise HpackError(f"header index {index} beyond the table")
        return self._entries[dynamic]

    def _literal(self, data: bytes, i: int, prefix_bits: int) -> tuple[str, str, int]:
        index, i = _integer(data, i, prefix_bits)
        if index:
            name = self._entry(index)[0]
        else:
            name, i = _string(data, i)
        value, i = _string(data, i)
        return name, value, i

    def _add(self, name: str, value: str) -> None:
        size = len(name) + len(value) + _ENTRY_OVERHEAD
        self._generation += 1
        if size > self._max:  # RFC 7541 4.4: an entry larger than the table empties it
            self._entries.clear()
            self._size = 0
            return
        self._entries.insert(0, (name, value))
        self._size += size
        self._evict()

    def _evict(self) -> None:
        while self._size > self._max and self._entries:
            name, value = self._entries.pop()
            self._size -= len(name) + len(value) + _ENTRY_OVERHEAD


def _integer(data: bytes, i: int, prefix_bits: int) -> tuple[int, int]:
    """RFC 7541 5.1: the integer at data[i] with an N-bit prefix, and the index after it."""
    mask = (1 << prefix_bits) - 1
    value = data[i] & mask
    i += 1
    if value < mask:
        return value, i
    shift = 0
    while True:
        if i >= len(data):
            raise HpackError("a header block ends inside an integer")
        b = data[i]
        i += 1
        value += (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i
        if shift > 28:
            raise HpackError("an integer over 2^28 in a header block")


def _string(data: bytes, i: int) -> tuple[str, int]:
    if i >= len(data):
        raise HpackError("a header block ends before a string")
    huffman = data[i] & 0x80
    length, i = _integer(data, i, 7)
    end = i + length
    if end > len(data):
        raise HpackError("a header string runs past its block")
    raw = data[i:end]
    if huffman:
        try:
            raw = decode_huffman(raw)
        except Exception as exc:  # noqa: BLE001 - the hpack package raises its own error type
            raise HpackError(f"bad Huffman code: {exc}") from None
    return raw.decode("latin-1"), end
