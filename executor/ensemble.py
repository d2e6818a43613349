"""The ensemble scheduler: runs one ensemble version's requests through its steps, as Triton's does.

An ensemble is not a model: it has no instances and no queue of its own. A request's tensors are the ensemble's
inputs; every step whose inputs are all there is sent, as an ordinary request, to the model that serves it (through
`route`: the core's routing, so the step's model batches it with its other requests, loads on demand, queues while
its worker restarts); each answer's outputs become ensemble tensors, and the steps they complete are sent in turn.
Steps whose inputs are ready at the same time run at the same time. When the last step answers, the request is
answered with the ensemble's outputs. Everything happens in callbacks on the event loop: no task per request or
step, and the intermediate tensors are the arrays the steps' answers carry (copied out of the worker's shared memory
once, into the next step's once, as for any request), never encoded.

Rules:
1. The ensemble's inputs are checked against its config before anything runs (as a model's are); a bad request
   changes nothing.
2. Only the steps that lead to the outputs the request asks for run (Triton prunes the same way), and each asks its
   model only for the outputs something reads.
3. A step that fails (refused at once, or answered with an error) fails the request: the error keeps the step's
   kind and says `in ensemble 'E', step i (model 'M'): ...`; the request's other steps still queued are cancelled.
4. `max_inflight_requests` (Triton's, beta there): at most that many requests of each step in flight across the
   ensemble's requests; a step over it waits, first come first served, for one of that step's requests to be
   answered. Backpressure: a fast step cannot pile up work in front of a slow one without bound.
5. Statistics (Triton's): per request, one execution of its batch size; queue is the time before its first step
   was sent, request the time to its answer, and the compute phases the sums of its steps' (the batch each step
   ran in, as that model records it). The steps' models record the steps in their own statistics.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from executor.model_config import EnsembleStep, ModelConfig
from executor.stats import ModelStats
from executor.scheduler import infer_through
from executor.types import ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor, RequestedOutput
from executor.validation import PreparedCache

log = logging.getLogger("gpud.executor")

Done = Callable[[Any], None]
_SENDING = (None, None)  # a step's place in `in_flight` while its submit() runs
_QUEUED = (None, "queued")  # ... while it waits for a slot (max_inflight_requests)


class StepTarget(Protocol):
    """What serves a step: a model version's scheduler (or another ensemble's)."""

    def submit(self, request: InferRequest, done: Done) -> Any: ...

    def cancel(self, handle: Any) -> None: ...


Route = Callable[[InferRequest], StepTarget]
"""The scheduler that serves a request (model name and version), or InferenceError saying why none does."""


@dataclass(frozen=True)
class _Step:
    index: int
    model: str
    version: str  # "" = the newest served (-1)
    inputs: tuple[tuple[str, str], ...]  # (model input, ensemble tensor)
    outputs: tuple[tuple[str, str], ...]  # (model output, ensemble tensor): only those something reads
    requested: list[RequestedOutput]  # shared by every request of this step: read, never changed
    label: str
    tensor_of: dict[str, str]  # model output -> ensemble tensor (`outputs` as a mapping)


@dataclass(frozen=True)
class _Route:
    """The steps that lead to one set of requested outputs."""

    steps: tuple[_Step, ...]  # by index
    waits: tuple[tuple[int, int], ...]  # (step index, how many distinct tensors it waits for)
    consumers: dict[str, tuple[int, ...]]  # ensemble tensor -> the steps that read it
    outputs: tuple[str, ...]  # the ensemble outputs, in the order answered
    by_index: dict[int, _Step]


def plan_route(steps: Sequence[EnsembleStep], outputs: Sequence[str]) -> _Route:
    """Pure: the steps that `outputs` need (backwards from them), and the data flow between them."""
    producer = {tensor: i for i, s in enumerate(steps) for _, tensor in s.output_map}
    needed_tensors = set(outputs)
    needed: set[int] = set()
    stack = list(outputs)
    while stack:
        i = producer.get(stack.pop())
        if i is None or i in needed:
            continue
        needed.add(i)
        for _, tensor in steps[i].input_map:
            if tensor not in needed_tensors:
                needed_tensors.add(tensor)
                stack.append(tensor)
    planned = []
    consumers: dict[str, list[int]] = {}
    for i in sorted(needed):
        s = steps[i]
        outs = tuple((o, t) for o, t in s.output_map if t in needed_tensors)
        planned.append(_Step(i, s.model_name, "" if s.model_version < 0 else str(s.model_version), s.input_map,
                             outs, [RequestedOutput(o) for o, _ in outs], f"step {i} (model '{s.model_name}')",
                             dict(outs)))
        for tensor in dict.fromkeys(t for _, t in s.input_map):
            consumers.setdefault(tensor, []).append(i)
    waits = tuple((s.index, len({t for _, t in s.inputs})) for s in planned)
    return _Route(tuple(planned), waits, {t: tuple(c) for t, c in consumers.items()}, tuple(outputs),
                  {s.index: s for s in planned})


class _Run:
    """One ensemble request on its way through the steps."""

    __slots__ = ("request", "done", "route", "rows", "arrival_ns", "sent_ns", "tensors", "waiting", "in_flight",
                 "finished", "compute", "submitting", "error", "steps", "holding")

    def __init__(self, request: InferRequest, done: Done, route: _Route, rows: int, arrival_ns: int):
        self.request = request
        self.done = done
        self.route = route
        self.rows = rows
        self.arrival_ns = arrival_ns
        self.sent_ns = 0  # when its first step was sent
        self.tensors: dict[str, tuple[str, Any]] = {}  # ensemble tensor -> (datatype, array)
        self.waiting: dict[int, int] = dict(route.waits)  # step index -> tensors it still waits for
        self.in_flight: dict[int, tuple[Any, Any]] = {}  # step index -> (its target, its handle) or _SENDING
        self.finished = False
        self.compute = [0, 0, 0]
        self.submitting = True
        self.error: InferenceError | None = None  # a failure while submitting: submit() raises it
        self.steps = route.by_index
        self.holding: set[int] = set()  # steps holding one of their step's slots (max_inflight_requests)


class EnsembleScheduler:
    """Runs the requests of one ensemble version (rules in the module docstring). Has the interface of
    executor.scheduler.ModelScheduler that the core, the registry and shutdown use: submit / cancel / infer,
    stats, pending_requests, wait_idle, fail_all_queued; no instances."""

    live_sequences = 0  # an ensemble holds no sequence state of its own (its steps' schedulers do)
    instances_needed = 0

    def __init__(self, config: ModelConfig, version: str, route: Route):
        if config.ensemble is None:
            raise ValueError(f"model '{config.name}' is not an ensemble")
        self.config = config
        self.version = version
        self.route = route
        self.stats = ModelStats()
        self.instances: list = []  # none: the steps' models have them
        self._runs: set[_Run] = set()
        self._idle_waiters: list[asyncio.Future] = []
        self._prepare = PreparedCache(config).prepare
        self._routes: dict[tuple[str, ...], _Route] = {}
        self._all_outputs = tuple(o.name for o in config.outputs)
        self._input_types = {s.name: s.datatype for s in config.inputs}
        self._signatures: dict[tuple, tuple] = {}
        # max_inflight_requests: each step's requests in flight, across the ensemble's requests; those over the limit
        # wait, first come first served, until one of the step's requests is answered.
        self._limit = config.ensemble.max_inflight_requests
        self._inflight = [0] * len(config.ensemble.steps)
        self._queued: list[deque[tuple[_Run, _Step]]] = [deque() for _ in config.ensemble.steps]

    @property
    def steps(self) -> tuple[EnsembleStep, ...]:
        return self.config.ensemble.steps  # type: ignore[union-attr]

    @property
    def pending_requests(self) -> int:
        return len(self._runs)

    @property
    def has_ready_instance(self) -> bool:
        return True  # whether its steps serve is the registry's to say (gpud.ensembles)

    # --- requests --------------------------------------------------------------------------------------------
    def _route_for(self, outputs: Sequence[str]) -> _Route:
        key = tuple(outputs)
        route = self._routes.get(key)
        if route is None:
            if len(self._routes) >= 64:  # requested-output subsets are few; bounded all the same
                self._routes.clear()
            route = self._routes[key] = plan_route(self.steps, key)
        return route

    def submit(self, request: InferRequest, done: Done) -> _Run:
        """Start `request` through the steps; `done(response_or_error)` is called once, from the event loop. A bad
        request, or a first step refused at once, raises InferenceError here (and nothing of it goes on running)."""
        arrival_ns = time.perf_counter_ns()
        prepared = self._prepare(request)  # rule 1: raises INVALID_ARGUMENT at once
        route = self._route_for(prepared.output_names if request.outputs is not None else self._all_outputs)
        run = _Run(request, done, route, prepared.batch_rows, arrival_ns)
        types = self._input_types
        for name, array in prepared.inputs.items():
            run.tensors[name] = (types[name], array)
        self._runs.add(run)
        # The ensemble's inputs are all there (an optional one the client left out is simply not passed on).
        first = []
        waiting = run.waiting
        for name in types:
            for index in route.consumers.get(name, ()):
                waiting[index] -= 1
                if waiting[index] == 0:
                    first.append(index)
        run.sent_ns = time.perf_counter_ns()
        try:
            for index in sorted(first):
                self._launch(run, run.steps[index])
                if run.finished:
                    break
        finally:
            run.submitting = False
        if run.error is not None:
            raise run.error
        return run

    def cancel(self, run: _Run) -> None:
        """The client went away: its steps still queued never run; its callback is not called."""
        if run.finished:
            return
        run.finished = True
        self._drop(run)

    async def infer(self, request: InferRequest) -> InferResponse:
        return await infer_through(self, request)

    # --- steps -----------------------------------------------------------------------------------------------
    def _launch(self, run: _Run, step: _Step) -> None:
        """Send a step whose inputs are all there, or, at its max_inflight_requests, queue it behind the others."""
        if self._limit:
            index = step.index
            if self._inflight[index] >= self._limit:
                run.in_flight[index] = _QUEUED
                self._queued[index].append((run, step))
                return
            self._inflight[index] += 1
            run.holding.add(index)
        self._send(run, step)

    def _release(self, run: _Run, index: int) -> None:
        """The step's request is answered or cancelled: its slot goes to the next queued request of the step."""
        if index not in run.holding:
            return
        run.holding.discard(index)
        self._inflight[index] -= 1
        queued = self._queued[index]
        while queued and self._inflight[index] < self._limit:
            waiting, step = queued.popleft()
            if waiting.finished or waiting.in_flight.get(index) is not _QUEUED:
                continue  # failed or cancelled meanwhile
            self._inflight[index] += 1
            waiting.holding.add(index)
            self._send(waiting, step)

    def _send(self, run: _Run, step: _Step) -> None:
        tensors = run.tensors
        inputs = []
        key: list = [step.model, *[o.name for o in step.requested]]
        for model_input, tensor in step.inputs:
            got = tensors.get(tensor)
            if got is not None:  # absent: an optional ensemble input the client left out
                datatype, array = got
                inputs.append(InferTensor(model_input, datatype, array.shape, array))
                key += (model_input, datatype, array.shape)
        r = run.request
        # Requests of a step with the same input names, datatypes and shapes and the same requested outputs share a
        # signature, so the step model's scheduler checks them once (executor.validation.PreparedCache): what the
        # check finds depends on nothing else (the cache is the step model version's own).
        signature = self._signatures.get(key_t := tuple(key))
        if signature is None:
            if len(self._signatures) >= 1024:  # shapes churn (variable dims): start over
                self._signatures.clear()
            signature = self._signatures[key_t] = (self, key_t)
        request = InferRequest(step.model, inputs, step.version, id=r.id, outputs=step.requested,
                               priority=r.priority, timeout_us=r.timeout_us, parameters=r.parameters,
                               signature=signature)
        # In flight before it is submitted: a scheduler may answer inside submit() (it handles replies already
        # waiting on its worker's pipe), and that answer must find the step in flight to take it out.
        run.in_flight[step.index] = _SENDING
        try:
            target = self.route(request)
            handle = target.submit(request, lambda result: self._on_step(run, step, result))
        except InferenceError as exc:
            run.in_flight.pop(step.index, None)
            self._release(run, step.index)
            self._fail(run, step, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a bug in a step's path must fail this request, not the loop
            run.in_flight.pop(step.index, None)
            self._release(run, step.index)
            log.exception("ensemble %s: sending %s failed", self.config.name, step.label)
            self._fail(run, step, InferenceError(ErrorKind.INTERNAL, str(exc)))
            return
        if run.finished:  # the request failed meanwhile (another step): this one need not run
            target.cancel(handle)
            self._release(run, step.index)
        elif step.index in run.in_flight:  # not answered yet
            run.in_flight[step.index] = (target, handle)

    def _on_step(self, run: _Run, step: _Step, result: Any) -> None:
        if self._limit:
            self._release(run, step.index)
        if run.finished:
            return
        run.in_flight.pop(step.index, None)
        if isinstance(result, BaseException):
            self._fail(run, step, result if isinstance(result, InferenceError)
                       else InferenceError(ErrorKind.INTERNAL, str(result)))
            return
        names = step.tensor_of
        compute = run.compute
        ci, cf, co = result.compute_ns
        compute[0] += ci
        compute[1] += cf
        compute[2] += co
        ready: list[str] = []
        for t in result.outputs:
            tensor = names.get(t.name)
            if tensor is not None:
                run.tensors[tensor] = (t.datatype, t.data)
                ready.append(tensor)
        consumers = run.route.consumers
        for tensor in ready:
            for index in consumers.get(tensor, ()):
                left = run.waiting[index] - 1
                run.waiting[index] = left
                if left == 0:
                    self._launch(run, run.steps[index])
                    if run.finished:
                        return
        if not run.in_flight and not run.finished:
            self._complete(run)

    # --- answers ---------------------------------------------------------------------------------------------
    def _complete(self, run: _Run) -> None:
        outputs = []
        for name in run.route.outputs:
            got = run.tensors.get(name)
            if got is None:  # a step answered without an output it maps (validation makes this unreachable)
                self._fail(run, None, InferenceError(
                    ErrorKind.INTERNAL, f"unexpected deadlock, output '{name}' is not set while no more ensemble "
                                        "steps can be made"))
                return
            datatype, array = got
            outputs.append(InferTensor(name, datatype, array.shape, array))
        run.finished = True
        self._runs.discard(run)
        now_ns = time.perf_counter_ns()
        ci, cf, co = run.compute
        self.stats.record_batch(run.rows, (run.sent_ns - run.arrival_ns,), (now_ns - run.arrival_ns,), ci, cf, co,
                                int(time.time() * 1000))
        response = InferResponse(self.config.name, self.version, outputs, id=run.request.id, compute_ns=(ci, cf, co))
        self._answer(run, response)
        self._notify_if_idle()

    def _fail(self, run: _Run, step: _Step | None, exc: InferenceError) -> None:
        if run.finished:
            return
        run.finished = True
        where = f"{step.label}: " if step is not None else ""
        error = InferenceError(exc.kind, f"in ensemble '{self.config.name}', {where}{exc.message}")
        self._drop(run)
        self.stats.record_failure(time.perf_counter_ns() - run.arrival_ns)
        if run.submitting:  # its other steps are cancelled: submit raises, as a model's refusal is raised
            run.error = error
            return
        self._answer(run, error)

    def _drop(self, run: _Run) -> None:
        """Cancel the run's steps still queued (their answers are not waited for) and forget the run."""
        for target, handle in run.in_flight.values():
            if target is None:
                continue  # being submitted (its submit() is on the stack and sees the run finished), or queued
            try:
                target.cancel(handle)
            except Exception:  # noqa: BLE001
                log.exception("ensemble %s: cancelling a step failed", self.config.name)
        run.in_flight.clear()
        self._runs.discard(run)
        for index in list(run.holding):
            self._release(run, index)
        self._notify_if_idle()

    def _answer(self, run: _Run, result: Any) -> None:
        try:
            run.done(result)
        except Exception:  # one front end's bug must not stop the other answers
            log.exception("answering request %r of ensemble %s failed", run.request.id, self.config.name)

    # --- shutdown / unload -----------------------------------------------------------------------------------
    def _notify_if_idle(self) -> None:
        if not self._runs:
            for fut in self._idle_waiters:
                if not fut.done():
                    fut.set_result(None)
            self._idle_waiters.clear()

    async def wait_idle(self) -> None:
        """Returns when no request is inside the ensemble."""
        if not self._runs:
            return
        fut = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(fut)
        await fut

    def fail_all_queued(self, message: str) -> None:
        """Fail every request inside the ensemble now (an unload that waited long enough, shutdown)."""
        for run in list(self._runs):
            self._fail(run, None, InferenceError(ErrorKind.UNAVAILABLE, message))
