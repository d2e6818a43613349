"""gpud.api.http_api against the official tritonclient.http client and raw HTTP requests.

The server runs on 127.0.0.1:<ephemeral> in a background thread with its own event loop (tritonclient.http is
synchronous). Startup and shutdown wait on futures with bounded timeouts; nothing sleeps to synchronise.
"""
from __future__ import annotations

import asyncio
import json
import gzip
import http.client
import re
import socket
import struct
import threading

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from gpud.executor.types import ErrorKind, InferenceError, InferResponse, InferTensor
from gpud.api.http_api import start_http_server
from gpud.api.http_infer import INFER_HEADER_CONTENT_LENGTH, decode_infer_request, encode_infer_response
from tests.fake_core import FakeCore

TIMEOUT_S = 10


class ServerThread:
    """The HTTP server on its own loop in a daemon thread."""

    def __init__(self, core: FakeCore, **kw):
        self.core = core
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="http-api-test", daemon=True)
        self.thread.start()
        started = asyncio.run_coroutine_threadsafe(start_http_server(core, "127.0.0.1", 0, **kw), self.loop)
        self.runner, self.port = started.result(timeout=TIMEOUT_S)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.close(1.0), self.loop).result(timeout=TIMEOUT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=TIMEOUT_S)
        self.loop.close()

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None, **kw) -> tuple[int, http.client.HTTPMessage, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
        try:
            conn.request(method, path, body=body, headers=headers or {}, **kw)
            response = conn.getresponse()
            return response.status, response.headers, response.read()
        finally:
            conn.close()

    def post_json(self, path: str, doc, headers=None):
        return self.request("POST", path, orjson.dumps(doc), {"Content-Type": "application/json", **(headers or {})})

    def assert_ready(self) -> None:
        status, _, _ = self.request("GET", "/v2/health/ready")
        assert status == 200


@pytest.fixture
def core() -> FakeCore:
    return FakeCore()


@pytest.fixture
def server(core):
    s = ServerThread(core)
    yield s
    s.stop()


class _Client(httpclient.InferenceServerClient):
    def __del__(self):
        # The fixture closes it. A later garbage collection may run on the server's thread, where gevent refuses
        # to join the client's greenlet pool (InvalidThreadUseError), so no second close from __del__.
        pass


@pytest.fixture
def client(server):
    c = _Client(server.url, connection_timeout=TIMEOUT_S, network_timeout=TIMEOUT_S)
    yield c
    c.close()


def _input(name, array, datatype, binary=True):
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def _bytes_payload(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


# ---------------------------------------------------------------------------------------------------------------------
class TestHealthAndMetadata:
    def test_live_and_ready(self, client):
        assert client.is_server_live()
        assert client.is_server_ready()

    def test_not_ready_is_400_as_triton(self, server, client, core):
        core.ready = False
        assert not client.is_server_ready()
        status, _, body = server.request("GET", "/v2/health/ready")
        assert (status, body) == (400, b"")
        core.live = False
        assert not client.is_server_live()

    def test_server_metadata(self, client):
        meta = client.get_server_metadata()
        assert meta["name"] == "gpud"
        assert "binary_tensor_data" in meta["extensions"]

    @pytest.mark.parametrize("version", ["", "1"])
    def test_model_metadata(self, client, version):
        meta = client.get_model_metadata("add_sub", model_version=version)
        assert meta["inputs"][0] == {"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}
        assert meta["versions"] == ["1"]

    def test_unknown_model_metadata_is_404(self, client):
        with pytest.raises(InferenceServerException) as e:
            client.get_model_metadata("nope")
        assert e.value.status() == "404"
        assert "nope" in e.value.message()

    def test_model_ready(self, server, client):
        assert client.is_model_ready("add_sub")
        assert client.is_model_ready("add_sub", model_version="1")
        assert not client.is_model_ready("not_ready")
        status, _, body = server.request("GET", "/v2/models/not_ready/ready")
        assert status == 400 and "not ready" in orjson.loads(body)["error"]
        status, _, body = server.request("GET", "/v2/models/nope/ready")
        assert status == 404 and "nope" in orjson.loads(body)["error"]

    @pytest.mark.parametrize("version", ["", "1"])
    def test_model_config(self, client, version):
        config = client.get_model_config("add_sub", model_version=version)
        assert config["max_batch_size"] == 8
        # every field Triton's HTTP server writes for an input, integers as JSON numbers
        assert config["input"][0] == {"name": "INPUT0", "data_type": "TYPE_FP32", "format": "FORMAT_NONE",
                                      "dims": [4], "is_shape_tensor": False, "allow_ragged_batch": False,
                                      "optional": False}
        assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 100

    def test_inspect(self, server):
        status, headers, body = server.request("GET", "/v2/gpud/inspect")
        assert status == 200 and headers["Content-Type"].startswith("application/json")
        assert {"devices", "models"} <= set(orjson.loads(body))


class TestStatisticsAndRepository:
    def test_statistics_count_inferences(self, client):
        a = np.ones((1, 4), np.float32)
        client.infer("add_sub", [_input("INPUT0", a, "FP32"), _input("INPUT1", a, "FP32")])
        every = client.get_inference_statistics()
        assert {s["name"] for s in every["model_stats"]} >= {"add_sub", "identity_bytes"}
        one = client.get_inference_statistics("add_sub")
        assert [s["inference_count"] for s in one["model_stats"]] == [1]
        versioned = client.get_inference_statistics("add_sub", model_version="1")
        assert versioned["model_stats"][0]["inference_stats"]["success"]["count"] == 1

    def test_repository_index(self, server, client):
        index = client.get_model_repository_index()
        assert {m["name"]: m["state"] for m in index}["not_ready"] == "UNAVAILABLE"
        status, _, body = server.post_json("/v2/repository/index", {"ready": True})
        assert status == 200
        assert "not_ready" not in {m["name"] for m in orjson.loads(body)}

    def test_repository_index_bad_ready(self, server):
        status, _, body = server.post_json("/v2/repository/index", {"ready": "yes"})
        assert status == 400 and "ready" in orjson.loads(body)["error"]

    def test_unload_then_load(self, client):
        a = np.ones((1, 4), np.float32)
        inputs = [_input("INPUT0", a, "FP32"), _input("INPUT1", a, "FP32")]
        client.unload_model("add_sub")
        assert not client.is_model_ready("add_sub")
        with pytest.raises(InferenceServerException) as e:
            client.infer("add_sub", inputs)
        assert e.value.status() == "503"
        client.load_model("add_sub")
        assert client.is_model_ready("add_sub")
        client.infer("add_sub", inputs)

    def test_unload_dependents_reaches_the_core_and_must_be_a_boolean(self, core, server, client):
        client.unload_model("add_sub", unload_dependents=True)  # tritonclient's body: {"parameters": {...: true}}
        client.unload_model("add_sub")
        assert core.unloads == [("add_sub", True), ("add_sub", False)]
        status, _, body = server.post_json("/v2/repository/models/add_sub/unload",
                                           {"parameters": {"unload_dependents": "yes"}})
        assert status == 400 and "unload_dependents" in orjson.loads(body)["error"]
        assert len(core.unloads) == 2  # refused: nothing unloaded

    def test_load_unknown_model_is_404(self, client):
        with pytest.raises(InferenceServerException) as e:
            client.load_model("nope")
        assert e.value.status() == "404"

    def test_load_overrides_reach_the_core_and_bad_ones_are_refused(self, client, core):
        client.load_model("add_sub", config='{"max_batch_size": 2}', files={"file:1/model.onnx": b"\x01\x02"})
        override = core.last_override
        assert override.config_json == '{"max_batch_size": 2}' and override.files == {"1/model.onnx": b"\x01\x02"}
        with pytest.raises(InferenceServerException) as e:
            client.load_model("add_sub", files={"file:1/model.onnx": b"x"})  # files need a config
        assert e.value.status() == "400" and "'config' parameter must be provided" in e.value.message()


# ---------------------------------------------------------------------------------------------------------------------
class TestInferWithTritonClient:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 0.5, dtype=np.float32)

    def _add_sub_inputs(self, binary: bool):
        return [_input("INPUT0", self.a, "FP32", binary), _input("INPUT1", self.b, "FP32", binary)]

    @pytest.mark.parametrize("binary_in", [True, False])
    def test_fp32_all_outputs_binary_by_default(self, client, binary_in):
        # No outputs named: tritonclient sets binary_data_output, so both outputs come back binary.
        result = client.infer("add_sub", self._add_sub_inputs(binary_in))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), self.a + self.b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), self.a - self.b)
        assert result.get_output("OUTPUT0")["parameters"]["binary_data_size"] == 2 * 4 * 4

    @pytest.mark.parametrize("binary_in", [True, False])
    def test_fp32_json_outputs(self, client, binary_in):
        outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=False),
                   httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
        result = client.infer("add_sub", self._add_sub_inputs(binary_in), outputs=outputs)
        assert result.get_output("OUTPUT0")["data"] == (self.a + self.b).reshape(-1).tolist()
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), self.a - self.b)

    def test_requested_subset_and_mixed_encoding(self, client):
        outputs = [httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)]
        result = client.infer("add_sub", self._add_sub_inputs(True), outputs=outputs)
        assert [o["name"] for o in result.get_response()["outputs"]] == ["OUTPUT1"]
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), self.a - self.b)

        outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=False),
                   httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)]
        result = client.infer("add_sub", self._add_sub_inputs(True), outputs=outputs)
        assert "data" in result.get_output("OUTPUT0") and "data" not in result.get_output("OUTPUT1")
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), self.a + self.b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), self.a - self.b)

    @pytest.mark.parametrize("binary_in", [True, False])
    @pytest.mark.parametrize("binary_out", [True, False])
    def test_int64(self, client, binary_in, binary_out):
        x = np.array([[1, -2, 3], [2**40, -(2**62), 0]], dtype=np.int64)
        result = client.infer("identity_int64", [_input("INPUT0", x, "INT64", binary_in)],
                              outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary_out)])
        out = result.as_numpy("OUTPUT0")
        assert out.dtype == np.int64
        np.testing.assert_array_equal(out, x)

    @pytest.mark.parametrize("binary_in", [True, False])
    @pytest.mark.parametrize("binary_out", [True, False])
    def test_bytes(self, client, binary_in, binary_out):
        x = np.array([b"hello", b"", "gr\u00fc\u00dfe".encode(), b"x" * 300], dtype=np.object_)
        result = client.infer("identity_bytes", [_input("INPUT0", x.reshape(1, 4), "BYTES", binary_in)],
                              outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary_out)])
        out = result.as_numpy("OUTPUT0")
        assert out.shape == (1, 4)
        decoded = [v if isinstance(v, bytes) else v.encode() for v in out.reshape(-1)]
        assert decoded == list(x)

    def test_non_utf8_bytes_output_needs_binary(self, client):
        x = np.array([[b"\xff\xfe"]], dtype=np.object_)
        result = client.infer("identity_bytes", [_input("INPUT0", x, "BYTES")])
        assert result.as_numpy("OUTPUT0").reshape(-1).tolist() == [b"\xff\xfe"]
        with pytest.raises(InferenceServerException) as e:
            client.infer("identity_bytes", [_input("INPUT0", x, "BYTES")],
                         outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)])
        assert e.value.status() == "400" and "UTF-8" in e.value.message()

    def test_fp16_binary(self, client):
        x = np.array([0.5, -1.25, 65504.0], dtype=np.float16)
        result = client.infer("identity_fp16", [_input("INPUT0", x, "FP16")])
        out = result.as_numpy("OUTPUT0")
        assert out.dtype == np.float16
        np.testing.assert_array_equal(out, x)

    def test_id_priority_timeout_reach_the_core(self, client, core):
        result = client.infer("add_sub", self._add_sub_inputs(True), model_version="1", request_id="req-7",
                              priority=3, timeout=2500)
        assert result.get_response()["id"] == "req-7"
        assert result.get_response()["model_version"] == "1"
        req = core.last_request
        assert (req.id, req.priority, req.timeout_us, req.model_version) == ("req-7", 3, 2500, "1")
        assert req.outputs is None

    @pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
    def test_compressed_request_body(self, client, algorithm):
        result = client.infer("add_sub", self._add_sub_inputs(True), request_compression_algorithm=algorithm)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), self.a + self.b)

    def test_core_errors_reach_the_client(self, server, client):
        x = np.ones((1, 4), dtype=np.int64)  # add_sub wants FP32: the core refuses it
        with pytest.raises(InferenceServerException) as e:
            client.infer("add_sub", [_input("INPUT0", x, "INT64"), _input("INPUT1", x, "INT64")])
        assert e.value.status() == "400" and "datatype" in e.value.message()
        server.assert_ready()


class TestInferRaw:
    def test_nested_json_data(self, server):
        doc = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2, 4], "data": [[1, 2, 3, 4], [5, 6, 7, 8]]},
                          {"name": "INPUT1", "datatype": "FP32", "shape": [2, 4], "data": [1.5] * 8}],
               "outputs": [{"name": "OUTPUT0"}]}
        status, headers, body = server.post_json("/v2/models/add_sub/infer", doc)
        assert status == 200 and INFER_HEADER_CONTENT_LENGTH not in headers
        out = orjson.loads(body)["outputs"]
        assert out == [{"name": "OUTPUT0", "datatype": "FP32", "shape": [2, 4],
                        "data": [2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5, 9.5]}]

    def test_binary_request_layout_by_hand(self, server):
        a = np.arange(4, dtype=np.float32).reshape(1, 4)
        header = orjson.dumps({"inputs": [
            {"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}},
            {"name": "INPUT1", "datatype": "FP32", "shape": [1, 4], "data": [1, 1, 1, 1]}],
            "parameters": {"binary_data_output": True}})
        status, headers, body = server.request("POST", "/v2/models/add_sub/infer", header + a.tobytes(),
                                                {INFER_HEADER_CONTENT_LENGTH: str(len(header))})
        assert status == 200
        json_len = int(headers[INFER_HEADER_CONTENT_LENGTH])
        outputs = orjson.loads(body[:json_len])["outputs"]
        assert [o["parameters"]["binary_data_size"] for o in outputs] == [16, 16]
        np.testing.assert_array_equal(np.frombuffer(body[json_len:json_len + 16], np.float32), (a + 1).reshape(-1))
        assert len(body) == json_len + 32


# ---------------------------------------------------------------------------------------------------------------------
def _fp32_doc(data0, shape0=(1, 4), datatype0="FP32"):
    return {"inputs": [{"name": "INPUT0", "datatype": datatype0, "shape": list(shape0), "data": data0},
                       {"name": "INPUT1", "datatype": "FP32", "shape": [1, 4], "data": [0, 0, 0, 0]}]}


def _binary(header_doc: dict, payload: bytes, header_length: int | str | None = None):
    header = orjson.dumps(header_doc)
    length = len(header) if header_length is None else header_length
    return header + payload, {INFER_HEADER_CONTENT_LENGTH: str(length)}


_BYTES_INPUT = {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [2],
                            "parameters": {"binary_data_size": 13}}]}

# (case id, path, body, headers, expected status, a fragment of the error message)
INVALID_REQUESTS = [
    ("element count", "/v2/models/add_sub/infer", orjson.dumps(_fp32_doc([1, 2, 3])), {}, 400, "4 elements"),
    ("shape vs model", "/v2/models/add_sub/infer", orjson.dumps(_fp32_doc([1] * 5, shape0=(1, 5))), {}, 400, "shape"),
    ("negative dim", "/v2/models/add_sub/infer", orjson.dumps(_fp32_doc([1] * 4, shape0=(-1, 4))), {}, 400,
     "non-negative"),
    ("unknown datatype", "/v2/models/add_sub/infer", orjson.dumps(_fp32_doc([1] * 4, datatype0="FP33")), {}, 400,
     "unknown datatype"),
    ("dtype vs model", "/v2/models/add_sub/infer", orjson.dumps(_fp32_doc([1] * 4, datatype0="INT64")), {}, 400,
     "datatype"),
    ("strings for FP32", "/v2/models/add_sub/infer", orjson.dumps(_fp32_doc(["a", "b", "c", "d"])), {}, 400,
     "strings"),
    ("floats for INT64", "/v2/models/identity_int64/infer",
     orjson.dumps({"inputs": [{"name": "INPUT0", "datatype": "INT64", "shape": [1, 2], "data": [1.5, 2]}]}), {}, 400,
     "integers"),
    ("out of range UINT8", "/v2/models/add_sub/infer", orjson.dumps(_fp32_doc([1, 2, 3, 300], datatype0="UINT8")),
     {}, 400, "range"),
    ("ragged data", "/v2/models/add_sub/infer", orjson.dumps(_fp32_doc([[1, 2], [3]])), {}, 400, "ragged"),
    ("no inputs", "/v2/models/add_sub/infer", b'{"outputs": []}', {}, 400, "inputs"),
    ("no data", "/v2/models/add_sub/infer",
     orjson.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4]}]}), {}, 400, "neither"),
    ("bad priority", "/v2/models/add_sub/infer",
     orjson.dumps({**_fp32_doc([1] * 4), "parameters": {"priority": -1}}), {}, 400, "priority"),
    ("bad timeout", "/v2/models/add_sub/infer",
     orjson.dumps({**_fp32_doc([1] * 4), "parameters": {"timeout": "soon"}}), {}, 400, "timeout"),
    ("malformed JSON", "/v2/models/add_sub/infer", b'{"inputs": [', {}, 400, "malformed JSON"),
    ("JSON not an object", "/v2/models/add_sub/infer", b"[1, 2]", {}, 400, "object"),
    ("unknown model", "/v2/models/nope/infer", orjson.dumps(_fp32_doc([1] * 4)), {}, 404, "nope"),
    ("unknown version", "/v2/models/add_sub/versions/9/infer", orjson.dumps(_fp32_doc([1] * 4)), {}, 404, "version"),
    ("not ready", "/v2/models/not_ready/infer",
     orjson.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}]}), {}, 503,
     "not ready"),
    ("truncated binary", "/v2/models/add_sub/infer",
     *_binary({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                           "parameters": {"binary_data_size": 16}}]}, b"\0" * 8), 400, "only 8 bytes"),
    ("binary size vs shape", "/v2/models/add_sub/infer",
     *_binary({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                           "parameters": {"binary_data_size": 8}}]}, b"\0" * 8), 400, "needs 16"),
    ("trailing bytes", "/v2/models/add_sub/infer",
     *_binary({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                           "parameters": {"binary_data_size": 16}}]}, b"\0" * 20), 400, "add up to 16"),
    ("binary without header", "/v2/models/add_sub/infer",
     orjson.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                               "parameters": {"binary_data_size": 16}}]}), {}, 400,
     "no Inference-Header-Content-Length"),
    ("header length not int", "/v2/models/add_sub/infer", *_binary(_fp32_doc([1] * 4), b"", "abc"), 400, "integer"),
    ("header length past body", "/v2/models/add_sub/infer", *_binary(_fp32_doc([1] * 4), b"", 10**6), 400,
     "body has"),
    ("BYTES prefix truncated", "/v2/models/identity_bytes/infer",
     *_binary(_BYTES_INPUT, _bytes_payload([b"hello"]) + b"\x05\0\0\0"), 400, "claims 5 bytes"),
    ("BYTES element count", "/v2/models/identity_bytes/infer",
     *_binary({"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [2],
                           "parameters": {"binary_data_size": 9}}]}, _bytes_payload([b"hello"])), 400,
     "2 elements"),
    ("bad binary_data_output", "/v2/models/add_sub/infer",
     orjson.dumps({**_fp32_doc([1] * 4), "parameters": {"binary_data_output": "yes"}}), {}, 400,
     "binary_data_output"),
    ("bad gzip body", "/v2/models/add_sub/infer", b"not gzip", {"Content-Encoding": "gzip"}, 400,
     "content-encoding"),
    ("unknown route", "/v2/nothing/here", b"", {}, 404, "no route"),
]


@pytest.mark.parametrize("path,body,headers,status,fragment", [c[1:] for c in INVALID_REQUESTS],
                         ids=[c[0] for c in INVALID_REQUESTS])
def test_invalid_requests_get_4xx_and_server_stays_ready(server, path, body, headers, status, fragment):
    got_status, got_headers, got_body = server.request("POST", path, body, headers)
    assert got_status == status, got_body
    assert got_headers["Content-Type"].startswith("application/json")
    message = orjson.loads(got_body)["error"]
    assert fragment in message
    server.assert_ready()


def test_expect_100_continue(server):
    # libcurl (perf_analyzer, tritonclient's C++ client) sends "Expect: 100-continue" before large bodies.
    body = orjson.dumps(_fp32_doc([1, 2, 3, 4]))
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        stream = sock.makefile("rb")
        assert stream.readline().startswith(b"HTTP/1.1 100")
        assert stream.readline() == b"\r\n"
        sock.sendall(body)
        assert stream.readline().startswith(b"HTTP/1.1 200")


def test_wrong_method_is_405_with_error_body(server):
    status, _, body = server.request("POST", "/v2/health/live", b"")
    assert status == 405 and "not allowed" in orjson.loads(body)["error"]
    server.assert_ready()


# Triton's HttpCodeFromError: the core's error kinds are protocol-neutral, the HTTP front end picks the status
ERROR_STATUSES = [(ErrorKind.INVALID_ARGUMENT, 400), (ErrorKind.NOT_FOUND, 404), (ErrorKind.UNAVAILABLE, 503),
                  (ErrorKind.INTERNAL, 500), (ErrorKind.PERMISSION_DENIED, 403), (ErrorKind.UNAUTHENTICATED, 401),
                  (ErrorKind.UNSUPPORTED, 501), (ErrorKind.ALREADY_EXISTS, 400)]


def test_error_statuses_cover_every_kind():
    assert {kind for kind, _ in ERROR_STATUSES} == set(ErrorKind)


@pytest.mark.parametrize("kind, status", ERROR_STATUSES, ids=[k.name for k, _ in ERROR_STATUSES])
def test_error_kind_to_status(server, core, monkeypatch, kind, status):
    def fail(name, version=""):
        raise InferenceError(kind, f"{kind.name} from the core")
    monkeypatch.setattr(core, "model_metadata", fail)
    got_status, _, body = server.request("GET", "/v2/models/add_sub")
    assert (got_status, orjson.loads(body)) == (status, {"error": f"{kind.name} from the core"})
    server.assert_ready()


def test_unexpected_core_exception_is_500_and_logged(server, caplog):
    doc = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}]}
    status, _, body = server.post_json("/v2/models/explode/infer", doc)
    assert status == 500 and "exploded" in orjson.loads(body)["error"]
    assert any("unexpected error" in r.message for r in caplog.records)
    server.assert_ready()


class TestBodyLimit:
    @pytest.fixture
    def small_server(self):
        s = ServerThread(FakeCore(), max_body_bytes=1024)
        yield s
        s.stop()

    def test_oversized_body_is_413(self, small_server):
        status, _, body = small_server.request("POST", "/v2/models/add_sub/infer", b"x" * 4096,
                                               {"Content-Type": "application/json"})
        assert status == 413 and "1024" in orjson.loads(body)["error"]
        small_server.assert_ready()

    def test_oversized_chunked_body_is_413(self, small_server):
        chunks = iter([b"x" * 700, b"x" * 700])  # no Content-Length: the limit is enforced while reading
        status, _, body = small_server.request("POST", "/v2/models/add_sub/infer", chunks,
                                               {"Transfer-Encoding": "chunked"}, encode_chunked=True)
        assert status == 413 and "exceeds" in orjson.loads(body)["error"]
        small_server.assert_ready()

    def test_gzip_bomb_is_413(self, small_server):
        # The limit applies to the inflated body, not to the few compressed bytes on the wire.
        bomb = gzip.compress(b" " * 100_000)
        status, _, body = small_server.request("POST", "/v2/models/add_sub/infer", bomb, {"Content-Encoding": "gzip"})
        assert status == 413
        small_server.assert_ready()


class TestCodec:
    """The pure decode/encode functions, for datatypes the fake models don't cover."""

    def test_binary_input_is_a_view_into_the_body(self):
        body, headers = _binary({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2],
                                             "parameters": {"binary_data_size": 16}}]},
                                np.arange(4, dtype=np.float32).tobytes())
        (tensor,) = decode_infer_request(body, headers[INFER_HEADER_CONTENT_LENGTH], "m", "").inputs
        np.testing.assert_array_equal(tensor.data, [[0, 1], [2, 3]])
        assert not tensor.data.flags.owndata  # no copy of the tensor bytes
        assert tensor.shape == (2, 2) and tensor.data.dtype == np.float32

    @pytest.mark.parametrize("binary", [True, False])
    def test_bool_round_trip(self, binary):
        x = np.array([True, False, True])
        if binary:
            body, headers = _binary({"inputs": [{"name": "x", "datatype": "BOOL", "shape": [3],
                                                 "parameters": {"binary_data_size": 3}}]}, x.tobytes())
            request = decode_infer_request(body, headers[INFER_HEADER_CONTENT_LENGTH], "m", "")
        else:
            doc = {"inputs": [{"name": "x", "datatype": "BOOL", "shape": [3], "data": x.tolist()}]}
            request = decode_infer_request(orjson.dumps(doc), None, "m", "")
        np.testing.assert_array_equal(request.inputs[0].data, x)
        request.parameters["binary_data_output"] = binary
        response = encode_infer_response(InferResponse("m", "1", request.inputs), request)
        header_length = response.headers.get(INFER_HEADER_CONTENT_LENGTH)
        result = httpclient.InferResult.from_response_body(
            response.body, header_length=int(header_length) if header_length else None)
        np.testing.assert_array_equal(result.as_numpy("x"), x)

    def test_bool_bytes_other_than_0_1_are_refused(self):
        body, headers = _binary({"inputs": [{"name": "x", "datatype": "BOOL", "shape": [1],
                                             "parameters": {"binary_data_size": 1}}]}, b"\x02")
        with pytest.raises(InferenceError, match="0 or 1"):
            decode_infer_request(body, headers[INFER_HEADER_CONTENT_LENGTH], "m", "")

    def test_non_finite_json_inputs_are_read_as_triton_reads_them(self):
        # Python's json (tritonclient's JSON inputs) writes NaN, Infinity, -Infinity; Triton reads them
        doc = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [4],
                                      "data": [float("nan"), float("inf"), float("-inf"), 1.5]}]}).encode()
        assert b"Infinity" in doc
        request = decode_infer_request(doc, None, "m", "")
        np.testing.assert_array_equal(request.inputs[0].data, np.array([np.nan, np.inf, -np.inf, 1.5], np.float32))
        for bad in (b'{"inputs": [{"name": "x", "datatype": "INT32", "shape": [1], "data": [NaN]}]}',
                    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [NaN]',):
            with pytest.raises(InferenceError) as info:
                decode_infer_request(bad, None, "m", "")
            assert info.value.kind is ErrorKind.INVALID_ARGUMENT

    @pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
    def test_non_finite_json_outputs_are_written_as_triton_writes_them_and_read_back_exactly(self, datatype):
        # Triton's JSON writes NaN, Infinity and -Infinity (its qa/L0_nan_inf); orjson alone would write null, which
        # tritonclient reads back as NaN: each infinity lost. An FP16 overflow is an infinity too.
        request = decode_infer_request(orjson.dumps(
            {"inputs": [{"name": "x", "datatype": "INT32", "shape": [1], "data": [0]}]}), None, "m", "")
        dtype = {"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}[datatype]
        y = np.array([np.nan, np.inf, -np.inf, 1.5, -0.0], dtype=dtype)
        if datatype == "FP16":
            with np.errstate(over="ignore"):
                y[3] = np.float32(70000.0).astype(np.float16)  # past FP16's range: an infinity
        finite = np.array([0.25, 2.0], dtype=dtype)
        response = encode_infer_response(InferResponse("m", "1", [InferTensor("y", datatype, (5,), y),
                                                                   InferTensor("f", datatype, (2,), finite)]),
                                         request)
        doc = json.loads(response.body)
        assert b"NaN" in response.body and b"-Infinity" in response.body and b"null" not in response.body
        assert doc["outputs"][1]["data"] == [0.25, 2.0]
        result = httpclient.InferResult.from_response_body(response.body)
        np.testing.assert_array_equal(result.as_numpy("y"), y)  # (NaN == NaN here: assert_array_equal)
        # and a finite answer is orjson's, unchanged
        plain = encode_infer_response(InferResponse("m", "1", [InferTensor("f", datatype, (2,), finite)]), request)
        assert plain.body == orjson.dumps({"model_name": "m", "model_version": "1", "outputs": [
            {"name": "f", "datatype": datatype, "shape": [2], "data": [0.25, 2.0]}]})

    def test_non_contiguous_output_is_serialized_in_row_major_order(self):
        x = np.arange(6, dtype=np.int32).reshape(2, 3).T  # a transposed view
        request = decode_infer_request(orjson.dumps(
            {"inputs": [{"name": "x", "datatype": "INT32", "shape": [1], "data": [0]}],
             "parameters": {"binary_data_output": True}}), None, "m", "")
        response = encode_infer_response(InferResponse("m", "1", [InferTensor("y", "INT32", (3, 2), x)]), request)
        result = httpclient.InferResult.from_response_body(
            response.body, header_length=int(response.headers[INFER_HEADER_CONTENT_LENGTH]))
        np.testing.assert_array_equal(result.as_numpy("y"), x)


class TestHeaderPlans:
    """decode_infer_request remembers binary-only headers it has parsed: a repeat gives the same request."""

    DOC = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "parameters": {"binary_data_size": 16}},
                      {"name": "k", "datatype": "INT64", "shape": [2, 1], "parameters": {"binary_data_size": 16}}],
           "outputs": [{"name": "y", "parameters": {"binary_data": True}}], "id": "r1",
           "parameters": {"priority": 2, "timeout": 700}}

    def _decode(self, x: np.ndarray, k: np.ndarray, model="m"):
        body, headers = _binary(self.DOC, x.tobytes() + k.tobytes())
        return decode_infer_request(body, headers[INFER_HEADER_CONTENT_LENGTH], model, "3")

    def test_a_repeated_header_decodes_like_the_first(self):
        x1, k1 = np.arange(4, dtype=np.float32), np.array([5, 6], dtype=np.int64)
        first = self._decode(x1, k1)
        x2, k2 = x1 + 10, k1 * 3
        again = self._decode(x2, k2, model="other")  # the plan is per header, not per model
        assert again.signature is first.signature is not None  # the executor reuses its validation by it
        assert (again.model_name, again.model_version, again.id, again.priority, again.timeout_us) == \
            ("other", "3", "r1", 2, 700)
        assert [o.name for o in again.outputs] == ["y"]
        np.testing.assert_array_equal(again.inputs[0].data, x2.reshape(2, 2))
        np.testing.assert_array_equal(again.inputs[1].data, k2.reshape(2, 1))
        assert again.inputs[1].data.dtype == np.int64 and again.inputs[1].shape == (2, 1)
        assert not again.inputs[0].data.flags.owndata  # still views into the body

    def test_a_known_header_with_the_wrong_amount_of_binary_data_is_still_refused(self):
        x, k = np.arange(4, dtype=np.float32), np.array([5, 6], dtype=np.int64)
        self._decode(x, k)
        body, headers = _binary(self.DOC, x.tobytes() + k.tobytes() + b"\0" * 8)
        with pytest.raises(InferenceError, match="binary_data_size parameters add up to 32"):
            decode_infer_request(body, headers[INFER_HEADER_CONTENT_LENGTH], "m", "")

    def test_bool_and_bytes_inputs_are_checked_every_time(self):
        doc = {"inputs": [{"name": "x", "datatype": "BOOL", "shape": [1], "parameters": {"binary_data_size": 1}}]}
        body, headers = _binary(doc, b"\x01")
        assert decode_infer_request(body, headers[INFER_HEADER_CONTENT_LENGTH], "m", "").signature is None
        body, headers = _binary(doc, b"\x02")
        with pytest.raises(InferenceError, match="0 or 1"):
            decode_infer_request(body, headers[INFER_HEADER_CONTENT_LENGTH], "m", "")

    def test_json_requests_have_no_signature(self):
        doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
        assert decode_infer_request(orjson.dumps(doc), None, "m", "").signature is None

    def test_answers_to_a_known_header_reuse_the_encoded_response_header(self):
        x, k = np.arange(4, dtype=np.float32), np.array([5, 6], dtype=np.int64)
        bodies = []
        for scale in (1, 2, 3):
            request = self._decode(x * scale, k)
            y = InferTensor("y", "FP32", (2, 2), (x * scale).reshape(2, 2))
            encoded = encode_infer_response(InferResponse("m", "3", [y]), request)
            result = httpclient.InferResult.from_response_body(
                encoded.body, header_length=int(encoded.headers[INFER_HEADER_CONTENT_LENGTH]))
            np.testing.assert_array_equal(result.as_numpy("y"), (x * scale).reshape(2, 2))
            assert result.get_response()["id"] == "r1"
            bodies.append(encoded.body)
        assert len(request.signature.answers) == 1  # one header, encoded once, reused twice
        # Another output shape is another header.
        y = InferTensor("y", "FP32", (1, 4), x.reshape(1, 4))
        encoded = encode_infer_response(InferResponse("m", "3", [y]), request)
        result = httpclient.InferResult.from_response_body(
            encoded.body, header_length=int(encoded.headers[INFER_HEADER_CONTENT_LENGTH]))
        assert result.as_numpy("y").shape == (1, 4)

    def test_json_outputs_are_never_cached(self):
        doc = {**self.DOC, "outputs": [{"name": "y", "parameters": {"binary_data": False}}], "id": "j"}
        x, k = np.arange(4, dtype=np.float32), np.array([5, 6], dtype=np.int64)
        body, headers = _binary(doc, x.tobytes() + k.tobytes())
        for scale in (1, 2):
            request = decode_infer_request(body, headers[INFER_HEADER_CONTENT_LENGTH], "m", "")
            y = InferTensor("y", "FP32", (2, 2), (x * scale).reshape(2, 2))
            encoded = encode_infer_response(InferResponse("m", "1", [y]), request)
            assert orjson.loads(encoded.body)["outputs"][0]["data"] == (x * scale).tolist()
        assert request.signature.answers == {}


class TestRawRequestShapes:
    """decode_raw_request (Triton's raw binary request): the input's shape from the config, pure."""

    @staticmethod
    def config(datatype: str, dims: tuple[int, ...], max_batch_size: int = 0, inputs: int = 1):
        from gpud.executor.model_config import ModelConfig, TensorSpec
        specs = tuple(TensorSpec(f"in{i}", datatype, dims) for i in range(inputs))
        return ModelConfig("m", max_batch_size=max_batch_size, inputs=specs)

    @pytest.mark.parametrize("datatype, dims, max_batch, body, shape", [
        ("FP32", (4,), 8, bytes(16), (1, 4)),  # a batch of one
        ("FP32", (4,), 0, bytes(16), (4,)),
        ("INT64", (-1,), 0, bytes(40), (5,)),  # 40 / 8: the variable dimension deduced
        ("UINT8", (2, -1), 4, bytes(6), (1, 2, 3)),
        ("FP32", (-1,), 0, b"", (0,)),  # an empty body: a zero-size tensor, as Triton
    ])
    def test_shapes(self, datatype, dims, max_batch, body, shape):
        from gpud.api.http_infer import decode_raw_request
        request = decode_raw_request(body, self.config(datatype, dims, max_batch), "m", "")
        (tensor,) = request.inputs
        assert tensor.shape == shape and tensor.data.shape == shape and tensor.datatype == datatype

    def test_bytes_take_the_whole_body_as_one_element(self):
        from gpud.api.http_infer import decode_raw_request
        request = decode_raw_request(b"he\x00llo", self.config("BYTES", (1,), 4), "m", "")
        assert request.inputs[0].shape == (1, 1) and request.inputs[0].data[0, 0] == b"he\x00llo"

    @pytest.mark.parametrize("config, body, message", [
        (dict(datatype="FP32", dims=(4,), inputs=2), bytes(16), "Raw request must only have 1 input"),
        (dict(datatype="FP32", dims=(-1, -1)), bytes(16), "more than one variable-sized dimension"),
        (dict(datatype="BYTES", dims=(-1,)), b"x", "the model must have input shape [1]"),
        (dict(datatype="FP32", dims=(4,)), bytes(15), "has 15 bytes, which is no shape [4] of FP32"),
        (dict(datatype="FP32", dims=(-1,)), bytes(6), "has 6 bytes, which is no shape [-1] of FP32"),
    ])
    def test_refusals(self, config, body, message):
        from gpud.api.http_infer import decode_raw_request
        with pytest.raises(InferenceError, match=re.escape(message)):
            decode_raw_request(body, self.config(**config), "m", "")
