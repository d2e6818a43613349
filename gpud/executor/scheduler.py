"""What every model version's scheduler is (the `Scheduler` protocol) and what the schedulers share.

A version's scheduler queues its requests, runs them on its instances and answers them: one per served version,
whatever decides its batches. `gpud.executor.dynamic_scheduler.DynamicScheduler` (dynamic batching, or none),
`gpud.executor.sequence_scheduler.SequenceScheduler` (sequence batching) and
`gpud.executor.ensemble.EnsembleScheduler` (an ensemble's requests through its steps) implement it; the registry,
the core, the placement service and the caller's-thread path (gpud.executor.direct) use nothing else. Which one
serves a configuration is decided in one place (gpud.scheduling).

Shared here: the request handle, the delivery of a batch's answers (requests they submit to other models are batched
once the answers are all out), `infer_through`, and `SchedulerBase`: what a scheduler that runs batches on instances
does whatever its batcher (readiness, one step timer, the wait for a ready instance, answering into the statistics
record, waiting until idle).
"""
from __future__ import annotations

import asyncio
from functools import partial
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
from mypy_extensions import mypyc_attr

from gpud.executor import protocol
from gpud.executor.batcher import QueuedRequest
from gpud.executor.instance import InstanceHandle
from gpud.executor.objective import LatencyObjective
from gpud.executor.model_config import ModelConfig
from gpud.executor.stats import ModelStats
from gpud.executor.shm import ShmFull
from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor
from gpud.executor.validation import PreparedCache, PreparedRequest

log = logging.getLogger("gpud.executor")


Done = Callable[[Any], None]
"""Called once with the request's InferResponse or its InferenceError."""


@mypyc_attr(allow_interpreted_subclasses=True)  # the ensemble's runs (gpud.executor.ensemble)
class RequestHandle:
    """What `Scheduler.submit` returns: opaque to the caller, for `cancel` on the same scheduler."""

    __slots__ = ()


class Scheduler(Protocol):
    """One served model version's requests: queued, run and answered. Every method runs on the event loop."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def version(self) -> str: ...

    @property
    def stats(self) -> ModelStats:
        """The one record of the version's requests and batches (gpud.executor.stats): others read it."""
        ...

    @property
    def instances(self) -> Sequence[InstanceHandle]:
        """The instances that serve the version: the one list of them (add_instance, remove_instance change it;
        everyone else reads it). Always empty for an ensemble."""
        ...

    @property
    def has_ready_instance(self) -> bool: ...

    @property
    def pending_requests(self) -> int:
        """Requests queued or running; a group (submit's `members`) counts as the requests it stands for."""
        ...

    @property
    def live_sequences(self) -> int:
        """Sequences holding state (a sequence model's; 0 for others)."""
        ...

    @property
    def backlog_sequences(self) -> int:
        """Live sequences waiting for a free slot (a sequence model's; 0 for others)."""
        ...

    @property
    def instances_needed(self) -> int:
        """The fewest instances whose slots hold the live sequences (the controller keeps at least this many)."""
        ...

    @property
    def takes_groups(self) -> bool:
        """Whether `submit(..., members=n)` may carry n requests' rows as one request."""
        ...

    @property
    def moves_client_tensors(self) -> bool:
        """Whether its workers read inputs from and write outputs into clients' shared-memory regions themselves
        (a request's `client_io`); else the core does, and the scheduler sees plain arrays."""
        ...

    def submit(self, request: InferRequest, done: Done, members: int = 1) -> RequestHandle:
        """Queue `request`; `done(response_or_error)` is called once, from the event loop. Bad input and a full
        queue raise InferenceError at once and change nothing. `members` > 1 only where `takes_groups`."""
        ...

    def cancel(self, handle: RequestHandle) -> None:
        """The client went away: its callback is not called (whether it still runs is the scheduler's to say)."""
        ...

    def withdraw_member(self, handle: RequestHandle) -> None:
        """One member of a group (`submit`'s `members` > 1) went away while the others wait: while the group is
        queued it stands for one request fewer in the statistics, as a lone request withdrawn while queued is not
        counted; its rows still run with the others'."""
        ...

    async def infer(self, request: InferRequest) -> InferResponse:
        """`submit` as a coroutine; cancelling the awaiting task withdraws the request."""
        ...

    def add_instance(self, inst: InstanceHandle) -> None: ...

    def remove_instance(self, inst: InstanceHandle) -> None:
        """No new batch goes to `inst` (the one it runs is answered)."""
        ...

    async def wait_idle(self) -> None:
        """Returns when nothing is queued or running: every accepted request has its answer."""
        ...

    def fail_all_queued(self, message: str) -> None:
        """Fail what waits (UNAVAILABLE with `message`): an unload or shutdown that waited long enough."""
        ...

    def direct_path(self) -> DirectPath | None:
        """How a caller's thread may run a lone request itself (gpud.executor.direct), or None where it may not."""
        ...


class DirectPath(Protocol):
    """A scheduler's side of a request run in its caller's thread (gpud.executor.direct), with the loop's lock held."""

    @property
    def config(self) -> ModelConfig: ...

    def idle_instance(self) -> InstanceHandle | None:
        """The instance a caller may take for its request: the first free one while nothing is queued."""
        ...

    def begin_direct(self, request: InferRequest, done: Done, inst: InstanceHandle) -> tuple[Pending, bool]:
        """Queue `request` as submit does and ask the batcher now: True when `inst` is taken for it alone."""
        ...

    def end_direct(self, inst: InstanceHandle, pending: Pending, outputs: list[np.ndarray] | InferenceError,
                   input_ns: int, infer_ns: int, output_ns: int) -> bool:
        """The caller's run is over: answer it, free `inst`; True when the loop has work now."""
        ...

    def cancel(self, handle: RequestHandle) -> None: ...

    def step(self) -> None:
        """Decide and dispatch now (from the loop)."""
        ...






class _Delivery(threading.local):
    """A batch's answers being delivered on this thread. A request one of them submits to another model (an
    ensemble's next step) is queued at once but batched only when the last answer is out: stepping its scheduler
    on the first would send that one alone to a free instance and the rest of the batch after it. Whoever gathers
    such requests to send them together (gpud.executor.ensemble) flushes them first (`after_delivery`)."""

    depth = 0

    def __init__(self) -> None:
        self.deferred: dict[SchedulerBase, None] = {}  # schedulers to step, in the order their requests came
        self.flushes: dict[Callable[[], None], None] = {}  # to call when the answers are out, before stepping


_delivery = _Delivery()


def delivering() -> bool:
    """Whether a batch's answers are being delivered on this thread (see after_delivery)."""
    return _delivery.depth > 0


def defer_step(scheduler: SchedulerBase) -> bool:
    """While a batch's answers are being delivered on this thread: `scheduler` is stepped once they are all out (a
    request they submit is batched with the others), and True. Else False: the caller steps it now."""
    if _delivery.depth:
        _delivery.deferred[scheduler] = None
        return True
    return False


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
            scheduler.step()


class Pending(RequestHandle):
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



@mypyc_attr(allow_interpreted_subclasses=True)  # SequenceScheduler (not compiled)
class SchedulerBase:
    """What a model version's scheduler does whatever decides its batches (the dynamic batcher here, the sequence
    batcher in gpud.executor.sequence_scheduler): its instances' readiness, one step timer, the wait for a ready
    instance, answering and failing requests into the statistics record, and waiting until idle. A subclass provides
    `step()` (decide and dispatch) and `_queued_requests()`."""

    # Sequences live only in a sequence model's scheduler, which overrides these.
    @property
    def live_sequences(self) -> int:
        return 0

    @property
    def backlog_sequences(self) -> int:
        return 0

    @property
    def instances_needed(self) -> int:
        """The fewest instances whose slots hold the live sequences."""
        return 0

    @property
    def takes_groups(self) -> bool:
        return False

    @property
    def moves_client_tensors(self) -> bool:
        return False

    def __init__(self, config: ModelConfig, version: str, clock: Callable[[], float], unready_wait_s: float,
                 objective: LatencyObjective | None = None):
        self.config = config
        self.version = version
        self.clock = clock
        self.objective = objective  # the version's latency objective (gpud.executor.objective), if it has one
        # With no instance ready (its worker restarting, or being placed elsewhere), requests wait in the queue at
        # most this long; then the queued ones fail with UNAVAILABLE and the reason.
        self.unready_wait_s = unready_wait_s
        self._unready_timer: asyncio.TimerHandle | None = None
        self.stats = ModelStats()  # the one record of this version's requests (gpud.executor.stats): others read it
        if objective is not None:
            self.stats.objective_ns, self.stats.objective_share = objective.ns, objective.share
        self._instances: list[InstanceHandle] = []  # the one list of them: `instances` to read it
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at_s: float | None = None
        self._idle_waiters: list[asyncio.Future] = []
        self._answering = 0  # batches whose answers are being delivered (not running, not yet answered)
        self._running: dict[InstanceHandle, Any] = {}  # the batch each busy instance runs
        self._prepare = PreparedCache(config).prepare

    _output_types: dict[str, str]  # output name -> datatype, of what the instances run (a subclass sets it)

    def step(self) -> None:
        raise NotImplementedError

    def _queued_requests(self) -> int:
        raise NotImplementedError

    # The rest of the Scheduler protocol, each subclass's own:
    @property
    def pending_requests(self) -> int:
        raise NotImplementedError

    def submit(self, request: InferRequest, done: Done, members: int = 1) -> RequestHandle:
        raise NotImplementedError

    def cancel(self, handle: RequestHandle) -> None:
        raise NotImplementedError

    def withdraw_member(self, handle: RequestHandle) -> None:
        """Groups come only where `takes_groups` says so (gpud.executor.dynamic_scheduler): nothing here."""

    def add_instance(self, inst: InstanceHandle) -> None:
        raise NotImplementedError

    def remove_instance(self, inst: InstanceHandle) -> None:
        raise NotImplementedError

    def fail_all_queued(self, message: str) -> None:
        raise NotImplementedError

    @property
    def instances(self) -> Sequence[InstanceHandle]:
        return self._instances

    def direct_path(self) -> DirectPath | None:
        return None  # a subclass whose requests may run in their callers' threads says how

    @property
    def ready_instances(self) -> int:
        return sum(1 for i in self.instances if i.ready)

    @property
    def has_ready_instance(self) -> bool:
        """Whether any instance is ready: asked on every request, so it stops at the first."""
        for inst in self._instances:
            if inst.ready:
                return True
        return False

    async def infer(self, request: InferRequest) -> InferResponse:
        return await infer_through(self, request)

    # --- the step timer and idleness ---------------------------------------------------------------------------
    def _notify_if_idle(self) -> None:
        if self._idle_waiters and not self._running and not self._queued_requests() and not self._answering:
            for fut in self._idle_waiters:
                if not fut.done():
                    fut.set_result(None)
            self._idle_waiters.clear()

    def _arm_timer(self, until_s: float | None) -> None:
        at_s = self._timer_at_s
        if until_s == at_s or (until_s is not None and at_s is not None and at_s < until_s):
            # A timer due earlier stays: it wakes a step that decides again and arms for the later time. Under
            # load each arrival moves the wait later (the next arrival is expected later); cancelling and making a
            # loop timer for each cost ~4 µs a request.
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
        self.step()

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
                             f"on another device){self._unready_note()}")

    def _unready_note(self) -> str:
        """Added to the message of requests failed for want of a ready instance (a method, not a class attribute:
        the compiled base class would read its own)."""
        return ""

    # --- answers -----------------------------------------------------------------------------------------------
    def _done_or_error(self, reply: protocol.Done | protocol.Failed | InferenceError) -> protocol.Done | InferenceError:
        """The worker's outputs, or the error its reply stands for (a lost worker, a failed run)."""
        if isinstance(reply, protocol.Failed):
            kind = ErrorKind[reply.kind] if reply.kind in ErrorKind.__members__ else ErrorKind.INTERNAL
            return InferenceError(kind, f"model '{self.config.name}' failed: {reply.error}")
        return reply

    def _answer(self, batch: list[Pending], per_request: list[list[InferTensor]], input_ns: int, infer_ns: int,
                output_ns: int, now_ns: int) -> None:
        rows = 0
        queue_ns: list[int] = []
        request_ns: list[int] = []
        name, version = self.config.name, self.version
        all_outputs = len(self.config.outputs)
        compute_ns = (input_ns, infer_ns, output_ns)
        mixed = len(batch) > 1  # the batch's outputs are its requests' union, in the order they first appear
        with gathering():  # what the answers submit to other models is batched once they are all out
            for p, tensors in zip(batch, per_request):
                prepared = p.prepared
                rows += prepared.batch_rows
                if mixed or len(prepared.output_names) != all_outputs:
                    names = prepared.output_names
                    if len(tensors) != len(names) or any(t.name != n for t, n in zip(tensors, names)):
                        by_name = {t.name: t for t in tensors}  # its own outputs, in its own order
                        tensors = [by_name[n] for n in names]
                if p.members == 1:
                    queue_ns.append(p.dispatch_ns - p.arrival_ns)
                    request_ns.append(now_ns - p.arrival_ns)
                else:
                    queue_ns += [p.dispatch_ns - p.arrival_ns] * p.members
                    request_ns += [now_ns - p.arrival_ns] * p.members
                trace = p.request.trace
                if trace is not None:
                    trace.computed(version, p.arrival_ns, p.dispatch_ns, input_ns, infer_ns, output_ns)
                p.finish(InferResponse(name, version, tensors, p.request.id, {}, compute_ns))
        self.stats.record_batch(rows, queue_ns, request_ns, input_ns, infer_ns, output_ns, int(time.time() * 1000))
        if batch:
            self._ran((now_ns - batch[0].dispatch_ns) / 1e9)

    def _ran(self, seconds: float) -> None:
        """A batch took `seconds` from dispatch to its answers (the dynamic batcher's expected run time: what an
        objective's batch delay leaves room for, and whether requests come faster than a batch runs)."""

    @staticmethod
    def _staging_error(exc: Exception) -> InferenceError:
        """A batch whose inputs could not be put in its instance's segment: UNAVAILABLE when shared memory is full
        (a condition of the node: retry, or give gpud more), INTERNAL otherwise."""
        kind = ErrorKind.UNAVAILABLE if isinstance(exc, ShmFull) else ErrorKind.INTERNAL
        return InferenceError(kind, f"could not stage the batch: {exc}")

    def _fail(self, batch: list[Pending], exc: InferenceError) -> None:
        now_ns = time.perf_counter_ns()
        for p in batch:
            for _ in range(p.members):
                self.stats.record_failure(now_ns - p.arrival_ns)
            p.finish(exc)

    def _read_outputs(self, inst: InstanceHandle, done: protocol.Done) -> list[tuple[str, str, np.ndarray]]:
        """A batch's outputs copied out of its instance's output segment (which the next batch reuses)."""
        out_seg = inst.out_seg
        if out_seg is None:
            raise InferenceError(ErrorKind.UNAVAILABLE, f"instance {inst.key} was unloaded")
        return protocol.read_outputs(done, out_seg)

    # --- a staged batch to its instance ------------------------------------------------------------------------
    def _submit_batch(self, inst: InstanceHandle, batch: list[Pending], handle: Any, inputs: tuple,
                      output_names: tuple[str, ...], t0_ns: int,
                      on_reply: Callable[[InstanceHandle, Any, Any, int], None],
                      reads: tuple = (), writes: tuple = ()) -> InferenceError | None:
        """Send a batch whose inputs are staged (since `t0_ns`) to its instance: each request's dispatch time, the
        instance running `handle` (what `on_reply(inst, handle, reply, stage_ns)` gets back). The error when its
        worker cannot be reached (the instance is then not running; the caller fails the batch)."""
        in_seg, out_seg, worker = inst.in_seg, inst.out_seg, inst.worker
        if in_seg is None or out_seg is None or worker is None:  # unloaded meanwhile
            return InferenceError(ErrorKind.UNAVAILABLE, f"instance {inst.key} is not loaded")
        msg = protocol.Infer(inst.key, in_seg.name, out_seg.name, inputs, output_names,
                             tuple([self._output_types[n] for n in output_names]), -1, reads, writes)
        stage_ns = time.perf_counter_ns() - t0_ns
        for p in batch:
            p.dispatch_ns = t0_ns
        self._running[inst] = handle
        try:
            worker.submit(msg, lambda reply: on_reply(inst, handle, reply, stage_ns))
        except (InferenceError, OSError) as refused:  # (a name per exception type: compiled code types each once)
            self._running.pop(inst, None)
            return refused if isinstance(refused, InferenceError) else \
                InferenceError(ErrorKind.UNAVAILABLE, f"worker for {inst.device_id} unreachable: {refused}")
        except Exception as exc:  # noqa: BLE001 - a bug: the batch's requests hear it, the instance stays usable
            self._running.pop(inst, None)
            log.exception("a batch could not be sent to instance %s", inst.key)
            return InferenceError(ErrorKind.INTERNAL, f"the batch could not be sent to instance {inst.key}: "
                                                      f"{type(exc).__name__}: {exc}")
        return None

    # --- shutdown / unload -------------------------------------------------------------------------------------
    async def wait_idle(self) -> None:
        """Returns when nothing is queued or running: every accepted request has its answer."""
        if not self._running and not self._queued_requests():
            return
        fut = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(fut)
        await fut

async def answer_of(submit: Callable[[Done], Callable[[], None]]) -> InferResponse:
    """A request submitted with a callback, as a coroutine: `submit(done)` sends it and returns its cancel; the
    answer is returned, the error raised, and cancelling the awaiting task withdraws the request."""
    future = asyncio.get_running_loop().create_future()

    def done(result: Any) -> None:
        if not future.done():
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    cancel = submit(done)
    try:
        return await future
    except asyncio.CancelledError:
        cancel()
        raise


async def infer_through(scheduler: Scheduler, request: InferRequest) -> InferResponse:
    """`scheduler.submit` as a coroutine (answer_of)."""
    return await answer_of(lambda done: partial(scheduler.cancel, scheduler.submit(request, done)))
