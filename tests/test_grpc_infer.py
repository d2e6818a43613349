"""ModelInfer's fast path on gpud's gRPC server (gpud.api.grpc_infer): a request kind's plan by its bytes, and the
answer written by hand. Each is held to what protobuf's own parse and serialization make of the same message."""
from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from gpud.api.grpc_api import InferenceServicer, to_infer_request, to_infer_response
from gpud.api.grpc_infer import InferPlan, InferPlans, encode_response, scan
from gpud.api.grpcwire import calls
from gpud.executor.client_shm import ShmRef
from gpud.executor.types import ErrorKind, InferenceError, InferResponse, InferTensor, RequestedOutput
from gpud.proto import grpc_service_pb2 as pb
from gpud.proto import grpc_service_pb2_grpc as pb_grpc
from tests.fake_core import FakeCore
from tests.test_grpc_api import TIMEOUT_S, ServerThread


def _request(request_id: str = "", rows: int = 2, values: np.ndarray | None = None, **kw) -> pb.ModelInferRequest:
    data = np.arange(rows * 4, dtype=np.float32) if values is None else values
    message = pb.ModelInferRequest(model_name="m", model_version=kw.pop("version", ""), id=request_id, **kw)
    message.inputs.add(name="x", datatype="FP32", shape=[rows, 4])
    message.inputs.add(name="n", datatype="INT64", shape=[rows, 1])
    message.raw_input_contents.append(data.tobytes())
    message.raw_input_contents.append(np.arange(rows, dtype=np.int64).tobytes())
    return message


def _through(plans: InferPlans, data: bytes):
    """What the servicer does with `data`: the plan's request, else the full parse (remembered)."""
    request, scanned = plans.request(data)
    if request is not None:
        return request, True
    request = to_infer_request(pb.ModelInferRequest.FromString(data))
    plans.keep(plans.prepare(request, scanned))
    return request, False


def _same(a, b) -> None:
    assert (a.model_name, a.model_version, a.id, a.priority, a.timeout_us, a.parameters) == \
           (b.model_name, b.model_version, b.id, b.priority, b.timeout_us, b.parameters)
    assert [(t.name, t.datatype, t.shape) for t in a.inputs] == [(t.name, t.datatype, t.shape) for t in b.inputs]
    for x, y in zip(a.inputs, b.inputs):
        assert x.data.dtype == y.data.dtype and np.array_equal(x.data, y.data)
    assert [(o.name, o.parameters) for o in a.outputs or ()] == [(o.name, o.parameters) for o in b.outputs or ()]


def test_a_request_kind_seen_before_is_cut_out_of_its_bytes_and_equals_the_full_parse():
    plans = InferPlans()
    first, planned = _through(plans, _request("a").SerializeToString())
    assert not planned and type(first.signature) is InferPlan
    values = np.linspace(-1, 1, 8, dtype=np.float32)
    message = _request("another id", values=values)
    message.outputs.add(name="y")
    second_kind, planned = _through(plans, message.SerializeToString())
    assert not planned  # requested outputs make another kind
    data = _request("b-\u00e9", values=values).SerializeToString()
    request, planned = _through(plans, data)
    assert planned and request.signature is first.signature  # one signature: the executor's checks are reused too
    _same(request, to_infer_request(pb.ModelInferRequest.FromString(data)))
    assert request.inputs[0].data.base is not None  # a view of the message, not a copy
    again, planned = _through(plans, message.SerializeToString())
    assert planned and again.signature is second_kind.signature and [o.name for o in again.outputs] == ["y"]


def test_parameters_priority_and_timeout_belong_to_the_kind():
    plans = InferPlans()
    message = _request("a")
    message.parameters["priority"].int64_param = 2
    message.parameters["timeout"].int64_param = 5000
    message.parameters["custom"].string_param = "z"
    _through(plans, message.SerializeToString())
    message.id = "b"
    request, planned = _through(plans, message.SerializeToString())
    assert planned and (request.priority, request.timeout_us, request.parameters) == (2, 5000, {"custom": "z"})
    _same(request, to_infer_request(pb.ModelInferRequest.FromString(message.SerializeToString())))


def test_what_does_not_match_the_plan_goes_the_full_way_and_gets_its_error():
    plans = InferPlans()
    _through(plans, _request("a").SerializeToString())
    short = _request("b")
    short.raw_input_contents[0] = short.raw_input_contents[0][:-4]  # one element short: same key, other size
    assert plans.request(short.SerializeToString())[0] is None
    with pytest.raises(InferenceError) as e:
        to_infer_request(pb.ModelInferRequest.FromString(short.SerializeToString()))
    assert e.value.kind is ErrorKind.INVALID_ARGUMENT and "raw content" in e.value.message
    one_raw = _request("c")
    del one_raw.raw_input_contents[1]
    assert plans.request(one_raw.SerializeToString())[0] is None
    other_shape = _request("d", rows=3)
    assert plans.request(other_shape.SerializeToString())[0] is None  # another kind (its shape is in the key)
    # an id that is not UTF-8: the full parse refuses the message
    raw_id = _request("").SerializeToString() + b"\x1a\x02\xff\xfe"
    assert plans.request(raw_id)[0] is None


def test_a_kind_with_large_parameters_gets_no_plan_and_an_id_given_twice_goes_the_full_way():
    plans = InferPlans()
    message = _request("a")
    message.parameters["note"].string_param = "x" * 5000  # a client's large parameter: plans must not pin these
    data = message.SerializeToString()
    for _ in range(2):
        request, planned = _through(plans, data)
        assert not planned and request.signature is None
    plans = InferPlans()
    _through(plans, _request("a").SerializeToString())
    twice = _request("").SerializeToString() + b"\x1a\x02\xff\xfe" + b"\x1a\x01b"  # a bad id, then a good one
    assert scan(twice) is None and plans.request(twice)[0] is None  # protobuf refuses it (each id's UTF-8)


class _Replies(list):
    def __call__(self, *reply) -> None:
        self.append(reply)


def test_a_request_the_core_refuses_leaves_no_plan():
    servicer = InferenceServicer(_Core(InferenceError(ErrorKind.NOT_FOUND, "no model 'm'")))
    data = _request("x").SerializeToString()
    for _ in range(2):
        replies = _Replies()
        servicer.model_infer_calls.start(data, calls.CallContext([], "ipv4:127.0.0.1:1"), replies)
        assert replies[0][0] == calls.NOT_FOUND
    assert servicer.model_infer_calls.plans.request(data)[0] is None  # refused kinds are not remembered
    accepting = InferenceServicer(_Core())
    accepting.model_infer_calls.start(data, calls.CallContext([], "ipv4:127.0.0.1:1"), lambda *r: None)
    assert accepting.model_infer_calls.plans.request(data)[0] is not None  # a kind the core took is


def test_kinds_that_need_checks_per_request_get_no_plan():
    plans = InferPlans()
    text = pb.ModelInferRequest(model_name="m")
    text.inputs.add(name="t", datatype="BYTES", shape=[1])
    text.raw_input_contents.append(b"\x02\x00\x00\x00hi")
    boolean = pb.ModelInferRequest(model_name="m")
    boolean.inputs.add(name="b", datatype="BOOL", shape=[2])
    boolean.raw_input_contents.append(b"\x01\x00")
    contents = pb.ModelInferRequest(model_name="m")  # typed contents, not raw: parsed every time
    contents.inputs.add(name="x", datatype="FP32", shape=[2], contents=pb.InferTensorContents(fp32_contents=[1, 2]))
    shm = pb.ModelInferRequest(model_name="m")
    tensor = shm.inputs.add(name="x", datatype="FP32", shape=[2])
    tensor.parameters["shared_memory_region"].string_param = "r"
    tensor.parameters["shared_memory_byte_size"].int64_param = 8
    shm_output = _request("o")  # inputs in raw contents, an output into the client's region: staged per request
    output = shm_output.outputs.add(name="y")
    output.parameters["shared_memory_region"].string_param = "r"
    output.parameters["shared_memory_byte_size"].int64_param = 8
    for message in (text, boolean, contents, shm, shm_output):
        data = message.SerializeToString()
        _through(plans, data)
        request, planned = _through(plans, data)
        assert not planned and request.signature is None


def test_the_scan_reads_fields_in_any_order_and_leaves_what_it_cannot_read_to_protobuf():
    data = _request("x").SerializeToString()
    key, ident, raws = scan(data)
    assert ident == b"x" and [bytes(r) for r in raws] == list(pb.ModelInferRequest.FromString(data).raw_input_contents)
    # raw contents first, then the id, then the rest: the same key and the same request
    message = pb.ModelInferRequest.FromString(data)
    # each part serialized on its own by protobuf; concatenated messages are one message with all their fields
    reordered = pb.ModelInferRequest(raw_input_contents=message.raw_input_contents).SerializeToString()
    message.ClearField("raw_input_contents")
    message.id = ""
    reordered += pb.ModelInferRequest(id="x").SerializeToString() + message.SerializeToString()
    assert scan(reordered)[:2] == (key, b"x")
    plans = InferPlans()
    _through(plans, data)
    request, planned = _through(plans, reordered)
    assert planned
    _same(request, to_infer_request(pb.ModelInferRequest.FromString(reordered)))
    assert scan(data + b"\x40\x01") is None  # a varint field (unknown here)
    assert scan(data[:-3]) is None  # cut short inside a raw content
    assert scan(b"\x0a\xff") is None  # a length that never ends


def _text(values: list[bytes], shape: tuple[int, ...]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array.reshape(shape)


ANSWERS = [
    # (outputs, requested output names or None, response id, request id)
    ([InferTensor("y", "FP32", (2, 3), np.arange(6, dtype=np.float32).reshape(2, 3))], None, "", "req"),
    ([InferTensor("y", "FP32", (2, 3), np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::-1]),  # not contiguous
      InferTensor("z", "INT64", (2,), np.array([-5, 2**40], dtype=np.int64)),
      InferTensor("h", "FP16", (), np.array(1.5, dtype=np.float16))], ["z", "y"], "own", "req"),
    ([InferTensor("t", "BYTES", (2,), _text([b"ab", b""], (2,))),
      InferTensor("s", "FP32", (300, 2), np.zeros((300, 2), np.float32), shm=ShmRef("r", 0, 2400))], None, "", ""),
    ([InferTensor("e", "UINT8", (0, 200), np.zeros((0, 200), np.uint8))], None, "", ""),
]


@pytest.mark.parametrize("outputs, requested, response_id, request_id", ANSWERS)
@pytest.mark.parametrize("version", ["", "3"])
def test_the_answer_written_by_hand_is_the_bytes_protobuf_writes(outputs, requested, response_id, request_id,
                                                                    version):
    response = InferResponse("model", version, outputs, response_id)
    wanted = None if requested is None else [RequestedOutput(name) for name in requested]
    expected = to_infer_response(response, wanted, request_id).SerializeToString()
    plan = InferPlan(to_infer_request(_request()))
    for _ in range(2):  # the second from the plan's kept description
        assert encode_response(response, wanted, request_id, plan) == expected
    assert encode_response(response, wanted, request_id, None) == expected


def test_an_answer_with_parameters_is_left_to_protobuf():
    response = InferResponse("m", "1", [InferTensor("y", "FP32", (1,), np.zeros(1, np.float32))], "",
                             {"sequence_end": True})
    assert encode_response(response, None, "", None) is None


# --- the servicer's callback (Method.start), over a core that answers when told -------------------------------------

class _Core:
    def __init__(self, refuse: InferenceError | None = None):
        self.refuse = refuse
        self.submitted: list = []
        self.cancelled = 0

    def submit(self, request, done):
        if self.refuse is not None:
            raise self.refuse
        self.submitted.append((request, done))
        return self._cancel

    def _cancel(self):
        self.cancelled += 1


def _start(core, data: bytes):
    replies: list = []
    cancel = InferenceServicer(core).model_infer_calls.start(data, calls.CallContext([], "ipv4:127.0.0.1:1"),
                                                       lambda *reply: replies.append(reply))
    return cancel, replies


def test_start_model_infer_answers_once_with_the_answer_or_the_status():
    core = _Core()
    cancel, replies = _start(core, _request("r1").SerializeToString())
    assert replies == [] and cancel is not None
    request, done = core.submitted[0]
    y = InferTensor("y", "FP32", (2, 1), np.ones((2, 1), np.float32))
    done(InferResponse("m", "1", [y]))
    (code, details, data), = replies
    assert code == calls.OK and pb.ModelInferResponse.FromString(data).id == "r1"
    cancel()
    assert core.cancelled == 1  # the core's cancel, handed back as it was
    _, replies = _start(core, _request("r2").SerializeToString())
    core.submitted[-1][1](InferenceError(ErrorKind.UNAVAILABLE, "queue full"))
    assert replies == [(calls.UNAVAILABLE, "queue full", None)]


@pytest.mark.parametrize("data, core, status", [
    (b"\xff\xff", _Core(), calls.INVALID_ARGUMENT),  # not a protobuf message
    (_request("x", rows=0).SerializeToString(), _Core(), calls.OK),  # the core decides on empty tensors
    (_request("x").SerializeToString(), _Core(InferenceError(ErrorKind.NOT_FOUND, "no model 'm'")), calls.NOT_FOUND),
])
def test_start_model_infer_refusals_are_statuses(data, core, status):
    cancel, replies = _start(core, data)
    if status == calls.OK:
        assert replies == [] and core.submitted
        return
    assert cancel is None and len(replies) == 1 and replies[0][0] == status


# --- a stream on gpud's server: answers and errors in band, requests cancelled with the call -------------------------

class _HoldingCore(FakeCore):
    """Answers requests for 'add_sub' as FakeCore does; holds those for 'hold' until the call ends, then says
    whether they were cancelled."""

    def __init__(self):
        super().__init__()
        self.held = threading.Event()
        self.cancelled = threading.Event()

    def submit(self, request, done):
        if request.model_name != "hold":
            return super().submit(request, done)
        self.held.set()
        return self.cancelled.set


def _stream_request(model: str, request_id: str) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name=model, id=request_id)
    for name in ("INPUT0", "INPUT1"):
        message.inputs.add(name=name, datatype="FP32", shape=[1, 4])
        message.raw_input_contents.append(np.ones((1, 4), np.float32).tobytes())
    return message


def test_a_stream_answers_in_band_with_what_identifies_each_request_and_a_plan_for_its_kind():
    running = ServerThread(_HoldingCore(), implementation="gpud")
    try:
        with grpc.insecure_channel(running.url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            requests = [_stream_request("add_sub", f"ok-{i}") for i in range(3)]
            requests.insert(1, _stream_request("no_such_model", "bad"))
            answers = list(stub.ModelStreamInfer(iter(requests), timeout=TIMEOUT_S))
    finally:
        running.close()
    assert len(answers) == 4
    errors = [a for a in answers if a.error_message]
    assert len(errors) == 1 and "no_such_model" in errors[0].error_message
    assert (errors[0].infer_response.model_name, errors[0].infer_response.id) == ("no_such_model", "bad")
    ok = {a.infer_response.id: a.infer_response for a in answers if not a.error_message}
    assert sorted(ok) == ["ok-0", "ok-1", "ok-2"]
    out = {o.name: np.frombuffer(raw, np.float32)
           for o, raw in zip(ok["ok-2"].outputs, ok["ok-2"].raw_output_contents)}
    np.testing.assert_array_equal(out["OUTPUT0"], np.full(4, 2, np.float32))  # add_sub: INPUT0 + INPUT1


def test_a_stream_cancelled_with_requests_in_flight_cancels_them_in_the_core():
    core = _HoldingCore()
    running = ServerThread(core, implementation="gpud")
    try:
        with grpc.insecure_channel(running.url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            call = stub.ModelStreamInfer(iter([_stream_request("hold", "h")]), timeout=TIMEOUT_S)
            assert core.held.wait(TIMEOUT_S)
            call.cancel()
            assert core.cancelled.wait(TIMEOUT_S)
    finally:
        running.close()


class _MovingCore(_Core):
    """Takes the tensors out of the request as it submits it, as a front-end process's core does (its arena)."""

    def submit(self, request, done):
        for tensor in request.inputs:
            tensor.data = np.empty(0, tensor.data.dtype)
        return super().submit(request, done)


@pytest.mark.parametrize("priority", [0, 3])  # 3: a request a front-end process sends alone
def test_a_plan_is_kept_when_the_core_moves_the_tensors_out_as_it_takes_the_request(priority):
    servicer = InferenceServicer(_MovingCore())
    message = _request("x")
    if priority:
        message.parameters["priority"].int64_param = priority
    data = message.SerializeToString()
    servicer.model_infer_calls.start(data, calls.CallContext([], "ipv4:127.0.0.1:1"), _Replies())
    request = servicer.model_infer_calls.plans.request(data)[0]
    assert request is not None and request.priority == priority


def test_a_large_request_assembled_in_place_is_served_unary_and_on_a_stream_from_its_plan():
    running = ServerThread(FakeCore(), max_message_bytes=8 << 20, implementation="gpud")
    data = np.arange(300_000, dtype=np.int64)  # 2.4 MB: over the size assembled in place as it comes
    message = pb.ModelInferRequest(model_name="identity_int64", id="big")
    message.inputs.add(name="INPUT0", datatype="INT64", shape=[1, data.size])
    message.raw_input_contents.append(data.tobytes())
    try:
        with grpc.insecure_channel(running.url, options=[("grpc.max_send_message_length", 8 << 20),
                                                         ("grpc.max_receive_message_length", 8 << 20)]) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            answers = [stub.ModelInfer(message, timeout=TIMEOUT_S) for _ in range(2)]  # the second from its plan
            answers += [a.infer_response for a in stub.ModelStreamInfer(iter([message] * 2), timeout=TIMEOUT_S)]
    finally:
        running.close()
    for answer in answers:
        assert answer.id == "big"
        np.testing.assert_array_equal(np.frombuffer(answer.raw_output_contents[0], np.int64), data)
