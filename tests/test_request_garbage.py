"""A served request leaves no reference cycle behind: everything it made goes when it is answered.

Compiled (gpud.compiled), a nested function and its environment refer to each other, so a closure made per request
(a `respond`, a completion callback) left the request, its tensors and its callbacks to the cyclic collector: ~10
objects a request, whose collections took ~5-9% of the loop's CPU under load, and request bodies stayed in memory
until a collection ran. This drives the daemon's real parts (HTTP protocol, core, scheduler, a worker process) with
the cyclic collector off and counts what a collection then finds; it runs in both modes (compiled under
./scripts/test, pure Python in .ci/run's second pass).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from gpud import wiring
from gpud.api.http_api import HttpApi
from gpud.api.http_server import HttpServer, _Connection
from gpud.executor.types import InferRequest, InferTensor
from gpud.settings import Settings, prepare_settings
from tests.daemon_harness import ADD_SUB_CONFIG, add_sub_model, save

REQUESTS = 300
# Start-up leftovers and per-connection cycles (a connection and its parser refer to each other) are not per
# request: what a collection finds must stay well under one object a request.
MAX_FOUND = REQUESTS // 3


class _Transport:
    """A keep-alive client connection as the protocol sees it: each answer written brings the next request."""

    def __init__(self, loop: asyncio.AbstractEventLoop, requests: list[bytes], finished: asyncio.Future):
        self.loop, self.requests, self.finished = loop, requests, finished
        self.protocol: _Connection | None = None
        self.answers: list[bytes] = []

    def get_extra_info(self, name: str, default=None):
        return default

    def write(self, data) -> None:
        self.answers.append(bytes(data))
        self.loop.call_soon(self.send_next)

    def writelines(self, parts) -> None:
        self.write(b"".join(bytes(p) for p in parts))

    def send_next(self) -> None:
        if self.requests:
            assert self.protocol is not None
            self.protocol.data_received(self.requests.pop())
        elif not self.finished.done():
            self.finished.set_result(None)

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _http(body: bytes, extra: str = "") -> bytes:
    return (f"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
            ).encode() + body


def _binary_request(a: np.ndarray, b: np.ndarray) -> bytes:
    header = orjson.dumps({"inputs": [
        {"name": n, "shape": [1, 16], "datatype": "FP32", "parameters": {"binary_data_size": 64}}
        for n in ("INPUT0", "INPUT1")], "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]})
    return _http(header + a.tobytes() + b.tobytes(), f"Inference-Header-Content-Length: {len(header)}\r\n")


def _json_request(a: np.ndarray, b: np.ndarray) -> bytes:
    return _http(orjson.dumps({"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": a.ravel().tolist()},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32", "data": b.ravel().tolist()}]}))


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextlib.asynccontextmanager
async def _daemon_parts(repo: Path) -> AsyncIterator[wiring.Components]:
    """gpud's parts, started on `repo` (add_sub in a real worker process); shut down at the end."""
    settings = Settings(model_repository=str(repo), allow_metrics=False, placement_control="off", json_processes=0,
                        log_level="WARNING")
    parts = wiring.build(prepare_settings(settings))
    await parts.start()
    try:
        yield parts
    finally:
        await parts.shutdown(5.0)


def _http_server(parts: wiring.Components) -> HttpServer:
    server = HttpServer(HttpApi(parts.core, None, 1 << 24, None))
    server.loop = asyncio.get_running_loop()  # as start() sets it; no socket is listened on
    return server


def _connect(transport: _Transport, server: HttpServer) -> None:
    """A new connection of `server` on `transport`, sending its first request."""
    transport.protocol = _Connection(server)
    transport.protocol.connection_made(transport)  # type: ignore[arg-type]
    transport.send_next()


async def _served(repo: Path, make_requests) -> tuple[int, list[bytes]]:
    """Serves `make_requests()`'s requests over 4 connections; returns what a collection then found, and the
    answers."""
    async with _daemon_parts(repo) as parts:
        loop = asyncio.get_running_loop()
        server = _http_server(parts)
        warm = loop.create_future()
        _run(server, loop, [_binary_request(np.zeros((1, 16), np.float32), np.ones((1, 16), np.float32))] * 8, warm)
        await asyncio.wait_for(warm, 60)
        gc.collect()  # what start-up left
        requests = make_requests()
        finished = [loop.create_future() for _ in range(4)]
        transports = [_run(server, loop, requests[i::4], f) for i, f in enumerate(finished)]
        await asyncio.wait_for(asyncio.gather(*finished), 60)
        found = gc.collect()
        for t in transports:
            assert t.protocol is not None
            t.protocol.connection_lost(None)
        return found, [a for t in transports for a in t.answers]


def _run(server: HttpServer, loop, requests: list[bytes], finished: asyncio.Future) -> _Transport:
    transport = _Transport(loop, list(requests), finished)
    _connect(transport, server)
    return transport


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    save(add_sub_model(), tmp_path, "add_sub", ADD_SUB_CONFIG)
    return tmp_path


@pytest.mark.parametrize("encoding", ["binary", "json"])
def test_answered_requests_leave_no_cycles(repo, collector_off, encoding):
    rng = np.random.default_rng(0)
    pairs = [(rng.standard_normal((1, 16)).astype(np.float32), rng.standard_normal((1, 16)).astype(np.float32))
             for _ in range(REQUESTS)]
    make = _binary_request if encoding == "binary" else _json_request
    found, answers = asyncio.run(_served(repo, lambda: [make(a, b) for a, b in pairs]))
    assert len(answers) == REQUESTS and all(a.startswith(b"HTTP/1.1 200 ") for a in answers), answers[:1]
    assert found < MAX_FOUND, f"{found} objects in reference cycles after {REQUESTS} requests"


class _ClosingTransport(_Transport):
    """One request a connection (`Connection: close`): the server closes it after the answer, as a client that
    does not keep connections alive sees it; the next request comes on a new connection."""

    def __init__(self, server: HttpServer, loop, requests: list[bytes], finished: asyncio.Future):
        super().__init__(loop, requests, finished)
        self.server = server
        self.closed = False

    def write(self, data) -> None:
        self.answers.append(bytes(data))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.call_soon(self._next_connection)

    def is_closing(self) -> bool:
        return self.closed

    def _next_connection(self) -> None:
        assert self.protocol is not None
        self.protocol.connection_lost(None)
        self.closed = False
        _connect(self, self.server)


def test_connections_closed_leave_no_cycles(repo, collector_off):
    """A client that opens a connection per request: the connection and its parser go with it."""
    async def served() -> tuple[int, list[bytes]]:
        async with _daemon_parts(repo) as parts:
            loop = asyncio.get_running_loop()
            server = _http_server(parts)
            ones = np.ones((1, 16), np.float32)
            request = _binary_request(ones, ones).replace(b"Host: t\r\n", b"Host: t\r\nConnection: close\r\n")
            warm = loop.create_future()
            _closing(server, loop, [request] * 4, warm)
            await asyncio.wait_for(warm, 60)
            gc.collect()
            finished = loop.create_future()
            transport = _closing(server, loop, [request] * REQUESTS, finished)
            await asyncio.wait_for(finished, 60)
            return gc.collect(), transport.answers
    found, answers = asyncio.run(served())
    assert len(answers) == REQUESTS and all(a.startswith(b"HTTP/1.1 200 ") and b"Connection: close" in a
                                            for a in answers), answers[:1]
    assert found < MAX_FOUND, f"{found} objects in reference cycles after {REQUESTS} connections"


def _closing(server: HttpServer, loop, requests: list[bytes], finished: asyncio.Future) -> _ClosingTransport:
    transport = _ClosingTransport(server, loop, list(requests), finished)
    _connect(transport, server)
    return transport


def test_refused_requests_leave_no_cycles(repo, collector_off):
    """Errors answered on the way in (a wrong shape) and by the core (an unknown model) too."""
    def make() -> list[bytes]:
        wrong = _http(orjson.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32",
                                                "data": [1, 2, 3]}]}))
        unknown = _http(b"{}").replace(b"/add_sub/", b"/nope/")
        return [wrong, unknown] * (REQUESTS // 2)
    found, answers = asyncio.run(_served(repo, make))
    assert len(answers) == REQUESTS and all(a.startswith(b"HTTP/1.1 400 ") or a.startswith(b"HTTP/1.1 404 ")
                                            for a in answers), answers[:2]
    assert found < MAX_FOUND, f"{found} objects in reference cycles after {REQUESTS} refused requests"


def test_in_process_calls_leave_no_cycles(repo, collector_off):
    """The core's own `infer` (what gpud.Server calls), with its future."""
    def request() -> InferRequest:
        ones = np.ones((1, 16), np.float32)
        return InferRequest("add_sub", [InferTensor("INPUT0", "FP32", (1, 16), ones),
                                        InferTensor("INPUT1", "FP32", (1, 16), ones)])

    async def served() -> int:
        async with _daemon_parts(repo) as parts:
            await parts.core.infer(request())
            gc.collect()
            for _ in range(REQUESTS // 10):
                responses = await asyncio.gather(*(parts.core.infer(request()) for _ in range(10)))
                assert all(r.outputs[0].data[0, 0] == 2.0 for r in responses)
            return gc.collect()
    found = asyncio.run(served())
    assert found < MAX_FOUND, f"{found} objects in reference cycles after {REQUESTS} in-process calls"


def _grpc_request(i: int) -> Any:
    from gpud.proto import grpc_service_pb2 as pb

    request = pb.ModelInferRequest(model_name="add_sub", id=str(i))
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype="FP32")
        tensor.shape.extend([1, 16])
        request.raw_input_contents.append(np.ones((1, 16), np.float32).tobytes())
    return request


@pytest.mark.parametrize("call", ["unary", "stream"])
def test_grpc_calls_leave_no_cycles(repo, collector_off, call):
    """gpud's own gRPC server (HTTP/2 framing, calls, plans: compiled too) over loopback, a grpcio client in a
    thread: unary ModelInfer calls, and one ModelStreamInfer stream with every request on it."""
    import grpc

    from gpud.api.grpc_api import start_grpc_server
    from gpud.proto import grpc_service_pb2_grpc as pb_grpc

    def client(port: int, n: int) -> list[Any]:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            if call == "unary":
                return [stub.ModelInfer(_grpc_request(i), timeout=30) for i in range(n)]
            return list(stub.ModelStreamInfer(iter([_grpc_request(i) for i in range(n)]), timeout=60))

    async def served() -> tuple[int, list[Any]]:
        async with _daemon_parts(repo) as parts:
            server = await start_grpc_server(parts.core, "127.0.0.1", 0)
            try:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, client, server.bound_port, 8)  # the channel's and plans' first
                gc.collect()
                answers = await loop.run_in_executor(None, client, server.bound_port, REQUESTS)
                return gc.collect(), answers
            finally:
                await server.stop(1.0)
    found, answers = asyncio.run(served())
    if call == "stream":
        assert all(not a.error_message for a in answers), answers[0]
        answers = [a.infer_response for a in answers]
    assert len(answers) == REQUESTS and all(len(a.raw_output_contents) == 2 for a in answers)
    assert found < MAX_FOUND, f"{found} objects in reference cycles after {REQUESTS} gRPC {call} requests"


def test_the_counting_can_fail(collector_off):
    """The check itself: a closure cycle per 'request' is found."""
    def leak() -> None:
        def f() -> None:
            f()  # f's cell holds f: a cycle
    for _ in range(REQUESTS):
        leak()
    assert gc.collect() >= REQUESTS
