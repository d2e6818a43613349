"""The socket between a front-end process and the core: length-prefixed pickled tuples, read without blocking.

Messages (plain tuples; pickle writes them in C):

    front end -> core   ("ready",)                          it serves now
                        ("call", id, method, args)        an InferenceCore method (or "client_shm.<method>")
                        ("submit", id, request, placed, token)   an inference request (`request_wire`); `placed`: {name:
                                                           (path, offset, bytes)} of the tensors it put in its
                                                           arena (their data is empty); `token`: a number
                                                           for requests of the same header (None: unknown)
                        ("cancel", id)                    the client went away
    core -> front end   ("result", id, ok, value)         a call's return value, or its InferenceError
                        ("answer", id, ok, value)         a request's answer (`response_wire`), or its
                                                           InferenceError
                        ("stop", grace_s)                 stop accepting, finish what was accepted, exit
                        ("tune", timeout_s, connections)  a reload's request timeout and connection cap
"""
from __future__ import annotations

import pickle
import socket
import struct
from collections.abc import Callable
from typing import Any

from gpud.executor.types import InferRequest, InferResponse, InferTensor, RequestedOutput, ShmRef

_HEADER = struct.Struct("<I")
_PICKLE = pickle.HIGHEST_PROTOCOL
READ_CHUNK_BYTES = 1 << 18


# --- requests and answers as plain tuples (a dataclass with slots pickles through Python code, a tuple in C) --
def _ref(ref: ShmRef | None) -> tuple | None:
    return None if ref is None else (ref.region, ref.offset, ref.byte_size)


def _unref(ref: tuple | None) -> ShmRef | None:
    return None if ref is None else ShmRef(*ref)


def request_wire(r: InferRequest) -> tuple:
    return (r.model_name, r.model_version, r.id, [(t.name, t.datatype, t.shape, t.data, _ref(t.shm)) for t in r.inputs],
            None if r.outputs is None else [(o.name, o.parameters, _ref(o.shm)) for o in r.outputs],
            r.priority, r.timeout_us, r.parameters, r.uses_shm)


def request_of(w: tuple) -> InferRequest:
    name, version, ident, inputs, outputs, priority, timeout_us, parameters, uses_shm = w
    return InferRequest(name, [InferTensor(n, d, s, a, _unref(ref)) for n, d, s, a, ref in inputs], version, ident,
                        None if outputs is None else [RequestedOutput(n, p, _unref(ref)) for n, p, ref in outputs],
                        priority, timeout_us, parameters, None, uses_shm)


def response_wire(r: InferResponse) -> tuple:
    return (r.model_name, r.model_version, r.id,
            [(t.name, t.datatype, t.shape, t.data, _ref(t.shm)) for t in r.outputs], r.parameters, r.compute_ns)



def response_of(w: tuple) -> InferResponse:
    name, version, ident, outputs, parameters, compute_ns = w
    return InferResponse(name, version, [InferTensor(n, d, s, a, _unref(ref)) for n, d, s, a, ref in outputs], ident,
                         parameters, compute_ns)


def frame(message: tuple) -> bytes:
    data = pickle.dumps(message, _PICKLE)
    return _HEADER.pack(len(data)) + data


class FrameReader:
    """Complete messages out of what arrives on a non-blocking socket. `read()` returns False at the end."""

    def __init__(self, sock: socket.socket, on_message: Callable[[Any], None]):
        self.sock = sock
        self.on_message = on_message
        self._buf = bytearray()

    def read(self) -> bool:
        alive = True
        while True:
            try:
                data = self.sock.recv(READ_CHUNK_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                alive = False
                break
            if not data:
                alive = False
                break
            self._buf += data
            if len(data) < READ_CHUNK_BYTES:
                break
        self.handle_frames()
        return alive

    def handle_frames(self) -> None:
        buf = self._buf
        while len(buf) >= 4:
            (size,) = _HEADER.unpack_from(buf)
            end = 4 + size
            if len(buf) < end:
                return
            message = pickle.loads(memoryview(buf)[4:end])
            del buf[:end]
            self.on_message(message)

    def read_blocking_until(self, done: Callable[[], bool]) -> None:
        """Block on the socket until `done()` (a sync call's answer handled); EOFError when the other end is gone."""
        self.sock.setblocking(True)
        try:
            while not done():
                data = self.sock.recv(READ_CHUNK_BYTES)
                if not data:
                    raise EOFError("the core is gone")
                self._buf += data
                self.handle_frames()
        finally:
            self.sock.setblocking(False)


class Sender:
    """Messages queued and sent together once the event loop's turn ends: one send for all the answers (or requests)
    of a turn, instead of one each."""

    def __init__(self, sock: socket.socket, on_error: Callable[[], None]):
        self.sock = sock
        self.on_error = on_error
        self._frames: list[bytes] = []
        self._loop: Any = None

    def put(self, message: tuple) -> None:
        if not self._frames:
            if self._loop is None:
                import asyncio

                self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self.flush)
        self._frames.append(frame(message))

    def flush(self) -> None:
        frames, self._frames = self._frames, []
        if not frames:
            return
        try:
            send_bytes(self.sock, b"".join(frames) if len(frames) > 1 else frames[0])
        except OSError:
            self.on_error()


def send(sock: socket.socket, message: tuple) -> None:
    """Send a whole message. The socket is non-blocking for reads; a full send buffer waits here (messages are
    small: tensors travel in shared memory)."""
    send_bytes(sock, frame(message))


def send_bytes(sock: socket.socket, payload: bytes) -> None:
    data = memoryview(payload)
    while data:
        try:
            sent = sock.send(data)
        except (BlockingIOError, InterruptedError):
            import select

            select.select([], [sock], [])
            continue
        data = data[sent:]
