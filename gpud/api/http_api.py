"""KServe v2 HTTP front end, wire-compatible with Triton, `tritonclient.http` and `perf_analyzer`.

A thin adapter over one `InferenceCore` served by `gpud.api.http_server` (httptools): it only translates the wire
format. Routes follow Triton's HTTP server
(`src/http_server.cc`) and protocol extensions (binary tensor data, statistics, model configuration, model repository,
shared memory, logging):

    GET  /v2/health/live | /v2/health/ready                 200, or 400 when not live/ready (empty body, as Triton)
    GET  /v2                                                 server metadata
    GET  /v2/models/{m}[/versions/{v}]                       model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready                 200, or 400 {"error"} when not ready
    GET  /v2/models/{m}[/versions/{v}]/config                Triton ModelConfig as JSON
    GET  /v2/models[/{m}[/versions/{v}]]/stats               statistics extension
    POST /v2/models/{m}[/versions/{v}]/infer                 JSON and binary tensor data
    POST /v2/repository/index                                body empty or {"ready": bool}
    POST /v2/repository/models/{m}/load | /unload
    GET  /v2/logging | POST /v2/logging                      logging extension (POST with settings: an admin action)
    GET  /v2/gpud/inspect                                    gpud's own view (`gpudctl inspect`)
    POST /v2/gpud/placement                                  apply a placement (`gpudctl place --apply`)

Errors are `{"error": "<message>"}` with the status Triton uses (`HttpCodeFromError`): INVALID_ARGUMENT 400,
NOT_FOUND 404, UNAVAILABLE 503, INTERNAL 500; unknown routes 404, wrong method 405, oversized bodies 413.

An inference is handed to the core with `submit` and answered from its completion callback: no task or future
per request. Its bodies are decoded and encoded by `gpud.api.http_infer`.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import orjson

from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferResponse
from gpud.api.http_encode import (applied_json, model_config_json, model_metadata_json, model_statistics_json,
                                  placements_from_json, repository_index_json, server_metadata_json)
from gpud.api.http_infer import (INFER_HEADER_CONTENT_LENGTH, EncodedResponse, decode_infer_request, decode_raw_request,
                                 encode_infer_response, invalid, is_raw_request, json_request_offloaded,
                                 json_response_offloaded, parameters_object)
from gpud.api.http_server import JSON, Body, HttpRequest, HttpServer, Respond, error_body
from gpud.api.admin import AdminAuth
from gpud.repository.overrides import override_of
from gpud.api.json_codec import JsonCodecPool
from gpud.api.limits import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_TENSOR_ELEMENTS
from gpud.core_api import InferenceCore

log = logging.getLogger(__name__)


def _json_body(obj: Any) -> bytes:
    return orjson.dumps(obj)


def _optional_json_object(body: Body, what: str) -> dict[str, Any]:
    """Bodies of the repository endpoints: empty means all defaults (as Triton)."""
    body = bytes(body)  # at most MAX_CONTROL_BODY_BYTES (a load: --max-request-bytes); maybe the server's buffer
    if not body.strip():
        return {}
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise invalid(f"malformed JSON in {what}: {e}") from None
    if not isinstance(doc, dict):
        raise invalid(f"{what} must be a JSON object")
    return doc


# ---------------------------------------------------------------------------------------------------------------------
# Routing and handlers
# ---------------------------------------------------------------------------------------------------------------------
# Triton's HttpCodeFromError
HTTP_STATUS: dict[ErrorKind, int] = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.INTERNAL: 500,
    ErrorKind.PERMISSION_DENIED: 403,
    ErrorKind.UNAUTHENTICATED: 401,
    ErrorKind.UNSUPPORTED: 501,
    ErrorKind.ALREADY_EXISTS: 400,
}
_Reply = tuple[int, bytes]  # status and JSON body (b"": an empty answer)
_Route = tuple[dict[str, Callable[..., Any]], tuple[Any, ...]]  # handlers by method, path arguments
_ROUTE_CACHE_SIZE = 4096
# Bodies of the routes other than infer (repository, placement) are small documents, parsed on the event loop:
# bounded well below --max-request-bytes, so that no such body can hold the loop for long. A model load is the
# exception: its `file:` parameters carry a model's files (base64, as Triton), so it takes up to --max-request-bytes,
# read once its caller is known to be allowed to load (an admin action, rare).
MAX_CONTROL_BODY_BYTES = 1 << 20


class HttpApi:
    """The routes above over one core, as an `http_server.Handler`. Sync handlers return a reply; the repository and
    placement ones are coroutines (one task each); infer answers from the core's completion callback."""

    def __init__(self, core: InferenceCore, admin: AdminAuth | None = None,
                 max_tensor_elements: int = DEFAULT_MAX_TENSOR_ELEMENTS, json_codec: JsonCodecPool | None = None):
        self.core = core
        self.admin = admin or AdminAuth()
        self.max_tensor_elements = max_tensor_elements
        self.json_codec = json_codec  # None: every body is decoded, and every answer encoded, on the loop
        self._tasks: set[asyncio.Task] = set()
        self._static: dict[str, dict[str, Callable[..., Any]]] = {
            "/v2/health/live": {"GET": self.live},
            "/v2/health/ready": {"GET": self.ready},
            "/v2": {"GET": self.server_metadata},
            "/v2/gpud/inspect": {"GET": self.inspect},
            "/v2/gpud/placement": {"POST": self.apply_placement},
            "/v2/models/stats": {"GET": self.model_stats},  # "stats" is not a model name here
            "/v2/repository/index": {"POST": self.repository_index},
            "/v2/logging": {"GET": self.log_settings, "POST": self.update_log_settings},
            "/v2/trace/setting": {"GET": self.trace_settings, "POST": self.update_trace_settings},
        }
        self._model_tails: dict[str, dict[str, Callable[..., Any]]] = {
            "": {"GET": self.model_metadata}, "ready": {"GET": self.model_ready},
            "config": {"GET": self.model_config}, "stats": {"GET": self.model_stats},
            "infer": {"POST": self.infer},
        }
        self._routes: dict[str, _Route | None] = {}

    # --- dispatch --------------------------------------------------------------------------------------------
    def __call__(self, request: HttpRequest, respond: Respond) -> None:
        route: _Route | None | Literal[False] = self._routes.get(request.path, False)  # False: not cached yet
        if route is False:
            route = self._route(request.path)
            if len(self._routes) < _ROUTE_CACHE_SIZE:
                self._routes[request.path] = route
        if route is None:
            respond(404, error_body(f"no route for {request.method} {request.path}"))
            return
        handlers, args = route
        handler = handlers.get("GET" if request.method == "HEAD" else request.method)
        if handler is None:
            respond(405, error_body(f"method {request.method} not allowed for {request.path}"))
            return
        if len(request.body) > MAX_CONTROL_BODY_BYTES and handler != self.infer and handler != self.load:
            respond(413, error_body(f"request body of {len(request.body)} bytes exceeds the limit of "
                                    f"{MAX_CONTROL_BODY_BYTES} bytes for {request.path}"))
            return
        try:
            reply = handler(request, respond, *args)
        except Exception as e:  # noqa: BLE001 - any bug is answered as an error, never a dropped connection
            self._respond_error(respond, e, request)
            return
        if reply is None:  # the handler answers by itself (infer)
            return
        if isinstance(reply, tuple):
            respond(reply[0], reply[1], JSON if reply[1] else "")
            return
        self._spawn(reply, respond, request)

    def _route(self, path: str) -> _Route | None:
        handlers = self._static.get(path)
        if handlers is not None:
            return handlers, ()
        parts = path.split("/")
        if len(parts) < 4 or parts[0] or parts[1] != "v2":
            return None
        if parts[2] == "models" and parts[3]:
            name, rest = parts[3], parts[4:]
            version = ""
            if len(rest) >= 2 and rest[0] == "versions" and rest[1]:
                version, rest = rest[1], rest[2:]
            if rest == ["trace", "setting"] and not version:  # (Triton's: a model's, not a version's)
                return {"GET": self.trace_settings, "POST": self.update_trace_settings}, (name,)
            if len(rest) > 1:
                return None
            handlers = self._model_tails.get(rest[0] if rest else "")
            return (handlers, (name, version)) if handlers is not None else None
        if parts[2] in ("systemsharedmemory", "cudasharedmemory"):
            return self._shm_route(parts[2] == "cudasharedmemory", parts[3:])
        if len(parts) == 6 and parts[2] == "repository" and parts[3] == "models" and parts[4]:
            if parts[5] == "load":
                return {"POST": self.load}, (parts[4],)
            if parts[5] == "unload":
                return {"POST": self.unload}, (parts[4],)
        return None

    def _shm_route(self, cuda: bool, rest: list[str]) -> _Route | None:
        """`[region/NAME/]status|register|unregister` of the shared-memory extension (register needs a NAME)."""
        name = ""
        if len(rest) == 3 and rest[0] == "region" and rest[1]:
            name, rest = rest[1], rest[2:]
        if len(rest) != 1:
            return None
        action = rest[0]
        if action == "status":
            return {"GET": self.shm_status}, (cuda, name)
        if action == "unregister":
            return {"POST": self.shm_unregister}, (cuda, name)
        if action == "register" and name:
            return {"POST": self.shm_register}, (cuda, name)
        return None

    def _spawn(self, coro: Awaitable[_Reply], respond: Respond, request: HttpRequest) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # the loop keeps only weak references to tasks

        def finished(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if t.cancelled():
                respond(503, error_body("the request was cancelled: the server is shutting down"))
                return
            exc = t.exception()
            if exc is not None:
                self._respond_error(respond, exc, request)
            else:
                status, body = t.result()
                respond(status, body, JSON if body else "")

        task.add_done_callback(finished)

    @staticmethod
    def _respond_error(respond: Respond, exc: BaseException, request: HttpRequest) -> None:
        """Every failure becomes `{"error": ...}`: clients (tritonclient reads `error`) never see anything else."""
        if isinstance(exc, InferenceError):
            respond(HTTP_STATUS[exc.kind], error_body(exc.message))
        else:  # a bug somewhere below us: answer 500 and keep serving
            log.error("unexpected error serving %s %s", request.method, request.path, exc_info=exc)
            respond(500, error_body(f"internal error: {type(exc).__name__}: {exc}"))

    # --- handlers --------------------------------------------------------------------------------------------
    def live(self, request: HttpRequest, respond: Respond) -> _Reply:
        return 200 if self.core.server_live() else 400, b""

    def ready(self, request: HttpRequest, respond: Respond) -> _Reply:
        return 200 if self.core.server_ready() else 400, b""

    def server_metadata(self, request: HttpRequest, respond: Respond) -> _Reply:
        return 200, _json_body(server_metadata_json(self.core.server_metadata()))

    def model_metadata(self, request: HttpRequest, respond: Respond, name: str, version: str) -> _Reply:
        return 200, _json_body(model_metadata_json(self.core.model_metadata(name, version)))

    def model_ready(self, request: HttpRequest, respond: Respond, name: str, version: str) -> _Reply:
        if self.core.model_ready(name, version):
            return 200, b""
        return 400, error_body(f"model '{name}' version '{version}' is not ready" if version
                               else f"model '{name}' is not ready")

    def model_config(self, request: HttpRequest, respond: Respond, name: str, version: str) -> _Reply:
        return 200, _json_body(model_config_json(self.core.model_config(name, version)))

    def model_stats(self, request: HttpRequest, respond: Respond, name: str = "", version: str = "") -> _Reply:
        return 200, _json_body(model_statistics_json(self.core.model_statistics(name, version)))

    def repository_index(self, request: HttpRequest, respond: Respond) -> _Reply:
        doc = _optional_json_object(request.body, "repository index request")
        ready = doc.get("ready", False)
        if not isinstance(ready, bool):
            raise invalid(f"repository index 'ready' must be a boolean, got {ready!r}")
        return 200, _json_body(repository_index_json(self.core.repository_index(ready_only=ready)))

    def load(self, request: HttpRequest, respond: Respond, name: str) -> Awaitable[_Reply]:
        self.admin.check(request.headers.get("authorization"), f"loading model '{name}'", request.peer)
        doc = _optional_json_object(request.body, "model load request")
        params = parameters_object(doc.get("parameters"), "load request")
        try:
            override = override_of(params, _base64_file)
        except ValueError as exc:
            raise invalid(f"failed to load '{name}': {exc}") from None

        async def run() -> _Reply:
            await self.core.load_model(name, override)
            return 200, b""
        return run()

    def unload(self, request: HttpRequest, respond: Respond, name: str) -> Awaitable[_Reply]:
        self.admin.check(request.headers.get("authorization"), f"unloading model '{name}'", request.peer)
        doc = _optional_json_object(request.body, "model unload request")
        dependents = parameters_object(doc.get("parameters"), "unload request").get("unload_dependents", False)
        if not isinstance(dependents, bool):
            raise invalid(f"Unable to parse 'unload_dependents': expected a boolean, got {dependents!r}")

        async def run() -> _Reply:
            await self.core.unload_model(name, unload_dependents=dependents)
            return 200, b""
        return run()

    # --- the shared-memory extension ---------------------------------------------------------------------------
    def shm_status(self, request: HttpRequest, respond: Respond, cuda: bool, name: str) -> _Reply:
        regions = self.core.client_shm
        if cuda:
            return 200, _json_body(regions.cuda_status(name))
        return 200, _json_body([{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                                for r in regions.status(name)])

    def shm_register(self, request: HttpRequest, respond: Respond, cuda: bool, name: str) -> _Reply:
        kind = "cuda" if cuda else "system"
        self.admin.check(request.headers.get("authorization"), f"registering {kind} shared memory region '{name}'",
                         request.peer)
        doc = _optional_json_object(request.body, f"{kind} shared memory register request")
        byte_size = _register_int(doc, "byte_size", required=True)
        if cuda:
            self.core.client_shm.check_cuda()  # without a GPU that is the answer, whatever the handle
            handle = doc.get("raw_handle")
            raw = handle.get("b64") if isinstance(handle, dict) else None
            if not isinstance(raw, str):
                raise invalid("Shared memory register request has no 'raw_handle' field with a 'b64' string")
            try:
                raw_handle = _b64decode(raw)
            except binascii.Error:
                raise invalid("'raw_handle' 'b64' is not base64") from None
            self.core.client_shm.cuda_register(name, raw_handle, _register_int(doc, "device_id", required=True),
                                               byte_size)
            return 200, b""
        key = doc.get("key")
        if not isinstance(key, str):
            raise invalid("Shared memory register request has no 'key' field")
        self.core.client_shm.register(name, key, _register_int(doc, "offset"), byte_size)
        return 200, b""

    def shm_unregister(self, request: HttpRequest, respond: Respond, cuda: bool, name: str) -> _Reply:
        kind = "cuda" if cuda else "system"
        self.admin.check(request.headers.get("authorization"),
                         f"unregistering {kind} shared memory region" + (f" '{name}'" if name else "s"), request.peer)
        if cuda:
            self.core.client_shm.cuda_unregister(name)
        else:
            self.core.client_shm.unregister(name)
        return 200, b""

    def inspect(self, request: HttpRequest, respond: Respond) -> _Reply:
        return 200, _json_body(self.core.inspect())

    # --- the logging extension -----------------------------------------------------------------------------------
    def log_settings(self, request: HttpRequest, respond: Respond) -> _Reply:
        return 200, _json_body(self.core.log_settings().wire())

    def update_log_settings(self, request: HttpRequest, respond: Respond) -> _Reply:
        changes = _optional_json_object(request.body, "log setting request")
        if changes:  # an empty request reads them, as GET
            self.admin.check(request.headers.get("authorization"), "changing the log settings", request.peer)
        return 200, _json_body(self.core.update_log_settings(changes).wire())

    def trace_settings(self, request: HttpRequest, respond: Respond, name: str = "") -> _Reply:
        return 200, _json_body(self.core.trace_settings(name).wire())

    def update_trace_settings(self, request: HttpRequest, respond: Respond, name: str = "") -> _Reply:
        changes = _optional_json_object(request.body, "trace setting request")
        if changes:  # an empty request reads them, as GET
            self.admin.check(request.headers.get("authorization"), "changing the trace settings", request.peer)
        return 200, _json_body(self.core.update_trace_settings(name, changes).wire())

    def apply_placement(self, request: HttpRequest, respond: Respond) -> Awaitable[_Reply]:
        self.admin.check(request.headers.get("authorization"), "applying a placement", request.peer)
        doc = _optional_json_object(request.body, "placement")

        async def run() -> _Reply:
            requested = placements_from_json(doc.get("placements"))  # bad shapes: refused before anything changes
            return 200, _json_body(applied_json(await self.core.apply_placement(requested)))
        return run()

    def infer(self, request: HttpRequest, respond: Respond, name: str, version: str) -> None:
        header_length = request.headers.get(_HEADER_LENGTH_KEY)
        if is_raw_request(header_length):  # the body is the model's one input (Triton's raw binary request)
            config = self.core.model_config(name, version).config
            self._submit(decode_raw_request(request.body, config, name, version, self.max_tensor_elements),
                         respond, request)
            return
        codec = self.json_codec
        if codec is not None and json_request_offloaded(len(request.body), header_length, codec.offload_bytes):
            # A large JSON body would hold the loop (and every other request) for as long as it takes to parse.
            codec.decode(request.body, header_length, name, version, self.max_tensor_elements,
                         _Decoded(self, respond, request))
            return
        self._submit(decode_infer_request(request.body, header_length, name, version, self.max_tensor_elements),
                     respond, request)

    def _submit(self, infer_request: InferRequest, respond: Respond, request: HttpRequest) -> None:
        self.core.submit(infer_request, _InferAnswer(self, infer_request, respond, request))


class _Decoded:
    """Submits a request the JSON codec decoded off the loop (a class rather than a closure: see _InferAnswer). It
    shares three fields with _InferAnswer but no base class: compiled with mypyc 2.4, a shared base's subclasses
    crashed the process (a segmentation fault in tests/test_request_garbage.py)."""
    __slots__ = ("api", "respond", "request")

    def __init__(self, api: HttpApi, respond: Respond, request: HttpRequest) -> None:
        self.api = api
        self.respond = respond
        self.request = request

    def __call__(self, result: InferRequest | BaseException) -> None:
        if isinstance(result, BaseException):
            self.api._respond_error(self.respond, result, self.request)
            return
        try:
            self.api._submit(result, self.respond, self.request)
        except Exception as e:  # noqa: BLE001 - refused (bad shape, unknown model, full queue): answered here,
            self.api._respond_error(self.respond, e, self.request)  # as route() answers the loop's own decode


class _InferAnswer:
    """Answers one inference request when the core is done with it (`done`), encoded here or by the JSON codec.
    A class rather than closures: compiled (gpud.compiled), closures and their environment refer to each other, so
    each request's (and the request's tensors with them) would wait for the cyclic collector."""
    __slots__ = ("api", "infer_request", "respond", "request")

    def __init__(self, api: HttpApi, infer_request: InferRequest, respond: Respond, request: HttpRequest) -> None:
        self.api = api
        self.infer_request = infer_request
        self.respond = respond
        self.request = request

    def __call__(self, result: InferResponse | BaseException) -> None:
        if isinstance(result, BaseException):
            self.api._respond_error(self.respond, result, self.request)
            return
        codec = self.api.json_codec
        if codec is not None and json_response_offloaded(result, self.infer_request, codec.offload_bytes):
            codec.encode(result, self.infer_request, self.answer)  # millions of numbers written as text: not here
            return
        try:
            encoded = encode_infer_response(result, self.infer_request)
        except Exception as e:  # noqa: BLE001 - any bug is answered as an error, never a dropped connection
            self.api._respond_error(self.respond, e, self.request)
            return
        self.answer(encoded)

    def answer(self, encoded: EncodedResponse | BaseException) -> None:
        if isinstance(encoded, BaseException):
            self.api._respond_error(self.respond, encoded, self.request)
            return
        self.respond(200, encoded.body, encoded.content_type,
                     list(encoded.headers.items()) if encoded.headers else None)


_HEADER_LENGTH_KEY = INFER_HEADER_CONTENT_LENGTH.lower()


_B64_LINE_BREAKS = str.maketrans("", "", "\r\n")


def _b64decode(text: str) -> bytes:
    """Strict base64 but for line breaks: Triton's C++ clients (perf_analyzer's `--shared-memory cuda`) encode with
    libb64, which breaks lines every 72 characters, and Triton's decoder skips them."""
    return base64.b64decode(text.translate(_B64_LINE_BREAKS), validate=True)


def _register_int(doc: dict[str, Any], key: str, required: bool = False) -> int:
    value = doc.get(key)
    if value is None:
        if required:
            raise invalid(f"Shared memory register request has no '{key}' field")
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid(f"Shared memory register request: '{key}' must be a non-negative integer, got {value!r}")
    return value


def _base64_file(key: str, value: object) -> bytes:
    """A `file:` load parameter over HTTP: the file's bytes, base64 encoded (as Triton)."""
    if not isinstance(value, str):
        raise ValueError(f"'{key}' must be the file's bytes, base64 encoded")
    try:
        return _b64decode(value)
    except binascii.Error:
        raise ValueError(f"'{key}' is not base64") from None


async def start_http_server(core: InferenceCore, host: str, port: int, *, max_body_bytes: int = 64 * 2**20,
                            keepalive_timeout_s: float = 75.0, request_timeout_s: float = 30.0,
                            max_connections: int = 10000, max_head_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                            max_tensor_elements: int = DEFAULT_MAX_TENSOR_ELEMENTS,
                            json_codec: JsonCodecPool | None = None,
                            admin: AdminAuth | None = None) -> tuple[HttpServer, int]:
    """Serve `core` on host:port (0 = an ephemeral port). Returns the server (`await server.close(grace_s)` stops
    it, and the JSON codec with it) and the bound port."""
    server = HttpServer(HttpApi(core, admin, max_tensor_elements, json_codec), max_body_bytes=max_body_bytes,
                        max_head_bytes=max_head_bytes, keepalive_timeout_s=keepalive_timeout_s,
                        request_timeout_s=request_timeout_s, max_connections=max_connections,
                        on_close=json_codec.close if json_codec is not None else None)
    return server, await server.start(host, port)


async def start_http_unix_server(core: InferenceCore, path: str, *, max_body_bytes: int = 64 * 2**20,
                                 request_timeout_s: float = 30.0, max_connections: int = 10000,
                                 max_head_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                                 max_tensor_elements: int = DEFAULT_MAX_TENSOR_ELEMENTS) -> HttpServer:
    """The admin socket (`--admin-socket`): the same routes on a unix socket at `path` (mode 0660), where the admin
    actions need no token: the socket file's permissions decide who may connect. `await server.close(grace_s)`
    stops it and removes the file."""
    server = HttpServer(HttpApi(core, AdminAuth(), max_tensor_elements), max_body_bytes=max_body_bytes,
                        max_head_bytes=max_head_bytes, request_timeout_s=request_timeout_s,
                        max_connections=max_connections)
    await server.start_unix(path)
    return server
