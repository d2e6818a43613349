"""The gRPC front end: KServe v2 / Triton's GRPCInferenceService over one InferenceCore.

A thin adapter: it translates protobuf messages to and from gpud.executor.types and the core's typed answers (those with
`gpud.api.grpc_encode`), and maps InferenceError kinds to gRPC status codes. It decides nothing about models,
batching or placement.

    server = await start_grpc_server(core, "0.0.0.0", 8001)
    server.bound_port   # the port actually bound (useful with port 0)
    ...
    await server.stop(grace=5.0)

Tensor wire format, as Triton's: `raw_input_contents` / `raw_output_contents` hold one entry per tensor, in tensor
order, little-endian and row-major; each BYTES element is prefixed by its length as a 4-byte little-endian integer.
Inputs may instead come as typed `contents` (InferTensorContents). Outputs always go back raw, as Triton sends them.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import grpc
import numpy as np
from google.protobuf import message_factory
from google.protobuf.message import DecodeError

from gpud.executor.client_shm import NO_DATA, shm_ref_of
from gpud.executor.bytes_tensor import decode_bytes_elements, encode_bytes_elements
from gpud.executor.datatypes import numpy_dtype
from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor, RequestedOutput
from gpud.api import GRPC_SERVERS
from gpud.api.admin import AdminAuth, grpc_peer_host
from gpud.api.grpc_infer import ModelInferCalls, stream_answer
from gpud.api.grpcwire import calls
from gpud.api.grpcwire.calls import CallAborted, Method, Received
from gpud.api.grpcwire.keepalive import Keepalive
from gpud.api.grpcwire.server import GrpcServer
from gpud.api.limits import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_TENSOR_ELEMENTS, SharedCount, check_shape
from gpud.api.grpc_encode import (log_settings_message, model_config_message, model_metadata_message,
                                  model_statistics_message, repository_index_message, server_metadata_message,
                                  trace_settings_message)
from gpud.core_api import InferenceCore
from gpud.repository.overrides import override_of
from gpud.proto import grpc_service_pb2 as pb
from gpud.proto import grpc_service_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# Triton's gRPC codes for the same errors (as HTTP_STATUS in http_api)
GRPC_STATUS_CODES: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorKind.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorKind.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
}

# Which InferTensorContents field carries each datatype. FP16 (and BF16) have none: Triton requires raw contents.
_CONTENTS_FIELDS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

# Request parameters that Triton turns into scheduling fields instead of passing on (tritonclient sets them).
_PRIORITY_PARAMETER = "priority"
_TIMEOUT_PARAMETER = "timeout"  # microseconds in the queue
_SHARED_MEMORY_PARAMETER = "shared_memory_region"



def _invalid(message: str) -> InferenceError:
    return InferenceError(ErrorKind.INVALID_ARGUMENT, message)


# ---------------------------------------------------------------------------------------------------------------------
# Parameters


def _parameter_value(parameter: pb.InferParameter) -> Any:
    choice = parameter.WhichOneof("parameter_choice")
    return None if choice is None else getattr(parameter, choice)


def _set_parameter(parameter: pb.InferParameter, value: Any) -> None:
    # bool first: bool is an int in Python, and clients read bool_param for flags
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    else:
        parameter.string_param = str(value)


def _parameters_dict(parameters) -> dict[str, Any]:
    return {key: _parameter_value(value) for key, value in parameters.items()}


def _non_negative_int_parameter(parameters: dict[str, Any], key: str) -> int:
    value = parameters.pop(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _invalid(f"request parameter {key!r} must be a non-negative integer, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------------------------------
# Decoding inputs



def _input_dtype(name: str, datatype: str) -> np.dtype:
    try:
        return numpy_dtype(datatype)
    except ValueError as exc:
        raise _invalid(f"input {name!r}: {exc}") from None


def _decode_raw_bytes_elements(name: str, raw: bytes, element_count: int) -> np.ndarray:
    try:
        return decode_bytes_elements(raw, element_count)
    except ValueError as exc:
        raise _invalid(f"input {name!r}: {exc}") from None


def _decode_raw(name: str, datatype: str, shape: tuple[int, ...], raw: bytes, element_count: int) -> np.ndarray:
    dtype = _input_dtype(name, datatype)
    if datatype == "BYTES":
        return _decode_raw_bytes_elements(name, raw, element_count).reshape(shape)
    expected_bytes = element_count * dtype.itemsize
    if len(raw) != expected_bytes:
        raise _invalid(f"input {name!r}: got {len(raw)} bytes of raw content, expected {expected_bytes} "
                       f"for shape {list(shape)} of {datatype}")
    if datatype == "BOOL" and element_count and np.frombuffer(raw, np.uint8).max() > 1:  # as HTTP: not 0 or 1
        raise _invalid(f"input {name!r}: BOOL elements must be bytes 0 or 1")
    # The wire is little-endian; astype is a no-op on little-endian hosts and swaps bytes elsewhere.
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False).reshape(shape)


def _decode_contents(name: str, datatype: str, shape: tuple[int, ...], contents: pb.InferTensorContents,
                     element_count: int) -> np.ndarray:
    dtype = _input_dtype(name, datatype)
    field = _CONTENTS_FIELDS.get(datatype)
    if field is None:
        raise _invalid(f"input {name!r}: {datatype} data must be sent in raw_input_contents")
    values = getattr(contents, field)
    if len(values) != element_count:
        raise _invalid(f"input {name!r}: got {len(values)} elements in {field}, expected {element_count} "
                       f"for shape {list(shape)}")
    if datatype == "BYTES":
        array = np.empty(element_count, dtype=np.object_)
        array[:] = list(values)
        return array.reshape(shape)
    if dtype.kind in "iu":
        # int_contents / uint_contents are 32-bit on the wire and also carry INT8/INT16/UINT8/UINT16:
        # check the range rather than let numpy wrap 300 into an INT8.
        wide = np.array(values, dtype=np.uint64 if dtype.kind == "u" else np.int64)
        limits = np.iinfo(dtype)
        if wide.size and (wide.min() < limits.min or wide.max() > limits.max):
            raise _invalid(f"input {name!r}: a value in {field} does not fit {datatype}")
        return wide.astype(dtype).reshape(shape)
    return np.array(values, dtype=dtype).reshape(shape)


def decode_inputs(request: pb.ModelInferRequest,
                  max_elements: int = DEFAULT_MAX_TENSOR_ELEMENTS) -> list[InferTensor]:
    """The request's input tensors as numpy arrays, validated against their shapes and datatypes; a shape spanning
    more than `max_elements` elements is refused before anything is allocated for it. Inputs in shared memory have
    no data here (their `shm` says where it lies) and take no raw_input_contents entry, as in Triton."""
    raw_contents = request.raw_input_contents
    in_shm = [_SHARED_MEMORY_PARAMETER in tensor.parameters for tensor in request.inputs]
    if raw_contents and len(raw_contents) != len(request.inputs) - sum(in_shm):
        raise _invalid(f"got {len(raw_contents)} raw_input_contents for {len(request.inputs) - sum(in_shm)} inputs "
                       "not in shared memory; raw contents need one entry per such input, in input order")
    tensors = []
    raw_index = 0
    for tensor, shm in zip(request.inputs, in_shm):
        shape = tuple(tensor.shape)
        count = check_shape(tensor.name, shape, max_elements)
        if shm:
            if tensor.HasField("contents"):
                raise _invalid(f"unexpected 'content' provided when using shared memory for input tensor "
                               f"'{tensor.name}' for model '{request.model_name}'")  # Triton's words
            ref = shm_ref_of(_parameters_dict(tensor.parameters), f"input '{tensor.name}'")
            tensors.append(InferTensor(tensor.name, tensor.datatype, shape, NO_DATA, ref))
            continue
        if raw_contents:
            if tensor.HasField("contents"):
                raise _invalid(f"contents field must not be specified when using raw_input_contents for "
                               f"'{tensor.name}' for model '{request.model_name}'")  # Triton's words
            data = _decode_raw(tensor.name, tensor.datatype, shape, raw_contents[raw_index], count)
            raw_index += 1
        else:
            data = _decode_contents(tensor.name, tensor.datatype, shape, tensor.contents, count)
        tensors.append(InferTensor(name=tensor.name, datatype=tensor.datatype, shape=shape, data=data))
    return tensors


def _requested_outputs(request: pb.ModelInferRequest) -> list[RequestedOutput] | None:
    if not request.outputs:
        return None  # Triton's rule: no requested outputs means every output
    requested = []
    for output in request.outputs:
        parameters = _parameters_dict(output.parameters)
        shm = None
        if _SHARED_MEMORY_PARAMETER in parameters:
            if "classification" in parameters:
                raise _invalid("Output can't set both 'shared_memory_region' and 'classification'")
            shm = shm_ref_of(parameters, f"output '{output.name}'")
        requested.append(RequestedOutput(name=output.name, parameters=parameters, shm=shm))
    return requested


def to_infer_request(request: pb.ModelInferRequest,
                     max_elements: int = DEFAULT_MAX_TENSOR_ELEMENTS) -> InferRequest:
    """The executor's InferRequest for a ModelInferRequest; raises INVALID_ARGUMENT for a malformed one."""
    parameters = _parameters_dict(request.parameters)
    priority = _non_negative_int_parameter(parameters, _PRIORITY_PARAMETER)
    timeout_us = _non_negative_int_parameter(parameters, _TIMEOUT_PARAMETER)
    inputs = decode_inputs(request, max_elements)
    outputs = _requested_outputs(request)
    return InferRequest(
        model_name=request.model_name,
        model_version=request.model_version,
        id=request.id,
        inputs=inputs,
        outputs=outputs,
        priority=priority,
        timeout_us=timeout_us,
        parameters=parameters,
        uses_shm=any(t.shm is not None for t in inputs) or any(o.shm is not None for o in outputs or ()),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Encoding outputs


def _encode_raw(tensor: InferTensor) -> bytes:
    if tensor.datatype == "BYTES":
        return encode_bytes_elements(tensor.data)
    dtype = numpy_dtype(tensor.datatype).newbyteorder("<")
    return np.ascontiguousarray(tensor.data, dtype=dtype).tobytes()


def to_infer_response(response: InferResponse, requested: list[RequestedOutput] | None,
                      request_id: str) -> pb.ModelInferResponse:
    """A ModelInferResponse with raw output contents, holding only the requested outputs (all when None)."""
    message = pb.ModelInferResponse(
        model_name=response.model_name,
        model_version=response.model_version,
        id=response.id or request_id,
    )
    for key, value in response.parameters.items():
        _set_parameter(message.parameters[key], value)
    wanted = None if requested is None else {output.name for output in requested}
    for tensor in response.outputs:
        # the core may compute every output; only requested ones go on the wire
        if wanted is not None and tensor.name not in wanted:
            continue
        message.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=list(tensor.shape))
        # An output written into the client's shared memory keeps its (empty) place: entries follow outputs' order.
        message.raw_output_contents.append(b"" if tensor.shm is not None else _encode_raw(tensor))
    return message


# ---------------------------------------------------------------------------------------------------------------------
# The servicer


def _encode_in_full(response: InferResponse, request: InferRequest) -> bytes:
    """The answer through protobuf's message, where grpc_infer.encode_response does not write it (parameters)."""
    return to_infer_response(response, request.outputs, request.id).SerializeToString()


def _status_of(exc: BaseException, method: str) -> tuple[int, str]:
    """The status and details a call ends with for `exc`: a client's error as its kind says, anything else (not an
    error a client caused) logged with its traceback and answered INTERNAL, so the server keeps serving."""
    if isinstance(exc, InferenceError):
        return calls.status_number(GRPC_STATUS_CODES[exc.kind]), exc.message
    if isinstance(exc, CallAborted):
        return exc.code, exc.details
    logger.error("gRPC %s failed", method, exc_info=exc)
    return calls.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}"


_STATUS_CODES_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    """Answer with the status for exc (context.abort raises, ending the RPC)."""
    number, details = _status_of(exc, method)
    await context.abort(_STATUS_CODES_BY_NUMBER[number], details)


class MalformedMessage:
    """What a request that is not a valid protobuf message deserializes to: the handler answers INVALID_ARGUMENT.
    grpc's own answer would be UNKNOWN, with a traceback in the daemon's log for every such request."""

    def __init__(self, error: str):
        self.error = error

    def refuse(self) -> InferenceError:
        return _invalid(f"the request is not a valid protobuf message of its method's type: {self.error}")


def _bytes_file(key: str, value: object) -> bytes:
    """A `file:` load parameter over gRPC: bytes_param (as Triton)."""
    if not isinstance(value, bytes):
        raise ValueError(f"'{key}' must be a bytes_param holding the file")
    return value


def _lenient(deserialize: Callable[[bytes], Any] | None) -> Callable[[Received], Any] | None:
    if deserialize is None:  # a method that takes the raw bytes (none of the generated ones)
        return None
    def parse(data: Received) -> Any:
        try:
            return deserialize(data)  # type: ignore[arg-type]  # upb takes any bytes-like (a large one's view)
        except DecodeError as exc:
            return MalformedMessage(str(exc))
    return parse


class _LenientRegistration:
    """Stands for the server in the generated add_..._to_server: registers its handlers with lenient request
    deserializers (and once: the generated code registers the same table twice, generic and by name)."""

    def __init__(self, server: grpc.aio.Server):
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # the same methods are registered below, with lenient deserializers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        # grpc's handlers are namedtuples at run time; its stub declares their fields only
        lenient = {name: h._replace(request_deserializer=_lenient(h.request_deserializer))  # type: ignore[attr-defined]
                   for name, h in handlers.items()}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, lenient),))
        self._server.add_registered_method_handlers(service, lenient)


def _unary(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Turn exceptions of a unary handler into gRPC statuses; context.abort's own exception passes through."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            if isinstance(request, MalformedMessage):
                raise request.refuse()
            return await handler(self, request, context)
        except Exception as exc:  # noqa: BLE001 - the server must answer every request, never crash
            if isinstance(exc, (grpc.aio.AbortError, CallAborted)):
                raise
            await _abort(context, exc, handler.__name__)

    return wrapper


def _trace_value(name: str, values: list[str]) -> object:
    """A trace setting's values as HTTP's JSON has them: none clears it (null), the level is a list, any other one
    value."""
    if not values:
        return None
    if name == "trace_level":
        return values
    if len(values) != 1:
        raise InferenceError(ErrorKind.INVALID_ARGUMENT, f"expect only 1 value for '{name}', got {len(values)}")
    return values[0]


def _oneof_value(value: Any) -> Any:
    """The value a SettingValue message holds in its `parameter_choice` oneof; None when it holds none (as null in
    HTTP's JSON: the setting stays as it is)."""
    member = value.WhichOneof("parameter_choice")
    return getattr(value, member) if member else None


class _StreamEnd:
    """Marks the end of a stream's responses in its queue."""


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """GRPCInferenceService over an InferenceCore."""

    def __init__(self, core: InferenceCore, admin: AdminAuth | None = None,
                 max_tensor_elements: int = DEFAULT_MAX_TENSOR_ELEMENTS):
        self._core = core
        self._admin = admin or AdminAuth()
        self._max_tensor_elements = max_tensor_elements
        # ModelInfer's and ModelStreamInfer's per-request path on gpud's own server (compiled: gpud.compiled), with
        # the request kinds it has seen (its plans); the method table calls its `start` for ModelInfer
        self.model_infer_calls = ModelInferCalls(core.submit, self._full_request, _encode_in_full,
                                                 functools.partial(_status_of, method="ModelInfer"))

    def _check_admin(self, context: grpc.aio.ServicerContext, action: str) -> None:
        metadata = dict(context.invocation_metadata() or ())
        token = metadata.get("authorization")  # bytes only for binary ("-bin") keys: no token
        self._admin.check(token if isinstance(token, str) else None, action, grpc_peer_host(context.peer() or ""))

    @_unary
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=self._core.server_live())

    @_unary
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self._core.server_ready())

    @_unary
    async def ModelReady(self, request, context):
        try:
            ready = self._core.model_ready(request.name, request.version)
        except InferenceError as exc:
            if exc.kind is not ErrorKind.NOT_FOUND:
                raise
            ready = False  # Triton answers "not ready" for an unknown model rather than an error
        return pb.ModelReadyResponse(ready=ready)

    @_unary
    async def ServerMetadata(self, request, context):
        return server_metadata_message(self._core.server_metadata())

    @_unary
    async def ModelMetadata(self, request, context):
        return model_metadata_message(self._core.model_metadata(request.name, request.version))

    @_unary
    async def ModelConfig(self, request, context):
        config = model_config_message(self._core.model_config(request.name, request.version))
        return pb.ModelConfigResponse(config=config)

    @_unary
    async def ModelStatistics(self, request, context):
        return model_statistics_message(self._core.model_statistics(request.name, request.version))

    @_unary
    async def RepositoryIndex(self, request, context):
        return repository_index_message(self._core.repository_index(ready_only=request.ready))

    @_unary
    async def RepositoryModelLoad(self, request, context):
        self._check_admin(context, f"loading model '{request.model_name}'")
        params = {key: getattr(p, p.WhichOneof("parameter_choice") or "string_param")
                  for key, p in request.parameters.items()}
        try:
            override = override_of(params, _bytes_file)
        except ValueError as exc:
            raise _invalid(f"failed to load '{request.model_name}': {exc}") from None
        await self._core.load_model(request.model_name, override)
        return pb.RepositoryModelLoadResponse()

    @_unary
    async def RepositoryModelUnload(self, request, context):
        self._check_admin(context, f"unloading model '{request.model_name}'")
        dependents = False
        if "unload_dependents" in request.parameters:
            param = request.parameters["unload_dependents"]
            if param.WhichOneof("parameter_choice") != "bool_param":
                raise _invalid("invalid value type for 'unload_dependents' parameter, expected bool_param.")
            dependents = param.bool_param
        await self._core.unload_model(request.model_name, unload_dependents=dependents)
        return pb.RepositoryModelUnloadResponse()

    # --- the shared-memory extension ---------------------------------------------------------------------------
    @_unary
    async def SystemSharedMemoryStatus(self, request, context):
        message = pb.SystemSharedMemoryStatusResponse()
        for r in self._core.client_shm.status(request.name):
            message.regions[r.name].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(
                name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size))
        return message

    @_unary
    async def SystemSharedMemoryRegister(self, request, context):
        self._check_admin(context, f"registering system shared memory region '{request.name}'")
        self._core.client_shm.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_unary
    async def SystemSharedMemoryUnregister(self, request, context):
        self._check_admin(context, "unregistering system shared memory region" +
                          (f" '{request.name}'" if request.name else "s"))
        self._core.client_shm.unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_unary
    async def CudaSharedMemoryStatus(self, request, context):
        message = pb.CudaSharedMemoryStatusResponse()
        for r in self._core.client_shm.cuda_status(request.name):
            message.regions[r["name"]].CopyFrom(pb.CudaSharedMemoryStatusResponse.RegionStatus(
                name=r["name"], device_id=r["device_id"], byte_size=r["byte_size"]))
        return message

    @_unary
    async def CudaSharedMemoryRegister(self, request, context):
        self._check_admin(context, f"registering cuda shared memory region '{request.name}'")
        self._core.client_shm.cuda_register(request.name, request.raw_handle, request.device_id, request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    @_unary
    async def CudaSharedMemoryUnregister(self, request, context):
        self._check_admin(context, "unregistering cuda shared memory region" +
                          (f" '{request.name}'" if request.name else "s"))
        self._core.client_shm.cuda_unregister(request.name)
        return pb.CudaSharedMemoryUnregisterResponse()

    # --- the logging extension ---------------------------------------------------------------------------------
    @_unary
    async def LogSettings(self, request, context):
        changes = {name: _oneof_value(value) for name, value in request.settings.items()}
        if changes:  # none: a read (tritonclient's get_log_settings)
            self._check_admin(context, "changing the log settings")
            settings = self._core.update_log_settings(changes)
        else:
            settings = self._core.log_settings()
        return log_settings_message(settings)

    # --- the trace extension -----------------------------------------------------------------------------------
    @_unary
    async def TraceSetting(self, request, context):
        changes = {name: _trace_value(name, list(value.value)) for name, value in request.settings.items()}
        if changes:  # none: a read (tritonclient's get_trace_settings)
            self._check_admin(context, "changing the trace settings")
            settings = self._core.update_trace_settings(request.model_name, changes)
        else:
            settings = self._core.trace_settings(request.model_name)
        return trace_settings_message(settings)

    @_unary
    async def ModelInfer(self, request, context):
        return await self._infer(request)

    def _full_request(self, data: Received) -> InferRequest:
        """A serialized ModelInferRequest parsed and checked in full (a kind's first, or one no plan matches);
        INVALID_ARGUMENT for what is no such message or not a valid request."""
        message = _parse_infer_request(data)
        if isinstance(message, MalformedMessage):
            raise message.refuse()
        return to_infer_request(message, self._max_tensor_elements)

    async def _infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        infer_request = to_infer_request(request, self._max_tensor_elements)
        response = await self._core.infer(infer_request)
        return to_infer_response(response, infer_request.outputs, request.id)

    # --- streams: each request submitted with a callback, its answer or error one response ------------------------
    def _start_stream_request(self, request: bytes | pb.ModelInferRequest | MalformedMessage,
                              answer: Callable[[Any], None]) -> Callable[[], None] | None:
        """Submit one of a stream's requests (bytes on gpud's server, a message on grpcio's); `answer` gets its
        response (bytes or a message, as the request came) once. Returns how to cancel it."""
        infer_request: InferRequest | None = None
        plan = None
        try:
            if isinstance(request, _WIRE):
                infer_request, plan = self.model_infer_calls.request_of(request)
            elif isinstance(request, MalformedMessage):
                raise request.refuse()
            else:
                infer_request = to_infer_request(request, self._max_tensor_elements)
            cancel = self._core.submit(infer_request, functools.partial(
                self._stream_done, infer_request, isinstance(request, _WIRE), answer))
        except Exception as exc:  # noqa: BLE001 - one bad request must not end the client's stream
            identity: Any = infer_request
            if identity is None and isinstance(request, _WIRE):
                parsed = _parse_infer_request(request)  # what identifies it, if it is a message at all
                identity = None if isinstance(parsed, MalformedMessage) else parsed
            elif identity is None and not isinstance(request, MalformedMessage):
                identity = request
            answer(_stream_error(exc, identity, isinstance(request, _WIRE)))
            return None
        self.model_infer_calls.plans.keep(plan)
        return cancel

    def _stream_done(self, request: InferRequest, as_bytes: bool, answer: Callable[[Any], None],
                     result: InferResponse | BaseException) -> None:
        if isinstance(result, BaseException):
            answer(_stream_error(result, request, as_bytes))
            return
        try:
            if as_bytes:
                answer(stream_answer(self.model_infer_calls.answer_bytes(request, result)))
            else:
                answer(pb.ModelStreamInferResponse(
                    infer_response=to_infer_response(result, request.outputs, request.id)))
        except Exception as exc:  # noqa: BLE001
            answer(_stream_error(exc, request, as_bytes))

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[Any], context) -> AsyncIterator[Any]:
        # Requests of one stream run concurrently, so that the batcher can batch them, and their responses go back
        # in completion order, as Triton sends them; clients match them to requests by id. Each is submitted with a
        # callback (no task per request); on gpud's own server requests come and answers go as bytes.
        responses: asyncio.Queue = asyncio.Queue()
        open_requests: dict[int, Callable[[], None] | None] = {}
        numbers = itertools.count()
        reading = True

        def answered(number: int, response: Any) -> None:
            open_requests.pop(number, None)
            responses.put_nowait(response)
            if not reading and not open_requests:
                responses.put_nowait(_StreamEnd)

        async def read_requests() -> None:
            nonlocal reading
            try:
                async for request in request_iterator:
                    number = next(numbers)
                    open_requests[number] = None
                    cancel = self._start_stream_request(request, functools.partial(answered, number))
                    if number in open_requests:  # not answered at once
                        open_requests[number] = cancel
            except BaseException:
                responses.put_nowait(_StreamEnd)  # the stream cannot be read: it ends now, with this error
                raise
            reading = False
            if not open_requests:
                responses.put_nowait(_StreamEnd)

        reader = asyncio.create_task(read_requests())
        try:
            while (response := await responses.get()) is not _StreamEnd:
                yield response
            await reader  # re-raises a failure to read the stream
        finally:
            reader.cancel()
            for cancel in open_requests.values():  # the call ended (cancelled, failed): nobody waits for these
                if cancel is not None:
                    cancel()
            open_requests.clear()


def _stream_error(exc: BaseException, identity: Any, as_bytes: bool) -> Any:
    """A stream's response for a request that failed: errors go in error_message so that the stream itself stays
    open, with what identifies the request (`identity`: its model name, version and id, when it has them), as
    clients match stream responses to requests by id. Serialized where the stream's requests come as bytes."""
    response = pb.ModelStreamInferResponse(error_message=_status_of(exc, "ModelStreamInfer")[1])
    if identity is not None:
        response.infer_response.CopyFrom(pb.ModelInferResponse(
            model_name=identity.model_name, model_version=identity.model_version, id=identity.id))
    return response.SerializeToString() if as_bytes else response


# ---------------------------------------------------------------------------------------------------------------------
# The server


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcioServer:
    """grpcio's aio server behind the interface of gpud's own (`bound_port`, `stop(grace)`)."""

    def __init__(self, server: grpc.aio.Server, bound_port: int):
        self.server = server
        self.bound_port = bound_port

    async def stop(self, grace: float | None) -> None:
        await self.server.stop(grace)


def _serialize(message: Any) -> bytes:
    """A response as it goes on the wire (ModelStreamInfer's answers come serialized already)."""
    return message if isinstance(message, bytes) else cast(bytes, message.SerializeToString())


def method_table(servicer: InferenceServicer) -> dict[str, Method]:
    """GRPCInferenceService's methods by path, for gpud's own server; requests that are not valid messages of their
    method's type reach the handler as MalformedMessage (INVALID_ARGUMENT), as with grpcio."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    table = {}
    for method in service.methods:
        parse = _lenient(message_factory.GetMessageClass(method.input_type).FromString)
        if method.name == "ModelStreamInfer":
            parse = _as_received  # its requests are read from their bytes (the servicer's plans), as ModelInfer's
        assert parse is not None
        table[f"/{service.full_name}/{method.name}"] = Method(
            getattr(servicer, method.name), parse, _serialize,
            client_streaming=method.client_streaming, server_streaming=method.server_streaming,
            start=servicer.model_infer_calls.start if method.name == "ModelInfer" else None)
    return table


_WIRE = (bytes, memoryview)  # a request as gpud's server reads it (a large one comes as a memoryview)


def _as_received(data: Any) -> Any:
    return data


def _parse_infer_request(data: bytes | memoryview) -> Any:
    try:
        return pb.ModelInferRequest.FromString(data)  # type: ignore[arg-type]  # upb takes any bytes-like
    except DecodeError as exc:
        return MalformedMessage(str(exc))


async def start_grpc_server(core: InferenceCore, host: str, port: int, *, max_message_bytes: int = 2**31 - 1,
                            max_metadata_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                            max_tensor_elements: int = DEFAULT_MAX_TENSOR_ELEMENTS,
                            admin: AdminAuth | None = None, reuse_port: bool = False,
                            listen: socket.socket | None = None,
                            implementation: str = "gpud", max_connections: int = 10000,
                            shared_connections: SharedCount | None = None,
                            keepalive: Keepalive = Keepalive()) -> GrpcServer | GrpcioServer:
    """Start serving GRPCInferenceService for `core` on host:port and return the started server.

    port 0 binds an ephemeral port; the port actually bound is in `server.bound_port`. A port already in use raises
    OSError (no SO_REUSEPORT sharing), unless `reuse_port`; `listen` (gpud's server only): accept on this listening
    socket instead of binding. Messages larger than max_message_bytes, either way, and request metadata (headers)
    over max_metadata_bytes are refused with RESOURCE_EXHAUSTED; a tensor shape over max_tensor_elements is
    INVALID_ARGUMENT. Stop with `await server.stop(grace)`. Must be called from the event loop that will run the
    server. `implementation`: "gpud" (gpud's own HTTP/2 server, ~4x less CPU per call; more than `max_connections`
    connections are closed at once) or "grpcio" (no connection cap). `keepalive`: keepalive PINGs, the client ping
    policy and the idle timeout, on either (grpcio's: as its channel options).
    """
    servicer = InferenceServicer(core, admin, max_tensor_elements)
    if implementation == "gpud":
        server = GrpcServer(method_table(servicer), max_message_bytes=max_message_bytes,
                            max_metadata_bytes=max_metadata_bytes, max_connections=max_connections,
                            keepalive=keepalive, shared_connections=shared_connections)
        if listen is not None:
            await server.start_socket(listen)
        else:
            try:
                await server.start(host, port, reuse_port=reuse_port)
            except OSError as exc:
                raise OSError(f"gRPC server could not bind {_address(host, port)}: {exc.strerror or exc}") from exc
        logger.info("gRPC server listening on %s", _address(host, server.bound_port))
        return server
    if implementation != "grpcio":
        raise ValueError(f"unknown gRPC server '{implementation}' (choose from {', '.join(GRPC_SERVERS)})")
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # grpc's default is a soft limit of 8 KiB, over which it refuses some requests at random up to a hard limit;
        # both at one value make the limit exact, as --max-header-bytes is for HTTP
        ("grpc.max_metadata_size", max_metadata_bytes),
        ("grpc.absolute_max_metadata_size", max_metadata_bytes),
        # grpc sets SO_REUSEPORT by default, which lets a second daemon bind a port in use and silently share it
        ("grpc.so_reuseport", 1 if reuse_port else 0),
        *keepalive.grpc_options(),
    ]
    aio_server = grpc.aio.server(options=options)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, _LenientRegistration(aio_server))
    address = _address(host, port)
    try:
        bound_port = aio_server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"gRPC server could not bind {address}: {exc}") from exc
    if bound_port == 0:  # older grpcio reports a failed bind this way instead of raising
        raise OSError(f"gRPC server could not bind {address}")
    await aio_server.start()
    logger.info("gRPC server (grpcio) listening on %s", _address(host, bound_port))
    return GrpcioServer(aio_server, bound_port)
