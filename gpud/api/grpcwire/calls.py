"""What a gRPC handler deals with on gpud's server: the call's context, the methods it serves, the statuses, and
the length-prefixed message framing (gRPC over HTTP/2, "Length-Prefixed-Message")."""
from __future__ import annotations

import base64
import mmap
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# grpc status codes (the numbers of grpc.StatusCode)
OK, CANCELLED, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND = 0, 1, 2, 3, 4, 5
RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 8, 12, 13, 14

Received = bytes | memoryview  # a request message as it came in: a large one (MessageReader) is a memoryview


@dataclass(frozen=True, slots=True)
class Method:
    """One RPC: its handler `(request or request iterator, context) -> response or async iterator of responses`,
    and how its messages are read and written."""

    handler: Callable[..., Any]
    parse: Callable[[Received], Any]
    serialize: Callable[[Any], bytes]
    client_streaming: bool = False
    server_streaming: bool = False
    # A unary method may also be answered without a task: `start(request as received, context, reply)` calls
    # `reply(status, details, message bytes)` once (now or later, from the event loop) and returns how to cancel
    # the call (or None). The server then uses it instead of `handler`.
    start: Callable[[Received, CallContext, Reply], Callable[[], None] | None] | None = None


Reply = Callable[[int, str, Any], None]  # (status, details, the serialized answer where the status is OK)


class CallAborted(Exception):
    """Ends the call with this status: raised by `CallContext.abort`, and by `MessageReader` for a message it
    refuses."""

    def __init__(self, code: int, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


def status_number(code: Any) -> int:
    """An int, or a grpc.StatusCode (whose value is (number, name))."""
    return code if isinstance(code, int) else int(code.value[0])


class CallContext:
    """The part of grpc.aio.ServicerContext that gpud's servicer uses."""

    __slots__ = ("_headers", "_peer", "_metadata")

    def __init__(self, headers: list[tuple[str, str]], peer: str):
        self._headers = headers
        self._peer = peer
        self._metadata: tuple[tuple[str, str | bytes], ...] | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The client's metadata: its headers less HTTP/2's and gRPC's own; "-bin" values decoded to bytes."""
        if self._metadata is None:
            out: list[tuple[str, str | bytes]] = []
            for name, value in self._headers:
                if name.startswith(":") or name.startswith("grpc-") or name in ("te", "content-type"):
                    continue
                if name.endswith("-bin"):
                    try:
                        out.append((name, base64.b64decode(value + "=" * (-len(value) % 4))))
                    except ValueError:
                        continue
                else:
                    out.append((name, value))
            self._metadata = tuple(out)
        return self._metadata

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: Any, details: str = "") -> None:
        raise CallAborted(status_number(code), details)


def peer_string(peername: Any) -> str:
    """grpc's form of a peer address: "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000"."""
    if isinstance(peername, tuple) and len(peername) >= 2:
        host, port = peername[0], peername[1]
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
    return f"unix:{peername}" if peername else "unknown"


_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def timeout_seconds(value: str) -> float | None:
    """grpc-timeout ("100m", "5S", at most 8 digits): seconds; None when it is malformed (then it is ignored)."""
    unit = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


def framed(message: bytes) -> bytes:
    """A message as it goes on the wire: uncompressed (flag 0), its 4-byte big-endian length, its bytes."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


ASSEMBLE_BYTES = 1 << 20  # a message this large is copied into place as its frames come


class MessageReader:
    """Cuts a stream's DATA into gRPC messages: a flag byte, a 4-byte big-endian length, the message. A message that
    spans many frames is joined once, when its last byte is in; one of `assemble_bytes` or more is copied into
    memory mapped for it as its frames come instead (a memoryview is handed out): joining 256 MiB at the end would
    hold the event loop for ~160 ms, each frame's copy takes well under a millisecond, and the pages are only
    taken as they are written (a client that announces a large message and sends little costs little)."""

    __slots__ = ("_chunks", "_have", "_need", "_max_bytes", "_encoding", "_assemble_bytes", "_into", "_flag")

    def __init__(self, max_bytes: int, encoding: str | None, assemble_bytes: int = ASSEMBLE_BYTES):
        self._chunks: list[bytes] = []  # the start of an incomplete message
        self._have = 0
        self._need = 0  # bytes the incomplete message needs in all (5 while its prefix is not in)
        self._max_bytes = max_bytes
        self._encoding = encoding
        self._assemble_bytes = assemble_bytes
        self._into: memoryview | None = None  # a large message's place, `_have` of its `_need` bytes in
        self._flag = 0  # its compressed flag

    def feed(self, data: bytes) -> list[Any]:
        """The messages `data` completes (bytes; a large one as a memoryview); CallAborted for one over the limit
        or that cannot be decompressed."""
        out: list[Any] = []
        if self._into is not None:
            take = min(len(data), self._need - self._have)
            self._into[self._have:self._have + take] = memoryview(data)[:take]
            self._have += take
            if self._have < self._need:
                return out
            message: Any = self._into
            self._into = None
            out.append(self._decompress(message) if self._flag else message)
            data = data[take:]
            if not data:
                return out
        elif self._chunks:
            self._chunks.append(data)
            self._have += len(data)
            if self._have < self._need:
                return out
            data = b"".join(self._chunks)
            self._chunks = []
        i, n = 0, len(data)
        while i < n:
            if n - i < 5:
                self._keep(data[i:], 5)
                break
            length = int.from_bytes(data[i + 1:i + 5], "big")
            if length > self._max_bytes:
                raise CallAborted(RESOURCE_EXHAUSTED,
                                   f"Received message larger than max ({length} vs. {self._max_bytes})")
            if n - i - 5 < length:
                if length >= self._assemble_bytes:
                    self._into = memoryview(mmap.mmap(-1, length))
                    self._have = n - i - 5
                    self._into[:self._have] = data[i + 5:]
                    self._need = length
                    self._flag = data[i]
                else:
                    self._keep(data[i:], 5 + length)
                break
            message = data[i + 5:i + 5 + length]
            if data[i]:
                message = self._decompress(message)
            out.append(message)
            i += 5 + length
        return out

    def _keep(self, start: bytes, need: int) -> None:
        self._chunks = [start]
        self._have = len(start)
        self._need = need

    @property
    def partial(self) -> bool:
        return bool(self._chunks) or self._into is not None

    @property
    def buffered_bytes(self) -> int:
        """What the incomplete message holds so far."""
        return self._have if self._chunks or self._into is not None else 0

    def _decompress(self, message: Any) -> bytes:
        if self._encoding in ("gzip", "deflate"):
            inflater = zlib.decompressobj(wbits=31 if self._encoding == "gzip" else 15)
            try:
                out = inflater.decompress(message, self._max_bytes + 1)
            except zlib.error as exc:
                raise CallAborted(INTERNAL, f"cannot decompress the message ({self._encoding}): {exc}") from None
            if len(out) > self._max_bytes:
                raise CallAborted(RESOURCE_EXHAUSTED,
                                   f"Received message larger than max (over {self._max_bytes} decompressed)")
            return out
        raise CallAborted(INTERNAL, "a compressed message without a grpc-encoding the server knows "
                                     f"({self._encoding or 'identity'})")


SUPPORTED_ENCODINGS = ("identity", "gzip", "deflate")
