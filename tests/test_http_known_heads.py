"""gpud.api.http_server's known request heads: a request whose head (request line and headers) is byte for byte one
the parser has accepted before is served without the parser, with what the parser made of it then.

The connection protocol is driven directly (a stand-in transport collects what it writes), so a test controls
exactly how the bytes arrive. The check throughout: the same bytes, arriving the same way, give the handler the same
requests and the client the same answers with the known heads as with the parser alone (`max_known_heads=0`).
"""
from __future__ import annotations

import asyncio
import gzip
import itertools

import pytest

from gpud.api.http_server import HttpRequest, HttpServer, _Connection, known_head_candidate


class Transport:
    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False
        self.reading = True

    def get_extra_info(self, name: str, default=None):
        return default

    def write(self, data) -> None:
        assert not self.closed, "written after close"
        self.out += data

    def writelines(self, parts) -> None:
        for part in parts:
            self.write(part)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


def seen(request: HttpRequest) -> tuple:
    return (request.method, request.path, request.query, dict(request.headers), bytes(request.body),
            request.keep_alive, request.peer)


class Harness:
    """One HttpServer (not listening) whose connections are fed by hand. The handler echoes the body (or the path)
    and records every request; a path starting /hold is answered only when the test says."""

    def __init__(self, max_known_heads: int = 256, **kw) -> None:
        self.loop = asyncio.new_event_loop()
        self.requests: list[tuple] = []
        self.held: list = []
        self.server = HttpServer(self.handler, max_known_heads=max_known_heads, **kw)
        self.server.loop = self.loop

    def handler(self, request: HttpRequest, respond) -> None:
        self.requests.append(seen(request))
        if request.path.startswith("/hold"):
            self.held.append(respond)
            return
        if request.path == "/mutate":
            request.headers["x-added"] = "by the handler"
        respond(200, bytes(request.body) or request.path.encode(), "application/octet-stream",
                [("X-Method", request.method), ("X-Query", request.query)])

    def connect(self) -> tuple[_Connection, Transport]:
        connection = _Connection(self.server)
        transport = Transport()
        connection.connection_made(transport)  # type: ignore[arg-type]
        return connection, transport

    def feed(self, chunks: list[bytes]) -> tuple[list[tuple], bytes, bool]:
        """A new connection fed `chunks` one read at a time: the requests the handler saw, the bytes written back,
        whether the connection was closed."""
        before = len(self.requests)
        connection, transport = self.connect()
        for chunk in chunks:
            connection.data_received(chunk)
        return self.requests[before:], bytes(transport.out), transport.closed

    def close(self) -> None:
        self.loop.close()


@pytest.fixture
def harness():
    made: list[Harness] = []

    def make(max_known_heads: int = 256, **kw) -> Harness:
        h = Harness(max_known_heads, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def post(path: str, body: bytes, *headers: str, version: str = "1.1") -> bytes:
    head = f"POST {path} HTTP/{version}\r\nHost: test\r\nContent-Length: {len(body)}\r\n"
    return (head + "".join(h + "\r\n" for h in headers) + "\r\n").encode("latin-1") + body


def get(path: str, *headers: str, version: str = "1.1") -> bytes:
    return (f"GET {path} HTTP/{version}\r\nHost: test\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


BODY = bytes(range(256)) * 4
INFER = post("/v2/models/mlp/infer", BODY, "Content-Type: application/octet-stream",
             "Inference-Header-Content-Length: 0")
# Requests of every kind the server takes: those the table may keep, and those it must leave to the parser.
CORPUS = {
    "infer": INFER,
    "get": get("/v2/health/ready"),
    "query and percent-encoded path": get("/v2/models/a%20b/config?x=1&y=%41"),
    "head": b"HEAD /v2/models/mlp HTTP/1.1\r\nHost: test\r\n\r\n",
    "empty post": post("/v2/repository/index", b""),
    "repeated header": post("/echo", b"ab", "X-Twice: 1", "x-twice: 2"),
    "gzip body": post("/echo", gzip.compress(b"inflated"), "Content-Encoding: gzip"),
    "unknown content-encoding": post("/echo", b"zz", "Content-Encoding: br"),
    "http/1.0 keep-alive": post("/echo", b"10", "Connection: keep-alive", version="1.0"),
    "connection close": post("/echo", b"cc", "Connection: close"),
    "chunked": (b"POST /echo HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"),
    "expect 100-continue": post("/echo", b"ex", "Expect: 100-continue"),
    "bare LF lines": b"POST /echo HTTP/1.1\nHost: test\nContent-Length: 2\n\nlf",
    "leading blank line": b"\r\n" + post("/echo", b"bl"),
    "obsolete line folding": post("/echo", b"of", "X-Folded: a\r\n b"),
    "upgrade": get("/ws", "Connection: Upgrade", "Upgrade: websocket"),
    "malformed": b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: 2\r\nBad Header\r\n\r\nxx",
    "too large": post("/echo", b"x" * 2048),
}


def splits(stream: bytes) -> list[list[bytes]]:
    """`stream` arriving in one read, a request per read (as the corpus cuts it), and a byte at a time."""
    return [[stream], [bytes([b]) for b in stream]]


@pytest.mark.parametrize("name", list(CORPUS))
def test_each_kind_of_request_repeated_is_served_as_the_parser_alone_serves_it(harness, name):
    request = CORPUS[name]
    for reads in ([request] * 3, [request * 3], [request, request[:7], request[7:], request]):
        with_table, parser_alone = harness(max_body_bytes=1024), harness(0, max_body_bytes=1024)
        assert with_table.feed(reads) == parser_alone.feed(reads), name
        assert not parser_alone.server.known_heads


def test_every_pair_of_kinds_pipelined_in_one_read_is_served_as_the_parser_alone_serves_it(harness):
    with_table, parser_alone = harness(max_body_bytes=1024), harness(0, max_body_bytes=1024)
    for a, b in itertools.product(CORPUS.values(), repeat=2):
        stream = a + b + a + a
        assert with_table.feed([stream]) == parser_alone.feed([stream]), (a, b)
        assert with_table.feed([a, b, a + a]) == parser_alone.feed([a, b, a + a]), (a, b)


@pytest.mark.parametrize("name", ["infer", "get", "query and percent-encoded path", "head", "empty post",
                                  "repeated header", "gzip body", "unknown content-encoding"])
def test_a_plain_request_seen_once_is_served_again_without_the_parser(harness, name):
    h = harness()
    request = CORPUS[name]
    first, out, _ = h.feed([request])
    assert len(h.server.known_heads) == 1
    connection, transport = h.connect()
    connection.parser = None  # type: ignore[assignment]  # any use of the parser would now fail with a 400
    for _ in range(3):
        connection.data_received(request)
    assert bytes(transport.out) == out * 3
    assert h.requests[1:] == first * 3


@pytest.mark.parametrize("name", ["http/1.0 keep-alive", "connection close", "chunked", "expect 100-continue",
                                  "bare LF lines", "leading blank line", "upgrade", "malformed", "too large"])
def test_requests_that_are_not_plain_are_never_remembered(harness, name):
    h = harness(max_body_bytes=1024)
    h.feed([CORPUS[name]] * 2)
    assert not h.server.known_heads


def test_a_body_in_place_is_never_remembered(harness):
    h = harness()
    h.feed([post("/echo", b"m" * (1 << 20))])
    assert not h.server.known_heads


def test_a_known_head_whose_body_has_not_all_arrived_goes_to_the_parser(harness):
    h = harness()
    h.feed([INFER])
    connection, transport = h.connect()
    cut = len(INFER) - 100
    connection.data_received(INFER[:cut])
    assert len(h.requests) == 1  # the body is not all there: nothing served yet
    connection.data_received(INFER[cut:] + INFER)
    assert h.requests[1:] == h.requests[:1] * 2
    assert bytes(transport.out).count(b"HTTP/1.1 200 OK") == 2


def test_known_and_unknown_requests_pipelined_are_answered_in_order(harness):
    h = harness()
    h.feed([INFER])
    other = post("/other", b"xyz")
    connection, transport = h.connect()
    connection.data_received(INFER * 3 + other + INFER * 2)
    assert [r[1] for r in h.requests[1:]] == ["/v2/models/mlp/infer"] * 3 + ["/other"] + ["/v2/models/mlp/infer"] * 2
    bodies = bytes(transport.out).split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert [b.endswith(BODY) for b in bodies] == [True, True, True, False, True, True]
    assert bodies[3].endswith(b"\r\n\r\nxyz")


def test_pipelining_past_the_limit_pauses_reading_as_the_parser_does(harness):
    with_table, parser_alone = harness(), harness(0)
    for h in (with_table, parser_alone):
        h.feed([get("/hold")])
        connection, transport = h.connect()
        connection.data_received(get("/hold") * 40)
        assert not transport.reading
        assert len(h.held) == 41
    assert with_table.requests == parser_alone.requests


def test_each_request_gets_its_own_headers(harness):
    h = harness()
    request = get("/mutate")
    h.feed([request, request, request])
    assert all("x-added" not in headers for _, _, _, headers, *_ in h.requests)


def test_the_table_is_bounded_and_starts_over_when_full(harness):
    h = harness(max_known_heads=8)
    for i in range(20):
        h.feed([get(f"/path/{i}")])
        assert 1 <= len(h.server.known_heads) <= 8
    assert get("/path/19") in h.server.known_heads


def test_a_refused_connection_serves_nothing_more_from_the_table(harness):
    h = harness(max_body_bytes=1024)
    h.feed([INFER])
    connection, transport = h.connect()
    connection.data_received(CORPUS["too large"] + INFER)
    assert len(h.requests) == 1  # the 413's connection takes no later request
    assert bytes(transport.out).startswith(b"HTTP/1.1 413")


@pytest.mark.parametrize("data, start, head", [
    (b"GET / HTTP/1.1\r\nHost: a\r\n\r\nbody", 0, b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"),
    (b"xxGET / HTTP/1.1\r\n\r\n", 2, b"GET / HTTP/1.1\r\n\r\n"),
    (b"GET / HTTP/1.1\r\nHost: a\r\n", 0, None),  # not all there
    (b"\r\nGET / HTTP/1.1\r\n\r\n", 0, None),  # a blank line first
    (b"GET / HTTP/1.1\nHost: a\r\n\r\n", 0, None),  # a bare LF
    (b"GET / HTTP/1.1\rHost: a\r\n\r\n", 0, None),  # a bare CR
    (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\n\r\n", 0, None),  # longer than any head remembered
])
def test_known_head_candidate(data, start, head):
    assert known_head_candidate(data, start) == head
