"""Large JSON inference bodies decoded, and large JSON answers encoded, in child processes, so that the event loop
never waits for them.

Why processes and not a thread: orjson and numpy's conversion of a parsed list each hold the GIL for the whole call.
Measured (Python 3.11, orjson 3.11): a thread parsing a 73 MB JSON body of 7M floats (0.48 s to parse, 0.12 s to
convert) kept the event loop's thread from running for 396 ms at a stretch, and one 60 MB body decoded on the loop
made /v2/health/ready wait 420 ms; writing 7M floats back as JSON takes 160 ms.

Why not concurrent.futures.ProcessPoolExecutor: it pickles the body on a thread of its own, and that copy (twice
60 MB) holds the GIL too: health probes waited up to 100-350 ms with four bodies at once. Here a job goes to the child
over a socketpair from the loop itself, non-blocking, with its large buffers (the body; the answer's tensors) sent
as pickle protocol 5 out-of-band buffers straight from their own memory, and the result's large buffers (the
tensors; the encoded answer) come back the same way, received in place into their final memory.

Memory is bounded, not multiplied by the number of large requests: at most `processes` jobs run at once, each child
peaking at about seven times the body it parses (a Python float and a list slot for every number, then the array;
measured: 418 MB for a 58 MB body) and back to ~63 MB afterwards; at most `max_in_flight` jobs wait or run, beyond
which a request is answered 503 / UNAVAILABLE at once (an answer that cannot be encoded in a child then is encoded on
the loop: it has been computed already). The daemon itself holds each waiting body (at most --max-request-bytes)
and, once decoded, its tensors. Children run at a lower priority (nice 10): where cores are short, the event loop and
the device workers go first.

    codec = JsonCodecPool(processes=2)
    if json_request_offloaded(len(body), header_length, codec.offload_bytes):   # gpud.api.http_infer
        codec.decode(body, header_length, "model", "", max_elements, done)   # done(InferRequest | exception)
    if json_response_offloaded(response, request, codec.offload_bytes):
        codec.encode(response, request, done)                                # done(EncodedResponse | exception)
    codec.close()
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from typing import Any

from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferResponse
from gpud.api.http_server import Body
from gpud.api.http_infer import EncodedResponse, decode_infer_request, encode_infer_response

log = logging.getLogger(__name__)

DEFAULT_OFFLOAD_BYTES = 1 << 20  # a 1 MiB JSON body takes ~8 ms to decode on the loop: more goes to a child
DEFAULT_PROCESSES = 2
IN_FLIGHT_PER_PROCESS = 4
CHILD_NICE = 10
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A frame, both ways: u64 pickle length, u32 buffer count, a u64 length per buffer, then the pickle (protocol 5) and
# its out-of-band buffers. A job is (kind, arguments); an answer ("ok", result) or ("error", exception).
_FRAME = struct.Struct("<QI")
_MAPPED_BYTES = 1 << 20  # a buffer from a child at least this long is received into mapped memory
_LENGTH = struct.Struct("<Q")

Done = Callable[[Any], None]


class _ChildGone(Exception):
    pass


def _frame(obj: Any) -> tuple[bytes, list[memoryview]]:
    """The frame's head and pickle, and its buffers (views of the objects' own memory: nothing is copied)."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    return _FRAME.pack(len(data), len(raws)) + b"".join(_LENGTH.pack(r.nbytes) for r in raws) + data, raws


def _slim(request: InferRequest) -> InferRequest:
    """What encoding an answer reads of its request (not the inputs, which would be sent for nothing)."""
    return InferRequest(request.model_name, [], request.model_version, request.id, request.outputs, request.priority,
                        request.timeout_us, request.parameters)


class _Child:
    """One codec process and the parent's end of its socketpair."""

    def __init__(self) -> None:
        parent, child = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PROJECT_ROOT, env.get("PYTHONPATH", "")) if p)
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "gpud.api.json_codec", "--fd", str(child.fileno())],
                                         pass_fds=[child.fileno()], env=env, cwd=_PROJECT_ROOT,
                                         stdin=subprocess.DEVNULL)
        finally:
            child.close()
        parent.setblocking(False)
        self.sock = parent

    async def run(self, loop: asyncio.AbstractEventLoop, job: tuple) -> Any:
        head, buffers = _frame(job)
        try:
            await loop.sock_sendall(self.sock, head)
            for buffer in buffers:
                await loop.sock_sendall(self.sock, buffer)
            del buffers
            data_length, count = _FRAME.unpack(await self._read(loop, _FRAME.size))
            lengths = _LENGTH.size * count
            lengths = [n for (n,) in _LENGTH.iter_unpack(await self._read(loop, lengths))] if count else []
            data = await self._read(loop, data_length)
            received = [await self._read(loop, n) for n in lengths]
        except OSError as e:
            raise _ChildGone(str(e)) from None
        status, value = pickle.loads(data, buffers=received)
        if status == "error":
            raise value
        return value

    async def _read(self, loop: asyncio.AbstractEventLoop, n: int) -> bytearray | mmap.mmap:
        # Received into place: a tensor's (or an answer's) memory is this, not a copy of it. A large one is mapped
        # memory, whose pages the kernel zeroes as the reads reach them: a bytearray is zeroed whole at once, which
        # held the loop ~10-25 ms for a 60 MB answer.
        out: bytearray | mmap.mmap = mmap.mmap(-1, n) if n >= _MAPPED_BYTES else bytearray(n)
        view = memoryview(out)
        got = 0
        while got < n:
            k = await loop.sock_recv_into(self.sock, view[got:])
            if k == 0:
                raise _ChildGone("the JSON codec process closed its socket")
            got += k
        return out

    def close(self, kill: bool = False) -> None:
        """An idle child exits when it reads EOF; a busy one (or one whose framing is lost) is killed."""
        self.sock.close()
        if kill:
            self.proc.kill()
        try:
            self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class JsonCodecPool:
    """Decodes inference bodies whose JSON part is at least `offload_bytes` long, and encodes answers with about as
    much JSON, in up to `processes` child processes (started on first use, kept; a dead one is replaced). Which ones:
    gpud.api.http_infer's json_request_offloaded and json_response_offloaded (compiled: asked of every request). Used
    from the event loop's thread only."""

    def __init__(self, processes: int = DEFAULT_PROCESSES, offload_bytes: int = DEFAULT_OFFLOAD_BYTES,
                 max_in_flight: int | None = None):
        if processes < 1 or offload_bytes < 0:
            raise ValueError(f"a JSON codec pool needs processes >= 1 and offload_bytes >= 0, got {processes} "
                             f"and {offload_bytes}")
        self.processes = processes
        self.offload_bytes = offload_bytes
        self.max_in_flight = max_in_flight if max_in_flight is not None else processes * IN_FLIGHT_PER_PROCESS
        self.in_flight = 0  # jobs waiting for a child or running
        self.decoded = 0  # bodies decoded in a child (for tests and logs)
        self.encoded = 0  # answers encoded in a child
        self._idle: list[_Child] = []
        self._started = 0  # children alive (idle or busy)
        self._waiters: deque[asyncio.Future] = deque()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    # --- what goes to a child ------------------------------------------------------------------------------------
    def decode(self, body: Body, header_length: str | None, model_name: str, model_version: str,
               max_elements: int, done: Done) -> None:
        """Decode in a child; `done` is called on the event loop with the InferRequest or the error (503 when too
        many jobs are in flight already or the child died)."""
        if self._full():
            done(InferenceError(ErrorKind.UNAVAILABLE,
                                f"{self.in_flight} large JSON requests are being decoded or answered already; retry "
                                "later, or send tensors as binary data (the binary tensor data extension)"))
            return
        job = ("decode", (pickle.PickleBuffer(body), header_length, model_name, model_version, max_elements))
        self._start(job, done, "decoded")

    def encode(self, response: InferResponse, request: InferRequest, done: Done) -> None:
        """Encode in a child; `done` is called on the event loop with the EncodedResponse or the error. When the
        pool is full the answer is encoded here at once: it has been computed, and refusing it would waste that."""
        if self._full():
            try:
                done(encode_infer_response(response, request))
            except Exception as e:  # noqa: BLE001 - answered by the front end like any encoding error
                done(e)
            return
        def encoded(result: Any) -> None:
            done(EncodedResponse(*result) if isinstance(result, tuple) else result)
        self._start(("encode", (response, _slim(request))), encoded, "encoded")

    def _full(self) -> bool:
        return self.in_flight >= self.max_in_flight or self._closed

    def _start(self, job: tuple, done: Done, counter: str) -> None:
        self.in_flight += 1
        task = asyncio.ensure_future(self._job(job))
        self._tasks.add(task)

        def finished(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            self.in_flight -= 1
            if t.cancelled():
                done(InferenceError(ErrorKind.UNAVAILABLE, "the server is shutting down"))
            elif t.exception() is not None:
                done(t.exception())
            else:
                setattr(self, counter, getattr(self, counter) + 1)
                done(t.result())

        task.add_done_callback(finished)

    # --- children --------------------------------------------------------------------------------------------------
    async def _job(self, job: tuple) -> Any:
        child = await self._acquire()
        try:
            result = await child.run(asyncio.get_running_loop(), job)
        except _ChildGone as e:
            log.warning("a JSON codec process (pid %d) died: %s; its request is answered 503, a new one will start",
                        child.proc.pid, e)
            self._lost(child)
            raise InferenceError(ErrorKind.UNAVAILABLE,
                                 "the process decoding or encoding the JSON body exited (out of memory?); retry, or "
                                 "send tensors as binary data (the binary tensor data extension)") from None
        except InferenceError:
            self._release(child)  # a client's bad body, answered by the child: it is fine
            raise
        except BaseException:
            # cancelled, or a bug mid-exchange: the socket's framing is unknown now, so the child is not reused
            self._lost(child)
            raise
        self._release(child)
        return result

    async def _acquire(self) -> _Child:
        while True:
            if self._idle:
                return self._idle.pop()
            if self._started < self.processes:
                self._started += 1
                try:
                    child = _Child()
                except OSError:
                    self._started -= 1
                    raise
                if self._started == 1:
                    log.info("JSON bodies and answers of %d bytes or more are decoded and encoded in up to %d child "
                             "process(es)", self.offload_bytes, self.processes)
                return child
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def _release(self, child: _Child) -> None:
        self._idle.append(child)
        self._wake()

    def _lost(self, child: _Child) -> None:
        self._started -= 1
        child.close(kill=True)
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        """Cancel the jobs not yet done (answered 503) and stop the children."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for child in self._idle:
            child.close()
        self._idle.clear()


# --- the child --------------------------------------------------------------------------------------------------------
def _recv_exactly(sock: socket.socket, n: int) -> bytearray | None:
    out = bytearray(n)
    view = memoryview(out)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return out


def _recv_frame(sock: socket.socket) -> Any:
    head = _recv_exactly(sock, _FRAME.size)
    if head is None:
        return None
    data_length, count = _FRAME.unpack(head)
    lengths = [n for (n,) in _LENGTH.iter_unpack(_recv_exactly(sock, _LENGTH.size * count) or b"")] if count else []
    data = _recv_exactly(sock, data_length)
    buffers = [_recv_exactly(sock, n) for n in lengths]
    if data is None or any(b is None for b in buffers):
        return None
    return pickle.loads(data, buffers=buffers)


def _work(kind: str, args: tuple) -> Any:
    if kind == "decode":
        body, header_length, model_name, model_version, max_elements = args
        request = decode_infer_request(body, header_length, model_name, model_version, max_elements)
        request.signature = None  # a parsed-header plan is only worth anything in the process that keeps it
        return request
    response, request = args
    encoded = encode_infer_response(response, request)
    # The body travels as an out-of-band pickle buffer (no copy); the parent receives a view of it and makes the
    # EncodedResponse (a tuple here: a PickleBuffer is no AnswerBody).
    return pickle.PickleBuffer(encoded.body), encoded.content_type, encoded.headers


def _serve(sock: socket.socket) -> None:
    while True:
        job = _recv_frame(sock)
        if job is None:
            return  # the daemon closed the pool (or died)
        try:
            answer = ("ok", _work(*job))
        except InferenceError as e:
            answer = ("error", e)
        except Exception as e:  # noqa: BLE001 - a bug: the daemon answers 500 and logs it
            answer = ("error", RuntimeError(f"JSON {job[0]} failed: {type(e).__name__}: {e}"))
        del job
        head, buffers = _frame(answer)
        sock.sendall(head)
        for buffer in buffers:
            sock.sendall(buffer)
        del answer, buffers  # the tensors are freed before the next job arrives


def child_main(fd: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon drains on these and then closes our socket
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.nice(CHILD_NICE)
    sock = socket.socket(fileno=fd)
    try:
        _serve(sock)
    except OSError:
        pass  # the daemon went away mid-answer
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="gpud's JSON codec process (started by the daemon)")
    parser.add_argument("--fd", type=int, required=True)
    sys.exit(child_main(parser.parse_args().fd))
