"""The gRPC adapter against the official tritonclient.grpc client and raw Triton stubs, over a FakeCore.

The server runs on its own event loop in a background thread, bound to 127.0.0.1 on an ephemeral port; every client
call has a deadline, and nothing waits by sleeping.
"""
from __future__ import annotations

import asyncio
import queue
import struct
import threading

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2 as triton_pb  # noqa: E402 - Triton's own messages: a real client's view
from tritonclient.grpc import service_pb2_grpc as triton_pb_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from gpud.executor.types import ShmRef, ErrorKind, InferenceError  # noqa: E402
from gpud.api.grpc_api import decode_inputs, start_grpc_server  # noqa: E402
from gpud.proto import grpc_service_pb2 as pb  # noqa: E402
from tests.daemon_harness import GRPC_SERVER  # noqa: E402
from tests.fake_core import FakeCore  # noqa: E402

TIMEOUT_S = 10.0  # bound on every client call and on server start/stop
MAX_MESSAGE_BYTES = 1 << 20  # small, so the oversized-message test sends only a little over 1 MiB


class ServerThread:
    """start_grpc_server on a private event loop in a daemon thread."""

    def __init__(self, core, max_message_bytes: int = MAX_MESSAGE_BYTES, **kw):
        kw.setdefault("implementation", GRPC_SERVER)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-test-server", daemon=True)
        self.thread.start()
        self.server = self._run(start_grpc_server(core, "127.0.0.1", 0, max_message_bytes=max_message_bytes, **kw))
        self.url = f"127.0.0.1:{self.server.bound_port}"

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=TIMEOUT_S)

    def close(self):
        self._run(self.server.stop(grace=None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=TIMEOUT_S)
        self.loop.close()


@pytest.fixture
def core():
    return FakeCore()


@pytest.fixture
def server(core):
    running = ServerThread(core)
    yield running
    running.close()


@pytest.fixture
def client(server):
    with grpcclient.InferenceServerClient(url=server.url) as triton_client:
        yield triton_client


@pytest.fixture
def stub(server):
    """Triton's generated stub on a raw channel: sends what tritonclient's helpers would refuse to build."""
    with grpc.insecure_channel(server.url) as channel:
        yield triton_pb_grpc.GRPCInferenceServiceStub(channel)


def _status(exc_info) -> str:
    return exc_info.value.status()


def _assert_still_serving(client):
    assert client.is_server_live(client_timeout=TIMEOUT_S)


def _add_sub_inputs(a: np.ndarray, b: np.ndarray):
    inputs = [grpcclient.InferInput("INPUT0", list(a.shape), "FP32"),
              grpcclient.InferInput("INPUT1", list(b.shape), "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def _single_input(name: str, data: np.ndarray, datatype: str):
    tensor = grpcclient.InferInput(name, list(data.shape), datatype)
    tensor.set_data_from_numpy(data)
    return [tensor]


# ---------------------------------------------------------------------------------------------------------------------
# Health, metadata, configuration


class TestHealthAndMetadata:
    def test_server_live_and_ready(self, client):
        assert client.is_server_live(client_timeout=TIMEOUT_S)
        assert client.is_server_ready(client_timeout=TIMEOUT_S)

    def test_server_not_ready(self, client, core):
        core.ready = False
        assert not client.is_server_ready(client_timeout=TIMEOUT_S)

    def test_model_ready(self, client):
        assert client.is_model_ready("add_sub", client_timeout=TIMEOUT_S)
        assert not client.is_model_ready("not_ready", client_timeout=TIMEOUT_S)

    def test_unknown_model_is_not_ready_as_in_triton(self, client):
        assert not client.is_model_ready("no_such_model", client_timeout=TIMEOUT_S)

    def test_server_metadata(self, client):
        metadata = client.get_server_metadata(as_json=True, client_timeout=TIMEOUT_S)
        assert metadata["name"] == "gpud"
        assert "binary_tensor_data" in metadata["extensions"]

    def test_model_metadata(self, client):
        metadata = client.get_model_metadata("add_sub", client_timeout=TIMEOUT_S)
        assert metadata.name == "add_sub"
        assert list(metadata.versions) == ["1"]
        assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
            ("INPUT0", "FP32", [-1, 4]), ("INPUT1", "FP32", [-1, 4])]

    def test_model_config(self, client):
        config = client.get_model_config("add_sub", as_json=True, client_timeout=TIMEOUT_S)["config"]
        assert config["name"] == "add_sub"
        assert config["max_batch_size"] == 8
        assert config["input"][0] == {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": ["4"]}  # int64 -> JSON string
        assert config["instance_group"][0]["kind"] == "KIND_CPU"
        assert config["dynamic_batching"]["max_queue_delay_microseconds"] == "100"

    def test_unknown_model_metadata_is_not_found(self, client):
        with pytest.raises(InferenceServerException) as exc_info:
            client.get_model_metadata("no_such_model", client_timeout=TIMEOUT_S)
        assert _status(exc_info) == "StatusCode.NOT_FOUND"
        assert "no_such_model" in exc_info.value.message()
        _assert_still_serving(client)

    def test_unimplemented_rpc(self, server, client):
        with grpc.insecure_channel(server.url) as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/NoSuchMethod")
            with pytest.raises(grpc.RpcError) as exc_info:
                call(b"", timeout=TIMEOUT_S)
        assert exc_info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        _assert_still_serving(client)


# ---------------------------------------------------------------------------------------------------------------------
# Inference


class TestInfer:
    def test_fp32_add_sub(self, client):
        a = np.arange(8, dtype=np.float32).reshape(2, 4)
        b = np.full((2, 4), 0.5, dtype=np.float32)
        result = client.infer("add_sub", _add_sub_inputs(a, b), client_timeout=TIMEOUT_S)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        response = result.get_response()
        assert (response.model_name, response.model_version) == ("add_sub", "1")

    def test_int64_keeps_values_beyond_32_bits(self, client):
        data = np.array([[2**40, -(2**35), 0, 7]], dtype=np.int64)
        result = client.infer("identity_int64", _single_input("INPUT0", data, "INT64"), client_timeout=TIMEOUT_S)
        output = result.as_numpy("OUTPUT0")
        assert output.dtype == np.int64
        np.testing.assert_array_equal(output, data)

    def test_bytes_with_empty_and_non_ascii_elements(self, client):
        data = np.array([[b"a", b"", "h\u00e9llo".encode(), b"\x00\xff"]], dtype=np.object_)
        result = client.infer("identity_bytes", _single_input("INPUT0", data, "BYTES"), client_timeout=TIMEOUT_S)
        assert result.as_numpy("OUTPUT0").tolist() == data.tolist()

    def test_fp16_on_a_non_batching_model(self, client):
        data = np.array([1.5, -2.25, 65504.0], dtype=np.float16)
        result = client.infer("identity_fp16", _single_input("INPUT0", data, "FP16"), client_timeout=TIMEOUT_S)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)

    def test_requested_outputs_only(self, client):
        a = np.ones((1, 4), dtype=np.float32)
        result = client.infer("add_sub", _add_sub_inputs(a, a), outputs=[grpcclient.InferRequestedOutput("OUTPUT1")],
                              client_timeout=TIMEOUT_S)
        assert [output.name for output in result.get_response().outputs] == ["OUTPUT1"]
        assert result.as_numpy("OUTPUT0") is None
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.zeros((1, 4), dtype=np.float32))

    def test_request_id_priority_and_timeout_reach_the_core(self, client, core):
        a = np.ones((1, 4), dtype=np.float32)
        result = client.infer("add_sub", _add_sub_inputs(a, a), request_id="req-7", priority=2, timeout=1500,
                              parameters={"custom": "x"}, client_timeout=TIMEOUT_S)
        assert result.get_response().id == "req-7"
        request = core.last_request
        assert (request.id, request.priority, request.timeout_us) == ("req-7", 2, 1500)
        assert request.parameters == {"custom": "x"}  # priority and timeout became fields, not parameters
        assert request.outputs is None  # nothing requested: every output

    def test_typed_contents_instead_of_raw(self, stub):
        request = triton_pb.ModelInferRequest(model_name="add_sub")
        for name, values in (("INPUT0", [1, 2, 3, 4]), ("INPUT1", [1, 1, 1, 1])):
            tensor = request.inputs.add(name=name, datatype="FP32", shape=[1, 4])
            tensor.contents.fp32_contents.extend(values)
        response = stub.ModelInfer(request, timeout=TIMEOUT_S)
        assert [o.name for o in response.outputs] == ["OUTPUT0", "OUTPUT1"]
        np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], dtype="<f4"), [2, 3, 4, 5])


# The core's error kinds are protocol-neutral; the gRPC front end picks Triton's codes
ERROR_CODES = [(ErrorKind.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT),
               (ErrorKind.NOT_FOUND, grpc.StatusCode.NOT_FOUND),
               (ErrorKind.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
               (ErrorKind.INTERNAL, grpc.StatusCode.INTERNAL),
               (ErrorKind.PERMISSION_DENIED, grpc.StatusCode.PERMISSION_DENIED),
               (ErrorKind.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED),
               (ErrorKind.UNSUPPORTED, grpc.StatusCode.UNIMPLEMENTED),
               (ErrorKind.ALREADY_EXISTS, grpc.StatusCode.ALREADY_EXISTS)]


def test_error_codes_cover_every_kind():
    assert {kind for kind, _ in ERROR_CODES} == set(ErrorKind)


@pytest.mark.parametrize("kind, code", ERROR_CODES, ids=[k.name for k, _ in ERROR_CODES])
def test_error_kind_to_code(stub, core, monkeypatch, kind, code):
    def fail(name, version=""):
        raise InferenceError(kind, f"{kind.name} from the core")
    monkeypatch.setattr(core, "model_metadata", fail)
    with pytest.raises(grpc.RpcError) as exc_info:
        stub.ModelMetadata(triton_pb.ModelMetadataRequest(name="add_sub"), timeout=TIMEOUT_S)
    assert (exc_info.value.code(), exc_info.value.details()) == (code, f"{kind.name} from the core")


class TestInferErrors:
    def test_unknown_model_is_not_found(self, client):
        a = np.ones((1, 4), dtype=np.float32)
        with pytest.raises(InferenceServerException) as exc_info:
            client.infer("no_such_model", _add_sub_inputs(a, a), client_timeout=TIMEOUT_S)
        assert _status(exc_info) == "StatusCode.NOT_FOUND"
        _assert_still_serving(client)

    def test_wrong_shape_is_invalid_argument(self, client):
        a = np.ones((1, 3), dtype=np.float32)
        with pytest.raises(InferenceServerException) as exc_info:
            client.infer("add_sub", _add_sub_inputs(a, a), client_timeout=TIMEOUT_S)
        assert _status(exc_info) == "StatusCode.INVALID_ARGUMENT"
        assert "shape [1, 3]" in exc_info.value.message()
        _assert_still_serving(client)

    def test_model_not_ready_is_unavailable(self, client):
        data = np.ones((1, 4), dtype=np.float32)
        with pytest.raises(InferenceServerException) as exc_info:
            client.infer("not_ready", _single_input("INPUT0", data, "FP32"), client_timeout=TIMEOUT_S)
        assert _status(exc_info) == "StatusCode.UNAVAILABLE"
        _assert_still_serving(client)

    def test_backend_bug_is_internal_and_server_keeps_serving(self, client, caplog):
        data = np.ones((1, 4), dtype=np.float32)
        with pytest.raises(InferenceServerException) as exc_info:
            client.infer("explode", _single_input("INPUT0", data, "FP32"), client_timeout=TIMEOUT_S)
        assert _status(exc_info) == "StatusCode.INTERNAL"
        assert "backend exploded" in exc_info.value.message()
        assert any("ModelInfer failed" in record.getMessage() for record in caplog.records)
        _assert_still_serving(client)

    def test_oversized_message_is_resource_exhausted(self, client):
        data = np.array([[b"x" * (MAX_MESSAGE_BYTES + 1)]], dtype=np.object_)
        with pytest.raises(InferenceServerException) as exc_info:
            client.infer("identity_bytes", _single_input("INPUT0", data, "BYTES"), client_timeout=TIMEOUT_S)
        assert _status(exc_info) == "StatusCode.RESOURCE_EXHAUSTED"
        _assert_still_serving(client)

    def test_raw_size_mismatch_over_the_wire(self, stub, client):
        request = triton_pb.ModelInferRequest(model_name="identity_int64")
        request.inputs.add(name="INPUT0", datatype="INT64", shape=[1, 3])
        request.raw_input_contents.append(b"\x00" * 16)  # 2 elements' worth for 3 elements
        with pytest.raises(grpc.RpcError) as exc_info:
            stub.ModelInfer(request, timeout=TIMEOUT_S)
        assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert exc_info.value.details() == (
            "input 'INPUT0': got 16 bytes of raw content, expected 24 for shape [1, 3] of INT64")
        _assert_still_serving(client)

    def test_negative_priority_is_invalid_argument(self, stub):
        request = triton_pb.ModelInferRequest(model_name="identity_int64")
        request.parameters["priority"].int64_param = -1
        request.inputs.add(name="INPUT0", datatype="INT64", shape=[1, 1])
        request.raw_input_contents.append(struct.pack("<q", 1))
        with pytest.raises(grpc.RpcError) as exc_info:
            stub.ModelInfer(request, timeout=TIMEOUT_S)
        assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "priority" in exc_info.value.details()


def _bytes_elements(*elements: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def _request(datatype: str, shape: list[int], raw: bytes | None = None, **contents) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=shape)
    if raw is not None:
        request.raw_input_contents.append(raw)
    for field, values in contents.items():
        getattr(tensor.contents, field).extend(values)
    return request


class TestDecodeInputs:
    """decode_inputs alone: the size and datatype checks, each with its message."""

    @pytest.mark.parametrize("request_, message", [
        # 3 x FP32 = 12 bytes
        (_request("FP32", [3], raw=b"\x00" * 8), "got 8 bytes of raw content, expected 12 for shape [3] of FP32"),
        (_request("FP32", [-1], raw=b""), "shape [-1] has a negative dimension"),
        (_request("FP8", [1], raw=b"\x00"), "unknown datatype 'FP8'"),
        (_request("BYTES", [2], raw=_bytes_elements(b"a")), "got 1 BYTES elements, expected 2"),
        (_request("BYTES", [1], raw=b"\x05\x00\x00\x00ab"), "BYTES element 0 claims 5 bytes, only 2 remain"),
        (_request("BYTES", [1], raw=_bytes_elements(b"a") + b"\x01"), "ends inside a 4-byte length prefix at byte 5"),
        (_request("FP32", [2, 2], fp32_contents=[1.0, 2.0, 3.0]), "got 3 elements in fp32_contents, expected 4"),
        (_request("FP16", [1], fp32_contents=[1.0]), "FP16 data must be sent in raw_input_contents"),
        (_request("INT8", [1], int_contents=[300]), "a value in int_contents does not fit INT8"),
        (_request("BOOL", [3], raw=b"\x00\x01\x02"), "input 'x': BOOL elements must be bytes 0 or 1"),  # as HTTP
    ])
    def test_malformed_input_is_invalid_argument(self, request_, message):
        with pytest.raises(InferenceError) as exc_info:
            decode_inputs(request_)
        assert exc_info.value.kind is ErrorKind.INVALID_ARGUMENT
        assert message in exc_info.value.message

    def test_raw_bool_of_zeros_and_ones_is_decoded(self):
        (tensor,) = decode_inputs(_request("BOOL", [3], raw=b"\x00\x01\x01"))
        assert tensor.data.tolist() == [False, True, True]

    def test_raw_contents_must_cover_every_input(self):
        request = _request("FP32", [1], raw=b"\x00" * 4)
        request.inputs.add(name="y", datatype="FP32", shape=[1])
        with pytest.raises(InferenceError, match="got 1 raw_input_contents for 2 inputs"):
            decode_inputs(request)

    def test_raw_and_typed_contents_together_are_refused(self):
        request = _request("FP32", [1], raw=b"\x00" * 4, fp32_contents=[1.0])
        with pytest.raises(InferenceError, match="^contents field must not be specified when using "
                                                 "raw_input_contents for 'x' for model '.*'$"):  # Triton's text
            decode_inputs(request)

    def test_a_shared_memory_input_says_where_it_lies_and_takes_no_raw_contents_entry(self):
        request = _request("FP32", [1], raw=b"\x00" * 4)
        request.inputs[0].parameters["shared_memory_region"].string_param = "region0"
        request.inputs[0].parameters["shared_memory_byte_size"].int64_param = 4
        with pytest.raises(InferenceError, match="got 1 raw_input_contents for 0 inputs not in shared memory"):
            decode_inputs(request)
        del request.raw_input_contents[:]
        [tensor] = decode_inputs(request)
        assert tensor.shm == ShmRef("region0", 0, 4)
        request.inputs[0].parameters["shared_memory_offset"].int64_param = -1
        with pytest.raises(InferenceError, match="'shared_memory_offset' must be a non-negative integer"):
            decode_inputs(request)

    @pytest.mark.parametrize("datatype, raw, expected", [
        ("BOOL", b"\x01\x00", np.array([True, False])),
        ("UINT16", struct.pack("<2H", 1, 65535), np.array([1, 65535], dtype=np.uint16)),
        ("FP64", struct.pack("<2d", 0.5, -1.0), np.array([0.5, -1.0])),
        ("BYTES", _bytes_elements(b"", b"ab"), np.array([b"", b"ab"], dtype=np.object_)),
    ])
    def test_raw_little_endian_decoding(self, datatype, raw, expected):
        (tensor,) = decode_inputs(_request(datatype, [2], raw=raw))
        assert tensor.shape == (2,)
        assert tensor.data.tolist() == expected.tolist()
        assert tensor.data.dtype == expected.dtype

    def test_zero_element_tensor(self):
        (tensor,) = decode_inputs(_request("FP32", [0, 4], raw=b""))
        assert tensor.data.shape == (0, 4)


# ---------------------------------------------------------------------------------------------------------------------
# Streaming, statistics, repository


class TestStream:
    def test_stream_answers_every_request_and_reports_errors_in_band(self, client):
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            a = np.ones((1, 4), dtype=np.float32)
            for index in range(3):
                client.async_stream_infer("add_sub", _add_sub_inputs(a * index, a), request_id=f"ok-{index}")
            client.async_stream_infer("no_such_model", _add_sub_inputs(a, a), request_id="bad")
            answers = [results.get(timeout=TIMEOUT_S) for _ in range(4)]
        finally:
            client.stop_stream()
        errors = [error for _, error in answers if error is not None]
        assert len(errors) == 1 and "no_such_model" in errors[0].message()
        by_id = {result.get_response().id: result for result, error in answers if error is None}
        assert sorted(by_id) == ["ok-0", "ok-1", "ok-2"]
        np.testing.assert_array_equal(by_id["ok-2"].as_numpy("OUTPUT0"), np.full((1, 4), 3, dtype=np.float32))
        _assert_still_serving(client)


    def test_stream_requests_run_concurrently(self):
        """Two requests that each wait for the other: they can only finish if the stream runs them concurrently
        (which the batcher needs, to batch a stream's requests)."""
        core = _RendezvousCore()
        running = ServerThread(core)
        results: queue.Queue = queue.Queue()
        try:
            with grpcclient.InferenceServerClient(url=running.url) as stream_client:
                stream_client.start_stream(callback=lambda result, error: results.put((result, error)))
                try:
                    data = np.ones((1, 2), dtype=np.int64)
                    for index in range(2):
                        stream_client.async_stream_infer("identity_int64", _single_input("INPUT0", data, "INT64"),
                                                         request_id=f"r{index}")
                    answers = [results.get(timeout=TIMEOUT_S) for _ in range(2)]
                finally:
                    stream_client.stop_stream()
        finally:
            running.close()
        assert sorted(result.get_response().id for result, error in answers if error is None) == ["r0", "r1"]


class _RendezvousCore(FakeCore):
    """Holds each inference until two have arrived."""

    def __init__(self):
        super().__init__()
        self._arrived = 0
        self._both_arrived: asyncio.Event | None = None  # created on the server's loop

    async def infer(self, request):
        if self._both_arrived is None:
            self._both_arrived = asyncio.Event()
        self._arrived += 1
        if self._arrived == 2:
            self._both_arrived.set()
        await self._both_arrived.wait()
        return await super().infer(request)


class TestStatisticsAndRepository:
    def test_statistics_count_inferences(self, client):
        a = np.ones((1, 4), dtype=np.float32)
        client.infer("add_sub", _add_sub_inputs(a, a), client_timeout=TIMEOUT_S)
        stats = client.get_inference_statistics("add_sub", client_timeout=TIMEOUT_S)
        (model_stats,) = stats.model_stats
        assert (model_stats.name, model_stats.version, model_stats.inference_count) == ("add_sub", "1", 1)
        assert model_stats.inference_stats.success.count == 1

    def test_statistics_of_every_model(self, client, core):
        stats = client.get_inference_statistics(client_timeout=TIMEOUT_S)
        assert {s.name for s in stats.model_stats} == set(core.models)

    def test_statistics_of_unknown_model_is_not_found(self, client):
        with pytest.raises(InferenceServerException) as exc_info:
            client.get_inference_statistics("no_such_model", client_timeout=TIMEOUT_S)
        assert _status(exc_info) == "StatusCode.NOT_FOUND"

    def test_repository_index(self, client):
        index = client.get_model_repository_index(as_json=True, client_timeout=TIMEOUT_S)["models"]
        states = {entry["name"]: entry["state"] for entry in index}
        assert states["add_sub"] == "READY"
        assert states["not_ready"] == "UNAVAILABLE"

    def test_unload_then_load(self, client):
        client.unload_model("identity_int64", client_timeout=TIMEOUT_S)
        assert not client.is_model_ready("identity_int64", client_timeout=TIMEOUT_S)
        client.load_model("identity_int64", client_timeout=TIMEOUT_S)
        assert client.is_model_ready("identity_int64", client_timeout=TIMEOUT_S)

    def test_unload_dependents_reaches_the_core_and_must_be_a_bool_param(self, core, client, stub):
        client.unload_model("identity_int64", unload_dependents=True, client_timeout=TIMEOUT_S)
        client.unload_model("identity_int64", client_timeout=TIMEOUT_S)
        assert core.unloads == [("identity_int64", True), ("identity_int64", False)]
        request = triton_pb.RepositoryModelUnloadRequest(model_name="identity_int64")
        request.parameters["unload_dependents"].int64_param = 1
        with pytest.raises(grpc.RpcError) as e:
            stub.RepositoryModelUnload(request, timeout=TIMEOUT_S)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "invalid value type for 'unload_dependents' parameter, expected bool_param" in e.value.details()
        assert len(core.unloads) == 2

    def test_load_unknown_model_is_not_found(self, client):
        with pytest.raises(InferenceServerException) as exc_info:
            client.load_model("no_such_model", client_timeout=TIMEOUT_S)
        assert _status(exc_info) == "StatusCode.NOT_FOUND"

    def test_load_overrides_reach_the_core_and_bad_ones_are_refused(self, client, core):
        client.load_model("add_sub", config='{"max_batch_size": 4}', files={"file:1/model.onnx": b"\x00"},
                          client_timeout=TIMEOUT_S)
        assert core.last_override.config_json == '{"max_batch_size": 4}'
        assert core.last_override.files == {"1/model.onnx": b"\x00"}
        with pytest.raises(InferenceServerException) as exc_info:
            client.load_model("add_sub", config='{}', files={"file:../x": b"\x00"}, client_timeout=TIMEOUT_S)
        assert _status(exc_info) == "StatusCode.INVALID_ARGUMENT"
        assert "expected 'file:<version>/<file name>'" in exc_info.value.message()


def test_port_in_use_is_refused(server, core):
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(OSError, match="could not bind"):
            loop.run_until_complete(
                asyncio.wait_for(start_grpc_server(core, "127.0.0.1", server.server.bound_port), TIMEOUT_S))
    finally:
        loop.close()


def test_bytes_that_are_not_a_message_are_invalid_argument_and_nothing_is_logged(server, caplog):
    # grpc's own answer is UNKNOWN, with a traceback logged for each such request (found by tests/test_fuzz_grpc.py)
    with grpc.insecure_channel(server.url) as channel:
        raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                  request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as exc_info:
            raw(b"\x00", timeout=TIMEOUT_S)
        assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid protobuf message" in exc_info.value.details()
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                       request_serializer=lambda b: b, response_deserializer=pb.ModelStreamInferResponse.FromString)
        (answer,) = list(stream(iter([b"\x00"]), timeout=TIMEOUT_S))
        assert "not a valid protobuf message" in answer.error_message
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
