"""Every request limit holds on both front ends, each with a clear 4xx (HTTP) or status (gRPC), and changes nothing:
declared tensor shapes (--max-tensor-elements), request heads (--max-header-bytes), bodies (--max-request-bytes).

Both servers run over a FakeCore on 127.0.0.1 in their own loop threads (the harnesses of test_http_api and
test_grpc_api); every call is bounded by a timeout.
"""
from __future__ import annotations

import struct
import tracemalloc

import grpc
import orjson
import pytest

from gpud.executor.types import ErrorKind, InferenceError
from gpud.api.grpc_api import decode_inputs
from gpud.api.http_infer import INFER_HEADER_CONTENT_LENGTH, decode_infer_request
from gpud.api.limits import DEFAULT_MAX_TENSOR_ELEMENTS, MAX_TENSOR_DIMS, check_shape
from gpud.proto import grpc_service_pb2 as pb
from gpud.proto import grpc_service_pb2_grpc as pb_grpc
from tests.fake_core import FakeCore
from tests.test_grpc_api import ServerThread as GrpcServerThread
from tests.test_http_api import ServerThread as HttpServerThread

TIMEOUT_S = 10.0
HUGE_SHAPES = [
    [1, 10**12],  # the example: a few bytes declare 4 TB of FP32
    [0, 10**18],  # zero elements, but numpy would be asked for a dimension it cannot hold
    [0, 2**62, 4],  # numpy's size computation overflows (ValueError, not a client error, before the limit)
    [1] * (MAX_TENSOR_DIMS + 1),  # more dimensions than numpy allows
    [2**64 - 1],  # the largest uint64 (gRPC's shape is int64: see the gRPC test)
]


@pytest.fixture
def http():
    s = HttpServerThread(FakeCore(), max_tensor_elements=1000, max_head_bytes=4096)
    yield s
    s.stop()


@pytest.fixture
def grpc_server():
    s = GrpcServerThread(FakeCore(), max_metadata_bytes=4096, max_tensor_elements=1000)
    yield s
    s.close()


@pytest.fixture
def stub(grpc_server):
    with grpc.insecure_channel(grpc_server.url) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


# --- check_shape alone ------------------------------------------------------------------------------------------------
class TestCheckShape:
    @pytest.mark.parametrize("shape, count", [([], 1), ([0], 0), ([3, 4], 12), ([10, 100], 1000), ([0, 1000], 0)])
    def test_shapes_within_the_limit_give_their_element_count(self, shape, count):
        assert check_shape("x", shape, 1000) == count

    @pytest.mark.parametrize("shape, fragment", [
        ([1001], "declares 1001 elements, more than the limit of 1000 (--max-tensor-elements)"),
        ([0, 1001], "declares 1001 elements"),  # 0 read as 1: 1 * 1001
        ([10, 10, 11], "declares 1100 elements"),  # 10 * 10 * 11
        ([3, -1], "negative dimension"),
        ([1] * 33, "33 dimensions, more than the limit of 32"),
    ])
    def test_shapes_over_the_limit_are_invalid_argument(self, shape, fragment):
        with pytest.raises(InferenceError) as e:
            check_shape("x", shape, 1000)
        assert e.value.kind is ErrorKind.INVALID_ARGUMENT and fragment in e.value.message

    def test_the_default_limit_allows_every_body_of_the_default_size(self):
        # 64 MiB of 1-byte elements (INT8, UINT8, BOOL) is the most elements a default-sized body can carry
        assert DEFAULT_MAX_TENSOR_ELEMENTS >= 64 * 2**20


# --- decoders: refused before any allocation --------------------------------------------------------------------------
def _json_doc(shape, data=None):
    return {"inputs": [{"name": "INPUT0", "datatype": "INT64", "shape": shape, "data": data or [1, 2]}]}


@pytest.mark.parametrize("shape", HUGE_SHAPES, ids=range(len(HUGE_SHAPES)))
def test_http_decoders_refuse_huge_shapes_without_allocating(shape):
    json_body = orjson.dumps(_json_doc(shape))
    header = orjson.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": shape,
                                       "parameters": {"binary_data_size": 8}}]})
    for body, header_length in ((json_body, None), (header + b"\x00" * 8, str(len(header)))):
        tracemalloc.start()
        try:
            with pytest.raises(InferenceError) as e:
                decode_infer_request(body, header_length, "m", "")
            _, peak_bytes = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert e.value.kind is ErrorKind.INVALID_ARGUMENT
        assert "dimensions" in e.value.message or "--max-tensor-elements" in e.value.message
        assert peak_bytes < 64 * 1024, peak_bytes  # the parsed JSON and the message, nothing of the shape's size


@pytest.mark.parametrize("shape", [s for s in HUGE_SHAPES if max(s) < 2**63], ids=range(4))
def test_grpc_decoder_refuses_huge_shapes_without_allocating(shape):
    for raw in (True, False):
        request = pb.ModelInferRequest(model_name="m")
        tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=shape)
        if raw:
            request.raw_input_contents.append(b"\x00" * 8)
        else:
            tensor.contents.fp32_contents.extend([1.0, 2.0])
        tracemalloc.start()
        try:
            with pytest.raises(InferenceError) as e:
                decode_inputs(request)
            _, peak_bytes = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert e.value.kind is ErrorKind.INVALID_ARGUMENT
        assert peak_bytes < 64 * 1024, peak_bytes


def test_a_cached_binary_header_does_not_bypass_a_lower_limit():
    shape = [1, 2000]
    header = orjson.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": shape,
                                       "parameters": {"binary_data_size": 8000}}]})
    body = header + b"\x00" * 8000
    decode_infer_request(body, str(len(header)), "m", "")  # accepted by the default limit: cached
    decode_infer_request(body, str(len(header)), "m", "")
    with pytest.raises(InferenceError, match="--max-tensor-elements"):
        decode_infer_request(body, str(len(header)), "m", "", max_elements=1000)


# --- over the wire ----------------------------------------------------------------------------------------------------
class TestHttp:
    @pytest.mark.parametrize("shape", HUGE_SHAPES + [[1, 1001]], ids=range(len(HUGE_SHAPES) + 1))
    def test_huge_declared_shapes_are_400(self, http, shape):
        status, _, body = http.post_json("/v2/models/identity_int64/infer", _json_doc(shape))
        assert status == 400, body
        message = orjson.loads(body)["error"]
        assert "--max-tensor-elements" in message or "dimensions" in message
        http.assert_ready()

    def test_binary_tensor_with_a_huge_declared_shape_is_400(self, http):
        header = orjson.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 10**12],
                                           "parameters": {"binary_data_size": 8}}]})
        status, _, body = http.request("POST", "/v2/models/identity_int64/infer", header + b"\x00" * 8,
                                       {INFER_HEADER_CONTENT_LENGTH: str(len(header))})
        assert status == 400 and "--max-tensor-elements" in orjson.loads(body)["error"]

    def test_a_shape_at_the_limit_is_served(self, http):
        status, _, body = http.post_json("/v2/models/identity_int64/infer", _json_doc([1, 1000], [5] * 1000))
        assert status == 200, body

    def test_a_head_over_the_configured_limit_is_431(self, http):
        status, headers, body = http.request("GET", "/v2/health/ready", headers={"X-Filler": "v" * 5000})
        assert status == 431 and "--max-header-bytes" in orjson.loads(body)["error"]
        assert headers["Connection"] == "close"
        http.assert_ready()

    def test_a_head_under_the_configured_limit_is_served(self, http):
        status, _, _ = http.request("GET", "/v2/health/ready", headers={"X-Filler": "v" * 3000})
        assert status == 200


class TestGrpc:
    @pytest.mark.parametrize("shape", [[1, 10**12], [0, 10**18], [0, 2**62, 4], [1] * 33, [1, 1001]])
    def test_huge_declared_shapes_are_invalid_argument(self, stub, shape):
        request = pb.ModelInferRequest(model_name="identity_int64")
        request.inputs.add(name="INPUT0", datatype="INT64", shape=shape)
        request.raw_input_contents.append(struct.pack("<2q", 1, 2))
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(request, timeout=TIMEOUT_S)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--max-tensor-elements" in e.value.details() or "dimensions" in e.value.details()
        assert stub.ServerReady(pb.ServerReadyRequest(), timeout=TIMEOUT_S).ready

    def test_metadata_over_the_limit_is_resource_exhausted_every_time(self, stub):
        for _ in range(5):  # grpc's default soft limit refuses at random: ours is exact
            with pytest.raises(grpc.RpcError) as e:
                stub.ServerReady(pb.ServerReadyRequest(), timeout=TIMEOUT_S, metadata=(("x-filler", "v" * 5000),))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stub.ServerReady(pb.ServerReadyRequest(), timeout=TIMEOUT_S).ready

    def test_metadata_under_the_limit_is_served(self, stub):
        for _ in range(5):
            assert stub.ServerReady(pb.ServerReadyRequest(), timeout=TIMEOUT_S,
                                    metadata=(("x-filler", "v" * 3000),)).ready

    def test_a_message_over_the_body_limit_is_resource_exhausted(self, stub):
        request = pb.ModelInferRequest(model_name="identity_int64")
        request.inputs.add(name="INPUT0", datatype="INT64", shape=[1, 150_000])
        request.raw_input_contents.append(b"\x00" * 1_200_000)  # over the 1 MiB limit
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(request, timeout=TIMEOUT_S)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stub.ServerReady(pb.ServerReadyRequest(), timeout=TIMEOUT_S).ready
