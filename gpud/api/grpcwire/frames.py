"""HTTP/2 frames (RFC 9113, section 6) as the gRPC server reads and writes them, and the header blocks it sends.

gpud encodes its own headers without the dynamic table (literal, never indexed by the peer), so they are constant
bytes made once: the peer's table size setting does not concern them.
"""
from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# flags
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# settings
SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
SETTINGS_MAX_HEADER_LIST_SIZE = 0x6
# error codes
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
ENHANCE_YOUR_CALM = 0xB

DEFAULT_TABLE_BYTES = 4096  # HPACK's dynamic table, until SETTINGS_HEADER_TABLE_SIZE says otherwise
DEFAULT_WINDOW_BYTES = 65_535
DEFAULT_MAX_FRAME_BYTES = 16_384
MAX_WINDOW_BYTES = 2**31 - 1

_HEAD = struct.Struct(">BHBBL")  # length (24 bits as 8 + 16), type, flags, stream id
_U32 = struct.Struct(">L")
_SETTING = struct.Struct(">HL")


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEAD.pack(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def frame_head(kind: int, flags: int, stream_id: int, length: int) -> bytes:
    return _HEAD.pack(length >> 16, length & 0xFFFF, kind, flags, stream_id)


def settings_frame(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(k, v) for k, v in values.items()))


def parse_settings(payload: bytes) -> list[tuple[int, int]]:
    return [_SETTING.unpack_from(payload, i) for i in range(0, len(payload), 6)]


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(increment))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, _U32.pack(code))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, _U32.pack(last_stream_id) + _U32.pack(code) + debug)


def u32(payload: bytes, offset: int = 0) -> int:
    return int(_U32.unpack_from(payload, offset)[0])


# --- HPACK encoding of what gpud sends (RFC 7541: no Huffman, no indexing) -------------------------------------------

def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    mask = (1 << prefix_bits) - 1
    if value < mask:
        return bytes([first | value])
    out = [first | mask]
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(value: bytes) -> bytes:
    return _integer(len(value), 7, 0) + value


def literal(name: bytes, value: bytes) -> bytes:
    """A header field without indexing, with a literal name."""
    return b"\x00" + _string(name) + _string(value)


def literal_static_name(index: int, value: bytes) -> bytes:
    """A header field without indexing whose name is static table entry `index`."""
    return _integer(index, 4, 0) + _string(value)


STATUS_200 = b"\x88"  # static table entry 8: ":status: 200"
CONTENT_TYPE_GRPC = literal_static_name(31, b"application/grpc")  # entry 31: content-type
RESPONSE_HEADERS = STATUS_200 + CONTENT_TYPE_GRPC + literal(b"grpc-accept-encoding", b"identity,deflate,gzip")
STATUS_OK_TRAILERS = literal(b"grpc-status", b"0")


def status_block(code: int, message: str) -> bytes:
    """The grpc-status and (when there is one) grpc-message fields, percent-encoded as gRPC asks."""
    block = literal(b"grpc-status", str(code).encode())
    if message:
        block += literal(b"grpc-message", percent_encode(message))
    return block


def http_status_block(status: int) -> bytes:
    return literal_static_name(8, str(status).encode())  # entry 8: :status


def percent_encode(message: str) -> bytes:
    raw = message.encode("utf-8")
    if all(0x20 <= b <= 0x7E and b != 0x25 for b in raw):
        return raw
    return b"".join(bytes([b]) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in raw)
