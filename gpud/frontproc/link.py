"""The socket between a front-end process and the core: length-prefixed frames, read without blocking; each frame is
the list of messages one side sent in one turn of its event loop, pickled together (one pickler call per turn, not
per message).

Messages (plain tuples; pickle writes them in C):

    front end -> core   ("ready",)                          it serves now
                        ("call", id, method, args)        an InferenceCore method (or "client_shm.<method>")
                        ("submit", id, request, placed, token)   an inference request (`request_wire`); `placed`: {name:
                                                           (path, offset, bytes)} of the tensors it put in its
                                                           arena (their data is empty); `token`: a number
                                                           for requests of the same header (None: unknown)
                        ("group", ids, request, placed, token)   requests alike but for their rows
                                                           (gpud.frontproc.group): `request` one of them, `placed`
                                                           each input's rows of all, one member after another
                        ("cancel", id)                    the client went away
                        ("loop", counts)                  its event loop's counts (gpud.telemetry.event_loop),
                                                           once a second
    core -> front end   ("result", id, ok, value)         a call's return value, or its InferenceError
                        ("answer", id, ok, value)         a request's answer (`response_wire`), or its
                                                           InferenceError
                        ("answers", ids, ok, value)       a group's answer, split by rows in the front end; or
                                                           the InferenceError each of them gets
                        ("stop", grace_s)                 stop accepting, finish what was accepted, exit
                        ("tune", timeout_s, connections)  a reload's request timeout and connection cap
"""
from __future__ import annotations

import collections
import logging
import pickle
import socket
import struct
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from gpud.executor.client_shm import NO_DATA
from gpud.executor.shm import Segment, new_segment_name, unlink
from gpud.executor.types import (ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor,
                                 RequestedOutput, ShmRef)

log = logging.getLogger("gpud.frontend")

_HEADER = struct.Struct("<I")
_PICKLE = pickle.HIGHEST_PROTOCOL
READ_CHUNK_BYTES = 1 << 18


# --- requests and answers as plain tuples (a dataclass with slots pickles through Python code, a tuple in C) --
def _ref(ref: ShmRef | None) -> tuple | None:
    return None if ref is None else (ref.region, ref.offset, ref.byte_size)


def _unref(ref: tuple | None) -> ShmRef | None:
    return None if ref is None else ShmRef(*ref)


# An ndarray pickles through numpy's reduce (its dtype too): ~6 µs each way for a small one, more than the rest of a
# request's message. So a placed tensor's empty data travels as None, and an answer's fixed-size output as its bytes.
def _data_wire(data: Any) -> Any:
    return None if data is NO_DATA else data


def _data_of(data: Any) -> Any:
    return NO_DATA if data is None else data


def request_wire(r: InferRequest) -> tuple:
    return (r.model_name, r.model_version, r.id,
            [(t.name, t.datatype, t.shape, _data_wire(t.data), _ref(t.shm)) for t in r.inputs],
            None if r.outputs is None else [(o.name, o.parameters, _ref(o.shm)) for o in r.outputs],
            r.priority, r.timeout_us, r.parameters, r.uses_shm)


def request_of(w: tuple) -> InferRequest:
    name, version, ident, inputs, outputs, priority, timeout_us, parameters, uses_shm = w
    return InferRequest(name, [InferTensor(n, d, s, _data_of(a), _unref(ref)) for n, d, s, a, ref in inputs], version,
                        ident,
                        None if outputs is None else [RequestedOutput(n, p, _unref(ref)) for n, p, ref in outputs],
                        priority, timeout_us, parameters, None, uses_shm)


def process_label(kind: str, index: int) -> str:
    """A front-end process's name in the metrics and the logs ("http-0", "grpc-1"), the same on both sides."""
    return f"{kind}-{index}"


HANDOFF_MIN_BYTES = 64 << 10  # an answer's tensor at least this big goes in a segment of its own, not in the message


def response_wire(r: InferResponse, handed: Callable[[str], None] | None = None) -> tuple:
    """The answer as a tuple. With `handed`, each large fixed-size output is written into a shared-memory segment of
    its own instead (one copy, where pickling and sending it would be three, and hold the loop while the other side
    reads); the receiver maps it and removes its file; `handed(name)` is told each segment's name once the whole
    answer is staged. When staging fails partway (/dev/shm full), the segments already made are removed: nobody
    will map them."""
    outputs = []
    made: list[str] = []
    try:
        for t in r.outputs:
            data: Any = t.data
            if data is NO_DATA:  # in the client's region (host._answer): only the shape travels
                data = None
            elif data.dtype.kind != "O":  # (text stays an array: its elements are Python objects)
                if handed is not None and t.shm is None and data.nbytes >= HANDOFF_MIN_BYTES:
                    data = _hand_off(data)
                    made.append(data[1])
                else:
                    data = ("bytes", data.dtype.str, data.shape, data.tobytes())
            outputs.append((t.name, t.datatype, t.shape, data, _ref(t.shm)))
    except BaseException:
        for name in made:
            unlink(name)
        raise
    if handed is not None:
        for name in made:
            handed(name)
    return (r.model_name, r.model_version, r.id, outputs, r.parameters, r.compute_ns)


def _hand_off(array: Any) -> tuple[str, str, str]:
    name = new_segment_name("answer")
    segment = Segment.create(name, array.nbytes)
    segment.owner = False  # the receiver removes it once mapped
    try:
        segment.ndarray(0, array.shape, array.dtype)[...] = array
    except BaseException:
        unlink(name)
        raise
    finally:
        segment.close()
    return ("segment", name, array.dtype.str)


def _taken(data: Any, shape: tuple[int, ...]) -> Any:
    """An output's array: as sent, from its bytes, or mapped from the segment it was handed over in (the file removed
    at once: the mapping lives as long as the array)."""
    if type(data) is not tuple:
        return _data_of(data)
    if data[0] == "bytes":  # a writable array of its own, as an unpickled one is
        _, dtype, own_shape, raw = data
        return np.frombuffer(bytearray(raw), np.dtype(dtype)).reshape(own_shape)
    _, name, dtype = data
    segment = Segment.attach(name)
    unlink(name)
    return segment.ndarray(0, shape, np.dtype(dtype))



def discard_response(w: tuple) -> None:
    """An answer nobody will read (its requests withdrawn meanwhile): the segments it was handed over in removed."""
    for _, _, _, data, _ in w[3]:
        if type(data) is tuple and data[0] == "segment":
            unlink(data[1])


def response_of(w: tuple) -> InferResponse:
    name, version, ident, outputs, parameters, compute_ns = w
    tensors = [InferTensor(n, d, s, _taken(a, s), _unref(ref)) for n, d, s, a, ref in outputs]
    return InferResponse(name, version, tensors, ident, parameters, compute_ns)


def frame(messages: list[tuple]) -> bytes:
    data = pickle.dumps(messages, _PICKLE)
    return _HEADER.pack(len(data)) + data


class FrameReader:
    """Complete messages out of what arrives on a non-blocking socket. `read()` returns False at the end."""

    def __init__(self, sock: socket.socket, on_message: Callable[[Any], None]):
        self.sock = sock
        self.on_message = on_message
        self._buf = bytearray()
        # Messages read and not yet handled, in order: a handler that reads again (read_blocking_until) goes on
        # from here, so messages are handled in the order they were sent.
        self._messages: collections.deque[Any] = collections.deque()

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
        messages = self._messages
        while len(buf) >= 4:
            (size,) = _HEADER.unpack_from(buf)
            end = 4 + size
            if len(buf) < end:
                break
            messages.extend(pickle.loads(memoryview(buf)[4:end]))
            del buf[:end]
        while messages:
            self.on_message(messages.popleft())

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
    """Messages queued and sent together once the event loop's turn ends (one send for all the answers, or requests,
    of a turn), never blocking the loop: what the socket does not take now is sent when it can (a writer callback).
    Neither side ever blocks on a full socket, so two processes writing to each other cannot wait on each other."""

    def __init__(self, sock: socket.socket, on_error: Callable[[], None]):
        self.sock = sock
        self.on_error = on_error
        self._messages: list[tuple] = []  # this turn's, sent as one frame
        self._pending = b""  # bytes the socket has not taken yet
        self._writing = False
        self._loop: Any = None

    def put(self, message: tuple) -> None:
        if not self._messages:
            if self._loop is None:
                import asyncio

                self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self.flush)
        self._messages.append(message)

    def flush(self) -> None:
        messages, self._messages = self._messages, []
        if messages:
            try:
                data = frame(messages)
            except Exception:  # noqa: BLE001 - one message that cannot be pickled must not take its turn's others
                data = b"".join(self._each(messages))
            self._pending = self._pending + data if self._pending else data
        if not self._writing:
            self._write()

    @staticmethod
    def _each(messages: list[tuple]) -> list[bytes]:
        frames = []
        for message in messages:
            try:
                frames.append(frame([message]))
            except Exception as exc:  # noqa: BLE001 - a bug: logged with what it was, the rest is sent
                log.exception("a %r message to the other process could not be pickled; dropped", message[0])
                if message[0] in ("answer", "answers", "result"):  # its requests or call wait: they hear why
                    frames.append(frame([(message[0], message[1], False, InferenceError(
                        ErrorKind.INTERNAL, f"the answer could not be sent to the front-end process: {exc}"))]))
        return frames

    def _write(self) -> None:
        data = memoryview(self._pending)
        sent = 0
        try:
            while sent < len(data):
                sent += self.sock.send(data[sent:])
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._pending = b""
            self._stop_writing()
            self.on_error()
            return
        self._pending = bytes(data[sent:]) if sent < len(data) else b""
        if self._pending and not self._writing:
            self._writing = True
            self._loop.add_writer(self.sock.fileno(), self._write)
        elif not self._pending:
            self._stop_writing()

    def _stop_writing(self) -> None:
        if self._writing:
            self._writing = False
            try:
                cast(Any, self._loop).remove_writer(self.sock.fileno())  # uvloop's returns None, typed bool
            except (ValueError, OSError, RuntimeError):
                pass

    def drain_blocking(self) -> None:
        """Send everything queued, waiting for the socket (a sync call, whose answer is awaited on the spot: the
        core never blocks on its side, so this ends)."""
        self.flush()
        if self._pending:
            self._stop_writing()
            self.sock.setblocking(True)
            try:
                self.sock.sendall(self._pending)
            finally:
                self.sock.setblocking(False)
            self._pending = b""
