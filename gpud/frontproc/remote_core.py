"""What a front-end process serves over: gpud's InferenceCore, answered by the real one in the daemon's process.

Inference (`submit`) is asynchronous: the request goes to the core with its tensors placed in this process's arena
(gpud.frontproc.arena), and `done` is called when the answer comes back. Requests that differ only in their rows
go together, one message per group, when the loop's turn ends (gpud.frontproc.group). The other methods are the
core's own, asked over the link: the coroutines (load, unload, placement) await their answer; the plain ones
(metadata, config, statistics, readiness, shared-memory regions) wait for it on the spot, the event loop held for
that round trip, as the in-process front end holds it to compute them. They are rare next to inference.
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import socket
from collections.abc import Callable, Hashable, Mapping, Sequence
from functools import partial
from typing import Any, cast

from gpud.api.admin import AdminAuth
from gpud.core_api import (Applied, ModelMetadata, ModelStatistics, RepositoryModel, RequestedPlacement,
                           ServedModelConfig, ServerMetadata)
from gpud.executor.client_shm import NO_DATA, RegionStatus
from gpud.executor.scheduler import answer_of
from gpud.executor.shm import ShmFull
from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferResponse
from gpud.frontproc.arena import Arena, Block
from gpud.frontproc.group import group_key, split_answer
from gpud.frontproc.link import FrameReader, Sender, discard_response, request_wire, response_of
from gpud.executor.process_log import LogSettings, follow
from gpud.tracing.settings import TraceSettings
from gpud.repository.overrides import LoadOverride
from gpud.telemetry.event_loop import LoopCounts

log = logging.getLogger("gpud.frontend")

Done = Callable[[InferResponse | InferenceError], None]
SIGNATURES_MAX = 4096


def _unreadable(exc: Exception, wire: tuple) -> InferenceError:
    """An answer that could not be read: logged, the segments it was handed over in removed (those not taken
    already), and the error its requests get instead."""
    log.exception("an answer from the core could not be read")
    try:
        discard_response(wire)
    except Exception:  # noqa: BLE001 - the wire itself may be what is wrong: nothing more to remove then
        pass
    return InferenceError(ErrorKind.INTERNAL, f"the answer could not be read: {type(exc).__name__}: {exc}")


class _SharedBlocks:
    """A group's blocks in the arena, shared by its members: freed when the last is answered or withdrawn."""

    __slots__ = ("blocks", "left")

    def __init__(self, blocks: list[Block], left: int):
        self.blocks = blocks
        self.left = left


def _with_id(done: Done, request_id: str, result: InferResponse | InferenceError) -> None:
    if isinstance(result, InferResponse):
        result.id = request_id
    done(result)


def _lost() -> InferenceError:
    return InferenceError(ErrorKind.UNAVAILABLE, "the server is shutting down (the core is gone)")


class RemoteRegions:
    """`core.client_shm` as the front ends use it: each call asked of the core's ClientRegions."""

    def __init__(self, core: RemoteCore):
        self._core = core

    def status(self, name: str = "") -> list[RegionStatus]:
        return self._core.call_sync("client_shm.status", name)

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._core.call_sync("client_shm.register", name, key, offset, byte_size)

    def unregister(self, name: str = "") -> None:
        self._core.call_sync("client_shm.unregister", name)

    def check_cuda(self) -> None:
        self._core.call_sync("client_shm.check_cuda")

    def cuda_register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self._core.call_sync("client_shm.cuda_register", name, raw_handle, device_id, byte_size)

    def cuda_unregister(self, name: str = "") -> None:
        self._core.call_sync("client_shm.cuda_unregister", name)

    def cuda_status(self, name: str = "") -> list[dict[str, Any]]:
        return self._core.call_sync("client_shm.cuda_status", name)


class RemoteAdmin(AdminAuth):
    """The admin rules as the core holds them (its token changes with a reload): each check asked of the core."""

    def __init__(self, core: RemoteCore):
        super().__init__()
        self._core = core

    def check(self, authorization: str | None, action: str, peer: str | None = None) -> None:
        self._core.call_sync("admin.check", authorization, action, peer)


class RemoteCore:
    def __init__(self, sock: socket.socket, arena: Arena):
        sock.setblocking(False)
        self.sock = sock
        self.arena = arena
        self.reader = FrameReader(sock, self._on_message)
        self.sender = Sender(sock, self._gone)
        self.client_shm = RemoteRegions(self)
        self._ids = itertools.count()
        self._calls: dict[int, asyncio.Future | list] = {}
        self._submits: dict[int, tuple[Done, list[Block] | _SharedBlocks]] = {}
        # This turn's requests that may go as groups, by their key (gpud.frontproc.group), in arrival order
        self._forming: dict[Hashable, list[tuple[int, InferRequest]]] = {}
        self.on_stop: Callable[[float], None] = lambda grace_s: None
        self.on_lost: Callable[[], None] = lambda: None
        self.on_tune: Callable[[float, int], None] = lambda request_timeout_s, max_connections: None
        self.on_logging: Callable[[LogSettings], None] = partial(follow, logger=log)
        self.lost = False
        # Request signatures (the front end's parse cache: requests with the same header) by a number the core maps
        # to its own, so that it validates a header's requests once (gpud.executor.validation.PreparedCache).
        self._signatures: dict[int, tuple[object, int]] = {}
        self._waiting = False  # in call_sync: answers that arrive meanwhile are delivered after it, from the loop

    def start(self) -> None:
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._readable)

    def close(self) -> None:
        try:
            cast(Any, asyncio.get_running_loop()).remove_reader(self.sock.fileno())  # uvloop's: None, typed bool
        except (RuntimeError, ValueError, OSError):
            pass
        self.sock.close()

    def ready(self) -> None:
        """Tell the core this process serves now."""
        self._send(("ready",), now=True)

    def report_loop(self, counts: LoopCounts) -> None:
        """This process's event-loop counts, for the core's metrics (sent with the turn's other messages)."""
        if not self.lost:
            self.sender.put(("loop", counts.wire()))

    # --- the link ----------------------------------------------------------------------------------------------
    def _readable(self) -> None:
        if not self.reader.read():
            self._gone()

    def _gone(self) -> None:
        if self.lost:
            return
        self.lost = True
        try:
            cast(Any, asyncio.get_running_loop()).remove_reader(self.sock.fileno())  # uvloop's: None, typed bool
        except (RuntimeError, ValueError, OSError):
            pass
        submits, self._submits = self._submits, {}
        for done, blocks in submits.values():
            self._free(blocks)
            done(_lost())
        calls, self._calls = self._calls, {}
        for box in calls.values():
            if isinstance(box, asyncio.Future) and not box.done():
                box.set_exception(_lost())
        self.on_lost()

    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "answer":
            if self._waiting:  # not inside another handler's call: from the loop, once it returns
                asyncio.get_running_loop().call_soon(self._on_message, message)
                return
            _, ident, ok, value = message
            entry = self._submits.pop(ident, None)
            if entry is not None:
                done, blocks = entry
                self._free(blocks)
                if ok:
                    try:
                        value = response_of(value)
                    except Exception as exc:  # noqa: BLE001 - its request hears why; the next messages go on
                        value = _unreadable(exc, value)
                done(value)
            elif ok:  # withdrawn while its answer was on the way
                discard_response(value)
        elif kind == "answers":  # a group's: one answer for its members, split by rows
            if self._waiting:
                asyncio.get_running_loop().call_soon(self._on_message, message)
                return
            _, idents, ok, value = message
            answers = None
            for i, ident in enumerate(idents):
                entry = self._submits.pop(ident, None)
                if entry is None:
                    continue  # withdrawn
                done, blocks = entry
                self._free(blocks)
                if not ok:
                    done(copy.copy(value))  # an error of its own each
                    continue
                if answers is None:
                    try:
                        answers = split_answer(response_of(value), len(idents))
                    except Exception as exc:  # noqa: BLE001 - every member hears why; the next messages go on
                        value, ok = _unreadable(exc, value), False
                        done(copy.copy(value))
                        continue
                done(answers[i])
            if ok and answers is None:  # every member withdrawn while the answer was on the way
                discard_response(value)
        elif kind == "result":
            _, ident, ok, value = message
            box = self._calls.pop(ident, None)
            if isinstance(box, asyncio.Future):
                if not box.done():
                    if ok:
                        box.set_result(value)
                    else:
                        box.set_exception(value)
            elif box is not None:
                box.append((ok, value))
        elif kind == "stop":
            self.on_stop(message[1])
        elif kind == "tune":
            self.on_tune(message[1], message[2])
        elif kind == "logging":  # the daemon's log settings changed (Triton's logging extension)
            self.on_logging(LogSettings(**message[1]))

    def _send(self, message: tuple, now: bool = False) -> None:
        """Queue a message for the end of the loop's turn (requests go together), or send it `now` (a sync call,
        which waits for its answer, sends what is queued first)."""
        if self.lost:
            raise _lost()
        self.sender.put(message)
        if now:
            try:
                self.sender.drain_blocking()
            except OSError:
                self._gone()
        if self.lost:
            raise _lost()

    def call_sync(self, method: str, *args: Any) -> Any:
        ident = next(self._ids)
        box: list = []
        self._calls[ident] = box
        self._send(("call", ident, method, args), now=True)
        self._waiting = True
        try:
            self.reader.read_blocking_until(lambda: bool(box))
        except (EOFError, OSError):
            self._waiting = False
            self._gone()
            raise _lost() from None
        finally:
            self._waiting = False
        ok, value = box[0]
        if not ok:
            raise value
        return value

    async def call(self, method: str, *args: Any) -> Any:
        ident = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[ident] = future
        self._send(("call", ident, method, args))
        return await future

    # --- inference ---------------------------------------------------------------------------------------------
    def submit(self, request: InferRequest, done: Done) -> Callable[[], None]:
        if self.lost:
            raise _lost()
        ident = next(self._ids)
        key = group_key(request)
        self._submits[ident] = (done, [])
        if key is None:
            try:
                self._send_alone(ident, request)
            except BaseException:
                entry = self._submits.pop(ident, None)
                if entry is not None:
                    self._free(entry[1])
                raise
        else:  # sent when the loop's turn ends, with the turn's others like it (gpud.frontproc.group)
            if not self._forming:
                asyncio.get_running_loop().call_soon(self._send_forming)
            self._forming.setdefault(key, []).append((ident, request))
        return partial(self._cancel, ident)

    def _cancel(self, ident: int) -> None:
        entry = self._submits.pop(ident, None)
        if entry is not None:
            self._free(entry[1])
            if not self.lost:  # (one still forming was never sent: the core knows no such request, no matter)
                self.sender.put(("cancel", ident))

    def _send_alone(self, ident: int, request: InferRequest) -> None:
        """Request `ident` (registered in _submits) placed in the arena and sent on its own."""
        placed, blocks = self._place(request)
        self._submits[ident] = (self._submits[ident][0], blocks)
        self._send(("submit", ident, request_wire(request), placed, self._token(request.signature)))

    def _place(self, request: InferRequest) -> tuple[dict[str, tuple[str, int, int]], list[Block]]:
        placed: dict[str, tuple[str, int, int]] = {}
        blocks: list[Block] = []
        if not request.uses_shm:  # a client's own regions: the core reads them (its ClientRegions)
            try:
                for tensor in request.inputs:
                    if tensor.datatype != "BYTES":  # text goes inline: the core checks it element by element
                        where, block = self.arena.put(tensor.data)
                        blocks.append(block)
                        placed[tensor.name] = (where.path, where.offset, where.byte_size)
            except BaseException as exc:
                self._free(blocks)  # the inputs placed before the one that did not fit
                if isinstance(exc, ShmFull):
                    raise InferenceError(ErrorKind.UNAVAILABLE, str(exc)) from None
                raise
            for tensor in request.inputs:
                if tensor.name in placed:
                    tensor.data = NO_DATA
        return placed, blocks

    def _send_forming(self) -> None:
        """The turn's requests that may go as groups: each group as one message (a lone one as a plain submit)."""
        forming, self._forming = self._forming, {}
        for members in forming.values():
            members = [m for m in members if m[0] in self._submits]  # not withdrawn meanwhile
            if not members:
                continue
            try:
                if len(members) == 1:
                    self._send_alone(*members[0])
                else:
                    self._send_group(members)
            except Exception as exc:  # noqa: BLE001 - the link lost, the arena full: its members hear why
                error = exc if isinstance(exc, InferenceError) else \
                    InferenceError(ErrorKind.UNAVAILABLE, str(exc)) if isinstance(exc, ShmFull) else \
                    InferenceError(ErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}")
                for ident, _ in members:
                    entry = self._submits.pop(ident, None)
                    if entry is not None:
                        self._free(entry[1])
                        entry[0](copy.copy(error))
        if not self.lost:
            self.sender.flush()  # now, not one more turn of the loop later

    def _send_group(self, members: list[tuple[int, InferRequest]]) -> None:
        """One message for requests with the same key: each input's rows, member after member, in one block."""
        first = members[0][1]
        placed: dict[str, tuple[str, int, int]] = {}
        blocks: list[Block] = []
        shared = _SharedBlocks(blocks, len(members))
        for ident, request in members:
            done = self._submits[ident][0]
            if request.id != first.id:  # the core answers with the first's id: each member's answer carries its own
                done = partial(_with_id, done, request.id)
            self._submits[ident] = (done, shared)
        for i, tensor in enumerate(first.inputs):
            where, block = self.arena.put_rows([request.inputs[i].data for _, request in members])
            blocks.append(block)
            placed[tensor.name] = (where.path, where.offset, where.byte_size)
        for _, request in members:
            for tensor in request.inputs:
                tensor.data = NO_DATA
        self._send(("group", [ident for ident, _ in members], request_wire(first), placed,
                    self._token(first.signature)))

    def _token(self, signature: object) -> int | None:
        """The number standing for `signature` (new numbers are never reused, so the core's map cannot go stale)."""
        if signature is None:
            return None
        entry = self._signatures.get(id(signature))
        if entry is not None and entry[0] is signature:
            return entry[1]
        if len(self._signatures) >= SIGNATURES_MAX:
            self._signatures.clear()
        token = next(self._ids)
        self._signatures[id(signature)] = (signature, token)  # held: its id is not reused while it is here
        return token

    def _free(self, blocks: list[Block] | _SharedBlocks) -> None:
        if type(blocks) is _SharedBlocks:  # a group's: freed with its last member
            blocks.left -= 1
            if blocks.left:
                return
            blocks = blocks.blocks
        for block in cast(list[Block], blocks):
            self.arena.free(block)

    async def infer(self, request: InferRequest) -> InferResponse:
        return await answer_of(lambda done: self.submit(request, done))

    # --- the rest of InferenceCore, asked of the core --------------------------------------------------------------
    def server_live(self) -> bool:
        return self.call_sync("server_live")

    def server_ready(self) -> bool:
        return self.call_sync("server_ready")

    def server_metadata(self) -> ServerMetadata:
        return self.call_sync("server_metadata")

    def model_ready(self, name: str, version: str = "") -> bool:
        return self.call_sync("model_ready", name, version)

    def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        return self.call_sync("model_metadata", name, version)

    def model_config(self, name: str, version: str = "") -> ServedModelConfig:
        return self.call_sync("model_config", name, version)

    def model_statistics(self, name: str = "", version: str = "") -> list[ModelStatistics]:
        return self.call_sync("model_statistics", name, version)

    def repository_index(self, ready_only: bool = False) -> list[RepositoryModel]:
        return self.call_sync("repository_index", ready_only)

    def inspect(self) -> dict[str, Any]:
        return self.call_sync("inspect")

    def log_settings(self) -> LogSettings:
        return self.call_sync("log_settings")

    def update_log_settings(self, changes: Mapping[str, object]) -> LogSettings:
        return self.call_sync("update_log_settings", dict(changes))

    def trace_settings(self, model_name: str = "") -> TraceSettings:
        return self.call_sync("trace_settings", model_name)

    def update_trace_settings(self, model_name: str, changes: Mapping[str, object]) -> TraceSettings:
        return self.call_sync("update_trace_settings", model_name, dict(changes))

    async def apply_placement(self, requested: Sequence[RequestedPlacement]) -> Applied:
        return await self.call("apply_placement", list(requested))

    async def load_model(self, name: str, override: LoadOverride | None = None) -> None:
        await self.call("load_model", name, override)

    async def unload_model(self, name: str, *, unload_dependents: bool = False) -> None:
        await self.call("unload_model", name, unload_dependents)
