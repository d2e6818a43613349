"""One client connection of gpud's gRPC server: HTTP/2 framing, streams, flow control, and each call's task.

A unary call runs when its request has ended (END_STREAM); its answer (headers, message, trailers) goes out in one
write, with the other answers of the same event-loop turn. A streaming call runs from its headers on, its requests
fed to the handler as they arrive. Errors a client causes end its stream with a status (or its connection, for a
violation of HTTP/2), never the server. Keepalive PINGs, the client ping policy and idle connections follow
gRPC core (gpud.api.grpcwire.keepalive), on timers of the connection's event loop: nothing is timed per frame.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol

from gpud.api.grpcwire import calls, frames
from gpud.api.grpcwire.calls import CallAborted, CallContext, MessageReader, Method, Received
from gpud.api.grpcwire.hpack_decoder import Decoder, HpackError
from gpud.api.grpcwire.keepalive import Keepalive, PingStrikes

log = logging.getLogger("gpud.grpc")

# What gpud lets a client send before it acknowledges: a stream's window, and the connection's. Received data is
# acknowledged when it is read (the message limit bounds what one call holds), once half a window is used.
STREAM_WINDOW_BYTES = 4 * 2**20
CONNECTION_WINDOW_BYTES = 16 * 2**20
MAX_FRAME_BYTES = 2**20  # the largest frame a client may send (advertised; HTTP/2's default is 16 KiB)
MAX_CONCURRENT_STREAMS = 1024
KEEPALIVE_PING = b"gpud-ka\x00"  # the opaque data of the server's keepalive PINGs, which the ACK echoes

_END = object()  # the end of a streaming call's requests


class ServerSide(Protocol):
    """What a connection reads of its server (gpud.api.grpcwire.server.GrpcServer)."""

    methods: dict[str, Method]
    max_message_bytes: int
    max_metadata_bytes: int
    max_connections: int
    keepalive: Keepalive
    connections: set[GrpcConnection]
    stopping: bool

    def open_connections(self) -> int: ...

    def counted(self) -> None: ...


class _ConnectionError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class _Stream:
    __slots__ = ("id", "path", "method", "context", "reader", "request", "requests", "task", "cancel", "started",
                 "remote_closed", "done", "send_window", "unacked", "pending", "trailers", "headers_sent", "deadline",
                 "writable")

    def __init__(self, stream_id: int, send_window: int):
        self.id = stream_id
        self.path = ""
        self.method: Method | None = None
        self.context: CallContext | None = None
        self.reader: MessageReader | None = None
        self.request: Received | None = None  # a unary call's request, once in
        self.requests: asyncio.Queue | None = None  # a streaming call's requests
        self.task: asyncio.Task | None = None
        self.cancel: Callable[[], None] | None = None  # a call answered by callback (Method.start): stops it
        self.started = False  # its handler (task or start) has been called
        self.remote_closed = False
        self.done = False  # this side has sent its end (trailers or a reset)
        self.send_window = send_window
        self.unacked = 0  # received bytes not yet acknowledged by a WINDOW_UPDATE
        self.pending: list[bytes] = []  # DATA payload bytes waiting for window
        self.trailers: bytes | None = None  # the status block, sent once `pending` is out
        self.headers_sent = False
        self.deadline: asyncio.TimerHandle | None = None
        self.writable: asyncio.Event | None = None  # set when a streaming call's output is no longer blocked


class _Requests:
    """A client-streaming call's requests, each parsed as it comes, until the client ends its side. A class, not an
    async generator: mypyc compiles no async generators (this module is compiled, gpud.compiled)."""

    def __init__(self, queue: asyncio.Queue, parse: Callable[[Received], Any]):
        self._queue = queue
        self._parse = parse
        self._ended = False

    def __aiter__(self) -> _Requests:
        return self

    async def __anext__(self) -> Any:
        if self._ended:
            raise StopAsyncIteration
        message = await self._queue.get()
        if message is _END:
            self._ended = True
            raise StopAsyncIteration
        return self._parse(message)


class GrpcConnection(asyncio.Protocol):
    def __init__(self, server: ServerSide):
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._preface = False
        self._decoder = Decoder()
        self._streams: dict[int, _Stream] = {}
        self._last_stream_id = 0
        self._send_window = frames.DEFAULT_WINDOW_BYTES  # the connection's, for DATA this side sends
        self._peer_stream_window = frames.DEFAULT_WINDOW_BYTES
        self._peer_max_frame = frames.DEFAULT_MAX_FRAME_BYTES
        self._unacked = 0
        self._buffered = 0  # bytes of incomplete messages, over all streams
        self._continuation: tuple[int, int, list[bytes]] | None = None  # a header block in pieces
        self._blocked: dict[int, _Stream] = {}
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._going_away = False
        self._table_update = False  # the next header block sent signals an empty table (see _block)
        # Keepalive (gpud.api.grpcwire.keepalive). `_data_sent`: HEADERS or DATA sent since the last PING either way,
        # set where they are written and read only when a PING goes or comes (gRPC core then forgives the client's
        # ping strikes and lets keepalive PINGs go again).
        self._keepalive = server.keepalive
        self._data_sent = False
        self._pings_without_data = 0
        self._strikes = PingStrikes(self._keepalive)
        self._keepalive_timer: asyncio.TimerHandle | None = None  # the next keepalive PING
        self._keepalive_watchdog: asyncio.TimerHandle | None = None  # its ACK's deadline
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_checked_stream_id = 0  # `_last_stream_id` at the last idle check
        self._idle_at_check = True  # no stream was open at the last idle check
        self.peer = "unknown"
        self.idle = asyncio.Event()  # no stream open: set when the server may close the connection
        self.idle.set()

    # --- asyncio.Protocol ------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self.peer = calls.peer_string(transport.get_extra_info("peername"))
        open_now = self._server.open_connections()
        if open_now >= self._server.max_connections:
            log.warning("gRPC connection from %s refused: %d connections open (--grpc-max-connections)", self.peer,
                        open_now)
            transport.write(frames.settings_frame({}) +  # type: ignore[attr-defined]
                            frames.goaway(0, frames.REFUSED_STREAM, b"too many connections"))
            transport.close()
            self._transport = None
            return
        self._server.connections.add(self)
        self._server.counted()
        self._write(frames.settings_frame({
            frames.SETTINGS_MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
            frames.SETTINGS_INITIAL_WINDOW_SIZE: STREAM_WINDOW_BYTES,
            frames.SETTINGS_MAX_FRAME_SIZE: MAX_FRAME_BYTES,
            frames.SETTINGS_ENABLE_PUSH: 0,
        }) + frames.window_update(0, CONNECTION_WINDOW_BYTES - frames.DEFAULT_WINDOW_BYTES))
        self._keepalive_timer = self._loop.call_later(self._keepalive.time_ms / 1000, self._send_keepalive)
        if self._keepalive.max_connection_idle_ms:
            self._idle_timer = self._loop.call_later(self._keepalive.max_connection_idle_ms / 1000, self._check_idle)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        for timer in (self._keepalive_timer, self._keepalive_watchdog, self._idle_timer):
            if timer is not None:
                timer.cancel()
        self._keepalive_timer = self._keepalive_watchdog = self._idle_timer = None
        self._server.connections.discard(self)
        self._server.counted()
        for stream in list(self._streams.values()):
            self._drop(stream)
        self.idle.set()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        i = 0
        try:
            if not self._preface:
                if len(buffer) < len(frames.PREFACE):
                    if not frames.PREFACE.startswith(bytes(buffer)):
                        raise _ConnectionError(frames.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                if buffer[:len(frames.PREFACE)] != frames.PREFACE:
                    raise _ConnectionError(frames.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self._preface = True
                i = len(frames.PREFACE)
            n = len(buffer)
            while n - i >= 9:
                length = (buffer[i] << 16) | (buffer[i + 1] << 8) | buffer[i + 2]
                if length > MAX_FRAME_BYTES:
                    raise _ConnectionError(frames.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                end = i + 9 + length
                if end > n:
                    break
                kind, flags = buffer[i + 3], buffer[i + 4]
                stream_id = int.from_bytes(buffer[i + 5:i + 9], "big") & 0x7FFFFFFF
                payload = bytes(buffer[i + 9:end])
                i = end
                self._frame(kind, flags, stream_id, payload)
                if self._transport is None:
                    return
        except _ConnectionError as exc:
            log.info("gRPC connection from %s closed: %s", self.peer, exc)
            self._close(exc.code, str(exc))
            return
        except Exception as bug:  # noqa: BLE001 - a bug of ours: said, and its calls end with the connection
            # (left to the event loop, the transport would close with a generic line, and a client's streams with
            # no status, which some clients wait on for ever)
            log.exception("gRPC connection from %s closed: an internal error handling its frames", self.peer)
            self._close(frames.INTERNAL_ERROR, f"internal error: {type(bug).__name__}")
            return
        del buffer[:i]

    # --- frames in -------------------------------------------------------------------------------------------------
    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._continuation is not None and kind != frames.CONTINUATION:
            raise _ConnectionError(frames.PROTOCOL_ERROR, "a header block interrupted")
        if kind == frames.DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == frames.HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == frames.CONTINUATION:
            if self._continuation is None or self._continuation[0] != stream_id:
                raise _ConnectionError(frames.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
            _, first_flags, pieces = self._continuation
            pieces.append(payload)
            if flags & frames.END_HEADERS:
                self._continuation = None
                self._on_header_block(stream_id, first_flags, b"".join(pieces))
            elif sum(map(len, pieces)) > self._server.max_metadata_bytes + 65536:
                raise _ConnectionError(frames.PROTOCOL_ERROR, "a header block over the metadata limit")
        elif kind == frames.SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == frames.WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == frames.PING:
            if len(payload) != 8 or stream_id:
                raise _ConnectionError(frames.FRAME_SIZE_ERROR if len(payload) != 8 else frames.PROTOCOL_ERROR,
                                       "a malformed PING")
            if flags & frames.ACK:
                if payload == KEEPALIVE_PING:
                    self._keepalive_acked()
            else:
                self._on_ping(payload)
        elif kind == frames.RST_STREAM:
            if not stream_id or len(payload) != 4:
                raise _ConnectionError(frames.PROTOCOL_ERROR, "a malformed RST_STREAM")
            stream = self._streams.get(stream_id)
            if stream is not None:
                self._drop(stream)
        elif kind == frames.GOAWAY:
            self._going_away = True  # the client opens no more streams; the open ones finish
        elif kind == frames.PUSH_PROMISE:
            raise _ConnectionError(frames.PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # PRIORITY and unknown frame types are ignored, as HTTP/2 asks

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise _ConnectionError(frames.PROTOCOL_ERROR, "DATA on stream 0")
        stream = self._streams.get(stream_id)
        open_stream = stream is not None and not stream.remote_closed
        if not open_stream and stream_id > self._last_stream_id:
            raise _ConnectionError(frames.PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
        self._unacked += len(payload)  # counted for the connection even on a stream this side ended or reset
        if self._unacked >= CONNECTION_WINDOW_BYTES // 2:  # acknowledged once half a window is used
            self._write(frames.window_update(0, self._unacked))
            self._unacked = 0
        if not open_stream:
            return  # a stream this side ended or reset: its data is dropped
        assert stream is not None
        stream.unacked += len(payload)
        if stream.unacked >= STREAM_WINDOW_BYTES // 2 and not flags & frames.END_STREAM:
            self._write(frames.window_update(stream_id, stream.unacked))
            stream.unacked = 0
        if flags & frames.PADDED:
            payload = _unpad(payload)
        if stream.reader is not None and payload and not stream.done:
            self._take(stream, stream.reader, payload)
        if flags & frames.END_STREAM:
            self._remote_end(stream)

    def _take(self, stream: _Stream, reader: MessageReader, payload: bytes) -> None:
        """The stream's DATA into its reader; the messages it completes to the call."""
        before = reader.buffered_bytes
        try:
            messages = reader.feed(payload)
        except CallAborted as exc:
            self._buffered += reader.buffered_bytes - before
            self._finish(stream, exc.code, exc.details)
            return
        self._buffered += reader.buffered_bytes - before
        if self._buffered > 2 * self._server.max_message_bytes:
            # Each message is within the limit, but the connection's streams together hold more than two: one client
            # must not hold the daemon's memory with many half-sent messages.
            self._finish(stream, calls.RESOURCE_EXHAUSTED, "the connection's incomplete messages hold over "
                         f"{2 * self._server.max_message_bytes} bytes; send fewer large messages at once")
            return
        for message in messages:
            if stream.requests is not None:
                stream.requests.put_nowait(message)
            elif stream.request is None:
                stream.request = message
            else:
                self._finish(stream, calls.UNIMPLEMENTED, "more than one request message for a unary method")
                return

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise _ConnectionError(frames.PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & frames.PADDED:
            payload = _unpad(payload)
        if flags & frames.PRIORITY_FLAG:
            payload = payload[5:]
        if not flags & frames.END_HEADERS:
            self._continuation = (stream_id, flags, [payload])
            return
        self._on_header_block(stream_id, flags, payload)

    def _on_header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        try:
            headers = self._decoder.decode(block)  # always, so that the decoder's table stays in step
        except HpackError as exc:
            raise _ConnectionError(frames.COMPRESSION_ERROR, str(exc)) from None
        stream = self._streams.get(stream_id)
        if stream is not None:  # the client's trailers: the end of its requests
            if not flags & frames.END_STREAM:
                raise _ConnectionError(frames.PROTOCOL_ERROR, "a second header block without END_STREAM")
            self._remote_end(stream)
            return
        if stream_id % 2 == 0:
            raise _ConnectionError(frames.PROTOCOL_ERROR, f"HEADERS opening stream {stream_id}")
        if stream_id <= self._last_stream_id:
            return  # a stream this side has ended or reset: what was in flight is ignored
        self._last_stream_id = stream_id
        if self._going_away or self._server.stopping or len(self._streams) >= MAX_CONCURRENT_STREAMS:
            self._write(frames.rst_stream(stream_id, frames.REFUSED_STREAM))
            return
        stream = _Stream(stream_id, self._peer_stream_window)
        self._streams[stream_id] = stream
        self.idle.clear()
        if flags & frames.END_STREAM:
            stream.remote_closed = True
        self._open(stream, headers)

    def _open(self, stream: _Stream, headers: list[tuple[str, str]]) -> None:
        server = self._server
        path = method_name = content_type = encoding = timeout = None
        size = 0
        for name, value in headers:
            size += len(name) + len(value) + 32
            if name == ":path":
                path = value
            elif name == ":method":
                method_name = value
            elif name == "content-type":
                content_type = value
            elif name == "grpc-encoding":
                encoding = value
            elif name == "grpc-timeout":
                timeout = value
        if method_name != "POST":
            self._refuse(stream, 405)
            return
        if content_type is None or not content_type.startswith("application/grpc"):
            self._refuse(stream, 415)
            return
        if size > server.max_metadata_bytes:
            self._finish(stream, calls.RESOURCE_EXHAUSTED,
                         f"received metadata of {size} bytes, over the limit of {server.max_metadata_bytes}")
            return
        method = server.methods.get(path or "")
        if method is None:
            self._finish(stream, calls.UNIMPLEMENTED, f"Method not found: {path}")
            return
        if encoding is not None and encoding not in calls.SUPPORTED_ENCODINGS:
            self._finish(stream, calls.UNIMPLEMENTED, f"grpc-encoding '{encoding}' is not supported")
            return
        stream.method = method
        stream.path = path or ""
        stream.context = CallContext(headers, self.peer)
        stream.reader = MessageReader(server.max_message_bytes, encoding)
        if timeout is not None:
            seconds = calls.timeout_seconds(timeout)
            if seconds is not None:
                stream.deadline = self._loop.call_later(seconds, self._expire, stream)
        if method.client_streaming:
            stream.requests = asyncio.Queue()
            stream.task = self._loop.create_task(self._run_streaming(stream, method))
            stream.started = True
            if stream.remote_closed:
                stream.requests.put_nowait(_END)
        elif stream.remote_closed:
            self._remote_end(stream)

    def _remote_end(self, stream: _Stream) -> None:
        if stream.remote_closed and stream.started:
            return
        stream.remote_closed = True
        if stream.done:
            self._forget(stream)
            return
        if stream.reader is not None and stream.reader.partial:
            self._finish(stream, calls.INTERNAL, "the request ended inside a message")
            return
        if stream.requests is not None:
            stream.requests.put_nowait(_END)
        elif stream.method is not None and not stream.started:
            if stream.request is None:
                self._finish(stream, calls.UNIMPLEMENTED, "no request message for a unary method")
                return
            request, stream.request = stream.request, None
            stream.started = True
            if stream.method.server_streaming:
                stream.task = self._loop.create_task(self._run_streaming(stream, stream.method, request))
            elif stream.method.start is not None:
                self._start(stream, stream.method.start, request)
            else:
                stream.task = self._loop.create_task(self._run_unary(stream, stream.method, request))

    def _on_ping(self, payload: bytes) -> None:
        if self._data_sent:
            self._data_flowed()
        self._write(frames.frame(frames.PING, frames.ACK, 0, payload))  # acknowledged even if over, as core does
        idle = not self._streams and not self._keepalive.permit_without_calls
        if self._strikes.received(self._loop.time(), idle):
            log.info("gRPC connection from %s closed: %d PINGs too soon (--grpc-http2-min-recv-ping-interval-"
                     "without-data, --grpc-http2-max-ping-strikes)", self.peer, self._strikes.strikes)
            self._close(frames.ENHANCE_YOUR_CALM, "too_many_pings")

    def _data_flowed(self) -> None:
        """HEADERS or DATA went out since the last PING: the client's strikes are forgiven, keepalive PINGs may go."""
        self._data_sent = False
        self._strikes.forgive()
        self._pings_without_data = 0

    # --- keepalive and idleness (timers) ---------------------------------------------------------------------------
    def _send_keepalive(self) -> None:
        self._keepalive_timer = None
        if self._transport is None:
            return
        keepalive = self._keepalive
        if self._data_sent:
            self._data_flowed()
        if (not self._streams and not keepalive.permit_without_calls) or \
                (keepalive.max_pings_without_data and self._pings_without_data >= keepalive.max_pings_without_data):
            self._keepalive_timer = self._loop.call_later(keepalive.time_ms / 1000, self._send_keepalive)
            return
        self._pings_without_data += 1
        self._write(frames.frame(frames.PING, 0, 0, KEEPALIVE_PING))
        self._keepalive_watchdog = self._loop.call_later(keepalive.timeout_ms / 1000, self._keepalive_expired)

    def _keepalive_acked(self) -> None:
        if self._keepalive_watchdog is None:
            return  # not awaited (a client echoing our data unasked)
        self._keepalive_watchdog.cancel()
        self._keepalive_watchdog = None
        self._keepalive_timer = self._loop.call_later(self._keepalive.time_ms / 1000, self._send_keepalive)

    def _keepalive_expired(self) -> None:
        self._keepalive_watchdog = None
        log.info("gRPC connection from %s closed: no PING ACK within %d ms (--grpc-keepalive-timeout)", self.peer,
                 self._keepalive.timeout_ms)
        self._close(frames.NO_ERROR, "keepalive watchdog timeout")

    def _check_idle(self) -> None:
        """Closes the connection if no call was open since the last check, a period ago; else checks again."""
        self._idle_timer = None
        if self._transport is None:
            return
        idle = not self._streams
        if idle and self._idle_at_check and self._last_stream_id == self._idle_checked_stream_id:
            log.info("gRPC connection from %s closed: no call for %d ms (--grpc-max-connection-idle-ms)", self.peer,
                     self._keepalive.max_connection_idle_ms)
            self._going_away = True
            self._close(frames.NO_ERROR, "connection idle")  # core's words (with INTERNAL_ERROR)
            return
        self._idle_at_check = idle
        self._idle_checked_stream_id = self._last_stream_id
        self._idle_timer = self._loop.call_later(self._keepalive.max_connection_idle_ms / 1000, self._check_idle)

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id or len(payload) % 6:
            raise _ConnectionError(frames.PROTOCOL_ERROR, "a malformed SETTINGS frame")
        if flags & frames.ACK:
            return
        for key, value in frames.parse_settings(payload):
            if key == frames.SETTINGS_INITIAL_WINDOW_SIZE:
                if value > frames.MAX_WINDOW_BYTES:
                    raise _ConnectionError(frames.FLOW_CONTROL_ERROR, "an initial window over 2^31-1")
                delta = value - self._peer_stream_window
                self._peer_stream_window = value
                for stream in self._streams.values():
                    stream.send_window += delta
            elif key == frames.SETTINGS_HEADER_TABLE_SIZE:
                self._table_update = value < frames.DEFAULT_TABLE_BYTES
            elif key == frames.SETTINGS_MAX_FRAME_SIZE:
                if not frames.DEFAULT_MAX_FRAME_BYTES <= value <= 2**24 - 1:
                    raise _ConnectionError(frames.PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value}")
                self._peer_max_frame = value
        self._write(frames.frame(frames.SETTINGS, frames.ACK, 0))
        self._pump_blocked()

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(frames.FRAME_SIZE_ERROR, "a malformed WINDOW_UPDATE")
        increment = frames.u32(payload) & 0x7FFFFFFF
        if stream_id == 0:
            self._send_window += increment
            if self._send_window > frames.MAX_WINDOW_BYTES:
                raise _ConnectionError(frames.FLOW_CONTROL_ERROR, "the connection's window over 2^31-1")
            self._pump_blocked()
            return
        stream = self._streams.get(stream_id)
        if stream is not None:
            stream.send_window += increment
            if stream.pending:
                self._pump(stream)

    # --- calls -----------------------------------------------------------------------------------------------------
    def _start(self, stream: _Stream, start: Callable, request: Received) -> None:
        """A unary call answered by callback (`Method.start`): no task, no coroutine."""
        try:
            cancel = start(request, stream.context, functools.partial(self._reply, stream))
        except Exception as exc:  # noqa: BLE001 - a handler's bug answers INTERNAL; the server goes on
            log.error("gRPC call %s from %s failed", stream.path, self.peer, exc_info=exc)
            self._finish(stream, calls.INTERNAL, f"{type(exc).__name__}: {exc}")
            return
        if not stream.done:
            stream.cancel = cancel

    def _reply(self, stream: _Stream, code: int, details: str, message: Any) -> None:
        stream.cancel = None
        if code == calls.OK:
            self._answer(stream, message)
        else:
            self._finish(stream, code, details)

    @staticmethod
    def _stop_call(stream: _Stream, task_too: bool = True) -> None:
        """Stop what runs the call (its task, or its callback's request) because the call ends without it."""
        if stream.task is not None and task_too:
            stream.task.cancel()
        cancel, stream.cancel = stream.cancel, None
        if cancel is not None:
            cancel()

    async def _run_unary(self, stream: _Stream, method: Method, request: Received) -> None:
        try:
            response = await method.handler(method.parse(request), stream.context)
            message = method.serialize(response)
        except CallAborted as exc:
            self._finish(stream, exc.code, exc.details)
        except Exception as bug:  # noqa: BLE001 - a handler's bug answers INTERNAL; the server goes on
            log.error("gRPC call %s from %s failed", stream.path, self.peer, exc_info=bug)
            self._finish(stream, calls.INTERNAL, f"{type(bug).__name__}: {bug}")
        else:
            self._answer(stream, message)

    async def _run_streaming(self, stream: _Stream, method: Method, request: Received = b"") -> None:
        """A call with a stream either way; `request`: the one request of a call that streams only answers."""
        try:
            argument: Any
            if method.client_streaming:
                argument = self._requests(stream, method)
            else:
                argument = method.parse(request)
            if method.server_streaming:
                async for response in method.handler(argument, stream.context):
                    if stream.done:
                        return
                    self._send_message(stream, calls.framed(method.serialize(response)))
                    if stream.pending:  # the client reads slower than the handler answers: wait for its window
                        stream.writable = stream.writable or asyncio.Event()
                        stream.writable.clear()
                        await stream.writable.wait()
            else:
                response = await method.handler(argument, stream.context)
                self._send_message(stream, calls.framed(method.serialize(response)))
        except CallAborted as exc:
            self._finish(stream, exc.code, exc.details)
        except Exception as bug:  # noqa: BLE001
            log.error("gRPC call %s from %s failed", stream.path, self.peer, exc_info=bug)
            self._finish(stream, calls.INTERNAL, f"{type(bug).__name__}: {bug}")
        else:
            self._finish(stream, calls.OK, "")

    @staticmethod
    def _requests(stream: _Stream, method: Method) -> _Requests:
        assert stream.requests is not None
        return _Requests(stream.requests, method.parse)

    def _expire(self, stream: _Stream) -> None:
        stream.deadline = None
        if stream.done:
            return
        self._stop_call(stream)
        self._finish(stream, calls.DEADLINE_EXCEEDED, "Deadline Exceeded")

    # --- frames out ------------------------------------------------------------------------------------------------
    def _answer(self, stream: _Stream, message: bytes) -> None:
        """A unary call's whole answer, in one write when the windows allow it (almost always)."""
        if stream.done:
            return
        if len(message) > self._server.max_message_bytes:
            self._finish(stream, calls.RESOURCE_EXHAUSTED,
                         f"Sent message larger than max ({len(message)} vs. {self._server.max_message_bytes})")
            return
        body = calls.framed(message)
        n = len(body)
        if n <= self._peer_max_frame and n <= self._send_window and n <= stream.send_window:
            self._send_window -= n
            stream.send_window -= n
            stream.headers_sent = stream.done = True
            sid = stream.id
            headers = self._block(frames.RESPONSE_HEADERS)
            self._write(b"".join((
                frames.frame_head(frames.HEADERS, frames.END_HEADERS, sid, len(headers)), headers,
                frames.frame_head(frames.DATA, 0, sid, n), body,
                frames.frame_head(frames.HEADERS, frames.END_HEADERS | frames.END_STREAM, sid,
                                  len(frames.STATUS_OK_TRAILERS)),
                frames.STATUS_OK_TRAILERS)))
            self._closed(stream)
            return
        self._send_message(stream, body)
        self._finish(stream, calls.OK, "")

    def _send_message(self, stream: _Stream, body: bytes) -> None:
        """One framed message (`calls.framed`), after the response headers, as the windows allow."""
        if stream.done:
            return
        if not stream.headers_sent:
            stream.headers_sent = True
            self._write(frames.frame(frames.HEADERS, frames.END_HEADERS, stream.id,
                                     self._block(frames.RESPONSE_HEADERS)))
        stream.pending.append(body)
        self._pump(stream)

    def _finish(self, stream: _Stream, code: int, details: str) -> None:
        """End the call with a status: after its messages (trailers), or alone (trailers-only)."""
        if stream.done:
            return
        stream.done = True
        if code != calls.OK:
            self._stop_call(stream, task_too=asyncio.current_task() is not stream.task)
        status = frames.status_block(code, details)
        if stream.headers_sent:
            stream.trailers = status  # after the data that waits for window
            self._pump(stream)
            return
        stream.headers_sent = True
        self._write(frames.frame(frames.HEADERS, frames.END_HEADERS | frames.END_STREAM, stream.id,
                                 self._block(frames.RESPONSE_HEADERS + status)))
        self._closed(stream)

    def _refuse(self, stream: _Stream, http_status: int) -> None:
        """Not a gRPC request: an HTTP status alone."""
        stream.done = stream.headers_sent = True
        self._write(frames.frame(frames.HEADERS, frames.END_HEADERS | frames.END_STREAM, stream.id,
                                 self._block(frames.http_status_block(http_status))))
        self._closed(stream)

    def _block(self, block: bytes) -> bytes:
        """A header block to send; the first after the client shrank its HPACK table starts by saying this side's
        table is empty (RFC 7541 4.2: the change must be signalled; gpud never indexes what it sends)."""
        self._data_sent = True
        if self._table_update:
            self._table_update = False
            return b"\x20" + block
        return block

    def _pump(self, stream: _Stream) -> None:
        """Send what the windows allow of the stream's waiting output; its trailers once the data is out."""
        pending = stream.pending
        while pending:
            item = pending[0]
            allowed = min(len(item), self._send_window, stream.send_window, self._peer_max_frame)
            if allowed <= 0:
                self._blocked[stream.id] = stream
                return
            self._write(frames.frame_head(frames.DATA, 0, stream.id, allowed) + item[:allowed])
            self._data_sent = True
            self._send_window -= allowed
            stream.send_window -= allowed
            if allowed == len(item):
                pending.pop(0)
            else:
                pending[0] = item[allowed:]
        self._blocked.pop(stream.id, None)
        if stream.trailers is not None:
            self._write(frames.frame(frames.HEADERS, frames.END_HEADERS | frames.END_STREAM, stream.id,
                                     self._block(stream.trailers)))
            stream.trailers = None
            self._closed(stream)
        elif stream.writable is not None:
            stream.writable.set()

    def _pump_blocked(self) -> None:
        for stream in list(self._blocked.values()):
            self._pump(stream)
            if self._send_window <= 0:
                return

    def _closed(self, stream: _Stream) -> None:
        """This side has sent its end of the stream."""
        _cancel_deadline(stream)
        if not stream.remote_closed:
            # the client may still be sending (an early error): tell it to stop; the stream is over
            self._write(frames.rst_stream(stream.id, frames.NO_ERROR))
            stream.remote_closed = True
        self._forget(stream)

    def _forget(self, stream: _Stream) -> None:
        if stream.reader is not None:
            self._buffered -= stream.reader.buffered_bytes
            stream.reader = None
        self._streams.pop(stream.id, None)
        self._blocked.pop(stream.id, None)
        if not self._streams:
            self.idle.set()
            if self._flush_scheduled:
                # No other call can add to this turn's write: out now, not a loop turn later (a client with one
                # call in flight waits on every answer; with more, the last answer of a batch takes them all)
                self._flush()

    def _drop(self, stream: _Stream) -> None:
        """The client reset the stream (or the connection is gone): stop its call, send nothing more."""
        stream.done = stream.remote_closed = True
        _cancel_deadline(stream)
        self._stop_call(stream)
        if stream.writable is not None:
            stream.writable.set()
        self._forget(stream)

    def _write(self, data: bytes) -> None:
        if self._transport is None:
            return
        self._out.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, []
        if self._transport is not None and out:
            self._transport.write(b"".join(out) if len(out) > 1 else out[0])

    # --- stopping --------------------------------------------------------------------------------------------------
    def go_away(self) -> None:
        """No new streams (GOAWAY naming the last one this side took); the open ones finish."""
        if self._transport is not None:
            self._write(frames.goaway(self._last_stream_id, frames.NO_ERROR))

    def abort(self) -> None:
        """Cancel what is still running and close."""
        for stream in list(self._streams.values()):
            if not stream.done:
                self._finish(stream, calls.UNAVAILABLE, "the server is shutting down")
            self._drop(stream)
        self._close_transport()

    def _close(self, code: int, message: str) -> None:
        self._write(frames.goaway(self._last_stream_id, code, message.encode()[:256]))
        self._close_transport()

    def _close_transport(self) -> None:
        """What is written goes out, then the connection closes."""
        self._flush()
        if self._transport is not None:
            self._transport.close()


def _cancel_deadline(stream: _Stream) -> None:
    if stream.deadline is not None:
        stream.deadline.cancel()
        stream.deadline = None


def _unpad(payload: bytes) -> bytes:
    if not payload:
        raise _ConnectionError(frames.PROTOCOL_ERROR, "a padded frame without its pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise _ConnectionError(frames.PROTOCOL_ERROR, "padding as long as the frame")
    return payload[1:len(payload) - pad]

