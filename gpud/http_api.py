"""KServe v2 HTTP front end, wire-compatible with Triton, `tritonclient.http` and `perf_analyzer`.

A thin aiohttp adapter over one `InferenceCore`: it only translates the wire format. Routes follow Triton's HTTP server
(`src/http_server.cc`) and protocol extensions (binary tensor data, statistics, model configuration, model repository):

    GET  /v2/health/live | /v2/health/ready                 200, or 400 when not live/ready (empty body, as Triton)
    GET  /v2                                                 server metadata
    GET  /v2/models/{m}[/versions/{v}]                       model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready                 200, or 400 {"error"} when not ready
    GET  /v2/models/{m}[/versions/{v}]/config                Triton ModelConfig as JSON
    GET  /v2/models[/{m}[/versions/{v}]]/stats               statistics extension
    POST /v2/models/{m}[/versions/{v}]/infer                 JSON and binary tensor data
    POST /v2/repository/index                                body empty or {"ready": bool}
    POST /v2/repository/models/{m}/load | /unload
    GET  /v2/gpud/inspect                                    gpud's own view (`gpudctl inspect`)
    POST /v2/gpud/placement                                  apply a placement (`gpudctl place --apply`)

Errors are `{"error": "<message>"}` with the status Triton uses (`HttpCodeFromError`): INVALID_ARGUMENT 400,
NOT_FOUND 404, UNAVAILABLE 503, INTERNAL 500; unknown routes 404, wrong method 405, oversized bodies 413.

Hot-path notes. The request body is read once (a single chunk is not copied at all); the JSON header is parsed by
orjson straight from a memoryview; binary inputs become `np.frombuffer` views into the body (read-only, possibly
unaligned; no copy); JSON outputs are serialized by orjson from the numpy array (no `tolist()`); binary outputs are
joined with the header into the body in one copy. TCP_NODELAY: aiohttp sets it on every accepted connection
(`aiohttp.base_protocol.BaseProtocol.connection_made` calls `tcp_nodelay(transport, True)`), so we don't.
"""
from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from executor.bytes_tensor import decode_bytes_elements, encode_bytes_elements
from executor.model_config import KSERVE_DATATYPES, numpy_dtype
from executor.types import ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor, RequestedOutput
from gpud.core_api import InferenceCore

log = logging.getLogger(__name__)

INFER_HEADER_CONTENT_LENGTH = "Inference-Header-Content-Length"
_JSON = "application/json"
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


class HttpError(Exception):
    """An error with an HTTP status outside ErrorKind (413, 404 route, 405); the message goes to the client."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _invalid(message: str) -> InferenceError:
    return InferenceError(ErrorKind.INVALID_ARGUMENT, message)


# ---------------------------------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------------------------------
def _json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type=_JSON)


def _error_response(status: int, message: str) -> web.Response:
    return _json_response({"error": message}, status)


@web.middleware
async def _error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Every failure becomes `{"error": ...}` so clients (tritonclient reads `error`) never see an HTML page."""
    try:
        return await handler(request)
    except InferenceError as e:
        return _error_response(e.http_status, e.message)
    except HttpError as e:
        return _error_response(e.status, e.message)
    except web.HTTPException as e:  # raised by aiohttp's router for unknown routes and wrong methods
        if e.status < 400:
            raise
        if e.status == 404:
            return _error_response(404, f"no route for {request.method} {request.path}")
        if e.status == 405:
            return _error_response(405, f"method {request.method} not allowed for {request.path}")
        return _error_response(e.status, e.text or e.reason)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # a bug somewhere below us: answer 500 and keep serving
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return _error_response(500, f"internal error: {type(e).__name__}: {e}")


# ---------------------------------------------------------------------------------------------------------------------
# Request bodies
# ---------------------------------------------------------------------------------------------------------------------
def _too_large(size: int, limit: int) -> HttpError:
    return HttpError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes")


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, at most `limit` bytes. Checks Content-Length before reading anything.

    Not `request.read()`: it copies twice (into a bytearray, then to bytes). `readexactly` of a body that arrived
    in one chunk returns that chunk itself. A compressed body (Content-Encoding, which aiohttp inflates) or a chunked
    one has no usable length, so it is read to the end and counted.
    """
    length = request.content_length
    if length is not None and length > limit:
        raise _too_large(length, limit)
    try:
        if length is not None and _content_encoding(request) is None:
            return await request.content.readexactly(length)
        chunks: list[bytes] = []
        size = 0
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
        return b"".join(chunks)
    except asyncio.IncompleteReadError as e:
        raise _invalid(f"request body ended after {len(e.partial)} of {length} bytes") from None
    except web.RequestPayloadError as e:  # e.g. a body that does not inflate with its Content-Encoding
        raise _invalid(f"cannot read the request body: {str(e).replace(chr(10), ' ')}") from None


def _content_encoding(request: web.Request) -> str | None:
    encoding = request.headers.get("Content-Encoding")
    return None if encoding in (None, "", "identity") else encoding


def _loads(data: bytes | memoryview, what: str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise _invalid(f"malformed JSON in {what}: {e}") from None


def _optional_json_object(body: bytes, what: str) -> dict[str, Any]:
    """Bodies of the repository endpoints: empty means all defaults (as Triton)."""
    if not body.strip():
        return {}
    doc = _loads(body, what)
    if not isinstance(doc, dict):
        raise _invalid(f"{what} must be a JSON object")
    return doc


# ---------------------------------------------------------------------------------------------------------------------
# Infer request decoding: JSON header + optional binary tensor data
# ---------------------------------------------------------------------------------------------------------------------
def decode_infer_request(body: bytes, header_length: str | None, model_name: str, model_version: str) -> InferRequest:
    """Parse a KServe v2 infer request body. `header_length` is the Inference-Header-Content-Length header, if any."""
    view = memoryview(body)
    json_end = len(body) if header_length is None else _parse_header_length(header_length, len(body))
    doc = _loads(view[:json_end], "inference request")
    if not isinstance(doc, dict):
        raise _invalid("inference request must be a JSON object")
    inputs_json = doc.get("inputs")
    if not isinstance(inputs_json, list) or not inputs_json:
        raise _invalid("inference request needs a non-empty 'inputs' array")

    inputs: list[InferTensor] = []
    offset = json_end  # binary tensor data follows the JSON, in input order
    for index, item in enumerate(inputs_json):
        tensor, offset = _decode_input(item, index, view, offset, header_length is not None)
        inputs.append(tensor)
    if offset != len(body):
        raise _invalid(f"request has {len(body) - json_end} bytes of binary tensor data but the inputs' "
                       f"binary_data_size parameters add up to {offset - json_end}")

    params = _parameters(doc.get("parameters"), "request")
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise _invalid("request 'id' must be a string")
    if not isinstance(params.get("binary_data_output", False), bool):
        raise _invalid("parameter 'binary_data_output' must be a boolean")
    return InferRequest(
        model_name=model_name, model_version=model_version, inputs=inputs, id=request_id,
        outputs=_requested_outputs(doc.get("outputs")),
        priority=_non_negative_int(params.get("priority", 0), "parameter 'priority'"),
        timeout_us=_non_negative_int(params.get("timeout", 0), "parameter 'timeout' (microseconds)"),
        parameters=params,
    )


def _parse_header_length(value: str, body_length: int) -> int:
    try:
        length = int(value)
    except ValueError:
        raise _invalid(f"{INFER_HEADER_CONTENT_LENGTH} must be an integer, got {value!r}") from None
    if not 0 < length <= body_length:
        raise _invalid(f"{INFER_HEADER_CONTENT_LENGTH} is {length} but the body has {body_length} bytes")
    return length


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _invalid(f"{where} 'parameters' must be a JSON object")
    return value


def _non_negative_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _invalid(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _requested_outputs(value: Any) -> list[RequestedOutput] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _invalid("'outputs' must be a JSON array")
    outputs = []
    for index, item in enumerate(value):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise _invalid(f"outputs[{index}] must be an object with a string 'name'")
        params = _parameters(item.get("parameters"), f"output '{item['name']}'")
        if not isinstance(params.get("binary_data", False), bool):
            raise _invalid(f"output '{item['name']}': parameter 'binary_data' must be a boolean")
        outputs.append(RequestedOutput(item["name"], params))
    return outputs


def _decode_input(item: Any, index: int, view: memoryview, offset: int,
                  binary_section: bool) -> tuple[InferTensor, int]:
    """One request input; returns the tensor and the offset of the next input's binary data."""
    if not isinstance(item, dict):
        raise _invalid(f"inputs[{index}] must be a JSON object")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise _invalid(f"inputs[{index}] needs a string 'name'")
    datatype = item.get("datatype")
    if datatype not in KSERVE_DATATYPES:
        raise _invalid(f"input '{name}': unknown datatype {datatype!r}; expected one of {sorted(KSERVE_DATATYPES)}")
    shape = item.get("shape")
    if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise _invalid(f"input '{name}': 'shape' must be an array of non-negative integers, got {shape!r}")
    count = math.prod(shape)
    params = _parameters(item.get("parameters"), f"input '{name}'")
    size = params.get("binary_data_size")

    if size is None:
        if "shared_memory_region" in params:
            raise _invalid(f"input '{name}': shared memory inputs are not supported")
        if "data" not in item:
            raise _invalid(f"input '{name}' has neither 'data' nor a 'binary_data_size' parameter")
        return InferTensor(name, datatype, tuple(shape), _from_json(name, datatype, shape, count, item["data"])), offset

    size = _non_negative_int(size, f"input '{name}': parameter 'binary_data_size'")
    if offset == len(view) and size and not binary_section:
        raise _invalid(f"input '{name}' has a binary_data_size parameter but the request has no "
                       f"{INFER_HEADER_CONTENT_LENGTH} header")
    if "data" in item:
        raise _invalid(f"input '{name}' has both 'data' and a 'binary_data_size' parameter")
    end = offset + size
    if end > len(view):
        raise _invalid(f"input '{name}': binary_data_size is {size} bytes but only {len(view) - offset} bytes "
                       f"of binary data are left in the body")
    array = _from_binary(name, datatype, shape, count, view[offset:end])
    return InferTensor(name, datatype, tuple(shape), array), end


def _from_binary(name: str, datatype: str, shape: list[int], count: int, buf: memoryview) -> np.ndarray:
    if datatype == "BYTES":
        return _decode_bytes_elements(name, count, buf).reshape(shape)
    dtype = _WIRE_DTYPES[datatype]
    if len(buf) != count * dtype.itemsize:
        raise _invalid(f"input '{name}': binary_data_size is {len(buf)} bytes but shape {shape} of {datatype} "
                       f"needs {count * dtype.itemsize}")
    array = np.frombuffer(buf, dtype=dtype)  # a view into the request body: no copy
    if datatype == "BOOL" and count and array.view(np.uint8).max() > 1:
        raise _invalid(f"input '{name}': BOOL elements must be bytes 0 or 1")
    return array.reshape(shape)


def _decode_bytes_elements(name: str, count: int, buf: memoryview) -> np.ndarray:
    try:
        return decode_bytes_elements(buf, count)
    except ValueError as e:
        raise _invalid(f"input '{name}': {e}") from None


def _object_array(items: list[Any]) -> np.ndarray:
    array = np.empty(len(items), dtype=object)  # not np.array(items): that would try to nest sequences
    array[:] = items
    return array


def _from_json(name: str, datatype: str, shape: list[int], count: int, data: Any) -> np.ndarray:
    """`data` as a flat or nested JSON array in row-major order."""
    if not isinstance(data, list):
        raise _invalid(f"input '{name}': 'data' must be a JSON array")
    if datatype == "BYTES":
        array = _bytes_from_json(name, data)
    else:
        array = _numbers_from_json(name, datatype, data)
    if array.size != count:
        raise _invalid(f"input '{name}': shape {shape} has {count} elements but 'data' holds {array.size}")
    return array.reshape(shape)


def _numbers_from_json(name: str, datatype: str, data: list) -> np.ndarray:
    try:
        parsed = np.array(data)  # let numpy infer the kind first, so "1.5" or 1.5 into INT64 is caught, not cast
    except ValueError:
        raise _invalid(f"input '{name}': 'data' is a ragged nested array") from None
    dtype = _WIRE_DTYPES[datatype]
    if parsed.size == 0:
        return parsed.astype(dtype)
    if parsed.dtype.kind not in _JSON_KINDS[datatype]:
        got = _KIND_NAMES.get(parsed.dtype.kind, str(parsed.dtype))
        raise _invalid(f"input '{name}': datatype {datatype} needs {_KIND_NAMES[_JSON_KINDS[datatype][-1]]} "
                       f"in 'data', got {got}")
    if dtype.kind in "iu" and parsed.dtype != dtype:
        info = np.iinfo(dtype)
        if parsed.min() < info.min or parsed.max() > info.max:
            raise _invalid(f"input '{name}': 'data' has values outside the range of {datatype}")
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
                raise _invalid(f"input '{name}': BYTES elements in 'data' must be strings, got {item!r}")
            flat.append(item.encode())
        else:
            stack.pop()
    return _object_array(flat)


# ---------------------------------------------------------------------------------------------------------------------
# Infer response encoding
# ---------------------------------------------------------------------------------------------------------------------
def encode_infer_response(response: InferResponse, request: InferRequest) -> web.Response:
    """JSON, or JSON header + binary tensor data as tritonclient's InferResult reads it.

    An output is binary when its requested output says `binary_data: true`, else when the request says
    `binary_data_output: true` (tritonclient sets the latter when no outputs are named).
    """
    default_binary = request.parameters.get("binary_data_output", False)
    per_output = {o.name: o.parameters.get("binary_data") for o in request.outputs} if request.outputs else {}
    outputs_json: list[dict[str, Any]] = []
    buffers: list[Any] = []
    for tensor in response.outputs:
        binary = per_output.get(tensor.name)
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if default_binary if binary is None else binary:
            data, nbytes = _binary_output(tensor)
            entry["parameters"] = {"binary_data_size": nbytes}
            buffers.append(data)
        else:
            entry["data"] = _json_output(tensor)
        outputs_json.append(entry)

    doc: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id or request.id:
        doc["id"] = response.id or request.id
    if response.parameters:
        doc["parameters"] = response.parameters
    doc["outputs"] = outputs_json
    header = orjson.dumps(doc, option=_OPT_NUMPY)
    if not buffers:
        return web.Response(body=header, content_type=_JSON)
    # One copy: join reads the arrays' buffers directly (no tobytes()).
    return web.Response(body=b"".join([header, *buffers]), content_type=_OCTET_STREAM,
                        headers={INFER_HEADER_CONTENT_LENGTH: str(len(header))})


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
        raise _invalid(f"output '{tensor.name}' holds bytes that are not UTF-8 text; "
                       f"request it with the 'binary_data' parameter") from None


# ---------------------------------------------------------------------------------------------------------------------
# Handlers
# ---------------------------------------------------------------------------------------------------------------------
class _Handlers:
    """Route handlers bound to one core; each translates one endpoint and nothing more."""

    def __init__(self, core: InferenceCore, max_body_bytes: int):
        self.core = core
        self.max_body_bytes = max_body_bytes

    async def live(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.core.server_live() else 400)

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.core.server_ready() else 400)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return _json_response(self.core.server_metadata())

    async def model_metadata(self, request: web.Request) -> web.Response:
        name, version = _model_route(request)
        return _json_response(self.core.model_metadata(name, version))

    async def model_ready(self, request: web.Request) -> web.Response:
        name, version = _model_route(request)
        if self.core.model_ready(name, version):
            return web.Response(status=200)
        return _error_response(400, f"model '{name}' version '{version}' is not ready" if version
                               else f"model '{name}' is not ready")

    async def model_config(self, request: web.Request) -> web.Response:
        name, version = _model_route(request)
        return _json_response(self.core.model_config(name, version))

    async def model_stats(self, request: web.Request) -> web.Response:
        name = request.match_info.get("model", "")
        return _json_response(self.core.model_statistics(name, request.match_info.get("version", "")))

    async def repository_index(self, request: web.Request) -> web.Response:
        doc = _optional_json_object(await _read_body(request, self.max_body_bytes), "repository index request")
        ready = doc.get("ready", False)
        if not isinstance(ready, bool):
            raise _invalid(f"repository index 'ready' must be a boolean, got {ready!r}")
        return _json_response(self.core.repository_index(ready_only=ready))

    async def load(self, request: web.Request) -> web.Response:
        doc = _optional_json_object(await _read_body(request, self.max_body_bytes), "model load request")
        params = _parameters(doc.get("parameters"), "load request")
        overrides = sorted(k for k in params if k == "config" or k.startswith("file:"))
        if overrides:  # Triton would load from the override; silently loading the repository copy would mislead
            raise _invalid(f"loading with overrides {overrides} is not supported; load from the model repository")
        await self.core.load_model(request.match_info["model"])
        return web.Response(status=200)

    async def unload(self, request: web.Request) -> web.Response:
        await _read_body(request, self.max_body_bytes)  # {"parameters": {"unload_dependents": ...}}: no ensembles
        await self.core.unload_model(request.match_info["model"])
        return web.Response(status=200)

    async def inspect(self, request: web.Request) -> web.Response:
        return _json_response(self.core.inspect())

    async def apply_placement(self, request: web.Request) -> web.Response:
        doc = _optional_json_object(await _read_body(request, self.max_body_bytes), "placement")
        return _json_response(await self.core.apply_placement(doc.get("placements")))

    async def infer(self, request: web.Request) -> web.Response:
        body = await _read_body(request, self.max_body_bytes)
        name, version = _model_route(request)
        infer_request = decode_infer_request(body, request.headers.get(INFER_HEADER_CONTENT_LENGTH), name, version)
        response = await self.core.infer(infer_request)
        return encode_infer_response(response, infer_request)


def _model_route(request: web.Request) -> tuple[str, str]:
    info = request.match_info
    return info["model"], info.get("version", "")


def make_app(core: InferenceCore, *, max_body_bytes: int = 64 * 2**20) -> web.Application:
    """The aiohttp application serving `core` over KServe v2 HTTP."""
    h = _Handlers(core, max_body_bytes)
    app = web.Application(middlewares=[_error_middleware], client_max_size=max_body_bytes)
    r = app.router
    # Infer first: the router tries routes in order, and this is the one hot route.
    r.add_post("/v2/models/{model}/infer", h.infer)
    r.add_post("/v2/models/{model}/versions/{version}/infer", h.infer)
    r.add_get("/v2/health/live", h.live)
    r.add_get("/v2/health/ready", h.ready)
    r.add_get("/v2", h.server_metadata)
    r.add_get("/v2/gpud/inspect", h.inspect)
    r.add_post("/v2/gpud/placement", h.apply_placement)
    r.add_get("/v2/models/stats", h.model_stats)  # before /v2/models/{model}: "stats" is not a model name here
    r.add_post("/v2/repository/index", h.repository_index)
    r.add_post("/v2/repository/models/{model}/load", h.load)
    r.add_post("/v2/repository/models/{model}/unload", h.unload)
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        r.add_get(prefix, h.model_metadata)
        r.add_get(prefix + "/ready", h.model_ready)
        r.add_get(prefix + "/config", h.model_config)
        r.add_get(prefix + "/stats", h.model_stats)
    return app


async def start_http_server(core: InferenceCore, host: str, port: int, **kw: Any) -> tuple[web.AppRunner, int]:
    """Serve `core` on host:port (0 = an ephemeral port). Returns the runner (`await runner.cleanup()` stops it)
    and the bound port. `kw` goes to make_app."""
    # No access log: formatting a line per request costs more than the rest of a small request's handling.
    runner = web.AppRunner(make_app(core, **kw), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    return runner, runner.addresses[0][1]
