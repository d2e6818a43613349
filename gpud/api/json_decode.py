"""Large JSON inference bodies decoded in child processes, so that the event loop never waits for them.

Why processes and not a thread: orjson.loads and numpy's conversion of the parsed list each hold the GIL for the
whole call. Measured (Python 3.11, orjson 3.11): a thread parsing a 73 MB JSON body of 7M floats (0.48 s to parse,
0.12 s to convert) kept the event loop's thread from running for 396 ms at a stretch, and one 60 MB body decoded on
the loop made /v2/health/ready wait 420 ms.

Why not concurrent.futures.ProcessPoolExecutor: it pickles the body on a thread of its own, and that copy (twice
60 MB) holds the GIL too: health probes waited up to 100-350 ms with four bodies at once. Here the body goes to the
child over a socketpair from the loop itself (non-blocking writes of the body's own buffer, no copy in Python), and
the tensors come back as pickle protocol 5 out-of-band buffers received straight into their arrays' memory.

Memory is bounded, not multiplied by the number of large requests: at most `processes` bodies are parsed at once,
each child peaking at about seven times its body while it parses (a Python float and a list slot for every number,
then the array; measured: 418 MB for a 58 MB body) and back to ~63 MB afterwards; at most `max_in_flight` bodies wait or run, beyond which a request is
answered 503 / UNAVAILABLE at once. The daemon itself holds each waiting body (at most --max-request-bytes) and,
once decoded, its tensors. Children run at a lower priority (nice 10): where cores are short, the event loop and the
device workers go first.

    pool = JsonDecodePool(processes=2)
    pool.decode(body, header_length, "model", "", max_elements, done)   # done(InferRequest | exception), on the loop
    pool.close()
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
from collections import deque
from collections.abc import Callable

from executor.types import ErrorKind, InferenceError, InferRequest
from gpud.api.http_infer import decode_infer_request

log = logging.getLogger(__name__)

DEFAULT_OFFLOAD_BYTES = 1 << 20  # a 1 MiB JSON body takes ~8 ms to decode on the loop: more goes to a child
DEFAULT_PROCESSES = 2
IN_FLIGHT_PER_PROCESS = 4
CHILD_NICE = 10
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A job: u64 meta length, u64 body length, then the meta (a pickle of the arguments) and the body.
# An answer: u64 meta length, u32 buffer count, a u64 length per buffer, then the meta (pickle protocol 5 of
# ("ok", InferRequest) or ("error", exception)) and the out-of-band buffers (the tensors' bytes).
_JOB = struct.Struct("<QQ")
_ANSWER = struct.Struct("<QI")
_LENGTH = struct.Struct("<Q")

Done = Callable[[InferRequest | BaseException], None]


class _ChildGone(Exception):
    pass


class _Child:
    """One decoding process and the parent's end of its socketpair."""

    def __init__(self) -> None:
        parent, child = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PROJECT_ROOT, env.get("PYTHONPATH", "")) if p)
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "gpud.api.json_decode", "--fd", str(child.fileno())],
                                         pass_fds=[child.fileno()], env=env, cwd=_PROJECT_ROOT,
                                         stdin=subprocess.DEVNULL)
        finally:
            child.close()
        parent.setblocking(False)
        self.sock = parent

    async def decode(self, loop: asyncio.AbstractEventLoop, body: bytes, args: tuple) -> InferRequest:
        meta = pickle.dumps(args)
        try:
            await loop.sock_sendall(self.sock, _JOB.pack(len(meta), len(body)) + meta)
            await loop.sock_sendall(self.sock, memoryview(body))
            meta_length, count = _ANSWER.unpack(await self._read(loop, _ANSWER.size))
            lengths = [_LENGTH.unpack_from(b, 0)[0] for b in [await self._read(loop, 8) for _ in range(count)]]
            meta = await self._read(loop, meta_length)
            buffers = [await self._read(loop, n) for n in lengths]
        except OSError as e:
            raise _ChildGone(str(e)) from None
        status, value = pickle.loads(meta, buffers=buffers)
        if status == "error":
            raise value
        return value

    async def _read(self, loop: asyncio.AbstractEventLoop, n: int) -> bytearray:
        out = bytearray(n)  # received into place: a tensor's buffer is this memory, not a copy of it
        view = memoryview(out)
        got = 0
        while got < n:
            k = await loop.sock_recv_into(self.sock, view[got:])
            if k == 0:
                raise _ChildGone("the decoding process closed its socket")
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


class JsonDecodePool:
    """Decodes inference bodies whose JSON part is at least `offload_bytes` long in up to `processes` child
    processes (started on first use, kept; a dead one is replaced). Used from the event loop's thread only."""

    def __init__(self, processes: int = DEFAULT_PROCESSES, offload_bytes: int = DEFAULT_OFFLOAD_BYTES,
                 max_in_flight: int | None = None):
        if processes < 1 or offload_bytes < 0:
            raise ValueError(f"a JSON decode pool needs processes >= 1 and offload_bytes >= 0, got {processes} "
                             f"and {offload_bytes}")
        self.processes = processes
        self.offload_bytes = offload_bytes
        self.max_in_flight = max_in_flight if max_in_flight is not None else processes * IN_FLIGHT_PER_PROCESS
        self.in_flight = 0  # bodies waiting for a child or being decoded
        self.decoded = 0  # bodies decoded in a child (for tests and logs)
        self._idle: list[_Child] = []
        self._started = 0  # children alive (idle or busy)
        self._waiters: deque[asyncio.Future] = deque()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    def wants(self, body: bytes, header_length: str | None) -> bool:
        """Whether this body's JSON part is large enough to decode in a child. A malformed header length is not:
        it is refused at once on the loop."""
        if len(body) < self.offload_bytes:
            return False
        if header_length is None:
            return True
        return header_length.isdigit() and int(header_length) >= self.offload_bytes

    def decode(self, body: bytes, header_length: str | None, model_name: str, model_version: str,
               max_elements: int, done: Done) -> None:
        """Decode in a child; `done` is called on the event loop with the InferRequest or the error (503 when too
        many bodies are in flight already or the child died)."""
        if self.in_flight >= self.max_in_flight or self._closed:
            done(InferenceError(ErrorKind.UNAVAILABLE,
                                f"{self.in_flight} large JSON request bodies are being decoded already; retry later, "
                                "or send tensors as binary data (the binary tensor data extension)"))
            return
        self.in_flight += 1
        task = asyncio.ensure_future(self._job(body, (header_length, model_name, model_version, max_elements)))
        self._tasks.add(task)

        def finished(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            self.in_flight -= 1
            if t.cancelled():
                done(InferenceError(ErrorKind.UNAVAILABLE, "the server is shutting down"))
            elif t.exception() is not None:
                done(t.exception())
            else:
                self.decoded += 1
                done(t.result())

        task.add_done_callback(finished)

    async def _job(self, body: bytes, args: tuple) -> InferRequest:
        child = await self._acquire()
        try:
            result = await child.decode(asyncio.get_running_loop(), body, args)
        except _ChildGone as e:
            log.warning("a JSON decoding process (pid %d) died: %s; its request is answered 503, a new one will start",
                        child.proc.pid, e)
            self._started -= 1
            child.close(kill=True)
            self._wake()
            raise InferenceError(ErrorKind.UNAVAILABLE,
                                 "the process decoding the JSON request body exited (out of memory?); retry, or "
                                 "send tensors as binary data (the binary tensor data extension)") from None
        except BaseException:
            # cancelled or a bug mid-exchange: the socket's framing is unknown now, so the child is not reused
            self._started -= 1
            child.close(kill=True)
            self._wake()
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
                    log.info("JSON request bodies of %d bytes or more are decoded in up to %d child process(es)",
                             self.offload_bytes, self.processes)
                return child
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def _release(self, child: _Child) -> None:
        self._idle.append(child)
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        """Cancel the bodies not yet decoded (answered 503) and stop the children."""
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


def _serve(sock: socket.socket) -> None:
    while True:
        head = _recv_exactly(sock, _JOB.size)
        if head is None:
            return  # the daemon closed the pool (or died)
        meta_length, body_length = _JOB.unpack(head)
        meta, body = _recv_exactly(sock, meta_length), _recv_exactly(sock, body_length)
        if meta is None or body is None:
            return
        header_length, model_name, model_version, max_elements = pickle.loads(meta)
        try:
            request = decode_infer_request(body, header_length, model_name, model_version, max_elements)
            request.signature = None  # a parsed-header plan is only worth anything in the process that keeps it
            answer = ("ok", request)
            del request
        except InferenceError as e:
            answer = ("error", e)
        except Exception as e:  # noqa: BLE001 - a bug: the daemon answers 500 and logs it
            answer = ("error", RuntimeError(f"decoding the JSON body failed: {type(e).__name__}: {e}"))
        del body
        buffers: list[pickle.PickleBuffer] = []
        out = pickle.dumps(answer, protocol=5, buffer_callback=buffers.append)
        raws = [b.raw() for b in buffers]
        sock.sendall(_ANSWER.pack(len(out), len(raws)) + b"".join(_LENGTH.pack(r.nbytes) for r in raws) + out)
        for raw in raws:
            sock.sendall(raw)
        del answer, buffers, raws  # the tensors are freed before the next body arrives


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="gpud's JSON request body decoder (started by the daemon)")
    parser.add_argument("--fd", type=int, required=True)
    sys.exit(child_main(parser.parse_args().fd))
