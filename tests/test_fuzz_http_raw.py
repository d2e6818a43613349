"""Raw, malformed HTTP/1.1 against the real daemon's own server (gpud.api.http_server over httptools), on 127.0.0.1:
bad request lines, duplicate and conflicting Content-Length, request smuggling shapes, chunked edge cases,
truncated binary tensors and huge declared shapes, written by hand and then mutated byte by byte by Hypothesis.
Every answer is a well-formed HTTP/1.1 response that is not a 5xx (503 aside), or the connection is closed without
one; nothing is logged as an error; the daemon is ready afterwards."""
from __future__ import annotations

import socket
import struct

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz_support import TOKEN, Tally, assert_clean_log, fuzz_settings, start_fuzz_daemon

pytestmark = pytest.mark.slow
TIMEOUT_S = 10.0
TALLY = Tally("raw HTTP/1.1")


def _json(doc) -> bytes:
    return orjson.dumps(doc)


def post(path: str, body: bytes, *headers: str) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Length: {len(body)}\r\n" + "".join(h + "\r\n" for h in headers)
    return head.encode() + b"\r\n" + body


MLP_JSON = _json({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 256], "data": [0.5] * 256}]})
BIN_HEADER = _json({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 256],
                                "parameters": {"binary_data_size": 1024}}],
                    "parameters": {"binary_data_output": True}})
MLP_BINARY = post("/v2/models/mlp/infer", BIN_HEADER + b"\x00" * 1024,
                  f"Inference-Header-Content-Length: {len(BIN_HEADER)}")
BYTES_HEADER = _json({"inputs": [{"name": "input", "datatype": "BYTES", "shape": [2],
                                  "parameters": {"binary_data_size": 12}}]})


def huge_shape_json(shape) -> bytes:
    return post("/v2/models/mlp/infer", _json({"inputs": [{"name": "input", "datatype": "FP32", "shape": shape,
                                                            "data": [0.5] * 4}]}))


def huge_shape_binary(shape) -> bytes:
    header = _json({"inputs": [{"name": "input", "datatype": "FP32", "shape": shape,
                                "parameters": {"binary_data_size": 16}}]})
    return post("/v2/models/mlp/infer", header + b"\x00" * 16, f"Inference-Header-Content-Length: {len(header)}")


# (name, bytes sent, statuses allowed for the first answer; None: the connection may also close without one)
CASES: list[tuple[str, bytes, set[int] | None]] = [
    # request lines
    ("empty line", b"\r\n\r\n", None),
    ("method only", b"GET\r\n\r\n", {400}),
    ("no version (HTTP/0.9)", b"GET /v2\r\n\r\n", {200, 400}),  # llhttp reads it as 0.9: answered, closed
    ("HTTP/9.9", b"GET /v2 HTTP/9.9\r\nHost: x\r\n\r\n", {400, 505}),
    ("HTTP/0.9 style", b"GET /v2\n", None),
    ("double space", b"GET  /v2 HTTP/1.1\r\nHost: x\r\n\r\n", {200, 400}),  # llhttp is lenient here
    ("lower-case method", b"get /v2 HTTP/1.1\r\nHost: x\r\n\r\n", {400}),
    ("unknown method", b"BREW /v2 HTTP/1.1\r\nHost: x\r\n\r\n", {400, 405}),
    ("binary garbage", bytes(range(256)), {400}),
    ("NUL in target", b"GET /v2/\x00models HTTP/1.1\r\nHost: x\r\n\r\n", {400}),
    ("absolute form", b"GET http://evil/v2 HTTP/1.1\r\nHost: x\r\n\r\n", {400, 404}),
    ("asterisk form", b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", {400, 404, 405}),
    ("percent-encoded slash", b"GET /v2/models/%2F..%2F/config HTTP/1.1\r\nHost: x\r\n\r\n", {400, 404}),
    ("bad percent encoding", b"GET /v2/models/%zz HTTP/1.1\r\nHost: x\r\n\r\n", {400, 404}),
    ("target of 70 KB", b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", {431}),
    ("LF line endings", b"GET /v2/health/ready HTTP/1.1\nHost: x\n\n", {200, 400}),
    # headers
    ("header without colon", b"GET /v2 HTTP/1.1\r\nHost x\r\n\r\n", {400}),
    ("space before colon", b"GET /v2 HTTP/1.1\r\nHost : x\r\n\r\n", {400}),
    ("obs-fold", b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n", {200, 400}),
    ("NUL in a header value", b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", {400}),
    ("headers of 70 KB", b"GET /v2 HTTP/1.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 1000) for i in range(70))
     + b"\r\n", {431}),
    # Content-Length
    ("duplicate equal Content-Length", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
     b"Content-Length: 2\r\n\r\n{}", {200, 400}),
    ("conflicting Content-Length", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
     b"Content-Length: 20\r\n\r\n{}", {400}),
    ("Content-Length list", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 2, 2\r\n\r\n{}", {400}),
    ("negative Content-Length", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", {400}),
    ("signed Content-Length", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: +2\r\n\r\n{}", {400}),
    ("hex Content-Length", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 0x2\r\n\r\n{}", {400}),
    ("overflowing Content-Length", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\n"
     b"Content-Length: 99999999999999999999999\r\n\r\n", {400, 413}),
    ("Content-Length over the limit", b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n"
     b"Content-Length: 999999999999\r\n\r\n", {413}),
    ("Expect 100-continue over the limit", b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
     b"Content-Length: 999999999999\r\n\r\n", {413}),
    ("body shorter than Content-Length", b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n"
     b"\r\n{\"inputs\"", None),
    ("a large body cut short", b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 3000000\r\n"
     b"\r\n" + b"[" * 200_000, None),
    # Transfer-Encoding and smuggling shapes
    ("Content-Length with chunked", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", {400}),
    ("chunked twice", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", {200, 400}),
    ("gzip, chunked", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
     b"2\r\n{}\r\n0\r\n\r\n", {501}),  # was 200: the gzip coding was ignored
    ("chunked, gzip", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, gzip\r\n\r\n"
     b"2\r\n{}\r\n0\r\n\r\n", {400, 501}),
    ("unknown Transfer-Encoding", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: zip\r\n\r\n"
     b"{}", {400, 501}),
    ("bad chunk size", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"zz\r\n{}\r\n0\r\n\r\n", {400}),
    ("overflowing chunk size", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"ffffffffffffffffffff\r\n{}\r\n0\r\n\r\n", {400, 413}),
    ("chunk longer than said", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"1\r\n{}\r\n0\r\n\r\n", {400}),
    ("chunk extension", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"2;name=value\r\n{}\r\n0\r\n\r\n", {200, 400}),
    ("trailer fields", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"2\r\n{}\r\n0\r\nX-Trailer: 1\r\n\r\n", {200, 400}),
    ("no last chunk", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"2\r\n{}\r\n", None),
    ("chunked over the limit", b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"7fffffff\r\n" + b"x" * 1000, None),
    ("chunked gzip bomb", b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n4\r\n\x1f\x8b\x08\x00\r\n0\r\n\r\n", {400}),
    ("HTTP/1.0 body without length", b"POST /v2/repository/index HTTP/1.0\r\n\r\n{}", None),
    ("upgrade", b"GET /v2 HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n", {200, 400}),
    ("h2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", {400}),
    # inference bodies
    ("truncated binary tensor", post("/v2/models/mlp/infer", BIN_HEADER + b"\x00" * 1000,
                                     f"Inference-Header-Content-Length: {len(BIN_HEADER)}"), {400}),
    ("binary tensor with extra bytes", post("/v2/models/mlp/infer", BIN_HEADER + b"\x00" * 1100,
                                            f"Inference-Header-Content-Length: {len(BIN_HEADER)}"), {400}),
    ("header length past the body", post("/v2/models/mlp/infer", BIN_HEADER,
                                         f"Inference-Header-Content-Length: {len(BIN_HEADER) + 1}"), {400}),
    ("header length not a number", post("/v2/models/mlp/infer", BIN_HEADER,
                                        "Inference-Header-Content-Length: 12abc"), {400}),
    ("header length negative", post("/v2/models/mlp/infer", BIN_HEADER, "Inference-Header-Content-Length: -5"),
     {400}),
    ("header length zero", post("/v2/models/mlp/infer", BIN_HEADER, "Inference-Header-Content-Length: 0"), {400}),
    ("BYTES length prefix past the end", post("/v2/models/mlp/infer",
                                              BYTES_HEADER + struct.pack("<I", 2**32 - 1) + b"\x00" * 8,
                                              f"Inference-Header-Content-Length: {len(BYTES_HEADER)}"), {400}),
    ("huge shape, JSON", huge_shape_json([1, 10**12]), {400}),
    ("huge shape with a zero, JSON", huge_shape_json([0, 2**62, 4]), {400}),
    ("shape of 40 dimensions", huge_shape_json([1] * 40), {400}),
    ("shape beyond int64", post("/v2/models/mlp/infer", b'{"inputs":[{"name":"input","datatype":"FP32",'
                                b'"shape":[18446744073709551617],"data":[0.5]}]}'), {400}),
    ("huge shape, binary", huge_shape_binary([1, 10**12]), {400}),
    ("huge shape with a zero, binary", huge_shape_binary([0, 10**18]), {400}),
    ("JSON nested 10000 deep", post("/v2/models/mlp/infer", b"[" * 10000 + b"]" * 10000), {400}),
    ("data nested 500 deep", post("/v2/models/mlp/infer", b'{"inputs":[{"name":"input","datatype":"FP32",'
                                  b'"shape":[1,256],"data":' + b"[" * 500 + b"]" * 500 + b"}]}"), {400}),
    ("invalid UTF-8", post("/v2/models/mlp/infer", b'{"inputs":[{"name":"\xff\xfe","datatype":"FP32"}]}'), {400}),
    # Triton reads NaN, Infinity and -Infinity in JSON (RapidJSON's kParseNanAndInfFlag): so does gpud
    ("NaN in data", post("/v2/models/mlp/infer", MLP_JSON.replace(b"0.5", b"NaN", 1)), {200}),
    ("NaN in an INT data", post("/v2/models/mlp/infer", MLP_JSON.replace(b"0.5", b"NaN", 1).replace(b"FP32", b"INT32")),
     {400}),
    ("NaN as a key's value elsewhere", post("/v2/models/mlp/infer", MLP_JSON.replace(b'"input"', b"NaN", 1)), {400}),
    ("model name with ..", post("/v2/models/../infer", MLP_JSON), {400, 404}),
    ("model name with NUL", post("/v2/models/a%00b/infer", MLP_JSON), {400}),
    ("load with file: override", post("/v2/repository/models/mlp/load",
                                      _json({"parameters": {"file:1/model.onnx": "AAAA"}}),
                                      f"Authorization: Bearer {TOKEN}"), {400}),
    ("placement with a bool index", post("/v2/gpud/placement",
                                         _json({"placements": [{"model": "mlp", "instance": True, "device": "cpu"}]}),
                                         f"Authorization: Bearer {TOKEN}"), {400}),
    ("control body over 1 MiB", post("/v2/repository/index", b" " * (1 << 20) + b"{}"), {413}),
]

SEEDS = [
    b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v2/models/mlp/config HTTP/1.1\r\nHost: x\r\n\r\n",
    post("/v2/models/mlp/infer", MLP_JSON),
    MLP_BINARY,
    b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"4\r\n{\"re\r\na\r\nady\":true}\r\n0\r\n\r\n",
]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_fuzz_daemon(tmp_path_factory.mktemp("fuzz-raw"))
    yield d
    assert exchange(d, SEEDS[0]) == [200], "not ready after the fuzzing"
    print(f"\n{TALLY.report()}")
    assert d.stop() == 0, d.log()
    assert_clean_log(d)


def exchange(daemon, data: bytes) -> list[int]:
    """Send `data`, close our side, and read every answer until the server closes: their statuses, each checked to
    be a well-formed response."""
    with socket.create_connection(("127.0.0.1", daemon.ports["http"]), timeout=TIMEOUT_S) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before taking everything (431, 413): read what it said
        received = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break  # closed on unread input after its answer
            if not chunk:
                break
            received += chunk
    statuses = []
    while received:
        head, sep, rest = received.partition(b"\r\n\r\n")
        assert sep, f"a truncated response head: {received[:200]!r}"
        lines = head.decode("latin-1").split("\r\n")
        version, status, _ = (lines[0].split(" ", 2) + [""])[:3]
        assert version == "HTTP/1.1" and status.isdigit(), lines[0]
        fields = dict(line.split(": ", 1) for line in lines[1:])
        length = int(fields.get("Content-Length", "0"))
        if status.startswith("1"):
            length = 0
        assert len(rest) >= length, f"a truncated body after {lines[0]}"
        body, received = rest[:length], rest[length:]
        if int(status) >= 400:
            assert fields.get("Content-Type") == "application/json" and list(orjson.loads(body)) == ["error"], body
        if not status.startswith("1"):
            statuses.append(int(status))
    return statuses


def assert_no_server_error(statuses: list[int], what: str) -> None:
    """One case: its answers (none when the server closed without one, e.g. on a request cut short)."""
    TALLY.add(statuses[0] if statuses else "closed without an answer")
    for status in statuses:
        assert status < 500 or status in (501, 503), (what, statuses)  # the documented ones


@pytest.mark.parametrize("data, allowed", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_request_gets_a_clean_4xx_or_a_clean_close(daemon, data, allowed):
    statuses = exchange(daemon, data)
    assert_no_server_error(statuses, repr(data[:200]))
    if allowed is not None:
        assert statuses and statuses[0] in allowed, statuses


@st.composite
def mutated(draw) -> bytes:
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "duplicate", "truncate"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.sampled_from([b"\r\n", b"\n", b":", b" ", b"\x00", b"0", b"-", b"9" * 20,
                                                b"Content-Length: 7\r\n", b"Transfer-Encoding: chunked\r\n",
                                                b"Expect: 100-continue\r\n", b"%", b"..", b"/"]))
        elif op == "delete" and data:
            del data[at:at + draw(st.integers(1, 8))]
        elif op == "duplicate" and data:
            data[at:at] = data[at:at + draw(st.integers(1, 64))]
        elif op == "truncate":
            del data[at:]
    return bytes(data)


def test_mutated_requests_never_get_a_5xx(daemon):
    @fuzz_settings(max_examples=20 * _examples())
    @given(data=mutated())
    def run(data: bytes) -> None:
        assert_no_server_error(exchange(daemon, data), repr(data[:300]))

    run()


def test_pipelined_good_and_bad_requests_answer_the_good_ones_first(daemon):
    good = SEEDS[0]
    statuses = exchange(daemon, good + good + b"GET /v2 HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n" + good)
    assert statuses == [200, 200, 400], statuses  # nothing after the malformed one is read


def _examples() -> int:
    from tests.fuzz_support import EXAMPLES
    return EXAMPLES
