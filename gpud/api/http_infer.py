"""The bodies of KServe v2 HTTP inference, as Triton and `tritonclient.http` write them: a JSON request or
response, or a JSON header followed by binary tensor data (the binary tensor data extension, whose header length is in
the `Inference-Header-Content-Length` header). `gpud.api.http_api` routes requests here; this is its hot path.

Hot-path notes. The request body is read once (a single chunk is not copied at all); the JSON header is parsed by
orjson straight from a memoryview; binary inputs become `np.frombuffer` views into the body (read-only, possibly
unaligned; no copy); JSON outputs are serialized by orjson from the numpy array (no `tolist()`); binary outputs are
joined with the header into the body in one copy. A header seen before is not parsed again (`_BinaryPlan`).
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import orjson

from gpud.executor.client_shm import NO_DATA, shm_ref_of
from gpud.executor.bytes_tensor import decode_bytes_elements, encode_bytes_elements
from gpud.executor.datatypes import KSERVE_DATATYPES, UNCHECKED_DATATYPES, numpy_dtype
from gpud.executor.model_config import ModelConfig
from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor, RequestedOutput
from gpud.api.http_server import JSON, AnswerBody, Body
from gpud.api.limits import DEFAULT_MAX_TENSOR_ELEMENTS, check_shape

INFER_HEADER_CONTENT_LENGTH = "Inference-Header-Content-Length"
_OCTET_STREAM = "application/octet-stream"
_OPT_NUMPY = orjson.OPT_SERIALIZE_NUMPY

# Wire dtypes are little-endian; on little-endian hosts these equal the native dtypes, so frombuffer is a pure view.
_WIRE_DTYPES: dict[str, np.dtype] = {
    d: numpy_dtype(d).newbyteorder("<") for d in KSERVE_DATATYPES if d != "BYTES"
}
# numpy kinds a JSON `data` list may parse to for each datatype (ints are fine for floats, not the reverse).
_JSON_KINDS: dict[str, str] = {
    d: ("b" if d == "BOOL" else "iu" if dt.kind in "iu" else "iuf") for d, dt in _WIRE_DTYPES.items()
}
_KIND_NAMES = {"b": "booleans", "i": "integers", "u": "integers", "f": "numbers", "U": "strings", "O": "mixed values"}


def invalid(message: str) -> InferenceError:
    """A client's malformed request (HTTP 400)."""
    return InferenceError(ErrorKind.INVALID_ARGUMENT, message)


def _loads(data: bytes | memoryview, what: str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        error = e
    raw = bytes(data)
    if b"NaN" in raw or b"Infinity" in raw:  # Triton reads NaN, Infinity and -Infinity (RapidJSON's
        try:                                   # kParseNanAndInfFlag), as Python's json writes them; orjson does not
            return json.loads(raw)
        except (ValueError, RecursionError):
            pass
    raise invalid(f"malformed JSON in {what}: {error}") from None


# ---------------------------------------------------------------------------------------------------------------------
# Infer request decoding: JSON header + optional binary tensor data
# ---------------------------------------------------------------------------------------------------------------------
class _BinaryPlan:
    """A JSON header seen before, already parsed and checked, whose inputs are all binary (not BYTES or BOOL, whose
    data needs checking per request). Clients send the same header again and again (same shapes, same outputs):
    a request with a known header only has its arrays cut out of the body. The plan is also the request's
    `signature`, so the executor reuses its validation too."""

    __slots__ = ("inputs", "binary_size", "max_elements", "id", "outputs", "priority", "timeout_us", "parameters",
                 "answers")

    def __init__(self, request: InferRequest, binary_size: int):
        self.inputs = tuple((t.name, t.datatype, t.shape, _WIRE_DTYPES[t.datatype], t.data.size,
                             t.data.size * _WIRE_DTYPES[t.datatype].itemsize) for t in request.inputs)
        self.binary_size = binary_size
        # the largest input's extent: a server with a lower --max-tensor-elements must not reuse this plan
        self.max_elements = max(math.prod(d or 1 for d in t.shape) for t in request.inputs)
        self.id = request.id
        self.outputs = request.outputs
        self.priority = request.priority
        self.timeout_us = request.timeout_us
        self.parameters = request.parameters
        # Response headers already encoded for this request header, by (model, version, id, outputs' names,
        # datatypes and shapes), when every output goes back as binary: the answer's header is then the same bytes.
        self.answers: dict[tuple, bytes] = {}

    @staticmethod
    def fits(request: InferRequest, binary_size: int) -> bool:
        return not request.uses_shm and sum(t.data.nbytes for t in request.inputs) == binary_size and all(
            t.datatype in UNCHECKED_DATATYPES and t.data.base is not None for t in request.inputs)

    def request(self, body: Body, offset: int, model_name: str, model_version: str) -> InferRequest:
        tensors = []
        for name, datatype, shape, dtype, count, nbytes in self.inputs:
            tensors.append(InferTensor(name, datatype, shape, np.frombuffer(body, dtype, count, offset).reshape(shape)))
            offset += nbytes
        return InferRequest(model_name, tensors, model_version, self.id, self.outputs, self.priority, self.timeout_us,
                            self.parameters, self)


_PLANS: dict[bytes, _BinaryPlan] = {}
_PLANS_MAX = 1024
_PLAN_MAX_HEADER_BYTES = 4096


def decode_infer_request(body: Body, header_length: str | None, model_name: str, model_version: str,
                         max_elements: int = DEFAULT_MAX_TENSOR_ELEMENTS) -> InferRequest:
    """Parse a KServe v2 infer request body. `header_length` is the Inference-Header-Content-Length header, if any;
    an input whose shape spans more than `max_elements` elements is refused before anything is allocated for it."""
    header = None
    if header_length is not None:
        json_end = _parse_header_length(header_length, len(body))
        header = bytes(body[:json_end])
        plan = _PLANS.get(header)
        if plan is not None and plan.binary_size == len(body) - json_end and plan.max_elements <= max_elements:
            return plan.request(body, json_end, model_name, model_version)
    request = _decode_infer_request(body, header_length, model_name, model_version, max_elements)
    if header is not None and len(header) <= _PLAN_MAX_HEADER_BYTES and \
            _BinaryPlan.fits(request, len(body) - len(header)):
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()  # headers churn (e.g. a request id in each): start over rather than track recency
        plan = _PLANS[header] = _BinaryPlan(request, len(body) - len(header))
        request.signature = plan
    return request


def _decode_infer_request(body: Body, header_length: str | None, model_name: str,
                          model_version: str, max_elements: int) -> InferRequest:
    view = memoryview(body)
    json_end = len(body) if header_length is None else _parse_header_length(header_length, len(body))
    doc = _loads(view[:json_end], "inference request")
    if not isinstance(doc, dict):
        raise invalid("inference request must be a JSON object")
    inputs_json = doc.get("inputs")
    if not isinstance(inputs_json, list) or not inputs_json:
        raise invalid("inference request needs a non-empty 'inputs' array")

    inputs: list[InferTensor] = []
    offset = json_end  # binary tensor data follows the JSON, in input order
    for index, item in enumerate(inputs_json):
        tensor, offset = _decode_input(item, index, view, offset, header_length is not None, max_elements)
        inputs.append(tensor)
    if offset != len(body):
        raise invalid(f"request has {len(body) - json_end} bytes of binary tensor data but the inputs' "
                       f"binary_data_size parameters add up to {offset - json_end}")

    params = parameters_object(doc.get("parameters"), "request")
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise invalid("request 'id' must be a string")
    if not isinstance(params.get("binary_data_output", False), bool):
        raise invalid("parameter 'binary_data_output' must be a boolean")
    outputs = _requested_outputs(doc.get("outputs"))
    return InferRequest(
        model_name=model_name, model_version=model_version, inputs=inputs, id=request_id,
        outputs=outputs,
        priority=_non_negative_int(params.get("priority", 0), "parameter 'priority'"),
        timeout_us=_non_negative_int(params.get("timeout", 0), "parameter 'timeout' (microseconds)"),
        parameters=params,
        uses_shm=any(t.shm is not None for t in inputs) or any(o.shm is not None for o in outputs or ()),
    )


def is_raw_request(header_length: str | None) -> bool:
    """Inference-Header-Content-Length 0: the body is one input's raw bytes, no JSON (Triton's raw binary request)."""
    if header_length is None:
        return False
    try:
        return int(header_length) == 0
    except ValueError:
        return False


def decode_raw_request(body: Body, config: ModelConfig, model_name: str, model_version: str,
                       max_elements: int = DEFAULT_MAX_TENSOR_ELEMENTS) -> InferRequest:
    """A raw binary request as Triton reads it: the model's single input, its datatype and shape from the config
    (a batch of 1 where the model batches; one variable dimension deduced from the body's size; a BYTES input of
    dims [1] takes the whole body as its one element). The answer is JSON, as for any request without parameters."""
    if len(config.inputs) != 1:
        raise invalid(f"Raw request must only have 1 input (found 1) to be deduced but got {len(config.inputs)} "
                      f"inputs in '{config.name}' model configuration")
    spec = config.inputs[0]
    data = memoryview(body)
    shape = ([1] if config.batches else []) + list(spec.dims)
    variable = [i for i, d in enumerate(shape) if d < 0]
    if spec.datatype == "BYTES":
        if variable or math.prod(spec.dims) != 1:
            raise invalid(f"For BYTE datatype raw input '{spec.name}', the model must have input shape [1]")
        array = np.empty(tuple(shape), dtype=np.object_)
        array.reshape(-1)[0] = bytes(data)
        return InferRequest(model_name, [InferTensor(spec.name, "BYTES", tuple(shape), array)], model_version)
    if len(variable) > 1:
        raise invalid(f"The shape of the raw input '{spec.name}' can not be deduced because there are more than one "
                      "variable-sized dimension")
    dtype = numpy_dtype(spec.datatype)
    fixed = math.prod(d for d in shape if d >= 0)
    if variable:
        shape[variable[0]] = len(data) // (fixed * dtype.itemsize) if fixed else 0
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise invalid(f"raw input '{spec.name}' of model '{config.name}' has {len(data)} bytes, which is no shape "
                      f"{_shape_text(shape, variable)} of {spec.datatype} ({dtype.itemsize} bytes an element)")
    check_shape(spec.name, shape, max_elements)
    array = np.frombuffer(data, dtype=dtype.newbyteorder("<")).reshape(shape)
    return InferRequest(model_name, [InferTensor(spec.name, spec.datatype, tuple(shape), array)], model_version)


def _shape_text(shape: list[int], variable: list[int]) -> str:
    return "[" + ", ".join("-1" if i in variable else str(d) for i, d in enumerate(shape)) + "]"


def _parse_header_length(value: str, body_length: int) -> int:
    try:
        length = int(value)
    except ValueError:
        raise invalid(f"{INFER_HEADER_CONTENT_LENGTH} must be an integer, got {value!r}") from None
    if not 0 < length <= body_length:
        raise invalid(f"{INFER_HEADER_CONTENT_LENGTH} is {length} but the body has {body_length} bytes")
    return length


def parameters_object(value: Any, where: str) -> dict[str, Any]:
    """A request's optional `parameters`: a JSON object, or {} when absent."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(f"{where} 'parameters' must be a JSON object")
    return value


def _non_negative_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _requested_outputs(value: Any) -> list[RequestedOutput] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid("'outputs' must be a JSON array")
    outputs = []
    for index, item in enumerate(value):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise invalid(f"outputs[{index}] must be an object with a string 'name'")
        params = parameters_object(item.get("parameters"), f"output '{item['name']}'")
        if not isinstance(params.get("binary_data", False), bool):
            raise invalid(f"output '{item['name']}': parameter 'binary_data' must be a boolean")
        shm = None
        if "shared_memory_region" in params:
            if "classification" in params:
                raise invalid("Output can't set both 'shared_memory_region' and 'classification'")
            if params.get("binary_data"):
                raise invalid("Output can't set both 'shared_memory_region' and 'binary_data'")
            shm = shm_ref_of(params, f"output '{item['name']}'")
        outputs.append(RequestedOutput(item["name"], params, shm))
    return outputs


def _decode_input(item: Any, index: int, view: memoryview, offset: int,
                  binary_section: bool, max_elements: int) -> tuple[InferTensor, int]:
    """One request input; returns the tensor and the offset of the next input's binary data."""
    if not isinstance(item, dict):
        raise invalid(f"inputs[{index}] must be a JSON object")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"inputs[{index}] needs a string 'name'")
    datatype = item.get("datatype")
    if datatype not in KSERVE_DATATYPES:
        raise invalid(f"input '{name}': unknown datatype {datatype!r}; expected one of {sorted(KSERVE_DATATYPES)}")
    shape = item.get("shape")
    if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise invalid(f"input '{name}': 'shape' must be an array of non-negative integers, got {shape!r}")
    count = check_shape(name, shape, max_elements)
    params = parameters_object(item.get("parameters"), f"input '{name}'")
    size = params.get("binary_data_size")
    if "shared_memory_region" in params:
        if size is not None or "data" in item:
            raise invalid("Input must set only one of the following fields: 'data', 'binary_data_size' in "
                          "'parameters', 'shared_memory_region' in 'parameters'. But set " +
                          " ".join(f"'{k}'" for k, there in (("data", "data" in item),
                                                             ("binary_data_size", size is not None),
                                                             ("shared_memory_region", True)) if there))
        return InferTensor(name, datatype, tuple(shape), NO_DATA, shm_ref_of(params, f"input '{name}'")), offset

    if size is None:
        if "data" not in item:
            raise invalid(f"input '{name}' has neither 'data' nor a 'binary_data_size' parameter")
        return InferTensor(name, datatype, tuple(shape), _from_json(name, datatype, shape, count, item["data"])), offset

    size = _non_negative_int(size, f"input '{name}': parameter 'binary_data_size'")
    if offset == len(view) and size and not binary_section:
        raise invalid(f"input '{name}' has a binary_data_size parameter but the request has no "
                       f"{INFER_HEADER_CONTENT_LENGTH} header")
    if "data" in item:
        raise invalid(f"input '{name}' has both 'data' and a 'binary_data_size' parameter")
    end = offset + size
    if end > len(view):
        raise invalid(f"input '{name}': binary_data_size is {size} bytes but only {len(view) - offset} bytes "
                       f"of binary data are left in the body")
    array = _from_binary(name, datatype, shape, count, view[offset:end])
    return InferTensor(name, datatype, tuple(shape), array), end


def _from_binary(name: str, datatype: str, shape: list[int], count: int, buf: memoryview) -> np.ndarray:
    if datatype == "BYTES":
        return _decode_bytes_elements(name, count, buf).reshape(shape)
    dtype = _WIRE_DTYPES[datatype]
    if len(buf) != count * dtype.itemsize:
        raise invalid(f"input '{name}': binary_data_size is {len(buf)} bytes but shape {shape} of {datatype} "
                       f"needs {count * dtype.itemsize}")
    array = np.frombuffer(buf, dtype=dtype)  # a view into the request body: no copy
    if datatype == "BOOL" and count and array.view(np.uint8).max() > 1:
        raise invalid(f"input '{name}': BOOL elements must be bytes 0 or 1")
    return array.reshape(shape)


def _decode_bytes_elements(name: str, count: int, buf: memoryview) -> np.ndarray:
    try:
        return decode_bytes_elements(buf, count)
    except ValueError as e:
        raise invalid(f"input '{name}': {e}") from None


def _object_array(items: list[Any]) -> np.ndarray:
    array = np.empty(len(items), dtype=object)  # not np.array(items): that would try to nest sequences
    array[:] = items
    return array


def _from_json(name: str, datatype: str, shape: list[int], count: int, data: Any) -> np.ndarray:
    """`data` as a flat or nested JSON array in row-major order."""
    if not isinstance(data, list):
        raise invalid(f"input '{name}': 'data' must be a JSON array")
    if datatype == "BYTES":
        array = _bytes_from_json(name, data)
    else:
        array = _numbers_from_json(name, datatype, data)
    if array.size != count:
        raise invalid(f"input '{name}': shape {shape} has {count} elements but 'data' holds {array.size}")
    return array.reshape(shape)


def _numbers_from_json(name: str, datatype: str, data: list) -> np.ndarray:
    try:
        parsed = np.array(data)  # let numpy infer the kind first, so "1.5" or 1.5 into INT64 is caught, not cast
    except ValueError:
        raise invalid(f"input '{name}': 'data' is a ragged nested array") from None
    dtype = _WIRE_DTYPES[datatype]
    if parsed.size == 0:
        return parsed.astype(dtype)
    if parsed.dtype.kind not in _JSON_KINDS[datatype]:
        got = _KIND_NAMES.get(parsed.dtype.kind, str(parsed.dtype))
        raise invalid(f"input '{name}': datatype {datatype} needs {_KIND_NAMES[_JSON_KINDS[datatype][-1]]} "
                       f"in 'data', got {got}")
    if dtype.kind in "iu" and parsed.dtype != dtype:
        info = np.iinfo(dtype)
        if parsed.min() < info.min or parsed.max() > info.max:
            raise invalid(f"input '{name}': 'data' has values outside the range of {datatype}")
    return parsed.astype(dtype, copy=False)


def _bytes_from_json(name: str, data: list) -> np.ndarray:
    flat: list[bytes] = []
    stack = [iter(data)]
    while stack:  # iterative flatten: nesting depth is client-controlled
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            if not isinstance(item, str):
                raise invalid(f"input '{name}': BYTES elements in 'data' must be strings, got {item!r}")
            flat.append(item.encode())
        else:
            stack.pop()
    return _object_array(flat)


# ---------------------------------------------------------------------------------------------------------------------
# Infer response encoding
# ---------------------------------------------------------------------------------------------------------------------
class EncodedResponse:
    """An answer's body and what its HTTP head says of it. Read only. A plain class (one per answer; compiled, a
    dataclass's generated __init__ would stay interpreted)."""
    __slots__ = ("body", "content_type", "headers")

    def __init__(self, body: AnswerBody, content_type: str, headers: dict[str, str]) -> None:
        self.body = body  # a view of the bytes where a JSON child encoded it
        self.content_type = content_type
        self.headers = headers


def encode_infer_response(response: InferResponse, request: InferRequest) -> EncodedResponse:
    """JSON, or JSON header + binary tensor data as tritonclient's InferResult reads it.

    An output is binary when its requested output says `binary_data: true`, else when the request says
    `binary_data_output: true` (tritonclient sets the latter when no outputs are named).
    """
    plan = request.signature
    if type(plan) is not _BinaryPlan or response.parameters:
        return _encode_infer_response(response, request)[0]
    key = (response.model_name, response.model_version, response.id,
           tuple([(t.name, t.datatype, t.shape) for t in response.outputs]))
    header = plan.answers.get(key)
    if header is None:
        encoded, header = _encode_infer_response(response, request)
        if header is not None and len(plan.answers) < 8:
            plan.answers[key] = header
        return encoded
    # .data: the arrays' buffers as memoryviews (numpy's stubs declare ndarray a buffer only for Python >= 3.12)
    return EncodedResponse(b"".join([header, *[_wire_array(t).data for t in response.outputs]]), _OCTET_STREAM,
                           {INFER_HEADER_CONTENT_LENGTH: str(len(header))})


_JSON_BYTES_PER_ELEMENT = 8  # about what a number takes in JSON (a float32 ~11, a small integer 2)


def json_request_offloaded(body_bytes: int, header_length: str | None, offload_bytes: int) -> bool:
    """Whether a body's JSON part is at least `offload_bytes` long (gpud.api.json_codec decodes it in a child). A
    malformed header length is not: it is refused at once on the loop. Here, compiled, not in the codec's module:
    asked of every request."""
    if body_bytes < offload_bytes:
        return False
    if header_length is None:
        return True
    return header_length.isdigit() and int(header_length) >= offload_bytes


def json_response_offloaded(response: InferResponse, request: InferRequest, offload_bytes: int) -> bool:
    """Whether this answer would write about `offload_bytes` of JSON (binary outputs cost a copy, no more): encoded
    in a child (gpud.api.json_codec). Asked of every answer."""
    bar = offload_bytes / _JSON_BYTES_PER_ELEMENT
    elements = 0
    for t in response.outputs:
        elements += t.data.size
    if elements < bar:
        return False  # under the bar even if every output were JSON (the usual small answer: asked first)
    return json_output_elements(response, request) >= bar


def json_output_elements(response: InferResponse, request: InferRequest) -> int:
    """How many elements of `response` would be written as JSON numbers or strings (its non-binary outputs)."""
    default_binary = request.parameters.get("binary_data_output", False)
    per_output = {o.name: o.parameters.get("binary_data") for o in request.outputs} if request.outputs else {}
    return sum(t.data.size for t in response.outputs
               if t.shm is None and not (default_binary if per_output.get(t.name) is None else per_output[t.name]))


def _encode_infer_response(response: InferResponse, request: InferRequest) -> tuple[EncodedResponse, bytes | None]:
    """The encoded response, and its JSON header when another response with the same outputs' names, datatypes and
    shapes has that same header (every output binary and none BYTES, whose size depends on the data)."""
    default_binary = request.parameters.get("binary_data_output", False)
    per_output = {o.name: o.parameters.get("binary_data") for o in request.outputs} if request.outputs else {}
    outputs_json: list[dict[str, Any]] = []
    buffers: list[Any] = []
    reusable = True
    finite = True
    for tensor in response.outputs:
        binary = per_output.get(tensor.name)
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if tensor.shm is not None:  # written into the client's region: no data here (as Triton)
            reusable = False
        elif default_binary if binary is None else binary:
            data, nbytes = _binary_output(tensor)
            entry["parameters"] = {"binary_data_size": nbytes}
            buffers.append(data)
            reusable = reusable and tensor.datatype != "BYTES"
        else:
            data = entry["data"] = _json_output(tensor)
            reusable = False
            if finite and isinstance(data, np.ndarray) and data.dtype.kind == "f" and not np.isfinite(data).all():
                finite = False
        outputs_json.append(entry)

    doc: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id or request.id:
        doc["id"] = response.id or request.id
    if response.parameters:
        doc["parameters"] = response.parameters
    doc["outputs"] = outputs_json
    header = orjson.dumps(doc, option=_OPT_NUMPY) if finite else _dumps_non_finite(doc)
    if not buffers:
        return EncodedResponse(header, JSON, {}), None
    # One copy: join reads the arrays' buffers directly (no tobytes()).
    return (EncodedResponse(b"".join([header, *buffers]), _OCTET_STREAM,
                            {INFER_HEADER_CONTENT_LENGTH: str(len(header))}), header if reusable else None)


def _dumps_non_finite(doc: dict[str, Any]) -> bytes:
    """`doc` with NaN, Infinity and -Infinity where its numbers are not finite, as Triton writes them (RapidJSON's
    kWriteNanAndInfFlag) and Python's json and tritonclient read them back; orjson would write null, which reads back
    as NaN at best: an infinity lost. Only for answers that hold such numbers (the stdlib is slower)."""
    return json.dumps(doc, default=_as_list, separators=(",", ":"), allow_nan=True).encode()


def _as_list(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot write a {type(value).__name__} as JSON")


def _wire_array(tensor: InferTensor) -> np.ndarray:
    """C-contiguous, little-endian, of the tensor's datatype: no copy when it already is (the usual case)."""
    dtype = _WIRE_DTYPES.get(tensor.datatype)
    if dtype is None:
        raise InferenceError(ErrorKind.INTERNAL, f"output '{tensor.name}' has unknown datatype {tensor.datatype!r}")
    return np.ascontiguousarray(tensor.data, dtype=dtype).reshape(-1)


def _binary_output(tensor: InferTensor) -> tuple[Any, int]:
    if tensor.datatype == "BYTES":
        data = encode_bytes_elements(tensor.data)
        return data, len(data)
    array = _wire_array(tensor)
    return array, array.nbytes


def _json_output(tensor: InferTensor) -> Any:
    if tensor.datatype != "BYTES":
        return _wire_array(tensor)  # orjson serializes the numpy array itself (OPT_SERIALIZE_NUMPY)
    try:
        return [item.decode() if isinstance(item, (bytes, bytearray)) else str(item)
                for item in np.asarray(tensor.data, dtype=object).reshape(-1)]
    except UnicodeDecodeError:
        raise invalid(f"output '{tensor.name}' holds bytes that are not UTF-8 text; "
                       f"request it with the 'binary_data' parameter") from None
