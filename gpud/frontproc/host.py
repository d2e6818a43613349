"""The core's side of the front-end processes: starts them on a listening socket the daemon bound (each accepts from
it: the kernel spreads connections over them), answers their calls and requests on the event loop, restarts one that
dies (only its own connections are lost: its requests in flight are withdrawn), and stops them all, each finishing
what it accepted.

A front-end process ignores SIGINT and SIGTERM (a terminal's Ctrl-C and systemd's stop reach every process of the
service): it stops when the core tells it to, after the core stopped taking new work, or when the core is gone.
"""
from __future__ import annotations

import asyncio
import collections
import copy
import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar, cast

from gpud.api.admin import AdminAuth
from gpud.core import GroupCancel, TracedCancel
from gpud.executor.client_shm import NO_DATA
from gpud.executor.shm import ShmFull, unlink
from gpud.frontproc.arena import remove_arena_of
from gpud.frontproc.connections import SharedConnections
from gpud.executor.types import ErrorKind, InferenceError, InferResponse, RegionSlice
from gpud.frontproc.group import group_sizes
from gpud.frontproc.link import FrameReader, Sender, process_label, request_of, response_wire
from gpud.executor.process_log import LogSettings
from gpud.telemetry.event_loop import LoopCounts

log = logging.getLogger("gpud.frontend")

# What a front-end process may ask of the core: the InferenceCore protocol's methods, and its regions'.
CALLS = frozenset({"server_live", "server_ready", "server_metadata", "model_ready", "model_metadata", "model_config",
                   "model_statistics", "repository_index", "inspect", "apply_placement", "load_model",
                   "unload_model", "log_settings", "update_log_settings", "trace_settings",
                   "update_trace_settings"})
REGION_CALLS = frozenset({"status", "register", "unregister", "check_cuda", "cuda_register", "cuda_unregister",
                          "cuda_status"})
RESTART_BACKOFF_S = (0.0, 1.0, 5.0)
SIGNATURES_MAX = 4096
SLICES_MAX = 4096


class HostedCore(Protocol):
    """What the host asks of the core (gpud.core.GpudCore): submits, group limits, its regions, and CALLS by name."""

    client_shm: Any

    def submit(self, request: Any, done: Callable[[Any], None], *, placed: dict[str, RegionSlice] | None = None,
               members: int = 1) -> Callable[[], None]: ...

    def group_limit(self, request: Any) -> int: ...


K = TypeVar("K")
V = TypeVar("V")


def _bounded_get(cache: dict[K, V], key: K, limit: int, make: Callable[[], V]) -> V:
    """`cache[key]`, made and kept when missing; a cache at `limit` starts over (what a process sends churns)."""
    value = cache.get(key)
    if value is None:
        if len(cache) >= limit:
            cache.clear()
        value = cache[key] = make()
    return value


def _rows_of(placed: dict[str, tuple], first: int, count: int, members: int) -> dict[str, RegionSlice]:
    """Where members `first` .. `first + count - 1` of a group's `members` lie (each input's members' bytes one
    after another, the same size each)."""
    where = {}
    for name, (path, offset, nbytes) in placed.items():
        each = nbytes // members
        where[name] = RegionSlice("", path, offset + first * each, count * each)
    return where


class _Withdraw:
    """A group member's cancel: the group is withdrawn when all its members are (one withdrawn alone still runs
    with the others, its answer dropped, and is not counted in the statistics while the group is still queued)."""

    __slots__ = ("cancel", "left")

    def __init__(self, cancel: Callable[[], None], members: int):
        self.cancel = cancel
        self.left = members

    def __call__(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.cancel()
        elif isinstance(self.cancel, (GroupCancel, TracedCancel)):
            self.cancel.one()


class Outbox(Protocol):
    """Where the host's messages to a process go: its link's Sender (a Protocol, so that tests may stand in)."""

    def put(self, message: tuple) -> None: ...

    def flush(self) -> None: ...


@dataclass(eq=False)
class FrontendProcess:
    index: int
    proc: subprocess.Popen
    sock: socket.socket
    reader: FrameReader | None = None
    sender: Outbox | None = None
    submits: dict[int, Callable[[], None] | None] = field(default_factory=dict)
    # the process's signature numbers -> ours; (number, members) -> a group's of that many
    signatures: dict[int | tuple[int, int], object] = field(default_factory=dict)
    # Where its placed tensors lie, by (path, offset, bytes): its arena hands the same blocks out again and again, and
    # a RegionSlice (frozen: shared safely) costs more to make than to look up.
    slices: dict[tuple, RegionSlice] = field(default_factory=dict)
    # Segments its recent answers' large outputs went in (link.response_wire): removed by the process once mapped;
    # if it dies first, by us (a name already removed is no matter).
    handed: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=1024))
    started_s: float = 0.0
    grouped: int = 0  # its requests that came in groups (gpud.frontproc.group)
    alive: bool = True
    serving: asyncio.Future | None = None  # done when it says it serves


def _unstaged(exc: Exception) -> InferenceError:
    """An answer that could not be put where its front-end process reads it (its removal from `submits` already
    done): logged, and the error its request gets instead of waiting for ever."""
    if isinstance(exc, ShmFull):  # a condition of the node, not a bug: no traceback per answer
        log.warning("an answer could not be staged for its front-end process: %s", exc)
        return InferenceError(ErrorKind.UNAVAILABLE, f"the answer could not be staged for the front end: {exc}")
    log.exception("an answer could not be staged for its front-end process")
    return InferenceError(ErrorKind.INTERNAL, f"the answer could not be staged for the front end: "
                                              f"{type(exc).__name__}: {exc}")


class FrontendHost:
    def __init__(self, core: HostedCore, admin: AdminAuth, count: int, listen: socket.socket, options: dict[str, Any],
                 log_settings: LogSettings = LogSettings()):
        """`listen`: the listening socket the processes accept from; for gRPC on grpcio (options["grpc_server"]),
        the port's socket the daemon holds (bound with SO_REUSEPORT, not listening), which the processes bind too."""
        self.core = core
        self.admin = admin  # the admin rules (a reload changes its token): front ends ask it
        self.count = count
        self.listen = listen
        self.options = options  # what each process's HttpServer and HttpApi take (JSON)
        # the processes' open connections, one slot each: the port's cap counts them all
        self.connections = SharedConnections.create(count)
        options["connections_fd"], options["processes"] = self.connections.fd, count
        self.log_settings = log_settings  # the daemon's (gpud.log_settings): each process is started with them
        self.processes: list[FrontendProcess | None] = [None] * count
        self.stopping = False
        self.restarts = [0] * count  # per process slot: how often its process was started again
        self.loop_reports: dict[str, LoopCounts] = {}  # each process's last, by its process_label
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, timeout_s: float = 60.0) -> None:
        """Start every process and wait until each serves (OSError when one cannot: its port, its start)."""
        self._loop = asyncio.get_running_loop()
        for i in range(self.count):
            self._spawn(i)
        waiting = [p.serving for p in self.processes if p is not None and p.serving is not None]
        done, pending = await asyncio.wait(waiting, timeout=timeout_s)
        failed = [f for f in done if f.exception() is not None]
        if pending or failed:
            await self.stop(0)
            why = failed[0].exception() if failed else f"not serving after {timeout_s:.0f} s"
            raise OSError(f"{self.options['kind']} front-end processes could not start: {why}")

    # A reload's request timeout and connection cap (gpud.reload's HTTP servers), for every process: the cap is the
    # port's, each process checks it against every process's connections (SharedConnections).
    @property
    def request_timeout_s(self) -> float:
        return self.options["request_timeout_s"]

    @request_timeout_s.setter
    def request_timeout_s(self, value: float) -> None:
        self.options["request_timeout_s"] = value
        self._tune()

    @property
    def max_connections(self) -> int:
        return self.options["max_connections"]

    @max_connections.setter
    def max_connections(self, value: int) -> None:
        self.options["max_connections"] = value
        self._tune()

    def _tune(self) -> None:
        for fp in self.processes:
            if fp is not None and fp.alive:
                self._send(fp, ("tune", self.options["request_timeout_s"], self.options["max_connections"]))

    def set_log_settings(self, settings: LogSettings) -> None:
        """The daemon's log settings changed (a LogControl listener): every process follows them, and a process
        started again starts with them."""
        self.log_settings = settings
        for fp in self.processes:
            if fp is not None and fp.alive:
                self._send(fp, ("logging", settings.plain()))

    def inspect(self) -> list[dict[str, Any]]:
        """Each process, for `gpudctl inspect` (FRONT ENDS): its protocol, pid, whether it serves, its requests now,
        its requests that came grouped."""
        return [{"kind": self.options["kind"], "index": p.index, "pid": p.proc.pid, "alive": p.alive,
                 "in_flight": len(p.submits), "restarts": self.restarts[p.index], "grouped": p.grouped}
                for p in self.processes if p is not None]

    def _spawn(self, index: int) -> None:
        ours, theirs = socket.socketpair()
        # HTTP's processes, and gRPC's on gpud's own server, accept on the daemon's listening socket; grpcio's bind
        # the port themselves (SO_REUSEPORT)
        http = self.options["kind"] == "http" or self.options["grpc_server"] == "gpud"
        cmd = [sys.executable, "-m", "gpud.frontproc.child", "--index", str(index), "--link-fd", str(theirs.fileno()),
               *(["--listen-fd", str(self.listen.fileno())] if http else []), "--options", json.dumps(self.options),
               "--log-settings", json.dumps(self.log_settings.plain())]
        fds = (theirs.fileno(), self.connections.fd, *((self.listen.fileno(),) if http else ()))
        proc = subprocess.Popen(cmd, pass_fds=fds)
        theirs.close()
        ours.setblocking(False)
        fp = FrontendProcess(index, proc, ours, started_s=time.monotonic())
        fp.serving = self._loop.create_future() if self._loop is not None else None
        fp.reader = FrameReader(ours, partial(self._on_message, fp))
        fp.sender = Sender(ours, lambda: self._lost(fp))
        self.processes[index] = fp
        assert self._loop is not None
        self._loop.add_reader(ours.fileno(), self._readable, fp)
        log.info("%s front-end process %d started (pid %d)", self.options["kind"], index, proc.pid)

    # --- messages ----------------------------------------------------------------------------------------------
    def _readable(self, fp: FrontendProcess) -> None:
        assert fp.reader is not None
        if not fp.reader.read():
            self._lost(fp)

    def _on_message(self, fp: FrontendProcess, message: tuple) -> None:
        kind = message[0]
        if kind == "submit":
            _, ident, wire, placed, token = message
            fp.submits[ident] = None  # answered before submit returns: the entry is gone, nothing to keep
            where = None
            if placed:  # the cached lookups written out: this runs for every request
                slices = fp.slices
                where = {}
                for name, at in placed.items():
                    where[name] = slices.get(at) or self._slice(fp, at)
            self._submit(fp, ident, wire, token, where)
        elif kind == "group":
            self._group(fp, *message[1:])
        elif kind == "cancel":
            withdraw = fp.submits.pop(message[1], None)
            if withdraw is not None:
                withdraw()
        elif kind == "call":
            _, ident, method, args = message
            self._call(fp, ident, method, args)
        elif kind == "ready":
            if fp.serving is not None and not fp.serving.done():
                fp.serving.set_result(None)
        elif kind == "loop":
            self._loop_report(fp, message[1])

    def _loop_report(self, fp: FrontendProcess, wire: tuple) -> None:
        """A process's event-loop counts (gpud.telemetry.event_loop), kept for the metrics: the last one of each
        process slot (a restarted process starts from zero, a counter reset to Prometheus)."""
        try:
            self.loop_reports[process_label(self.options["kind"], fp.index)] = LoopCounts.of_wire(wire)
        except (ValueError, TypeError) as exc:
            log.warning("front-end process %d sent a loop report that cannot be read: %s", fp.index, exc)

    def _submit(self, fp: FrontendProcess, ident: int, wire: tuple, token: int | None,
                where: dict[str, RegionSlice] | None) -> None:
        try:
            request = request_of(wire)
            if token is not None:
                request.signature = fp.signatures.get(token) or self._signature(fp, token)
            # a partial, not a lambda: the answer goes straight to _answer, one Python frame fewer
            cancel = self.core.submit(request, partial(self._answer, fp, ident), placed=where)
        except InferenceError as exc:
            self._answer(fp, ident, exc)
            return
        except Exception as bug:  # noqa: BLE001 - a bug answers this request with a 500, the rest goes on
            log.exception("front-end process %d: a request failed", fp.index)
            self._answer(fp, ident, InferenceError(ErrorKind.INTERNAL, f"{type(bug).__name__}: {bug}"))
            return
        if ident in fp.submits:
            fp.submits[ident] = cancel

    def _group(self, fp: FrontendProcess, idents: list[int], wire: tuple, placed: dict[str, tuple],
               token: int | None) -> None:
        """Requests that differ only in their rows (gpud.frontproc.group), each input's rows one after another in
        the process's arena: submitted as groups of at most `group_limit`; a group the scheduler refuses (its
        validation, a full queue), and the rest, go request by request, each with its own answer."""
        for ident in idents:
            fp.submits[ident] = None
        fp.grouped += len(idents)
        try:
            limit = self.core.group_limit(request_of(wire))
        except InferenceError as exc:  # what each would have been told (no such model, not ready)
            for ident in idents:
                self._answer(fp, ident, copy.copy(exc))
            return
        except Exception:  # noqa: BLE001 - a bug: each goes alone, and fails or not on its own
            log.exception("front-end process %d: a group failed", fp.index)
            limit = 1
        count = len(idents)
        first = 0
        for size in group_sizes(count, limit):
            chunk = idents[first:first + size]
            if size == 1 or not self._submit_group(fp, chunk, wire, token, _rows_of(placed, first, size, count)):
                for i, ident in enumerate(chunk):
                    self._submit(fp, ident, wire, token, _rows_of(placed, first + i, 1, count))
            first += size

    def _submit_group(self, fp: FrontendProcess, idents: list[int], wire: tuple, token: int | None,
                      where: dict[str, RegionSlice]) -> bool:
        """One group submitted as one request of its members' rows; False, and nothing done, when refused."""
        count = len(idents)
        request = request_of(wire)
        for tensor in request.inputs:
            tensor.shape = (tensor.shape[0] * count, *tensor.shape[1:])
        if token is not None:  # its own signature: the group's validation (its rows) is not its members'
            request.signature = _bounded_get(fp.signatures, (token, count), SIGNATURES_MAX, object)
        try:
            cancel = self.core.submit(request, partial(self._answer_group, fp, idents), placed=where, members=count)
        except InferenceError:
            return False
        except Exception:  # noqa: BLE001 - a bug: its members go alone
            log.exception("front-end process %d: a group failed", fp.index)
            return False
        withdraw = _Withdraw(cancel, count)
        for ident in idents:
            if ident in fp.submits:  # (not answered inside submit)
                fp.submits[ident] = withdraw
        return True

    def _answer_group(self, fp: FrontendProcess, idents: list[int], result: InferResponse | InferenceError) -> None:
        waiting = False
        for ident in idents:
            if fp.submits.pop(ident, 0) != 0:
                waiting = True
        if not waiting or not fp.alive or fp.sender is None:
            return  # all withdrawn, or their process is gone
        self._send_answer(fp, "answers", idents, result)

    @staticmethod
    def _slice(fp: FrontendProcess, at: tuple) -> RegionSlice:
        return _bounded_get(fp.slices, at, SLICES_MAX, lambda: RegionSlice("", *at))

    @staticmethod
    def _signature(fp: FrontendProcess, token: int) -> object:
        """Ours for the process's signature number: requests with the same header share it, and their checks."""
        return _bounded_get(fp.signatures, token, SIGNATURES_MAX, object)

    def _answer(self, fp: FrontendProcess, ident: int, result: InferResponse | InferenceError) -> None:
        if fp.submits.pop(ident, 0) == 0 or not fp.alive or fp.sender is None:
            return  # withdrawn, or its process is gone
        if isinstance(result, InferResponse):
            for tensor in result.outputs:
                if tensor.shm is not None:  # in the client's region: only the shape travels
                    tensor.data = NO_DATA
        self._send_answer(fp, "answer", ident, result)

    @staticmethod
    def _send_answer(fp: FrontendProcess, kind: str, to: int | list[int], result: InferResponse | InferenceError
                     ) -> None:
        """An "answer" (one request's) or "answers" (a group's) message. A response that cannot be staged for the
        process (e.g. /dev/shm full) reaches its requests as an error instead of nothing."""
        assert fp.sender is not None
        if isinstance(result, InferResponse):
            try:
                fp.sender.put((kind, to, True, response_wire(result, fp.handed.append)))
                return
            except Exception as exc:  # noqa: BLE001 - see above
                result = _unstaged(exc)
        fp.sender.put((kind, to, False, result))

    def _call(self, fp: FrontendProcess, ident: int, method: str, args: tuple) -> None:
        try:
            if method == "admin.check":
                fn: Callable[..., Any] = self.admin.check
            elif method.startswith("client_shm.") and method[len("client_shm."):] in REGION_CALLS:
                fn = getattr(self.core.client_shm, method[len("client_shm."):])
            elif method in CALLS:
                fn = getattr(self.core, method)
            else:
                raise InferenceError(ErrorKind.INTERNAL, f"a front end asked for {method!r}, which the core lacks")
            if method == "unload_model":
                result = fn(args[0], unload_dependents=args[1])
            else:
                result = fn(*args)
        except InferenceError as exc:
            self._send(fp, ("result", ident, False, exc))
            return
        except Exception as bug:  # noqa: BLE001 - the caller gets a 500; the core goes on
            log.exception("front-end process %d: %s failed", fp.index, method)
            self._send(fp, ("result", ident, False, InferenceError(ErrorKind.INTERNAL, f"{type(bug).__name__}: {bug}")))
            return
        if not asyncio.iscoroutine(result):
            self._send(fp, ("result", ident, True, result))
            return
        task = asyncio.ensure_future(result)
        self._tasks.add(task)

        def finished(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if t.cancelled():
                self._send(fp, ("result", ident, False,
                                InferenceError(ErrorKind.UNAVAILABLE, "the server is shutting down")))
                return
            exc = t.exception()
            if exc is None:
                self._send(fp, ("result", ident, True, t.result()))
            elif isinstance(exc, InferenceError):
                self._send(fp, ("result", ident, False, exc))
            else:
                log.error("front-end process %d: %s failed", fp.index, method, exc_info=exc)
                self._send(fp, ("result", ident, False, InferenceError(ErrorKind.INTERNAL,
                                                                       f"{type(exc).__name__}: {exc}")))
        task.add_done_callback(finished)

    def _send(self, fp: FrontendProcess, message: tuple) -> None:
        if fp.alive and fp.sender is not None:
            fp.sender.put(message)

    # --- a process lost, and the end -----------------------------------------------------------------------------
    def _lost(self, fp: FrontendProcess) -> None:
        if not fp.alive:
            return
        fp.alive = False
        if fp.sender is not None:
            fp.sender.flush()  # what the core said before the end (a stop, answers)
        assert self._loop is not None
        try:
            cast(Any, self._loop).remove_reader(fp.sock.fileno())  # uvloop's returns None, typed bool
        except (ValueError, OSError, RuntimeError):
            pass
        fp.sock.close()
        if fp.serving is not None and not fp.serving.done():
            fp.serving.set_exception(OSError(f"process {fp.index} ended before serving (see its log above)"))
        for name in fp.handed:
            unlink(name)
        fp.handed.clear()
        if fp.proc.poll() is None:
            fp.proc.kill()  # its link is gone: it serves no one (SIGKILL: its arena may be removed under it)
        remove_arena_of(fp.proc.pid)  # a process killed had no chance to remove its own
        self.connections.clear(fp.index)  # its connections ended with it
        submits, fp.submits = fp.submits, {}
        for cancel in submits.values():
            if cancel is not None:
                cancel()  # nobody waits for these answers any more
        self._reap(fp)
        if self.stopping:
            return
        code = fp.proc.poll()
        log.error("front-end process %d (pid %d) ended (%s); its connections are lost; restarting it", fp.index,
                  fp.proc.pid, f"exit code {code}" if code is not None else "its link closed")
        delay = RESTART_BACKOFF_S[min(self.restarts[fp.index], len(RESTART_BACKOFF_S) - 1)] \
            if time.monotonic() - fp.started_s < 10 else 0.0
        self.restarts[fp.index] += 1
        self._loop.call_later(delay, self._restart, fp.index)

    def _reap(self, fp: FrontendProcess) -> None:
        """Collect an ended process's exit status (no zombie left), checking again shortly while it has not."""
        if fp.proc.poll() is None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_later(0.05, self._reap, fp)
        elif fp.proc.poll() is not None and self.processes[fp.index] is fp:
            self.connections.clear(fp.index)  # again, now that it cannot write its count any more

    def _restart(self, index: int) -> None:
        if not self.stopping:
            self._spawn(index)

    async def stop(self, grace_s: float) -> None:
        """Every process stops accepting and finishes what it accepted (up to `grace_s`), then exits."""
        self.stopping = True
        live = [p for p in self.processes if p is not None and p.alive]
        for fp in live:
            self._send(fp, ("stop", grace_s))
        # Each process has a descriptor of its own: ours closed now, the port refuses new connections once they have
        # closed theirs (as the in-process front end's does at once), instead of queueing them unaccepted until the
        # end and resetting them then.
        self.listen.close()
        deadline = time.monotonic() + grace_s + 5
        for fp in live:
            while fp.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if fp.proc.poll() is None:
                log.warning("front-end process %d did not stop within %.0f s; killing it", fp.index, grace_s + 5)
                fp.proc.kill()
                fp.proc.wait()
            self._lost(fp)
        self.connections.close()
