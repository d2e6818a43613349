"""The daemon's end of one worker process's socket pair: typed messages out, and in without ever blocking the loop.

Frames are multiprocessing.Connection's (a 4-byte big-endian length, or -1 and an 8-byte one, then the payload);
payloads are gpud.executor.protocol messages. Sends block (they are small, and the worker always reads); reads are one
non-blocking recv per readable event on a second descriptor of the socket, instead of Connection.poll (a selector
per call) and recv. A batch is `submit`ted with a callback, called once with the worker's Done or Failed; other
messages go to `on_message`; the socket's end goes to `on_closed`, after every reply that arrived before it. Whoever
closes the channel gets the callbacks of the batches left unanswered. One channel per worker process: a restarted
worker gets a new one (gpud.executor.supervisor).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import select
import socket
from collections.abc import Callable
from typing import Any, cast
from multiprocessing.connection import Connection

from gpud.executor.busy import BusyTracker
from gpud.executor.protocol import Done, Failed, FromWorker, Infer, ToWorker, dumps, loads
from gpud.executor.types import ErrorKind, InferenceError

log = logging.getLogger("gpud.executor")

READ_CHUNK_BYTES = 1 << 18

Reply = Done | Failed | InferenceError
"""A batch's answer: the worker's outputs (Done), its error (Failed), or the worker lost (InferenceError)."""
"""What a batch's callback gets: the worker's answer, or the error that it will never come."""


class WorkerChannel:
    def __init__(self, sock: socket.socket, *, name: str, on_message: Callable[[FromWorker], None],
                 on_closed: Callable[[], None], busy: BusyTracker, clock: Callable[[], float] | None = None):
        """`sock`: the daemon's end (taken over). `name` names the worker in logs. `busy` is told when batches start
        and end. With a `clock`, when each unanswered batch was sent is kept in `sent_s` (the hang watch)."""
        self.name = name
        self.on_message = on_message
        self.on_closed = on_closed
        self.busy = busy
        self.clock = clock
        self.conn: Connection | None = Connection(sock.detach())
        # A second descriptor on the same socket, for non-blocking reads (the Connection keeps blocking sends).
        self._rsock: socket.socket | None = socket.socket(fileno=os.dup(self.conn.fileno()))
        # poll()'s look at the socket: a zero-timeout poll costs a third of a recv that finds nothing and raises
        self._poller = select.poll()
        self._poller.register(self._rsock.fileno(), select.POLLIN)
        self._rbuf = bytearray()
        self._reading = False  # in _on_readable: a callback's poll() must not re-enter it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._seq = itertools.count()
        self._inflight: dict[int, Callable[[Reply], None]] = {}
        self.sent_s: dict[int, float] = {}  # seq -> when sent, oldest first (only with a clock)

    @property
    def closed(self) -> bool:
        return self.conn is None

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def oldest_sent_s(self) -> float | None:
        """When the oldest unanswered batch was sent, or None when none is (or no clock keeps the times)."""
        return next(iter(self.sent_s.values()), None)

    def start_reading(self) -> None:
        """Handle what the worker sends from the running event loop's reader callbacks."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._conn().fileno(), self._on_readable)

    # --- out ---------------------------------------------------------------------------------------------------
    def _conn(self) -> Connection:
        conn = self.conn
        if conn is None:
            raise InferenceError(ErrorKind.UNAVAILABLE, f"the channel to worker {self.name} is closed")
        return conn

    def send(self, msg: ToWorker) -> None:
        self._conn().send_bytes(dumps(msg))

    def submit(self, msg: Infer, callback: Callable[[Reply], None]) -> int:
        """Send a batch, numbered; `callback` gets its reply. Raises (OSError) when the worker is gone."""
        seq = next(self._seq)
        self.send(msg.numbered(seq))
        if self.clock is not None:
            self.sent_s[seq] = self.clock()
        self._inflight[seq] = callback
        self.busy.begin()
        return seq

    def close(self) -> list[Callable[[Reply], None]]:
        """Stop reading and close both descriptors; returns the callbacks of the batches left unanswered (the
        caller fails them). Idempotent."""
        inflight, self._inflight = list(self._inflight.values()), {}
        self.sent_s.clear()
        if self.conn is not None:
            if self._loop is not None:
                try:
                    # (through Any: uvloop's returns None where asyncio's typing says bool, which compiled code
                    # would check)
                    cast(Any, self._loop).remove_reader(self.conn.fileno())
                except (ValueError, OSError, RuntimeError):  # RuntimeError: the loop is closed already
                    pass
            self.conn.close()
            self.conn = None
        if self._rsock is not None:
            self._rsock.close()
            self._rsock = None
        self._rbuf = bytearray()
        return inflight

    # --- in ----------------------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Handle replies already waiting on the pipe, without blocking. Under a flood of requests the event loop
        runs every readable socket's callback before it gets to this pipe's; a scheduler calls this while taking
        requests in, so a finished batch is answered, and its instance fed, within one request's time."""
        if self._inflight and self.conn is not None and self._poller.poll(0):
            self._on_readable()

    def _on_readable(self) -> None:
        """Read what the worker sent, without blocking, and handle every complete message."""
        rsock = self._rsock
        if rsock is None or self._reading:
            return
        self._reading = True
        try:
            self._read(rsock)
        finally:
            self._reading = False

    def _read(self, rsock: socket.socket) -> None:
        dead = False
        try:
            while True:
                try:
                    data = rsock.recv(READ_CHUNK_BYTES, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                if not data:
                    raise EOFError
                self._rbuf += data
                if len(data) < READ_CHUNK_BYTES:
                    break
        except (EOFError, OSError):
            dead = True  # but first the replies that arrived before the end: a finished batch is not a failed one
        self._handle_frames()
        if dead and self.conn is not None:
            self.on_closed()

    def _handle_frames(self) -> None:
        buf = self._rbuf
        while len(buf) >= 4:
            size = int.from_bytes(buf[:4], "big", signed=True)
            head = 4
            if size == -1:
                if len(buf) < 12:
                    return
                size = int.from_bytes(buf[4:12], "big")
                head = 12
            end = head + size
            if end > len(buf):
                return
            msg = loads(buf[head:end])
            del buf[:end]  # before handling: a handler that raises must not get its message again
            try:
                self._handle(cast(FromWorker, msg))  # a worker sends only these
            except Exception:  # a callback's bug must not strand the replies behind it
                log.exception("device %s: handling the worker's %s message failed", self.name, type(msg).__name__)
            if self.conn is None:  # the handler closed the channel (the worker is being stopped or replaced)
                return

    def _handle(self, msg: FromWorker) -> None:
        if isinstance(msg, (Done, Failed)):
            self.sent_s.pop(msg.seq, None)
            cb = self._inflight.pop(msg.seq, None)
            self.busy.end()
            if cb is not None:
                cb(msg)
        else:
            self.on_message(msg)
