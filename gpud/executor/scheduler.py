"""The asyncio driver of one model version: queue (gpud.executor.batcher), instances, batches in shared memory.

Three events move it: a request arrives, an instance finishes a batch (or becomes ready), a timer fires. After each
it runs the batcher's step: fail expired requests, dispatch batches while instances are free, arm one timer.
Completion is a callback from the worker channel's reader, not a task per batch. Putting a batch into shared memory and
taking its outputs out is gpud.executor.protocol's; this module decides what runs where and when, and answers the requests.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Any, Callable

import numpy as np

from gpud.executor import protocol
from gpud.executor.batcher import BatchQueue, Dispatch, QueuedRequest, Wait, timeout_error
from gpud.executor.direct import direct_capable
from gpud.executor.instance import InstanceHandle
from gpud.executor.model_config import ModelConfig
from gpud.executor.stats import ModelStats
from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor
from gpud.executor.validation import PreparedCache, PreparedRequest

log = logging.getLogger("gpud.executor")


# While requests pour in, look for finished batches at most this often (one non-blocking poll of the worker pipe).
_POLL_INTERVAL_S = 50e-6


Done = Callable[[Any], None]
"""Called once with the request's InferResponse or its InferenceError."""


class _Delivery(threading.local):
    """A batch's answers being delivered on this thread. A request one of them submits to another model (an
    ensemble's next step) is queued at once but batched only when the last answer is out: stepping its scheduler
    on the first would send that one alone to a free instance and the rest of the batch after it. Whoever gathers
    such requests to send them together (gpud.executor.ensemble) flushes them first (`after_delivery`)."""

    depth = 0

    def __init__(self) -> None:
        self.deferred: dict[ModelScheduler, None] = {}  # schedulers to step, in the order their requests came
        self.flushes: dict[Callable[[], None], None] = {}  # to call when the answers are out, before stepping


_delivery = _Delivery()


def delivering() -> bool:
    """Whether a batch's answers are being delivered on this thread (see after_delivery)."""
    return _delivery.depth > 0


def after_delivery(flush: Callable[[], None]) -> None:
    """Call `flush` once the answers being delivered on this thread are all out, before the schedulers they fed
    are stepped (a request it submits is batched with the others). Registering the same callable twice calls it
    once. Only while delivering()."""
    _delivery.flushes[flush] = None


class gathering:
    """A context in which this thread acts as if delivering a batch's answers: requests submitted inside it are
    batched, and gatherers flushed, when the outermost such context (or delivery) ends."""

    __slots__ = ()

    def __enter__(self) -> None:
        _delivery.depth += 1

    def __exit__(self, *exc: object) -> None:
        _delivery.depth -= 1
        if not _delivery.depth and (_delivery.deferred or _delivery.flushes):
            _finish_delivery()


def _finish_delivery() -> None:
    d = _delivery
    while d.flushes or d.deferred:
        d.depth += 1  # what a flush submits is stepped below, with the rest
        try:
            while d.flushes:
                flush = next(iter(d.flushes))
                del d.flushes[flush]
                try:
                    flush()
                except Exception:  # noqa: BLE001 - one gatherer's bug must not strand the others' requests
                    log.exception("flushing requests gathered during a batch's answers failed")
        finally:
            d.depth -= 1
        while d.deferred and not d.flushes:
            scheduler = next(iter(d.deferred))
            del d.deferred[scheduler]
            scheduler._step()


class _Pending:
    __slots__ = ("request", "prepared", "done", "arrival_ns", "dispatch_ns", "finished", "queued", "members")

    def __init__(self, request: InferRequest, prepared: PreparedRequest, done: Done, arrival_ns: int,
                 members: int = 1):
        self.request = request
        self.prepared = prepared
        self.done = done
        self.arrival_ns = arrival_ns
        self.members = members  # the requests it stands for in the statistics (ModelScheduler.submit)
        self.dispatch_ns = 0
        self.finished = False
        self.queued: QueuedRequest | None = None

    def finish(self, result: Any) -> None:
        if self.finished:
            return
        self.finished = True
        self.queued = None
        try:
            self.done(result)
        except Exception:  # one front end's bug must not stop the rest of the batch from being answered
            log.exception("answering request %r of model %s failed", self.request.id, self.request.model_name)



class SchedulerBase:
    """What a model version's scheduler does whatever decides its batches (the dynamic batcher here, the sequence
    batcher in gpud.executor.sequence_scheduler): its instances' readiness, one step timer, the wait for a ready instance,
    answering and failing requests into the statistics record, and waiting until idle. A subclass provides
    `_step()` (decide and dispatch) and `_queued_requests()`."""

    # Sequences live only in a sequence model's scheduler, which overrides these.
    live_sequences = 0
    instances_needed = 0  # the fewest instances whose slots hold the live sequences
    _unready_note = ""  # added to the message of requests failed for want of a ready instance

    def __init__(self, config: ModelConfig, version: str, clock: Callable[[], float], unready_wait_s: float):
        self.config = config
        self.version = version
        self.clock = clock
        # With no instance ready (its worker restarting, or being placed elsewhere), requests wait in the queue at
        # most this long; then the queued ones fail with UNAVAILABLE and the reason.
        self.unready_wait_s = unready_wait_s
        self._unready_timer: asyncio.TimerHandle | None = None
        self.stats = ModelStats()  # the one record of this version's requests (gpud.executor.stats): others read it
        self.instances: list[InstanceHandle] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at_s: float | None = None
        self._idle_waiters: list[asyncio.Future] = []
        self._answering = 0  # batches whose answers are being delivered (not running, not yet answered)
        self._running: dict[InstanceHandle, Any] = {}  # the batch each busy instance runs
        self._prepare = PreparedCache(config).prepare

    def _step(self) -> None:
        raise NotImplementedError

    def _queued_requests(self) -> int:
        raise NotImplementedError

    @property
    def ready_instances(self) -> int:
        return sum(1 for i in self.instances if i.ready)

    @property
    def has_ready_instance(self) -> bool:
        """Whether any instance is ready: asked on every request, so it stops at the first."""
        for inst in self.instances:
            if inst.ready:
                return True
        return False

    async def infer(self, request: InferRequest) -> InferResponse:
        return await infer_through(self, request)

    # --- the step timer and idleness ---------------------------------------------------------------------------
    def _notify_if_idle(self) -> None:
        if not self._running and not self._queued_requests() and not self._answering:
            for fut in self._idle_waiters:
                if not fut.done():
                    fut.set_result(None)
            self._idle_waiters.clear()

    def _arm_timer(self, until_s: float | None) -> None:
        if until_s == self._timer_at_s:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at_s = until_s
        if until_s is not None:
            loop = asyncio.get_running_loop()
            # The batcher's clock is time.monotonic, which is also what the event loop's clock reads.
            self._timer = loop.call_at(loop.time() + max(0.0, until_s - self.clock()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at_s = None
        self._step()

    # --- no instance ready -------------------------------------------------------------------------------------
    def _arm_unready_deadline(self) -> None:
        if self._unready_timer is None and not self.has_ready_instance:
            self._unready_timer = asyncio.get_running_loop().call_later(self.unready_wait_s, self._on_unready_deadline)

    def _cancel_unready_deadline(self) -> None:
        if self._unready_timer is not None:
            self._unready_timer.cancel()
            self._unready_timer = None

    def _on_unready_deadline(self) -> None:
        """No instance became ready within unready_wait_s of a request waiting for one: fail what waits."""
        self._unready_timer = None
        if self.has_ready_instance or not self._queued_requests():
            return
        self.fail_all_queued(f"no instance of model '{self.config.name}' version {self.version} became ready within "
                             f"{self.unready_wait_s:g} s (its worker is restarting, or the model is being placed "
                             f"on another device){self._unready_note}")

    # --- answers -----------------------------------------------------------------------------------------------
    def _reply_error(self, reply: protocol.Done | protocol.Failed | InferenceError) -> InferenceError | None:
        """The error a worker's reply stands for (a lost worker, a failed run), or None for its outputs."""
        if isinstance(reply, Exception):
            return reply
        if isinstance(reply, protocol.Failed):
            kind = ErrorKind[reply.kind] if reply.kind in ErrorKind.__members__ else ErrorKind.INTERNAL
            return InferenceError(kind, f"model '{self.config.name}' failed: {reply.error}")
        return None

    def _answer(self, batch: list[_Pending], per_request: list[list[InferTensor]], input_ns: int, infer_ns: int,
                output_ns: int, now_ns: int) -> None:
        rows = 0
        queue_ns: list[int] = []
        request_ns: list[int] = []
        name, version = self.config.name, self.version
        all_outputs = len(self.config.outputs)
        compute_ns = (input_ns, infer_ns, output_ns)
        with gathering():  # what the answers submit to other models is batched once they are all out
            for p, tensors in zip(batch, per_request):
                prepared = p.prepared
                rows += prepared.batch_rows
                if len(prepared.output_names) != all_outputs:
                    wanted = set(prepared.output_names)
                    tensors = [t for t in tensors if t.name in wanted]
                if p.members == 1:
                    queue_ns.append(p.dispatch_ns - p.arrival_ns)
                    request_ns.append(now_ns - p.arrival_ns)
                else:
                    queue_ns += [p.dispatch_ns - p.arrival_ns] * p.members
                    request_ns += [now_ns - p.arrival_ns] * p.members
                p.finish(InferResponse(name, version, tensors, id=p.request.id, compute_ns=compute_ns))
        self.stats.record_batch(rows, queue_ns, request_ns, input_ns, infer_ns, output_ns, int(time.time() * 1000))

    def _fail(self, batch: list[_Pending], exc: InferenceError) -> None:
        now_ns = time.perf_counter_ns()
        for p in batch:
            for _ in range(p.members):
                self.stats.record_failure(now_ns - p.arrival_ns)
            p.finish(exc)

    # --- a staged batch to its instance ------------------------------------------------------------------------
    def _submit_batch(self, inst: InstanceHandle, batch: list[_Pending], handle: Any, inputs: tuple,
                      output_names: tuple[str, ...], t0_ns: int,
                      on_reply: Callable[[InstanceHandle, Any, Any, int], None]) -> InferenceError | None:
        """Send a batch whose inputs are staged (since `t0_ns`) to its instance: each request's dispatch time, the
        instance running `handle` (what `on_reply(inst, handle, reply, stage_ns)` gets back). The error when its
        worker cannot be reached (the instance is then not running; the caller fails the batch)."""
        msg = protocol.Infer(inst.key, inst.in_seg.name, inst.out_seg.name, inputs, output_names,
                             tuple([self._output_types[n] for n in output_names]))
        stage_ns = time.perf_counter_ns() - t0_ns
        for p in batch:
            p.dispatch_ns = t0_ns
        self._running[inst] = handle
        try:
            inst.worker.submit(msg, lambda reply: on_reply(inst, handle, reply, stage_ns))
        except (InferenceError, OSError) as exc:
            self._running.pop(inst, None)
            return exc if isinstance(exc, InferenceError) else \
                InferenceError(ErrorKind.UNAVAILABLE, f"worker for {inst.device_id} unreachable: {exc}")
        return None

    # --- shutdown / unload -------------------------------------------------------------------------------------
    async def wait_idle(self) -> None:
        """Returns when nothing is queued or running: every accepted request has its answer."""
        if not self._running and not self._queued_requests():
            return
        fut = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(fut)
        await fut

class ModelScheduler(SchedulerBase):
    """Queues, batches and runs the requests of one model version on its instances."""

    def __init__(self, config: ModelConfig, version: str, *, clock: Callable[[], float] = time.monotonic,
                 unready_wait_s: float = 30.0, default_max_queue_size: int = 0):
        super().__init__(config, version, clock, unready_wait_s)
        adaptive = config.options.batching == "adaptive"  # "triton": Triton's exact dynamic batcher
        self.queue = BatchQueue(max_batch_size=config.max_batch_size, dynamic_batching=config.dynamic_batching,
                                clock=clock, dispatch_lone_request=adaptive, quiet_dispatch=adaptive,
                                default_max_queue_size=default_max_queue_size)
        self._free: deque[InstanceHandle] = deque()
        self._running: dict[InstanceHandle, list[_Pending]] = {}
        self._polled_s = 0.0
        self._output_types = {o.name: o.datatype for o in config.outputs}
        self.direct_capable = direct_capable(config)  # gpud.executor.direct may run a lone request in its caller

    def _queued_requests(self) -> int:
        return len(self.queue)

    # --- instances -------------------------------------------------------------------------------------------
    def add_instance(self, inst: InstanceHandle) -> None:
        inst.on_ready_change = self._on_ready_change
        self.instances.append(inst)
        if inst.ready:
            self._free.append(inst)
            self._cancel_unready_deadline()
            self._step()

    def remove_instance(self, inst: InstanceHandle) -> None:
        inst.on_ready_change = None
        if inst in self.instances:
            self.instances.remove(inst)
        if inst in self._free:
            self._free.remove(inst)

    def _on_ready_change(self, inst: InstanceHandle) -> None:
        if inst.ready and inst not in self._free and inst not in self._running:
            self._free.append(inst)
            self._cancel_unready_deadline()
            self._step()
        elif not inst.ready and inst in self._free:
            self._free.remove(inst)

    @property
    def pending_requests(self) -> int:
        """Requests queued or running; a group (submit's `members`) counts as the requests it stands for."""
        return sum(q.payload.members for q in self.queue) + sum(p.members for b in self._running.values() for p in b)

    # --- requests --------------------------------------------------------------------------------------------
    @property
    def takes_groups(self) -> bool:
        """Whether requests may come as groups (`submit(..., members=n)`): a model that batches them anyway."""
        return self.config.batches and self.config.dynamic_batching is not None

    def _enqueue(self, request: InferRequest, done: Done, members: int = 1) -> _Pending:
        """`request` checked and queued; bad input and a full queue raise InferenceError and change nothing."""
        prepared = self._prepare(request)
        pending = _Pending(request, prepared, done, time.perf_counter_ns(), members)
        queued = QueuedRequest(payload=pending, batch_rows=prepared.batch_rows, shape_key=prepared.shape_key,
                               priority=request.priority, timeout_us=request.timeout_us)
        self.queue.enqueue(queued)  # raises at once (queue full, bad priority) and changes nothing
        pending.queued = queued
        return pending

    def submit(self, request: InferRequest, done: Done, members: int = 1) -> _Pending:
        """Queue `request`; `done(response_or_error)` is called once when it is answered (from the event loop).
        Bad input and a full queue raise InferenceError at once and change nothing. The returned handle is for
        `cancel`. A callback, not a future: a front end that answers from it needs no task per request.
        `members` > 1 (only where `takes_groups`): the request is that many requests' rows, concatenated (an
        ensemble's step for several of its requests): it is batched and answered as one, and counted as that many
        requests in the statistics."""
        pending = self._enqueue(request, done, members)
        if _delivery.depth:
            _delivery.deferred[self] = None  # batched once the answers being delivered are all out
        else:
            self._step()
        if not self._free:
            self._arm_unready_deadline()
        if self._running:
            now_s = time.perf_counter()
            if now_s - self._polled_s >= _POLL_INTERVAL_S:
                self._polled_s = now_s
                for inst in list(self._running):
                    inst.worker.poll()
        return pending

    # --- a request run by its caller (gpud.executor.direct; the loop's lock held) -----------------------------------
    def idle_instance(self) -> InstanceHandle | None:
        """The instance a caller may take for its request: the first free one while nothing is queued."""
        return self._free[0] if self._free and not self.queue else None

    def begin_direct(self, request: InferRequest, done: Done, inst: InstanceHandle) -> tuple[_Pending, bool]:
        """Queue `request` as submit does and ask the batcher now; True when it dispatched this request alone, and
        `inst` (the first free instance) is then taken for it. False: it stays queued for the loop."""
        pending = self._enqueue(request, done)
        decision = self.queue.decide(len(self._free))
        if not isinstance(decision, Dispatch):
            return pending, False
        pending.queued = None
        self._free.remove(inst)
        self._running[inst] = [pending]
        pending.dispatch_ns = time.perf_counter_ns()
        return pending, True

    def end_direct(self, inst: InstanceHandle, pending: _Pending, outputs: list[np.ndarray] | InferenceError,
                   input_ns: int, infer_ns: int, output_ns: int) -> bool:
        """The caller's run on `inst` is over: the instance is free again (if it still serves), the request answered
        with its outputs (in its requested outputs' order) or failed. True when the loop has work now (requests
        queued meanwhile, a wait for idleness)."""
        self._running.pop(inst, None)
        if inst.ready and inst in self.instances:
            self._free.append(inst)
        if isinstance(outputs, InferenceError):
            self._fail([pending], outputs)
        else:
            names = pending.prepared.output_names
            tensors = [InferTensor(n, self._output_types[n], a.shape, a) for n, a in zip(names, outputs)]
            self._answer([pending], [tensors], input_ns, infer_ns, output_ns, time.perf_counter_ns())
        return bool(self.queue) or bool(self._idle_waiters)

    def cancel(self, pending: _Pending) -> None:
        """The client went away: if the request is still queued it never runs; its callback is not called."""
        pending.finished = True
        if pending.queued is not None:
            self.queue.remove(pending.queued)
            pending.queued = None
            self._notify_if_idle()  # the queue may just have emptied: a shutdown waiting for idle goes on

    def _step(self) -> None:
        for q in self.queue.expire():
            self._fail([q.payload], timeout_error())
        while True:
            decision = self.queue.decide(len(self._free))
            if isinstance(decision, Dispatch):
                batch = [q.payload for q in decision.requests if not q.payload.finished]
                for p in batch:
                    p.queued = None  # out of the queue; and no cycle (queued.payload is p) keeping the body alive
                if batch:
                    self._run(self._free.popleft(), batch)
                continue
            self._arm_timer(decision.until_s if isinstance(decision, Wait) else None)
            break
        self._notify_if_idle()

    # --- one batch -------------------------------------------------------------------------------------------
    def _run(self, inst: InstanceHandle, batch: list[_Pending]) -> None:
        t0 = time.perf_counter_ns()
        try:
            inputs = protocol.write_inputs(self.config, [p.prepared.inputs for p in batch], inst.ensure_capacity)
        except Exception as exc:  # e.g. /dev/shm full: this batch fails, the instance stays usable
            self._free.appendleft(inst)
            self._fail(batch, InferenceError(ErrorKind.INTERNAL, f"could not stage the batch: {exc}"))
            return
        output_names = tuple(dict.fromkeys(n for p in batch for n in p.prepared.output_names))
        error = self._submit_batch(inst, batch, batch, inputs, output_names, t0, self._on_reply)
        if error is not None:
            self._fail(batch, error)

    def _on_reply(self, inst: InstanceHandle, batch: list[_Pending],
                  reply: protocol.Done | protocol.Failed | InferenceError, stage_ns: int) -> None:
        self._running.pop(inst, None)
        answers = None
        error = self._reply_error(reply)
        if error is None:
            try:
                answers = self._collect(inst, batch, reply, stage_ns)
            except Exception as exc:
                log.exception("model %s: reading a batch's outputs failed", self.config.name)
                error = InferenceError(ErrorKind.INTERNAL, f"reading outputs failed: {exc}")
        if inst.ready and inst in self.instances:
            self._free.append(inst)
        # The outputs are out of shared memory: hand the instance its next batch before answering this one, so the
        # worker computes while the front end encodes and writes the answers.
        self._answering += 1
        try:
            self._step()
        finally:
            self._answering -= 1
            if error is not None:
                self._fail(batch, error)
            else:
                self._answer(batch, *answers)
            self._notify_if_idle()

    def _collect(self, inst: InstanceHandle, batch: list[_Pending], reply: protocol.Done,
                 stage_ns: int) -> tuple[list[list[InferTensor]], int, int, int, int]:
        """The batch's outputs copied out of shared memory (the instance's output segment is reused by the next
        batch), split per request, and its timings (input, infer, output ns; time read)."""
        t0 = time.perf_counter_ns()
        per_request = self._split(batch, protocol.read_outputs(reply, inst.out_seg))
        now_ns = time.perf_counter_ns()
        return (per_request, stage_ns + reply.input_ns, reply.infer_ns, reply.output_ns + (now_ns - t0), now_ns)

    def _split(self, batch: list[_Pending], outputs: list[tuple[str, str, np.ndarray]]) -> list[list[InferTensor]]:
        """Each request's rows of every output: views into the batch's outputs (already copied out of shm)."""
        if not self.config.batches or len(batch) == 1:
            return [[InferTensor(name, datatype, arr.shape, arr) for name, datatype, arr in outputs]]
        per_request: list[list[InferTensor]] = [[] for _ in batch]
        for name, datatype, arr in outputs:
            start = 0
            for i, p in enumerate(batch):
                stop = start + p.prepared.batch_rows
                part = arr[start:stop]
                start = stop
                per_request[i].append(InferTensor(name, datatype, part.shape, part))
        return per_request

    # --- shutdown / unload -----------------------------------------------------------------------------------
    def fail_all_queued(self, message: str) -> None:
        self._fail([q.payload for q in self.queue.drain()], InferenceError(ErrorKind.UNAVAILABLE, message))
        self._step()


async def infer_through(scheduler: Any, request: InferRequest) -> InferResponse:
    """`scheduler.submit` as a coroutine (any scheduler with submit(request, done) and cancel(handle)): the answer,
    or the error raised; cancelling the awaiting task withdraws the request."""
    future = asyncio.get_running_loop().create_future()

    def done(result: Any) -> None:
        if not future.done():
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    handle = scheduler.submit(request, done)
    try:
        return await future
    except asyncio.CancelledError:
        scheduler.cancel(handle)
        raise
