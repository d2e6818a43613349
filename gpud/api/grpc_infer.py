"""ModelInfer on gpud's own gRPC server without protobuf's Python objects per request.

Clients send the same request again and again but for its id and its tensors' bytes (perf_analyzer, tritonclient,
any serving loop). The first of each kind is parsed and checked in full (`grpc_api.to_infer_request`); its outcome is
kept as a plan keyed by the message's bytes less its id and its raw contents. The next request with that key has
only its id and its raw contents cut out of the message (views, no copy) and is the plan's request, whose
`signature` is the plan, so the executor reuses its checks too (`PreparedCache`). Anything the scan does not read,
or that does not match the plan (a raw content of another size), goes the full way, which gives the error.

The answer is written by hand from the same fields `to_infer_response` fills: the outputs' descriptions are the
same bytes for answers of the same shapes (kept per plan), and the outputs' bytes are joined in once.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from gpud.api.grpcwire.calls import OK, CallContext, Received, Reply
from gpud.executor.bytes_tensor import encode_bytes_elements
from gpud.executor.datatypes import UNCHECKED_DATATYPES, numpy_dtype
from gpud.executor.types import InferRequest, InferResponse, InferTensor, RequestedOutput

_PLANS_MAX = 1024
_PLAN_MAX_KEY_BYTES = 4096  # a kind with more than this around its tensors (large parameters) gets no plan: 1024
# plans then hold at most 4 MiB, whatever clients send
_ANSWERS_MAX = 8  # output layouts remembered per plan (one in practice)
# Little-endian hosts only: a plan's arrays are views of the wire's little-endian bytes.
_PLANNABLE_DATATYPES = UNCHECKED_DATATYPES if sys.byteorder == "little" else frozenset()

# ModelInferRequest's fields (grpc_service.proto) that the scan treats apart
_ID_FIELD = 3
_RAW_INPUT_FIELD = 7


def _varint(data: bytes | memoryview, i: int) -> tuple[int, int]:
    """The varint at data[i:] and the index after it; IndexError when the data ends inside it."""
    b = data[i]
    if b < 0x80:
        return b, i + 1
    value, shift = b & 0x7F, 7
    while True:
        i += 1
        b = data[i]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i + 1
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


def scan(data: bytes | memoryview) -> tuple[bytes, bytes | None, list[memoryview]] | None:
    """A ModelInferRequest's bytes as (key: its fields but the id and the raw contents, the id's bytes, the raw
    contents as views of `data`); None where a field is not length-delimited or the message is cut short (only
    the full parse says what such a message means), or where it has no raw contents."""
    view = memoryview(data)
    key: list[bytes | memoryview] = []
    raws: list[memoryview] = []
    ident = None
    i, n = 0, len(data)
    try:
        while i < n:
            start = i
            tag, i = _varint(data, i)
            if tag & 7 != 2:
                return None
            length, i = _varint(data, i)
            end = i + length
            if end > n:
                return None
            field = tag >> 3
            if field == _RAW_INPUT_FIELD:
                raws.append(view[i:end])
            elif field == _ID_FIELD:
                if ident is not None:
                    return None  # the id twice: protobuf checks each one's UTF-8, the full parse decides
                ident = bytes(data[i:end])
            else:
                key.append(data[start:end])
            i = end
    except IndexError:
        return None
    if not raws:
        return None  # no plan cuts inputs out of anything but raw contents: no key worth joining
    return b"".join(key), ident, raws


class InferPlan:
    """A request kind checked before: what its requests share, and how to cut the rest out of a message."""

    __slots__ = ("model_name", "model_version", "inputs", "outputs", "priority", "timeout_us", "parameters",
                 "answers")

    def __init__(self, request: InferRequest):
        self.model_name = request.model_name
        self.model_version = request.model_version
        self.inputs = tuple((t.name, t.datatype, t.shape, numpy_dtype(t.datatype).newbyteorder("<"), t.data.size,
                             t.data.nbytes) for t in request.inputs)
        self.outputs = request.outputs
        self.priority = request.priority
        self.timeout_us = request.timeout_us
        self.parameters = request.parameters
        # the answer's model name and version (fields 1, 2) and its outputs described (field 5), by the model,
        # version and outputs' names, datatypes and shapes
        self.answers: dict[tuple, tuple[bytes, bytes]] = {}

    @staticmethod
    def fits(request: InferRequest, raws: list[memoryview]) -> bool:
        """Whether requests like this one can be cut out by a plan: every input in raw contents, of a fixed-size
        datatype (BOOL's bytes must be checked per request, BYTES' are text), none in shared memory."""
        return (not request.uses_shm and len(raws) == len(request.inputs)
                and all(t.datatype in _PLANNABLE_DATATYPES and t.data.nbytes == len(raw)
                        for t, raw in zip(request.inputs, raws)))

    def request(self, ident: bytes | None, raws: list[memoryview]) -> InferRequest | None:
        """The request of this kind with this id and these raw contents; None when they do not match the plan."""
        if len(raws) != len(self.inputs):
            return None
        tensors = []
        for (name, datatype, shape, dtype, count, nbytes), raw in zip(self.inputs, raws):
            if len(raw) != nbytes:
                return None
            tensors.append(InferTensor(name, datatype, shape, np.frombuffer(raw, dtype, count).reshape(shape)))
        try:
            request_id = ident.decode() if ident else ""
        except UnicodeDecodeError:
            return None  # not a protobuf string: the full parse refuses the message
        return InferRequest(self.model_name, tensors, self.model_version, request_id, self.outputs, self.priority,
                            self.timeout_us, self.parameters, self)


class InferPlans:
    """The plans of one server (its limits are theirs), by key."""

    def __init__(self, capacity: int = _PLANS_MAX):
        self.capacity = capacity
        self._plans: dict[bytes, InferPlan] = {}

    def request(self, data: bytes | memoryview) -> tuple[InferRequest | None, Any]:
        """(the request, None) from a known plan; else (None, what `prepare` needs to make one)."""
        scanned = scan(data)
        if scanned is None:
            return None, None
        key, ident, raws = scanned
        plan = self._plans.get(key)
        if plan is not None:
            request = plan.request(ident, raws)
            if request is not None:
                return request, None
        return None, (key, raws)

    def prepare(self, request: InferRequest, scanned: Any) -> tuple[bytes, InferPlan] | None:
        """A plan for requests like `request` (fully parsed and checked, its tensors still its own: a front-end
        process's core moves them out when it submits), set as its signature; None when its kind gets none. It is
        kept (`keep`) once the core has taken the request: refused kinds must not pin memory here."""
        if scanned is None:
            return None
        key, raws = scanned
        if len(key) > _PLAN_MAX_KEY_BYTES or not InferPlan.fits(request, raws):
            return None
        plan = request.signature = InferPlan(request)
        return key, plan

    def keep(self, prepared: tuple[bytes, InferPlan] | None) -> None:
        if prepared is None:
            return
        if len(self._plans) >= self.capacity:
            self._plans.clear()  # kinds churn: start over rather than track recency
        key, plan = prepared
        self._plans[key] = plan


# ---------------------------------------------------------------------------------------------------------------------
# ModelInfer's calls on gpud's own server: one compiled path from the message to the answer's bytes

Submit = Callable[[InferRequest, Callable[[Any], None]], Callable[[], None]]  # InferenceCore.submit


class ModelInferCalls:
    """ModelInfer without a task per call (`Method.start`), compiled: the request from its kind's plan when one
    matches, else from `parse_full` (the full parse and checks, which raises what the client did wrong); submitted
    to the core with a callback; answered through `reply` with the answer's bytes (`encode_response`, else
    `encode_full`) or the status `status_of` gives an exception. The servicer (gpud.api.grpc_api) passes in the
    parts that use protobuf's Python objects and its logging: they run only for a kind's first request, for
    answers with parameters, and for errors."""

    def __init__(self, submit: Submit, parse_full: Callable[[Received], InferRequest],
                 encode_full: Callable[[InferResponse, InferRequest], bytes],
                 status_of: Callable[[BaseException], tuple[int, str]]):
        self._submit = submit
        self.plans = InferPlans()  # the request kinds seen
        self._parse_full = parse_full
        self._encode_full = encode_full
        self._status_of = status_of

    def start(self, data: Received, context: CallContext, reply: Reply) -> Callable[[], None] | None:
        try:
            request, plan = self.request_of(data)
            cancel = self._submit(request, _Answer(self, request, reply))
        except Exception as exc:  # noqa: BLE001 - every request is answered, never a crash
            code, details = self._status_of(exc)
            reply(code, details, None)
            return None
        self.plans.keep(plan)  # a kind the core took: the next of its kind comes from the plan
        return cancel

    def request_of(self, data: Received) -> tuple[InferRequest, Any]:
        """A serialized ModelInferRequest as the core's request, and a new plan for its kind (None when it came
        from one, or gets none), for `InferPlans.keep` once the core has taken the request."""
        request, scanned = self.plans.request(data)
        if request is not None:
            return request, None
        request = self._parse_full(data)
        return request, self.plans.prepare(request, scanned)

    def answer_bytes(self, request: InferRequest, response: InferResponse) -> bytes:
        signature = request.signature
        data = encode_response(response, request.outputs, request.id,
                               signature if isinstance(signature, InferPlan) else None)
        if data is None:
            data = self._encode_full(response, request)
        return data

    def done(self, request: InferRequest, reply: Reply, result: Any) -> None:
        if isinstance(result, BaseException):
            code, details = self._status_of(result)
            reply(code, details, None)
            return
        try:
            data = self.answer_bytes(request, result)
        except Exception as exc:  # noqa: BLE001
            code, details = self._status_of(exc)
            reply(code, details, None)
            return
        reply(OK, "", data)


class _Answer:
    """A call's completion callback: a plain class (a partial or closure costs more, compiled)."""

    __slots__ = ("calls", "request", "reply")

    def __init__(self, calls: ModelInferCalls, request: InferRequest, reply: Reply):
        self.calls = calls
        self.request = request
        self.reply = reply

    def __call__(self, result: Any) -> None:
        self.calls.done(self.request, self.reply, result)


# ---------------------------------------------------------------------------------------------------------------------
# The answer (ModelInferResponse), written by hand


def _key(field: int, length: int) -> bytes:
    """A length-delimited field's tag and length."""
    return _varint_bytes(field << 3 | 2) + _varint_bytes(length)


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(field: int, text: str) -> bytes:
    """A string field, left out when empty (proto3)."""
    if not text:
        return b""
    data = text.encode()
    return _key(field, len(data)) + data


def _output_description(tensor: InferTensor) -> bytes:
    """ModelInferResponse.outputs' entry (field 5): InferOutputTensor with name, datatype, shape (packed)."""
    body = _string(1, tensor.name) + _string(2, tensor.datatype)
    if tensor.shape:
        dims = b"".join(_varint_bytes(int(d)) for d in tensor.shape)
        body += _key(3, len(dims)) + dims
    return _key(5, len(body)) + body


def _raw_output(tensor: InferTensor) -> Any:
    """The output's bytes as raw_output_contents carries them: little-endian, C order; empty where the output went
    into the client's shared memory (its entry keeps its place)."""
    if tensor.shm is not None:
        return b""
    if tensor.datatype == "BYTES":
        return encode_bytes_elements(tensor.data)
    array = np.ascontiguousarray(tensor.data, dtype=numpy_dtype(tensor.datatype).newbyteorder("<"))
    return array.reshape(-1).view(np.uint8).data


def stream_answer(data: bytes) -> bytes:
    """ModelStreamInferResponse holding `data` (a serialized ModelInferResponse) as its infer_response (field 2)."""
    return b"\x12" + _varint_bytes(len(data)) + data


def encode_response(response: InferResponse, requested: list[RequestedOutput] | None, request_id: str,
                    plan: InferPlan | None) -> bytes | None:
    """The serialized ModelInferResponse `to_infer_response` would make (only the requested outputs; all when None);
    None where it has parameters (rare: that path makes the message). `plan`: where the outputs' description is
    kept for the next answer of the same shapes."""
    if response.parameters:
        return None
    outputs = response.outputs
    if requested is not None:
        wanted = {output.name for output in requested}
        outputs = [t for t in outputs if t.name in wanted]
    described = None
    layout: tuple | None = None
    if plan is not None:
        layout = (response.model_name, response.model_version,
                  tuple([(t.name, t.datatype, t.shape) for t in outputs]))
        described = plan.answers.get(layout)
    if described is None:
        described = (_string(1, response.model_name) + _string(2, response.model_version),
                     b"".join(_output_description(t) for t in outputs))
        if layout is not None and plan is not None and len(plan.answers) < _ANSWERS_MAX:
            plan.answers[layout] = described
    head, descriptions = described
    parts: list[Any] = [head, _string(_ID_FIELD, response.id or request_id), descriptions]
    for tensor in outputs:
        raw = _raw_output(tensor)
        parts.append(_key(6, len(raw)))
        parts.append(raw)
    return b"".join(parts)
