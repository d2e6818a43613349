"""Hypothesis-generated gRPC messages against the real daemon (127.0.0.1): ModelInferRequest with any names,
datatypes, shapes (int64's extremes included), typed or raw contents, parameters and outputs; the metadata,
configuration, readiness, statistics and repository RPCs with any names; and bytes that are not a protobuf message
at all. Every call ends in a status a client caused (never INTERNAL or UNKNOWN), nothing is logged as an error, and
the daemon is ready afterwards."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpud.proto import grpc_service_pb2 as pb
from gpud.proto import grpc_service_pb2_grpc as pb_grpc
from tests.fuzz_support import EXAMPLES, TOKEN, Tally, assert_clean_log, fuzz_settings, start_fuzz_daemon

pytestmark = pytest.mark.slow
TIMEOUT_S = 30.0
TALLY = Tally("gRPC")
CLIENT_CAUSED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                 grpc.StatusCode.RESOURCE_EXHAUSTED}
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64",
             "BYTES"]
CONTENT_FIELDS = {
    "bool_contents": st.booleans(), "int_contents": st.integers(-2**31, 2**31 - 1),
    "int64_contents": st.integers(-2**63, 2**63 - 1), "uint_contents": st.integers(0, 2**32 - 1),
    "uint64_contents": st.integers(0, 2**64 - 1), "fp32_contents": st.floats(width=32),
    "fp64_contents": st.floats(), "bytes_contents": st.binary(max_size=16),
}
names = st.one_of(st.sampled_from(["mlp", "two_input", "", "..", "a/b", "/etc/passwd", ".hidden", "a\x00b", "m" * 300]),
                  st.text(max_size=20))
dims = st.one_of(st.integers(0, 8), st.sampled_from([-1, -2**63, 2**63 - 1, 2**31, 10**12, 256]))


@st.composite
def parameters(draw, message) -> None:
    for key in draw(st.lists(st.sampled_from(["priority", "timeout", "binary_data_output", "binary_data",
                                              "shared_memory_region", "sequence_id", "x"]), max_size=3)):
        choice = draw(st.sampled_from(["bool_param", "int64_param", "string_param", "double_param", "uint64_param"]))
        value = {"bool_param": st.booleans(), "int64_param": st.integers(-2**63, 2**63 - 1),
                 "string_param": st.text(max_size=8), "double_param": st.floats(),
                 "uint64_param": st.integers(0, 2**64 - 1)}[choice]
        setattr(message.parameters[key], choice, draw(value))


@st.composite
def infer_requests(draw) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=draw(names), model_version=draw(st.sampled_from(["", "1", "2", "x"])),
                                   id=draw(st.text(max_size=8)))
    draw(parameters(request))
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        shape = draw(st.lists(dims, max_size=draw(st.sampled_from([3, 40]))))
        tensor = request.inputs.add(name=draw(st.sampled_from(["input", "ids", "scale", "", "zz"])),
                                    datatype=draw(st.one_of(st.sampled_from(DATATYPES), st.text(max_size=6))),
                                    shape=shape)
        draw(parameters(tensor))
        if raw:
            if draw(st.booleans()) and tensor.datatype in DATATYPES and tensor.datatype != "BYTES" \
                    and all(0 <= d <= 8 for d in shape):  # exactly the bytes the shape needs
                size = int(np.prod(shape)) * np.dtype(tensor.datatype.lower().replace("fp", "float")
                                                      .replace("bool", "bool")).itemsize
                request.raw_input_contents.append(draw(st.binary(min_size=size, max_size=size)))
            else:
                request.raw_input_contents.append(draw(st.binary(max_size=64)))
        else:
            field = draw(st.sampled_from(sorted(CONTENT_FIELDS)))
            getattr(tensor.contents, field).extend(draw(st.lists(CONTENT_FIELDS[field], max_size=20)))
    if draw(st.booleans()):
        request.raw_input_contents.append(draw(st.binary(max_size=8)))  # one entry too many, or the only one
    for _ in range(draw(st.integers(0, 2))):
        draw(parameters(request.outputs.add(name=draw(st.sampled_from(["output", "out", "", "nope"])))))
    return request


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_fuzz_daemon(tmp_path_factory.mktemp("fuzz-grpc"))
    yield d
    with grpc.insecure_channel(d.grpc_url) as channel:
        assert pb_grpc.GRPCInferenceServiceStub(channel).ServerReady(pb.ServerReadyRequest(), timeout=TIMEOUT_S).ready
    print(f"\n{TALLY.report()}")
    assert d.stop() == 0, d.log()
    assert_clean_log(d)


@pytest.fixture(scope="module")
def channel(daemon):
    with grpc.insecure_channel(daemon.grpc_url) as ch:
        yield ch


def call(method, request, **kw) -> grpc.StatusCode:
    try:
        method(request, timeout=TIMEOUT_S, **kw)
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()
        assert code in CLIENT_CAUSED, (code, e.details(), request)
    TALLY.add(code.name)
    return code


def test_infer_requests(channel):
    stub = pb_grpc.GRPCInferenceServiceStub(channel)

    @fuzz_settings(max_examples=10 * EXAMPLES)
    @given(request=infer_requests())
    def run(request) -> None:
        call(stub.ModelInfer, request)

    run()


def test_stream_infer_requests(channel):
    stub = pb_grpc.GRPCInferenceServiceStub(channel)

    @fuzz_settings(max_examples=2 * EXAMPLES)
    @given(requests=st.lists(infer_requests(), min_size=1, max_size=4))
    def run(requests) -> None:
        answers = list(stub.ModelStreamInfer(iter(requests), timeout=TIMEOUT_S))
        assert len(answers) == len(requests)  # every request answered in band, the stream kept open
        for answer in answers:
            assert "internal error" not in answer.error_message, answer.error_message
            TALLY.add("stream:" + ("error" if answer.error_message else "OK"))

    run()


def test_model_rpcs_with_any_names(channel):
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    token = (("authorization", f"Bearer {TOKEN}"),)

    @fuzz_settings(max_examples=4 * EXAMPLES)
    @given(name=names, version=st.one_of(st.sampled_from(["", "1", "0", "-1", "99999999999999999999"]),
                                         st.text(max_size=6)),
           admin=st.booleans())
    def run(name, version, admin) -> None:
        call(stub.ModelMetadata, pb.ModelMetadataRequest(name=name, version=version))
        call(stub.ModelConfig, pb.ModelConfigRequest(name=name, version=version))
        call(stub.ModelReady, pb.ModelReadyRequest(name=name, version=version))
        call(stub.ModelStatistics, pb.ModelStatisticsRequest(name=name, version=version))
        if name not in ("mlp", "two_input"):  # the fuzzing of the others needs them loaded
            call(stub.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name=name),
                 metadata=token if admin else None)
            call(stub.RepositoryModelUnload, pb.RepositoryModelUnloadRequest(model_name=name),
                 metadata=token if admin else None)

    run()


@pytest.mark.parametrize("method", ["ModelInfer", "ModelMetadata", "RepositoryModelLoad", "ServerReady"])
def test_bytes_that_are_not_a_message(channel, method):
    raw = channel.unary_unary(f"/inference.GRPCInferenceService/{method}",
                              request_serializer=lambda b: b, response_deserializer=lambda b: b)

    @fuzz_settings(max_examples=2 * EXAMPLES)
    @given(data=st.binary(max_size=64))
    def run(data) -> None:
        call(raw, data)

    run()
