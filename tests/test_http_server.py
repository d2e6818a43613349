"""gpud.api.http_server.HttpServer over raw sockets: keep-alive, pipelining, bodies, limits, errors and shutdown.

Each server runs on 127.0.0.1:<ephemeral> on its own event loop in a daemon thread; the test thread talks to it with
plain blocking sockets, every read bounded by a timeout. Nothing sleeps to synchronise: the tests wait on events
(a handler was called, a connection went away, a sweep ran, a socket became readable or reached EOF). The event loop
is a `ClockLoop`, whose clock a test can move forward, so the keep-alive sweeper can be exercised without waiting
for it (one test also waits for it in real time).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import gzip
import mmap
import socket
import struct
import threading
import time
import zlib
from dataclasses import dataclass

import orjson
import pytest

from gpud.api.http_server import BodyTooLarge, HttpRequest, HttpServer, error_body, inflate

TIMEOUT_S = 5.0


# --- harness ----------------------------------------------------------------------------------------------------------
class ClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock can be moved forward: timers due by the new time fire at the next iteration."""

    def __init__(self) -> None:
        super().__init__()
        self.skew_s = 0.0

    def time(self) -> float:
        return super().time() + self.skew_s


class WatchedSet(set):
    """HttpServer.connections, telling waiting tests when a connection comes or goes."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = threading.Condition()

    def add(self, item) -> None:
        with self.changed:
            super().add(item)
            self.changed.notify_all()

    def discard(self, item) -> None:
        with self.changed:
            super().discard(item)
            self.changed.notify_all()

    def wait_len(self, n: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self) == n, TIMEOUT_S), f"{len(self)} connection(s), not {n}"


@dataclass
class Response:
    status: int
    reason: str
    headers: dict[str, str]  # names lower-cased
    body: bytes
    head: bytes  # the raw status line and headers


class Client:
    """A raw HTTP/1.1 client over one blocking socket; every read times out after TIMEOUT_S."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise EOFError(f"connection closed by the server; unparsed bytes: {self.buf!r}")
        self.buf += chunk

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def read_response(self, head_request: bool = False) -> Response:
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        version, status, reason = status_line.split(" ", 2)
        assert version == "HTTP/1.1", status_line
        headers = {}
        for line in header_lines:
            name, value = line.split(":", 1)
            assert name.lower() not in headers, f"repeated header {name} in {head!r}"
            headers[name.lower()] = value.strip()
        code = int(status)
        body = b""
        if code >= 200 and not head_request:
            body = self._take(int(headers["content-length"]))
        return Response(code, reason, headers, body, head)

    def read_eof(self) -> None:
        """The server closed the connection, with nothing more to read (a reset fails the test)."""
        assert self.buf == b"", f"unread bytes before EOF: {self.buf!r}"
        data = self.sock.recv(65536)
        assert data == b"", f"expected EOF, got {data!r}"

    def nothing_to_read_now(self) -> bool:
        """No byte (and no EOF) has arrived yet."""
        if self.buf:
            return False
        self.sock.setblocking(False)
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        finally:
            self.sock.settimeout(TIMEOUT_S)
        return False

    def reset(self) -> None:
        """Close with an RST rather than a FIN."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def close(self) -> None:
        self.sock.close()


def req(method: str, path: str, body: bytes = b"", headers: list[tuple[str, str]] | tuple = (),
        version: str = "1.1", length: bool | None = None) -> bytes:
    head = f"{method} {path} HTTP/{version}\r\nHost: test\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers)
    if length if length is not None else (body or method in ("POST", "PUT")):
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode("latin-1") + b"\r\n" + body


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def _raw_deflate(data: bytes) -> bytes:
    d = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return d.compress(data) + d.flush()


class ServerThread:
    """An HttpServer on its own ClockLoop in a daemon thread.

    The default handler records every request, then by path: /hold... keeps `respond` in `held[path]` (the test
    answers later), /raise raises, /twice answers twice; anything else is echoed: 200 with the request body (the
    path when the body is empty) and X-Method / X-Query headers."""

    def __init__(self, handler=None, **kw) -> None:
        self.requests: list[HttpRequest] = []
        self.held: dict[str, object] = {}
        self.seen = threading.Condition()
        self.sweeps = 0
        self.clients: list[Client] = []
        self.closed = False
        self.loop = ClockLoop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="http-server-test", daemon=True)
        self.thread.start()
        def counted_sweep() -> None:
            with self.seen:
                self.sweeps += 1
                self.seen.notify_all()

        self.http = HttpServer(handler or self.handler, connections=WatchedSet(), on_swept=counted_sweep, **kw)
        self.port = self.submit(self.http.start("127.0.0.1", 0)).result(TIMEOUT_S)

    # --- the default handler, called on the loop thread ----------------------------------------------------------
    def handler(self, request: HttpRequest, respond) -> None:
        with self.seen:
            self.requests.append(request)
            if request.path.startswith("/hold"):
                self.held[request.path] = respond
            self.seen.notify_all()
        if request.path.startswith("/hold"):
            return
        if request.path == "/raise":
            raise RuntimeError("boom")
        if request.path == "/twice":
            respond(200, b"first", "text/plain")
            respond(201, b"second", "text/plain")
            return
        respond(200, bytes(request.body) or request.path.encode(), "application/octet-stream",  # (a large body: mmap)
                [("X-Method", request.method), ("X-Query", request.query)])

    # --- helpers for the test thread ----------------------------------------------------------------------------
    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn, *args):
        """Run fn(*args) on the loop thread; its result or exception comes back here."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                done.set_exception(e)

        self.loop.call_soon_threadsafe(run)
        return done.result(TIMEOUT_S)

    def wait_requests(self, n: int) -> list[HttpRequest]:
        with self.seen:
            assert self.seen.wait_for(lambda: len(self.requests) >= n, TIMEOUT_S), \
                f"{len(self.requests)} request(s) reached the handler, not {n}"
            return list(self.requests)

    def answer(self, path: str, status: int = 200, body: bytes = b"", **kw) -> None:
        """Answer the held request for `path` now, on the loop thread."""
        with self.seen:
            assert self.seen.wait_for(lambda: path in self.held, TIMEOUT_S), f"{path} never reached the handler"
            respond = self.held[path]
        self.call(lambda: respond(status, body, **kw))

    def advance_clock(self, seconds: float) -> None:
        self.call(lambda: setattr(self.loop, "skew_s", self.loop.skew_s + seconds))

    def wait_sweeps(self, n: int) -> None:
        with self.seen:
            assert self.seen.wait_for(lambda: self.sweeps >= n, TIMEOUT_S), f"{self.sweeps} sweep(s), not {n}"

    def connect(self) -> Client:
        client = Client(self.port)
        self.clients.append(client)
        return client

    def close(self, grace_s: float) -> None:
        self.closed = True
        self.submit(self.http.close(grace_s)).result(TIMEOUT_S + grace_s)

    def stop(self) -> None:
        for client in self.clients:
            client.close()
        if not self.closed:
            self.close(1.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=TIMEOUT_S)
        self.loop.close()


@pytest.fixture
def make_server():
    servers: list[ServerThread] = []

    def make(handler=None, **kw) -> ServerThread:
        s = ServerThread(handler, **kw)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def server(make_server) -> ServerThread:
    return make_server()


@pytest.fixture
def small_server(make_server) -> ServerThread:
    return make_server(max_body_bytes=1024)


def error_of(response: Response) -> str:
    assert response.headers["content-type"] == "application/json"
    doc = orjson.loads(response.body)
    assert list(doc) == ["error"] and isinstance(doc["error"], str)
    return doc["error"]


# --- inflate() on its own -----------------------------------------------------------------------------------------
def test_inflate_function():
    data = b"abc" * 100
    assert inflate(gzip.compress(data), "gzip", 300) == data
    assert inflate(zlib.compress(data), "deflate", 300) == data
    assert inflate(_raw_deflate(data), "deflate", 300) == data
    with pytest.raises(BodyTooLarge):
        inflate(gzip.compress(data), "gzip", 299)
    with pytest.raises(LookupError):
        inflate(data, "br", 300)
    with pytest.raises(ValueError, match="truncated"):
        inflate(gzip.compress(data)[:-8], "gzip", 300)
    with pytest.raises(ValueError):
        inflate(b"not compressed", "deflate", 300)
    assert orjson.loads(error_body('a "quoted" message')) == {"error": 'a "quoted" message'}


# --- keep-alive and connection close ------------------------------------------------------------------------------
def test_keep_alive_serves_two_requests_on_one_connection(server):
    c = server.connect()
    c.send(req("GET", "/one"))
    first = c.read_response()
    assert (first.status, first.reason, first.body) == (200, "OK", b"/one")
    assert "connection" not in first.headers
    assert first.headers["content-type"] == "application/octet-stream"
    c.send(req("POST", "/two", b"payload"))
    second = c.read_response()
    assert (second.status, second.body, second.headers["x-method"]) == (200, b"payload", "POST")
    assert [r.path for r in server.requests] == ["/one", "/two"]
    assert server.call(len, server.http.connections) == 1
    assert server.http.port == server.port != 0


def test_http10_without_keep_alive_is_answered_with_connection_close_and_closed(server):
    c = server.connect()
    c.send(b"GET /old HTTP/1.0\r\n\r\n")
    r = c.read_response()
    assert (r.status, r.body, r.headers["connection"]) == (200, b"/old", "close")
    c.read_eof()
    assert not server.requests[0].keep_alive
    server.http.connections.wait_len(0)


def test_http11_connection_close_header_closes_after_the_answer(server):
    c = server.connect()
    c.send(req("GET", "/bye", headers=[("Connection", "close")]))
    r = c.read_response()
    assert (r.status, r.headers["connection"]) == (200, "close")
    c.read_eof()


def test_http10_with_keep_alive_stays_open(server):
    c = server.connect()
    c.send(b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    first = c.read_response()
    assert first.status == 200 and first.headers["connection"] == "keep-alive"  # HTTP/1.0 keeps it only when told
    c.send(b"GET /b HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert c.read_response().body == b"/b"


def test_client_half_close_still_gets_its_answer(server):
    c = server.connect()
    c.send(req("GET", "/hold/half"))
    server.wait_requests(1)
    c.sock.shutdown(socket.SHUT_WR)  # the server sees EOF while the answer is outstanding
    server.answer("/hold/half", 200, b"late")
    r = c.read_response()
    assert (r.status, r.body) == (200, b"late")
    c.read_eof()


# --- pipelining ---------------------------------------------------------------------------------------------------
def test_pipelined_answers_come_back_in_request_order(server):
    c = server.connect()
    c.send(req("GET", "/hold/first") + req("POST", "/second", b"two") + req("GET", "/third?x=3"))
    requests = server.wait_requests(3)
    assert [r.path for r in requests] == ["/hold/first", "/second", "/third"]
    # /second and /third were answered at once, but wait behind the held /hold/first.
    assert c.nothing_to_read_now()
    server.answer("/hold/first", 200, b"one", content_type="text/plain")
    answers = [c.read_response() for _ in range(3)]
    assert [a.body for a in answers] == [b"one", b"two", b"/third"]
    assert answers[0].headers["content-type"] == "text/plain"
    assert answers[2].headers["x-query"] == "x=3"
    c.send(req("GET", "/fourth"))
    assert c.read_response().body == b"/fourth"


def test_many_pipelined_requests_behind_a_slow_one_are_all_answered_in_order(server):
    # With 32 answers outstanding the server stops reading; it reads on once the slow first answer lets the
    # others out.
    c = server.connect()
    c.send(req("GET", "/hold/0"))
    server.wait_requests(1)
    for i in range(1, 32):
        c.send(req("GET", f"/r{i}"))
        server.wait_requests(i + 1)
    c.send(b"".join(req("GET", f"/r{i}") for i in range(32, 60)))  # not read while 32 answers are outstanding
    server.call(lambda: None)
    assert len(server.requests) == 32
    server.answer("/hold/0", 200, b"/r0")
    bodies = [c.read_response().body for _ in range(60)]
    assert bodies == [f"/r{i}".encode() for i in range(60)]
    c.send(req("GET", "/after"))
    assert c.read_response().body == b"/after"


def test_large_pipelined_answers_to_a_client_that_reads_late_arrive_whole_and_in_order(make_server):
    # 16 MiB of answers queued while the client reads nothing: the transport's write buffer fills and drains.
    def handler(request, respond):
        n = int(request.path[1:])
        respond(200, bytes([n]) * 2**20, "application/octet-stream")

    s = make_server(handler)
    c = s.connect()
    c.send(b"".join(req("GET", f"/{i}") for i in range(16)))
    for i in range(16):
        r = c.read_response()
        assert r.status == 200 and r.body == bytes([i]) * 2**20
    c.send(req("GET", "/99"))
    assert c.read_response().body == bytes([99]) * 2**20


def test_pipelined_requests_split_across_writes(server):
    c = server.connect()
    data = req("POST", "/a", b"alpha") + req("GET", "/b") + req("POST", "/c", b"gamma")
    cut = data.index(b"/b") + 1
    c.send(data[:cut])
    assert c.read_response().body == b"alpha"
    c.send(data[cut:])
    assert [c.read_response().body for _ in range(2)] == [b"/b", b"gamma"]


# --- request bodies -----------------------------------------------------------------------------------------------
def test_chunked_body_is_reassembled(server):
    c = server.connect()
    c.send(req("POST", "/echo", headers=[("Transfer-Encoding", "chunked")], length=False)
           + chunked(b"hello", b" ", b"chunked", b" world"))
    r = c.read_response()
    assert (r.status, r.body) == (200, b"hello chunked world")
    assert server.requests[0].body == b"hello chunked world"


def test_large_chunked_body_is_reassembled_and_echoed(server):
    payload = bytes(range(256)) * 1200  # 300 KiB: the answer goes out as header + body writes
    parts = [payload[i:i + 4096] for i in range(0, len(payload), 4096)]
    c = server.connect()
    c.send(req("POST", "/big", headers=[("Transfer-Encoding", "chunked")], length=False))
    for part in parts:
        c.send(chunked(part)[:-5])  # each chunk alone, without the last-chunk marker
    c.send(b"0\r\n\r\n")
    r = c.read_response()
    assert r.status == 200 and int(r.headers["content-length"]) == len(payload) and r.body == payload


def test_a_body_of_a_mebibyte_or_more_is_written_in_place_and_served_whole(server):
    # Declared by Content-Length: the body goes into memory mapped for it as it arrives (no join on the loop).
    payload = bytes(range(256)) * (5 * 4096 + 7)  # 5 MiB and a bit
    c = server.connect()
    c.send(req("POST", "/big", payload)[:-len(payload)])
    for i in range(0, len(payload), 100_003):
        c.send(payload[i:i + 100_003])
    c.send(req("GET", "/after"))  # pipelined behind it
    r = c.read_response()
    assert r.status == 200 and r.body == payload
    assert c.read_response().body == b"/after"
    big, after = server.wait_requests(2)
    assert isinstance(big.body, mmap.mmap) and isinstance(after.body, bytes)


def test_a_body_longer_than_its_content_length_is_not_read_past_it(server):
    payload = b"x" * (1 << 20)
    c = server.connect()
    c.send(req("POST", "/big", payload) + b"GET /next HTTP/1.1\r\nHost: t\r\n\r\n")
    assert c.read_response().body == payload
    assert c.read_response().body == b"/next"


def test_request_split_over_many_small_writes_is_reassembled(server):
    body = b"".join(b"%03d," % i for i in range(100))
    data = req("POST", "/v2/models/split/infer?q=1", body, headers=[("X-Long-Header", "v" * 50)])
    c = server.connect()
    for i in range(0, len(data), 3):
        c.send(data[i:i + 3])
    r = c.read_response()
    assert (r.status, r.body) == (200, body)
    (request,) = server.requests
    assert (request.method, request.path, request.query) == ("POST", "/v2/models/split/infer", "q=1")
    assert request.headers["x-long-header"] == "v" * 50


def test_empty_post_body(server):
    c = server.connect()
    c.send(req("POST", "/empty", length=True))
    assert c.read_response().body == b"/empty"
    assert server.requests[0].body == b""


# --- content encodings --------------------------------------------------------------------------------------------
PLAIN = b'{"inputs": [' + b"1.5, " * 200 + b"0]}"


@pytest.mark.parametrize("encoding,encode", [
    ("gzip", gzip.compress),
    ("GZip", gzip.compress),
    ("deflate", zlib.compress),
    ("deflate", _raw_deflate),
    ("identity", lambda b: b),
], ids=["gzip", "gzip-mixed-case", "deflate-zlib", "deflate-raw", "identity"])
def test_compressed_body_is_inflated_before_the_handler(server, encoding, encode):
    c = server.connect()
    c.send(req("POST", "/z", encode(PLAIN), headers=[("Content-Encoding", encoding)]))
    r = c.read_response()
    assert (r.status, r.body) == (200, PLAIN)
    assert server.requests[0].body == PLAIN


def test_unknown_content_encoding_is_415_and_connection_stays_usable(server):
    c = server.connect()
    c.send(req("POST", "/z", b"\x0b\x02\x80hello\x03", headers=[("Content-Encoding", "br")]))
    r = c.read_response()
    assert r.status == 415 and r.reason == "Unsupported Media Type"
    assert "'br'" in error_of(r)
    assert server.requests == []
    c.send(req("GET", "/next"))
    assert c.read_response().body == b"/next"


@pytest.mark.parametrize("encoding,body", [
    ("gzip", b"this is not gzip at all"),
    ("gzip", gzip.compress(PLAIN)[:-12]),
    ("deflate", b"\x00\x01\x02\x03 not deflate"),
    ("gzip", b""),
], ids=["garbage-gzip", "truncated-gzip", "garbage-deflate", "empty-gzip"])
def test_corrupt_compressed_body_is_400(server, encoding, body):
    c = server.connect()
    c.send(req("POST", "/z", body, headers=[("Content-Encoding", encoding)], length=True))
    r = c.read_response()
    assert r.status == 400
    assert f"content-encoding {encoding}" in error_of(r)
    assert server.requests == []
    c.send(req("GET", "/next"))
    assert c.read_response().body == b"/next"


@pytest.mark.parametrize("encoding,encode", [("gzip", gzip.compress), ("deflate", zlib.compress),
                                             ("deflate", _raw_deflate)],
                         ids=["gzip", "deflate-zlib", "deflate-raw"])
def test_body_inflating_past_the_limit_is_413(small_server, encoding, encode):
    bomb = encode(b" " * 100_000)
    assert len(bomb) < 1024
    c = small_server.connect()
    c.send(req("POST", "/z", bomb, headers=[("Content-Encoding", encoding)]))
    r = c.read_response()
    assert r.status == 413 and "1024" in error_of(r)
    assert small_server.requests == []
    c.send(req("GET", "/next"))
    assert c.read_response().body == b"/next"


def test_inflated_body_exactly_at_the_limit_is_accepted(small_server):
    c = small_server.connect()
    c.send(req("POST", "/z", gzip.compress(b"a" * 1024), headers=[("Content-Encoding", "gzip")]))
    assert c.read_response().body == b"a" * 1024
    c.send(req("POST", "/z", gzip.compress(b"a" * 1025), headers=[("Content-Encoding", "gzip")]))
    assert c.read_response().status == 413


def test_multi_member_gzip_body_is_inflated_whole(server):
    body = gzip.compress(b"first half, ") + gzip.compress(b"second half")
    assert gzip.decompress(body) == b"first half, second half"
    c = server.connect()
    c.send(req("POST", "/z", body, headers=[("Content-Encoding", "gzip")]))
    assert c.read_response().body == b"first half, second half"


# --- body size limit ----------------------------------------------------------------------------------------------
def test_body_exactly_at_the_limit_is_accepted(small_server):
    c = small_server.connect()
    c.send(req("POST", "/limit", b"x" * 1024))
    assert c.read_response().body == b"x" * 1024


def test_content_length_over_the_limit_is_413_before_the_body_is_sent(small_server):
    c = small_server.connect()
    c.send(req("POST", "/big", headers=[("Content-Length", "5000")], length=False))
    r = c.read_response()  # answered on the headers alone
    assert r.status == 413 and r.reason == "Payload Too Large"
    assert r.headers["connection"] == "close"
    assert "5000" in error_of(r) and "1024" in error_of(r)
    c.send(b"y" * 5000)  # the refused body is read and dropped, then the connection closed: no reset
    c.read_eof()
    assert small_server.requests == []
    small_server.http.connections.wait_len(0)


def test_413_is_readable_after_the_whole_body_was_sent(small_server):
    c = small_server.connect()
    c.send(req("POST", "/big", b"z" * 200_000))
    r = c.read_response()
    assert r.status == 413 and r.headers["connection"] == "close"
    c.read_eof()
    assert small_server.requests == []
    fresh = small_server.connect()
    fresh.send(req("GET", "/still-serving"))
    assert fresh.read_response().status == 200


def test_413_refuses_expect_100_continue_without_a_continue(small_server):
    c = small_server.connect()
    c.send(req("POST", "/big", headers=[("Content-Length", "4096"), ("Expect", "100-continue")], length=False))
    r = c.read_response()
    assert r.status == 413  # not "100 Continue": the client need not send the body at all
    c.sock.shutdown(socket.SHUT_WR)
    c.read_eof()


@pytest.mark.parametrize("codings", [["gzip, chunked"], ["deflate,chunked"], ["identity"], ["gzip", "chunked"]])
def test_a_transfer_coding_other_than_chunked_is_501_and_the_body_never_reaches_the_handler(server, codings):
    # llhttp frames "gzip, chunked" as chunked and drops gzip: the handler would have read gzip bytes as the body.
    c = server.connect()
    c.send(req("POST", "/coded", headers=[("Transfer-Encoding", v) for v in codings], length=False) + chunked(b"{}"))
    r = c.read_response()
    assert r.status == 501 and "transfer coding" in error_of(r) and r.headers["connection"] == "close"
    assert server.requests == []


def test_chunked_in_any_case_is_accepted(server):
    c = server.connect()
    c.send(req("POST", "/echo", headers=[("Transfer-Encoding", "Chunked")], length=False) + chunked(b"ab", b"c"))
    assert c.read_response().body == b"abc"


def test_chunked_body_over_the_limit_is_413(small_server):
    c = small_server.connect()
    c.send(req("POST", "/big", headers=[("Transfer-Encoding", "chunked")], length=False)
           + chunked(b"x" * 700, b"x" * 700, b"x" * 700))
    r = c.read_response()
    assert r.status == 413 and r.headers["connection"] == "close"
    assert "exceeds the limit of 1024" in error_of(r)
    c.read_eof()
    assert small_server.requests == []


def test_413_behind_a_pipelined_request_in_flight_keeps_the_earlier_answer(small_server):
    c = small_server.connect()
    c.send(req("GET", "/hold/first") + req("POST", "/big", b"x" * 2000))
    small_server.wait_requests(1)
    small_server.answer("/hold/first", 200, b"first")
    first = c.read_response()
    assert (first.status, first.body) == (200, b"first")
    assert c.read_response().status == 413
    c.read_eof()


def test_request_pipelined_after_a_refused_body_is_not_handled(small_server):
    c = small_server.connect()
    c.send(req("POST", "/big", b"x" * 2000) + req("POST", "/after", b"side effect"))
    r = c.read_response()
    assert r.status == 413 and r.headers["connection"] == "close"
    c.read_eof()  # nothing but the 413: the client must assume /after was not processed
    small_server.http.connections.wait_len(0)
    assert [r.path for r in small_server.requests] == []  # fails: the handler ran POST /after


# --- Expect: 100-continue -----------------------------------------------------------------------------------------
def test_expect_100_continue_is_answered_before_the_body(server):
    body = b'{"x": 1}'
    c = server.connect()
    c.send(req("POST", "/cont", headers=[("Expect", "100-continue"), ("Content-Length", str(len(body)))],
               length=False))
    interim = c.read_response()
    assert (interim.status, interim.reason, interim.head) == (100, "Continue", b"HTTP/1.1 100 Continue")
    assert c.buf == b"" and server.requests == []
    c.send(body)
    r = c.read_response()
    assert (r.status, r.body) == (200, body)
    assert server.requests[0].headers["expect"] == "100-continue"


def test_expect_100_continue_with_the_body_already_sent(server):
    c = server.connect()
    c.send(req("POST", "/cont", b"data", headers=[("Expect", "100-continue")]))
    assert c.read_response().status == 100
    assert c.read_response().body == b"data"


def test_no_100_continue_for_an_http10_client(server):
    c = server.connect()
    c.send(b"POST /old HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\nbody")
    r = c.read_response()
    assert (r.status, r.body) == (200, b"body")  # fails: the first answer read is 100 Continue
    c.read_eof()


def test_100_continue_does_not_overtake_an_earlier_pipelined_answer(server):
    c = server.connect()
    c.send(req("GET", "/hold/first")
           + req("POST", "/cont", headers=[("Expect", "100-continue"), ("Content-Length", "4")], length=False))
    server.wait_requests(1)
    server.answer("/hold/first", 200, b"first")
    first = c.read_response()
    assert (first.status, first.body) == (200, b"first")  # fails here: the first thing read is 100 Continue
    c.send(b"body")
    r = c.read_response()
    if r.status == 100:
        r = c.read_response()
    assert (r.status, r.body) == (200, b"body")


# --- malformed requests -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("data", [
    b"\x00\x01\x02 garbage bytes\r\n\r\n",
    b"GET\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"GET / HTTP/1.1\r\nNo colon here\r\n\r\n",
    b"POST / HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
    b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    b"GET /caf\xc3\xa9 HTTP/1.1\r\n\r\n",
], ids=["garbage", "no-target", "bad-version", "bad-header", "bad-length", "length-and-chunked", "bad-chunk-size",
        "raw-utf8-url"])
def test_malformed_request_is_400_and_closed(server, data):
    c = server.connect()
    c.send(data)
    r = c.read_response()
    assert r.status == 400 and r.reason == "Bad Request"
    assert error_of(r).startswith("malformed HTTP request")
    assert r.headers["connection"] == "close"
    c.read_eof()
    assert server.requests == []


def test_garbage_after_a_good_request_answers_both_then_closes(server):
    c = server.connect()
    c.send(req("GET", "/hold/good") + b"\xff\xfe not http\r\n\r\n")
    server.wait_requests(1)
    server.answer("/hold/good", 200, b"good")
    assert c.read_response().body == b"good"  # the 400 waits for the earlier answer
    bad = c.read_response()
    assert bad.status == 400 and bad.headers["connection"] == "close"
    c.read_eof()


def test_upgrade_request_is_answered_then_closed(server):
    c = server.connect()
    c.send(req("GET", "/ws", headers=[("Connection", "Upgrade"), ("Upgrade", "websocket")]))
    r = c.read_response()
    assert (r.status, r.body) == (200, b"/ws")
    c.read_eof()


# --- HEAD -----------------------------------------------------------------------------------------------------------
def test_head_has_the_content_length_but_no_body_and_the_next_pipelined_request_follows(server):
    c = server.connect()
    c.send(req("HEAD", "/hello") + req("GET", "/next"))
    head = c.read_response(head_request=True)
    assert head.status == 200 and head.headers["content-length"] == str(len(b"/hello"))
    assert head.headers["x-method"] == "HEAD"
    following = c.read_response()  # starts right after the HEAD answer's blank line
    assert (following.status, following.body, following.headers["x-method"]) == (200, b"/next", "GET")
    assert [r.method for r in server.requests] == ["HEAD", "GET"]


def test_head_with_a_large_body_sends_no_body(make_server):
    big = b"b" * 100_000

    def handler(request, respond):
        respond(200, big, "application/octet-stream")

    c = make_server(handler).connect()
    c.send(req("HEAD", "/big") + req("GET", "/big"))
    head = c.read_response(head_request=True)
    assert head.headers["content-length"] == "100000"
    assert c.read_response().body == big


# --- handler errors and misuse ------------------------------------------------------------------------------------
def test_handler_exception_is_500_and_the_server_keeps_serving(server, caplog):
    c = server.connect()
    c.send(req("GET", "/raise"))
    r = c.read_response()
    assert r.status == 500 and r.reason == "Internal Server Error"
    assert error_of(r) == "internal error: RuntimeError: boom"
    assert "connection" not in r.headers
    c.send(req("GET", "/ok"))
    assert c.read_response().body == b"/ok"
    assert any("unexpected error serving GET /raise" in rec.getMessage() for rec in caplog.records)


def test_handler_exception_after_answering_keeps_the_first_answer(make_server):
    def handler(request, respond):
        respond(202, b"accepted", "text/plain")
        raise ValueError("after the answer")

    s = make_server(handler)
    c = s.connect()
    c.send(req("GET", "/x") + req("GET", "/y"))
    assert [(r.status, r.body) for r in (c.read_response(), c.read_response())] == [(202, b"accepted")] * 2


def test_respond_twice_sends_only_the_first_answer(server):
    c = server.connect()
    c.send(req("GET", "/twice") + req("GET", "/after"))
    first = c.read_response()
    assert (first.status, first.body) == (200, b"first")
    after = c.read_response()
    assert (after.status, after.body) == (200, b"/after")
    c.send(req("GET", "/again"))
    assert c.read_response().body == b"/again"


def test_a_late_second_respond_is_ignored(server):
    c = server.connect()
    c.send(req("GET", "/hold/x"))
    server.answer("/hold/x", 200, b"one")
    assert c.read_response().body == b"one"
    c.send(req("GET", "/hold/y"))
    server.wait_requests(2)
    server.answer("/hold/x", 500, b"again")  # a second call for the answered request: not sent, not in y's place
    assert c.nothing_to_read_now()
    server.answer("/hold/y", 200, b"two")
    assert c.read_response().body == b"two"


def test_custom_headers_content_type_and_status(make_server):
    def handler(request, respond):
        if request.path == "/plain":
            respond(404, b"nope", "", [("X-One", "1"), ("Retry-After", "3")])
        else:
            respond(299, b"{}")

    s = make_server(handler)
    c = s.connect()
    c.send(req("GET", "/plain") + req("GET", "/odd"))
    r = c.read_response()
    assert (r.status, r.reason, r.body) == (404, "Not Found", b"nope")
    assert "content-type" not in r.headers
    assert (r.headers["x-one"], r.headers["retry-after"], r.headers["content-length"]) == ("1", "3", "4")
    odd = c.read_response()
    assert (odd.status, odd.reason, odd.headers["content-type"]) == (299, "Unknown", "application/json")


# --- request line and headers -------------------------------------------------------------------------------------
@pytest.mark.parametrize("target,path,query", [
    ("/v2/models/a%20b/infer?x=1", "/v2/models/a b/infer", "x=1"),
    ("/v2/models/plain/infer", "/v2/models/plain/infer", ""),
    ("/v2/models/%E2%82%AC/ready?", "/v2/models/\u20ac/ready", ""),
    ("/a%3Fb?c=%20d&e", "/a?b", "c=%20d&e"),
])
def test_path_is_percent_decoded_and_the_query_split_off(server, target, path, query):
    c = server.connect()
    c.send(req("GET", target))
    assert c.read_response().status == 200
    (request,) = server.requests
    assert (request.path, request.query) == (path, query)


def test_header_names_are_lower_cased_and_a_repeated_header_keeps_its_last_value(server):
    c = server.connect()
    c.send(req("POST", "/h", b"{}", headers=[("X-Custom-Header", "Mixed Case Value"), ("CONTENT-TYPE", "a/b"),
                                             ("X-Twice", "1"), ("x-twice", "2")]))
    assert c.read_response().status == 200
    headers = server.requests[0].headers
    assert headers["x-custom-header"] == "Mixed Case Value"
    assert headers["content-type"] == "a/b"
    assert headers["x-twice"] == "2"
    assert headers["host"] == "test" and headers["content-length"] == "2"
    assert all(name == name.lower() for name in headers)


# --- idle keep-alive connections ----------------------------------------------------------------------------------
def test_idle_keep_alive_connection_is_closed_by_the_sweeper(make_server):
    # Real time: the sweeper runs every max(0.05, keepalive_timeout_s / 4) seconds, so this takes well under a second.
    s = make_server(keepalive_timeout_s=0.05)
    used = s.connect()
    used.send(req("GET", "/once"))
    assert used.read_response().body == b"/once"
    silent = s.connect()  # never sends anything
    started = time.monotonic()
    used.read_eof()  # blocks (up to TIMEOUT_S) until the sweeper closes it
    silent.read_eof()
    assert time.monotonic() - started < 3.0
    s.http.connections.wait_len(0)


def test_sweeper_spares_a_connection_with_a_request_in_flight(make_server):
    s = make_server(keepalive_timeout_s=10.0)
    busy = s.connect()
    busy.send(req("GET", "/hold/slow"))
    s.wait_requests(1)
    idle = s.connect()
    idle.send(req("GET", "/quick"))
    assert idle.read_response().body == b"/quick"
    fresh_count = s.sweeps
    s.advance_clock(20.0)  # both connections now look idle for 20 s
    s.wait_sweeps(fresh_count + 1)
    idle.read_eof()
    s.answer("/hold/slow", 200, b"slow")  # the busy one was left open
    assert busy.read_response().body == b"slow"


def test_sweeper_leaves_recently_active_connections_open(make_server):
    s = make_server(keepalive_timeout_s=10.0)
    old = s.connect()
    old.send(req("GET", "/old"))
    assert old.read_response().status == 200
    s.advance_clock(6.0)  # one sweep (every 2.5 s): nobody idle for 10 s yet
    s.wait_sweeps(1)
    recent = s.connect()
    recent.send(req("GET", "/recent"))
    assert recent.read_response().status == 200
    s.advance_clock(6.0)  # old: idle for 12 s, recent: for 6 s
    s.wait_sweeps(2)
    old.read_eof()
    recent.send(req("GET", "/still-open"))
    assert recent.read_response().body == b"/still-open"


def test_idle_time_counts_from_the_last_answer(make_server):
    s = make_server(keepalive_timeout_s=10.0)
    c = s.connect()
    c.send(req("GET", "/hold/long"))
    s.wait_requests(1)
    s.advance_clock(20.0)  # a 20 s request: the sweep leaves it alone while it is in flight
    s.wait_sweeps(1)
    s.answer("/hold/long", 200, b"done")
    assert c.read_response().body == b"done"
    s.advance_clock(3.0)  # the next sweep, 3 s after the answer: well within the 10 s keep-alive
    s.wait_sweeps(2)
    c.send(req("GET", "/next"))
    assert c.read_response().body == b"/next"


# --- slow clients and connection floods ---------------------------------------------------------------------------
def test_a_request_trickling_in_gets_408_and_its_connection_closed(make_server):
    s = make_server(keepalive_timeout_s=10.0, request_timeout_s=5.0)
    c = s.connect()
    c.send(b"GET /slow HTTP/1.1\r\nHost: test\r\n")  # a head that never ends (slowloris)
    deadline = time.monotonic() + TIMEOUT_S
    while not any(conn.request_started_s is not None for conn in list(s.http.connections)):
        assert time.monotonic() < deadline, "the partial request never reached the server"
        time.sleep(0.01)
    c.send(b"X-Trickle: 1\r\n")  # still sending: activity does not extend the request's time
    s.advance_clock(6.0)  # the request began 6 s ago: over its 5 s
    s.wait_sweeps(1)
    response = c.read_response()
    assert response.status == 408 and b"request not received within 5 s" in response.body
    c.read_eof()
    assert s.requests == []  # the handler never saw it


def test_connections_over_the_cap_are_answered_503_and_closed(make_server):
    s = make_server(max_connections=1)
    first = s.connect()
    first.send(req("GET", "/one"))
    assert first.read_response().status == 200
    second = s.connect()
    response = second.read_response()
    assert response.status == 503 and b"too many connections" in response.body
    second.read_eof()
    first.send(req("GET", "/still"))  # the first is untouched
    assert first.read_response().body == b"/still"


# --- graceful close -----------------------------------------------------------------------------------------------
def test_close_waits_for_the_answer_in_flight_and_refuses_new_connections(server):
    c = server.connect()
    c.send(req("GET", "/hold/inflight"))
    server.wait_requests(1)
    order: list[str] = []

    async def begin_close():
        async def close_and_note():
            await server.http.close(grace_s=5)
            order.append("closed")

        task = asyncio.ensure_future(close_and_note())
        await asyncio.sleep(0)  # one loop step: close() runs up to its wait for the outstanding answer
        return task

    task = server.submit(begin_close()).result(TIMEOUT_S)
    server.closed = True
    assert server.http.closing and not task.done()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S).close()
    assert server.call(task.done) is False

    def answer() -> None:
        assert not task.done()
        order.append("answered")
        server.held["/hold/inflight"](200, b"finished")

    server.call(answer)
    closed = concurrent.futures.Future()
    server.loop.call_soon_threadsafe(lambda: task.add_done_callback(lambda t: closed.set_result(t.exception())))
    assert closed.result(TIMEOUT_S) is None
    assert order == ["answered", "closed"]
    r = c.read_response()
    assert (r.status, r.body, r.headers["connection"]) == (200, b"finished", "close")
    c.read_eof()
    assert len(server.http.connections) == 0


def test_close_with_no_connections_returns_promptly(server):
    started = time.monotonic()
    server.close(grace_s=5)
    assert time.monotonic() - started < 1.0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S).close()


def test_close_closes_idle_keep_alive_connections_at_once(server):
    c = server.connect()
    c.send(req("GET", "/a"))
    assert c.read_response().status == 200
    started = time.monotonic()
    server.close(grace_s=5)
    assert time.monotonic() - started < 1.0
    c.read_eof()


def test_close_gives_up_after_the_grace_period(server, caplog):
    c = server.connect()
    c.send(req("GET", "/hold/never"))
    server.wait_requests(1)
    started = time.monotonic()
    server.close(grace_s=0.1)
    elapsed = time.monotonic() - started
    assert 0.09 <= elapsed < 1.5
    c.read_eof()
    server.http.connections.wait_len(0)
    server.answer("/hold/never", 200, b"too late")  # a harmless no-op now
    assert any("still had answers outstanding" in rec.getMessage() for rec in caplog.records)


# --- clients that go away -----------------------------------------------------------------------------------------
def test_respond_after_the_client_reset_the_connection_is_a_no_op(server):
    c = server.connect()
    c.send(req("GET", "/hold/gone"))
    server.wait_requests(1)
    c.reset()
    server.http.connections.wait_len(0)
    server.answer("/hold/gone", 200, b"nobody listens")
    server.answer("/hold/gone", 200, b"twice")
    fresh = server.connect()
    fresh.send(req("GET", "/alive"))
    assert fresh.read_response().body == b"/alive"


def test_respond_after_the_client_closed_is_harmless(server):
    c = server.connect()
    c.send(req("GET", "/hold/left"))
    server.wait_requests(1)
    c.close()  # a FIN: the server keeps the connection until its answer is out, then closes it
    server.answer("/hold/left", 200, b"x" * 200_000)
    server.http.connections.wait_len(0)
    server.answer("/hold/left", 200, b"again")
    fresh = server.connect()
    fresh.send(req("GET", "/alive"))
    assert fresh.read_response().body == b"/alive"


@pytest.mark.parametrize("where", ["headers", "url"])
def test_request_head_over_64_kib_is_431_and_closed(server, where):
    # llhttp bounds nothing: without gpud's own limit a client could grow a request's head without end.
    c = server.connect()
    if where == "headers":
        c.send(req("GET", "/big", headers=[(f"X-Filler-{i}", "v" * 1000) for i in range(70)]))
    else:
        c.send(req("GET", "/" + "a" * 70_000))
    r = c.read_response()
    assert r.status == 431 and r.headers["connection"] == "close"
    assert "longer than 65536 bytes" in error_of(r)
    c.read_eof()
    assert server.requests == []  # never handed to the handler


def test_request_head_just_under_the_limit_is_served(server):
    c = server.connect()
    c.send(req("GET", "/ok", headers=[(f"X-Filler-{i}", "v" * 1000) for i in range(60)]))
    assert c.read_response().status == 200
