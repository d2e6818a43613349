"""A small HTTP/1.1 server: one asyncio.Protocol per connection over httptools (llhttp, the C parser Node.js uses).

Why not aiohttp: its per-request machinery (request and response objects, stream readers, a task per request, the
router) cost ~0.1 ms of CPU per request, more than everything else gpud does for a small inference. Here a request
is parsed by C callbacks into one `HttpRequest`, handed to the application's handler inside `data_received`, and
answered through a `respond` callable, at once or later (an inference answers from the batch-completion callback):
no task, no future, no stream object per request.

What it does, as a production HTTP/1.1 server must: keep-alive and HTTP/1.0 close, pipelined requests answered in
order, `Expect: 100-continue`, chunked request bodies, gzip/deflate request bodies (inflated under the same size limit
as plain ones: 413, not a memory blow-up), HEAD, malformed requests answered 400 and closed, a transfer coding other
than chunked answered 501 (llhttp would drop it silently), bodies of 1 MiB or more written in place into memory mapped
for them, idle keep-alive connections closed after `keepalive_timeout_s`, a request not received within
`request_timeout_s` answered 408 and closed (slowloris), connections over `max_connections` answered 503 and closed,
reading paused while too many pipelined answers are outstanding or the client does not read, and a graceful close that
lets accepted requests finish.
"""
from __future__ import annotations

import asyncio
import logging
import mmap
import os
import socket
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast
from urllib.parse import unquote

import httptools
import orjson

from gpud.api.limits import SharedCount
from gpud.api.unix_socket import bind_unix_socket, remove_socket_file

log = logging.getLogger(__name__)

_REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 413: "Payload Too Large", 415: "Unsupported Media Type",
            417: "Expectation Failed", 431: "Request Header Fields Too Large", 429: "Too Many Requests",
            500: "Internal Server Error",
            501: "Not Implemented", 503: "Service Unavailable", 504: "Gateway Timeout"}
_STATUS_LINES: dict[int, bytes] = {}
JSON = "application/json"
# A request body: an mmap (bytes-like, read it as a buffer) from 1 MiB on; a bytearray where a JSON child received it.
Body = bytes | bytearray | mmap.mmap
# An answer's body: a view of the bytes a JSON child encoded (received into place, not copied).
AnswerBody = bytes | bytearray | memoryview
# The answers a handler gives most often have their first lines prebuilt.
_HEAD_CACHE: dict[tuple[int, str], bytes] = {}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_MAX_PIPELINED = 32  # answers outstanding on one connection before we stop reading from it
_MAX_DISCARD_BYTES = 64 * 2**20  # of a refused (413) body read and dropped before closing on the client
# A body declared at least this long is written in place, as it arrives, into memory mapped for it: joining 60 MB of
# parts at the end (or zeroing a bytearray for it) would hold the event loop for ~25 ms.
_IN_PLACE_BODY_BYTES = 1 << 20
# Header names as sent -> their lower-case text: clients send the same few names on every request.
_HEADER_KEYS: dict[bytes, str] = {}
_HEADER_KEYS_MAX = 512


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n".encode()
    return line


def _head_prefix(status: int, content_type: str) -> bytes:
    key = (status, content_type)
    head = _HEAD_CACHE.get(key)
    if head is None:
        head = _status_line(status) + (f"Content-Type: {content_type}\r\n".encode() if content_type else b"")
        if len(_HEAD_CACHE) < 256:
            _HEAD_CACHE[key] = head
    return head


class HttpRequest:
    """One request, as the handler gets it. A plain class (one per request; compiled, a dataclass's generated
    __init__ would stay interpreted)."""
    __slots__ = ("method", "path", "query", "headers", "body", "keep_alive", "peer")

    def __init__(self, method: str, path: str, query: str, headers: dict[str, str], body: Body,
                 keep_alive: bool = True, peer: str = "") -> None:
        self.method = method
        self.path = path  # percent-decoded, without the query
        self.query = query
        self.headers = headers  # names lower-cased; a repeated header keeps its last value
        self.body = body  # an mmap (bytes-like, read it as a buffer) for a Content-Length of 1 MiB or more
        self.keep_alive = keep_alive
        self.peer = peer  # the client's address; "" on a unix socket

    def __repr__(self) -> str:
        return f"HttpRequest({self.method} {self.path!r}, query={self.query!r}, {len(self.body)} body bytes)"


class Respond(Protocol):
    def __call__(self, status: int, body: AnswerBody = b"", content_type: str = JSON,
                 headers: list[tuple[str, str]] | None = None) -> None: ...


Handler = Callable[[HttpRequest, Respond], None]
"""Called once per request inside the event loop; answers through `respond` exactly once, now or later. An
exception it raises is answered 500 (and logged). Calls of `respond` after the first, or after the client went
away, are ignored."""


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


class BodyTooLarge(Exception):
    pass


class _HeadTooLarge(Exception):
    """Raised inside a parser callback to stop parsing a request whose head is over the limit (already answered)."""


def inflate(body: Body, encoding: str, limit: int) -> bytes:
    """A gzip or deflate request body, inflated to at most `limit` bytes. Raises BodyTooLarge or ValueError."""
    attempts: tuple[int, ...]
    if encoding == "gzip":
        attempts = (16 + zlib.MAX_WBITS,)
    elif encoding == "deflate":  # RFC 9110 says zlib-wrapped; some clients send raw deflate
        attempts = (zlib.MAX_WBITS, -zlib.MAX_WBITS)
    else:
        raise LookupError(encoding)
    error: Exception | None = None
    for wbits in attempts:
        try:
            return _inflate_members(body, wbits, limit, several=encoding == "gzip")
        except zlib.error as e:
            error = e
    raise ValueError(str(error))


def _inflate_members(data: Body, wbits: int, limit: int, several: bool) -> bytes:
    """A gzip body may be several members one after the other (RFC 1952); deflate is one stream."""
    parts: list[bytes] = []
    size = 0
    while True:
        d = zlib.decompressobj(wbits)
        out = d.decompress(data, limit - size + 1)
        size += len(out)
        if size > limit or d.unconsumed_tail:
            raise BodyTooLarge(f"request body inflates to more than the limit of {limit} bytes")
        if not d.eof:
            raise ValueError("the compressed body is truncated")
        parts.append(out)
        data = d.unused_data
        if not data:
            return parts[0] if len(parts) == 1 else b"".join(parts)
        if not several:
            raise ValueError(f"{len(data)} bytes follow the end of the compressed stream")


class _Slot:
    """One request's place in its connection's answer order (pipelining)."""
    __slots__ = ("data", "close", "done", "http10_keep_alive")

    def __init__(self) -> None:
        self.data: bytes | list[AnswerBody] | None = None
        self.close = False
        self.done = False
        self.http10_keep_alive = False


class KnownHead:
    """What llhttp made of a request head (request line and headers, every byte up to the blank line) that this
    server has parsed and accepted before. Clients send the same head again and again (same path, same headers, same
    Content-Length): a request whose head is byte for byte one of these is served without the parser, with what the
    parser made of it then. Only plain requests are remembered: HTTP/1.1 and kept alive, the body's length given by
    Content-Length (or none) and under the in-place size, no Expect, no upgrade."""
    __slots__ = ("method", "path", "query", "headers", "body_bytes")

    def __init__(self, method: str, path: str, query: str, headers: dict[str, str], body_bytes: int) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers  # copied for each request: a handler may keep or change its own
        self.body_bytes = body_bytes


_KNOWN_HEAD_MAX_BYTES = 4096


def known_head_candidate(data: bytes, start: int) -> bytes | None:
    """The head of the request that starts at `start` of `data`, when it is all there and every line of it ends in
    CRLF (no bare CR or LF, so its end is where llhttp's is, and nothing after it can pass for part of it)."""
    end = data.find(b"\r\n\r\n", start, start + _KNOWN_HEAD_MAX_BYTES)
    if end <= start or data[start] in (10, 13):  # (llhttp skips blank lines before a request)
        return None
    head = data[start:end + 4]
    crlf = head.count(b"\r\n")
    if head.count(b"\r") != crlf or head.count(b"\n") != crlf:
        return None
    return head


class _NoCallbacks:
    pass


_CLOSED_PARSER = httptools.HttpRequestParser(_NoCallbacks())  # a closed connection's: fed nothing, calls nothing


class _Responder:
    """A request's `respond`. A class rather than a closure: compiled (gpud.compiled), a closure and its environment
    refer to each other, so each request's would wait for the cyclic collector instead of going when answered."""
    __slots__ = ("connection", "slot", "head_only")

    def __init__(self, connection: _Connection, slot: _Slot, head_only: bool) -> None:
        self.connection = connection
        self.slot = slot
        self.head_only = head_only

    def __call__(self, status: int, body: AnswerBody = b"", content_type: str = JSON,
                 headers: list[tuple[str, str]] | None = None) -> None:
        self.connection._write(self.slot, status, body, content_type, headers, self.head_only)


class _Connection(asyncio.Protocol):
    def __init__(self, server: HttpServer):
        self.server = server
        assert server.loop is not None  # connections are made only once start() has set it
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.slots: deque[_Slot] = deque()
        self.closing = False  # no more requests: close once the outstanding answers are written
        self.refusing = False  # a body was refused (413): no later request on this connection is handled
        self.draining = False  # reading and dropping the refused body before closing
        self.pending_continue = False  # a 100 Continue waits for the earlier answers to go out first
        self.reading = True
        self.writable = True
        self.last_activity_s = 0.0
        self.request_started_s: float | None = None  # a request's first byte came, its last has not yet
        self.peer = ""  # the client's address (connection_made)
        # The head of the request the parser is on, when it came whole in one read (KnownHead): remembered as the
        # request completes.
        self.learning: bytes | None = None
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.headers: dict[str, str] = {}
        self.body_parts: list[bytes] = []
        self.body_in_place: mmap.mmap | None = None
        self.body_size = 0
        self.discarded_bytes = 0
        self.head_bytes = 0

    # --- transport callbacks ---------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peername = transport.get_extra_info("peername")
        self.peer = peername[0] if isinstance(peername, tuple) and peername else ""
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:  # answers are single small writes: never wait for Nagle
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self.last_activity_s = self.loop.time()
        if self.server.open_connections() >= self.server.max_connections:
            # Over the cap: answered and closed at once, so a flood of connections cannot exhaust descriptors.
            self.server.connections.add(self)
            self.server.counted()
            self._answer_and_close(503, f"too many connections (more than {self.server.max_connections}); "
                                        "try again later")
            return
        self.server.connections.add(self)
        self.server.counted()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.server.counted()
        self.transport = None
        # The parser holds this connection's callbacks and the connection the parser: without this the pair (and
        # whatever the last request left on it) waits for the cyclic collector, for every connection closed.
        self.parser = _CLOSED_PARSER
        self.slots.clear()
        self.server._maybe_idle()

    def data_received(self, data: bytes) -> None:
        self.last_activity_s = self.loop.time()
        if self.closing and not self.slots and not self.draining:
            return
        start = 0
        if self.request_started_s is None and not self.refusing and self.server.max_known_heads > 0:  # between requests
            if self.server.known_heads:
                start = self._serve_known_heads(data)
                if start == len(data):
                    return
            self.learning = known_head_candidate(data, start)
        try:
            self.parser.feed_data(data if start == 0 else data[start:])
        except httptools.HttpParserUpgrade:
            # The request before the upgrade was dispatched already; we speak only HTTP/1.1.
            self._stop_after_answers()
        except Exception as e:  # noqa: BLE001 - a request the parser cannot take is answered, never a crash
            if self.refusing or self.closing:
                return
            message = str(e.__context__ or e) or type(e).__name__
            self._answer_and_close(400, f"malformed HTTP request: {message}")

    def _serve_known_heads(self, data: bytes) -> int:
        """Serve the requests at the start of `data` whose heads are known (KnownHead) and whose bodies are all
        there; where the rest begins (for the parser)."""
        known_heads = self.server.known_heads
        start = 0
        size = len(data)
        while start < size:
            end = data.find(b"\r\n\r\n", start, start + _KNOWN_HEAD_MAX_BYTES)
            if end < 0:
                break
            head_end = end + 4
            known = known_heads.get(data[start:head_end])
            if known is None:
                break
            body_end = head_end + known.body_bytes
            if body_end > size:
                break
            body = data[head_end:body_end] if known.body_bytes else b""
            start = body_end
            self._dispatch(known.method, known.path, known.query, dict(known.headers), body, True, False)
        return start

    def eof_received(self) -> bool | None:
        self._stop_after_answers()
        return True  # keep the write side open until our answers are out

    def pause_writing(self) -> None:
        self.writable = False
        self._pause_reading()

    def resume_writing(self) -> None:
        self.writable = True
        self._maybe_resume_reading()

    # --- parser callbacks ------------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._reset()
        self.request_started_s = self.loop.time()

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.head_bytes += len(url)
        if self.head_bytes > self.server.max_head_bytes:
            self._head_too_large("request line")

    def on_header(self, name: bytes, value: bytes) -> None:
        key = _HEADER_KEYS.get(name)
        if key is None:
            key = name.decode("latin-1").lower()
            if len(_HEADER_KEYS) < _HEADER_KEYS_MAX and len(name) <= 64:
                _HEADER_KEYS[name] = key
        text = value.decode("latin-1")
        if key == "transfer-encoding" and key in self.headers:  # repeated: one list, as llhttp frames it
            text = f"{self.headers[key]}, {text}"
        self.headers[key] = text
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > self.server.max_head_bytes:
            self._head_too_large("request headers")

    def _head_too_large(self, what: str) -> None:
        """llhttp sets no bound on a request's head: without one a client could grow it without end."""
        self._answer_and_close(431, f"{what} longer than {self.server.max_head_bytes} bytes (--max-header-bytes)")
        raise _HeadTooLarge

    def on_headers_complete(self) -> None:
        if self.refusing:
            return
        length = self.headers.get("content-length")
        limit = self.server.max_body_bytes
        coding = self.headers.get("transfer-encoding")
        if coding is not None and coding.replace(" ", "").lower() != "chunked":
            # llhttp frames any coding list ending in chunked as chunked and drops the rest: a body sent as
            # "gzip, chunked" would reach the handler still gzipped. RFC 9112 6.1: 501 for a coding not understood.
            self._reject(501, f"transfer coding {coding!r} is not supported: send bodies chunked or with "
                              "Content-Length, compressed with Content-Encoding")
            return
        if length is not None and length.isdigit() and int(length) > limit:
            self._reject(413, f"request body of {length} bytes exceeds the limit of {limit} bytes")
            return
        if length is not None and length.isdigit() and int(length) >= _IN_PLACE_BODY_BYTES:
            self.body_in_place = mmap.mmap(-1, int(length))  # pages come as the body fills them, not at once
        if self.headers.get("expect", "").lower() == "100-continue" and self.transport is not None \
                and self.parser.get_http_version() == "1.1":  # RFC 9110 15.2: no 1xx to an HTTP/1.0 client
            if self.slots:  # earlier pipelined answers go first
                self.pending_continue = True
            else:
                self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        if self.refusing:
            # Drop the rest of a refused body rather than close on it at once: closing with unread data makes the
            # kernel reset the connection, and the client would see a reset instead of our 413.
            self.discarded_bytes += len(body)
            if self.discarded_bytes > _MAX_DISCARD_BYTES and self.transport is not None:
                self.transport.close()
            return
        start = self.body_size
        self.body_size += len(body)
        if self.body_in_place is not None:  # llhttp delivers exactly Content-Length bytes
            self.body_in_place[start:self.body_size] = body
            return
        if self.body_size > self.server.max_body_bytes:
            self._reject(413, f"request body of more than {self.server.max_body_bytes} bytes exceeds the limit "
                              f"of {self.server.max_body_bytes} bytes")
            return
        self.body_parts.append(body)

    def on_message_complete(self) -> None:
        self.request_started_s = None
        head = self.learning
        self.learning = None
        if self.refusing:
            if self.draining:  # the refused body has been read: close once the answers before it are out
                self.draining = False
                if not self.slots and self.transport is not None:
                    self.transport.close()
            return
        parts = self.body_parts
        body: Body
        if self.body_in_place is not None:
            body = self.body_in_place
            self.body_in_place = None
        else:
            body = parts[0] if len(parts) == 1 else b"".join(parts)
        url = self.url
        q = url.find(b"?")
        raw_path, query = (url, "") if q < 0 else (url[:q], url[q + 1:].decode("latin-1"))
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = unquote(path)
        method = self.parser.get_method().decode("latin-1")
        keep_alive = self.parser.should_keep_alive()
        version = self.parser.get_http_version()
        if head is not None and keep_alive and version == "1.1" and type(body) is bytes:  # (not one in place)
            self._remember(head, method, path, query, body)
        self._dispatch(method, path, query, self.headers, body, keep_alive, keep_alive and version == "1.0")

    def _remember(self, head: bytes, method: str, path: str, query: str, body: bytes) -> None:
        """Remember what the parser made of `head` (KnownHead), when the request is a plain one."""
        headers = self.headers
        if "transfer-encoding" in headers or "expect" in headers or "upgrade" in headers or method == "CONNECT" \
                or headers.get("content-length", "0") != str(len(body)):
            return
        known_heads = self.server.known_heads
        if len(known_heads) >= self.server.max_known_heads:
            known_heads.clear()  # heads that churn (a request id in each): start over rather than track recency
        known_heads[head] = KnownHead(method, path, query, dict(headers), len(body))

    def _dispatch(self, method: str, path: str, query: str, headers: dict[str, str], body: Body, keep_alive: bool,
                  http10_keep_alive: bool) -> None:
        """Hand a whole request to the handler, in its place in the connection's answer order."""
        request = HttpRequest(method, path, query, headers, body, keep_alive, self.peer)
        slot = _Slot()
        slot.close = not keep_alive
        slot.http10_keep_alive = http10_keep_alive
        self.slots.append(slot)
        if len(self.slots) >= _MAX_PIPELINED:
            self._pause_reading()
        if not keep_alive:
            self.closing = True
        encoding = headers.get("content-encoding")
        if encoding and encoding != "identity":
            try:
                request.body = inflate(body, encoding.lower(), self.server.max_body_bytes)
            except BodyTooLarge as too_large:  # (a name per exception type: compiled code types each name once)
                self._write(slot, 413, error_body(str(too_large)), JSON, None, False)
                return
            except LookupError:
                self._write(slot, 415, error_body(f"unsupported content-encoding {encoding!r}; "
                                                  "use gzip or deflate"), JSON, None, False)
                return
            except ValueError as undecodable:
                self._write(slot, 400, error_body(f"cannot decode the request body with content-encoding "
                                                  f"{encoding}: {undecodable}"), JSON, None, False)
                return
        respond = _Responder(self, slot, request.method == "HEAD")
        try:
            self.server.handler(request, respond)
        except Exception as e:
            log.exception("unexpected error serving %s %s", request.method, request.path)
            respond(500, error_body(f"internal error: {type(e).__name__}: {e}"))

    # --- answers ---------------------------------------------------------------------------------------------
    def _write(self, slot: _Slot, status: int, body: AnswerBody, content_type: str,
               headers: list[tuple[str, str]] | None, head_only: bool) -> None:
        if slot.done or self.transport is None:
            return
        slot.done = True
        close = slot.close or self.server.closing
        head = _head_prefix(status, content_type)
        extra = b"Content-Length: %d\r\n" % len(body)
        if headers:
            extra += "".join([f"{k}: {v}\r\n" for k, v in headers]).encode("latin-1")
        if close:
            extra += b"Connection: close\r\n"
            slot.close = True
        elif slot.http10_keep_alive:  # an HTTP/1.0 client keeps the connection only when told so
            extra += b"Connection: keep-alive\r\n"
        if head_only:
            slot.data = head + extra + b"\r\n"
        elif len(body) <= 65536:
            slot.data = head + extra + b"\r\n" + body
        else:
            slot.data = [head + extra + b"\r\n", body]
        slots = self.slots
        if slots[0] is not slot:
            return  # an earlier pipelined request is still running: it goes out first
        transport = self.transport
        self.last_activity_s = self.loop.time()  # idle time counts from the last answer too
        while slots and slots[0].done:
            s = slots.popleft()
            if isinstance(s.data, list):
                transport.writelines(s.data)
            else:
                assert s.data is not None  # a done slot has its answer
                transport.write(s.data)
            if s.close:
                self.closing = True
                slots.clear()
                transport.close()
                return
        if self.closing and not slots and not self.draining:
            transport.close()
            return
        if self.pending_continue and not slots:
            self.pending_continue = False
            transport.write(_CONTINUE)
        if not self.reading and len(slots) < _MAX_PIPELINED // 2:
            self._maybe_resume_reading()
        if not slots:
            self.server._maybe_idle()

    def _reject(self, status: int, message: str) -> None:
        """Answer (after any earlier pipelined answers) before the body has been read; the body is then read and
        dropped, and the connection closed."""
        self.refusing = True
        self.draining = True
        self.closing = True
        slot = _Slot()
        self.slots.append(slot)
        self._write(slot, status, error_body(message), JSON, [("Connection", "close")], False)

    def _answer_and_close(self, status: int, message: str) -> None:
        slot = _Slot()
        slot.close = True
        self.slots.append(slot)
        self.closing = True
        self._write(slot, status, error_body(message), JSON, None, False)

    def _stop_after_answers(self) -> None:
        self.closing = True
        if not self.slots and self.transport is not None:
            self.transport.close()

    def _pause_reading(self) -> None:
        if self.reading and self.transport is not None:
            self.reading = False
            self.transport.pause_reading()

    def _maybe_resume_reading(self) -> None:
        if not self.reading and self.writable and len(self.slots) < _MAX_PIPELINED // 2 \
                and self.transport is not None and not self.closing:
            self.reading = True
            self.transport.resume_reading()

    def request_timed_out(self) -> None:
        """The request began more than request_timeout_s ago and is not complete (a client trickling its head or
        body, slowloris): 408 and close, so it cannot hold the connection."""
        self.request_started_s = None
        if not self.closing and self.transport is not None:
            self._answer_and_close(408, f"request not received within {self.server.request_timeout_s:g} s")
            self.refusing = True  # whatever else arrives on it is dropped

    def close_if_idle(self) -> bool:
        if not self.slots and self.transport is not None:
            self.closing = True
            self.transport.close()
            return True
        return False


@dataclass(eq=False)
class HttpServer:
    """Serves `handler` on one listening socket. `start()` binds; `close(grace_s)` stops accepting, lets accepted
    requests finish (up to grace_s), then closes every connection."""

    handler: Handler
    max_body_bytes: int = 64 * 2**20
    # request line and headers together (aiohttp allows 8 KiB a line; nginx 32 KiB in all); more is 431
    max_head_bytes: int = 64 * 1024
    keepalive_timeout_s: float = 75.0
    request_timeout_s: float = 30.0  # a request's head and body must arrive within this, else 408
    max_connections: int = 10000  # more are answered 503 and closed at once
    # a front-end process's: the cap counts every process's connections on the port (None: this server's alone)
    shared_connections: SharedCount | None = None
    backlog: int = 1024
    on_close: Callable[[], None] | None = None  # called once every connection is closed (the handler's resources)
    on_swept: Callable[[], None] | None = None  # called after each sweep of idle connections (tests count them)
    connections: set[_Connection] = field(default_factory=set)
    # request heads parsed and accepted before, served again without the parser (KnownHead); 0: parse every one
    max_known_heads: int = 256
    known_heads: dict[bytes, KnownHead] = field(default_factory=dict)
    closing: bool = False
    port: int = 0

    def __post_init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._idle: asyncio.Future | None = None
        self._unix_socket: tuple[str, int] | None = None  # the unix socket served: its path and inode

    def open_connections(self) -> int:
        """The connections the cap counts: this server's, or every process's on the port."""
        return len(self.connections) if self.shared_connections is None else self.shared_connections.total()

    def counted(self) -> None:
        """This server's connections changed: the other processes on the port see its count."""
        if self.shared_connections is not None:
            self.shared_connections.set(len(self.connections))

    async def start(self, host: str, port: int) -> int:
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: _Connection(self), host, port, backlog=self.backlog,
                                                     reuse_address=True)
        # (through Any: uvloop gives a list where asyncio's typing says tuple, which compiled code would check)
        sockets = cast(Any, self._server).sockets
        self.port = sockets[0].getsockname()[1]
        self._arm_sweeper()
        return self.port

    async def start_socket(self, sock: socket.socket) -> int:
        """Serve on a listening socket bound elsewhere (a front-end process's, shared with the others)."""
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: _Connection(self), sock=sock, backlog=self.backlog)
        self.port = sock.getsockname()[1]
        self._arm_sweeper()
        return self.port

    async def start_unix(self, path: str) -> None:
        """Serve on a unix socket at `path`, created with mode 0660 (gpud.api.unix_socket); `close()` removes it."""
        sock = bind_unix_socket(path)
        self._unix_socket = (path, os.lstat(path).st_ino)
        self.loop = asyncio.get_running_loop()
        try:
            self._server = await self.loop.create_unix_server(lambda: _Connection(self), sock=sock,
                                                              backlog=self.backlog)
        except BaseException:
            sock.close()
            remove_socket_file(*self._unix_socket)
            raise
        self._arm_sweeper()

    def _started_loop(self) -> asyncio.AbstractEventLoop:
        assert self.loop is not None, "the server was not started"
        return self.loop

    def _arm_sweeper(self) -> None:
        period_s = max(0.05, min(self.keepalive_timeout_s, self.request_timeout_s) / 4)
        self._sweeper = self._started_loop().call_later(period_s, self._sweep)

    def _sweep(self) -> None:
        """Close keep-alive connections idle for longer than keepalive_timeout_s and answer 408 to requests not
        received within request_timeout_s (one timer for all connections)."""
        now_s = self._started_loop().time()
        deadline = now_s - self.keepalive_timeout_s
        for conn in list(self.connections):
            if conn.request_started_s is not None and now_s - conn.request_started_s > self.request_timeout_s:
                conn.request_timed_out()
            elif conn.last_activity_s < deadline:
                conn.close_if_idle()
        if not self.closing:
            self._arm_sweeper()
        if self.on_swept is not None:
            self.on_swept()

    def _maybe_idle(self) -> None:
        if self._idle is not None and not self._idle.done() and all(not c.slots for c in self.connections):
            self._idle.set_result(None)

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop listening; wait up to grace_s for outstanding answers; close every connection."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.closing = True
            conn.close_if_idle()
        if any(c.slots for c in self.connections):
            self._idle = self._started_loop().create_future()
            try:
                await asyncio.wait_for(self._idle, grace_s)
            except TimeoutError:
                log.warning("HTTP: %d connection(s) still had answers outstanding after %.1f s; closing them",
                            sum(1 for c in self.connections if c.slots), grace_s)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        if self._server is not None:
            await self._server.wait_closed()
        if self._unix_socket is not None:
            remove_socket_file(*self._unix_socket)
        if self.on_close is not None:
            self.on_close()
