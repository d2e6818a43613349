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
6. Steps go to their models in groups where they can: the first steps of the requests that arrive in one turn of
   the event loop (what the front ends read in one go) are sent at the end of that turn, and the steps that one
   batch's answers make ready once those answers are all out. The requests of one group for the same step, with
   the same outputs wanted, input shapes past the batch dimension, priority, timeout and parameters, go as one
   request: their rows concatenated (a view when they lie in order in one array, as a batch's answers do), at most
   the model's max_batch_size rows each, counted as that many requests in the model's statistics. Only for a model
   that would batch them anyway (it batches, with dynamic batching; not a sequence model or an ensemble); any
   other is sent each request on its own. What each answer carries is the same; what this spares is the front
   end's per-request work at every step, most of an ensemble's cost beyond its steps'. So a first step refused (a
   full queue, a model not served) fails the request through its callback, not by raising from submit; and a
   group takes one place in its model's queue (`max_queue_size` counts it once).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from gpud.executor.model_config import EnsembleStep, ModelConfig
from gpud.executor.objective import LatencyObjective
from gpud.executor.stats import ModelStats
from gpud.executor.instance import InstanceHandle
from gpud.executor.scheduler import (Done, RequestHandle, Scheduler, after_delivery, delivering, gathering,
                                     infer_through)
from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor, RequestedOutput
from gpud.executor.validation import PreparedCache

log = logging.getLogger("gpud.executor")

_SENDING = (None, None)  # a step's place in `in_flight` while its submit() runs
_QUEUED = (None, "queued")  # ... while it waits for a slot (max_inflight_requests)


Route = Callable[[InferRequest], Scheduler]
"""The scheduler that serves a step's request (model name and version: a model's, or another ensemble's), or
InferenceError saying why none does."""


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


class _Run(RequestHandle):
    """One ensemble request on its way through the steps (the handle `submit` returns)."""

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


class _Group:
    """One step's requests sent as one (rule 6): the runs, their step's input tensors and rows. It is the target
    in each run's `in_flight` entry, so cancelling a run (`cancel(run)`) leaves it out; the group's own request is
    withdrawn when no run is left in it."""

    __slots__ = ("step", "members", "target", "handle", "answered")

    def __init__(self, step: _Step):
        self.step = step
        self.members: list[tuple[_Run, list[InferTensor], int]] = []
        self.target: Scheduler | None = None
        self.handle: RequestHandle | None = None
        self.answered = False

    def add(self, run: _Run, inputs: list[InferTensor], rows: int) -> None:
        self.members.append((run, inputs, rows))
        run.in_flight[self.step.index] = (self, run)

    @property
    def abandoned(self) -> bool:
        """Every member's run is over (answered elsewhere, failed or cancelled): nobody waits for the answer."""
        return all(run.finished for run, _, _ in self.members)

    def cancel(self, run: RequestHandle) -> None:
        """`run` is over (the ensemble marks it finished first); the group's request goes once all its runs are.
        Until then the step's model counts one request fewer for it while the group is queued (as a lone step
        request withdrawn while queued is not counted: Scheduler.withdraw_member)."""
        if self.target is None or self.handle is None:
            return
        if self.abandoned:
            self.target.cancel(self.handle)
            self.handle = None
        else:
            self.target.withdraw_member(self.handle)


def _joined(arrays: list[Any]) -> Any:
    """The arrays one after the other along the batch dimension: a view when they lie so in one array (a batch's
    answers split per request do), else a copy. (Object arrays, BYTES elements, are always copied: their memory
    holds references.)"""
    first = arrays[0]
    base = first.base
    if isinstance(base, np.ndarray) and base.flags.c_contiguous and not first.dtype.hasobject:
        address = first.ctypes.data
        for a in arrays:
            if a.base is not base or a.dtype != first.dtype or not a.flags.c_contiguous or a.ctypes.data != address:
                break
            address += a.nbytes
        else:
            rows = sum(a.shape[0] for a in arrays)
            return np.ndarray((rows,) + first.shape[1:], first.dtype, buffer=base,
                              offset=first.ctypes.data - base.ctypes.data)
    return np.concatenate(arrays, axis=0)


class EnsembleScheduler:
    """Runs the requests of one ensemble version (rules in the module docstring). A
    gpud.executor.scheduler.Scheduler with no instances: its steps' models have them."""

    # An ensemble holds no sequence state of its own (its steps' schedulers do), and takes requests one at a time.
    live_sequences = 0
    backlog_sequences = 0
    instances_needed = 0
    takes_groups = False
    moves_client_tensors = False  # the core reads a request's regions and writes its outputs there
    instances: tuple[InstanceHandle, ...] = ()

    def __init__(self, config: ModelConfig, version: str, route: Route, objective: LatencyObjective | None = None):
        if config.ensemble is None:
            raise ValueError(f"model '{config.name}' is not an ensemble")
        self.config = config
        self.version = version
        self.route = route
        self.objective = objective  # the pipeline's latency objective, end to end (counted in its record)
        self.stats = ModelStats()
        if objective is not None:
            self.stats.objective_ns, self.stats.objective_share = objective.ns, objective.share
        self._runs: set[_Run] = set()
        self._idle_waiters: list[asyncio.Future] = []
        self._prepare = PreparedCache(config).prepare
        self._routes: dict[tuple[str, ...], _Route] = {}
        self._all_outputs = tuple(o.name for o in config.outputs)
        self._input_types = {s.name: s.datatype for s in config.inputs}
        self._signatures: dict[tuple, tuple] = {}
        self._forming: dict[tuple, _Group] = {}  # rule 6: steps gathered while a batch's answers are delivered
        self._intake: list[tuple[_Run, list[int]]] = []  # rule 6: requests of this turn, their first steps
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

    def submit(self, request: InferRequest, done: Done, members: int = 1) -> _Run:
        """Start `request` through the steps; `done(response_or_error)` is called once, from the event loop. A bad
        request raises InferenceError here (and nothing of it runs). Its first steps are sent at the end of this
        turn of the loop, with those of the other requests that came in it (rule 6); inside a batch's delivery,
        when its answers are out (a first step refused at once there is raised here, as before rule 6)."""
        if members != 1:
            raise ValueError(f"ensemble '{self.config.name}' takes no groups of requests")
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
        first.sort()
        if not delivering():
            run.submitting = False
            if not self._intake:
                asyncio.get_running_loop().call_soon(self._send_intake)
            self._intake.append((run, first))
            return run
        run.sent_ns = time.perf_counter_ns()
        try:
            for index in first:
                self._launch(run, run.steps[index])
                if run.finished:
                    break
        finally:
            run.submitting = False
        if run.error is not None:
            raise run.error
        return run

    def _send_intake(self) -> None:
        """The first steps of the requests that came in this turn of the loop, gathered (rule 6)."""
        intake, self._intake = self._intake, []
        now_ns = time.perf_counter_ns()
        with gathering():
            for run, first in intake:
                run.sent_ns = now_ns
                for index in first:
                    if run.finished:  # cancelled, failed, or a parallel first step refused
                        break
                    self._launch(run, run.steps[index])

    def withdraw_member(self, handle: RequestHandle) -> None:
        """An ensemble takes no groups (takes_groups): nothing to withdraw."""

    def cancel(self, handle: RequestHandle) -> None:
        """The client went away: its steps still queued never run; its callback is not called."""
        run = cast(_Run, handle)  # submit's, by the protocol
        if run.finished:
            return
        run.finished = True
        self._drop(run)

    async def infer(self, request: InferRequest) -> InferResponse:
        return await infer_through(self, request)

    def add_instance(self, inst: InstanceHandle) -> None:
        raise ValueError(f"ensemble '{self.config.name}' has no instances: its steps' models have them")

    def remove_instance(self, inst: InstanceHandle) -> None:
        raise ValueError(f"ensemble '{self.config.name}' has no instances: its steps' models have them")

    def direct_path(self) -> None:
        return None  # its requests go through its steps' schedulers

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
        for model_input, tensor in step.inputs:
            got = tensors.get(tensor)
            if got is not None:  # absent: an optional ensemble input the client left out
                datatype, array = got
                inputs.append(InferTensor(model_input, datatype, array.shape, array))
        if run.request.trace is None and delivering() and self._join(run, step, inputs):  # (a traced one alone)
            return
        self._send_one(run, step, inputs)

    def _signature(self, step: _Step, inputs: list[InferTensor]) -> tuple:
        # Requests of a step with the same input names, datatypes and shapes and the same requested outputs share a
        # signature, so the step model's scheduler checks them once (gpud.executor.validation.PreparedCache): what the
        # check finds depends on nothing else (the cache is the step model version's own).
        key: list = [step.model, *[o.name for o in step.requested]]
        for t in inputs:
            key += (t.name, t.datatype, t.shape)
        signature = self._signatures.get(key_t := tuple(key))
        if signature is None:
            if len(self._signatures) >= 1024:  # shapes churn (variable dims): start over
                self._signatures.clear()
            signature = self._signatures[key_t] = (self, key_t)
        return signature

    def _request(self, run: _Run, step: _Step, inputs: list[InferTensor]) -> InferRequest:
        r = run.request
        return InferRequest(step.model, inputs, step.version, id=r.id, outputs=step.requested, priority=r.priority,
                            timeout_us=r.timeout_us, parameters=r.parameters, signature=self._signature(step, inputs))

    def _send_one(self, run: _Run, step: _Step, inputs: list[InferTensor]) -> None:
        request = self._request(run, step, inputs)
        parent = run.request.trace
        if parent is not None:  # the step's own trace, a child of the ensemble's (gpud.tracing)
            request.trace = parent.child(step.model, step.version)
        # In flight before it is submitted: a scheduler may answer inside submit() (it handles replies already
        # waiting on its worker's pipe), and that answer must find the step in flight to take it out.
        run.in_flight[step.index] = _SENDING
        try:
            target = self.route(request)
            handle = target.submit(request, lambda result: self._on_step(run, step, result, request.trace))
        except Exception as exc:  # noqa: BLE001 - a bug in a step's path must fail this request, not the loop
            run.in_flight.pop(step.index, None)
            if request.trace is not None:
                request.trace.end()
            self._refused(run, step, exc)
            return
        if run.finished:  # the request failed meanwhile (another step): this one need not run
            target.cancel(handle)
            if request.trace is not None:
                request.trace.end()
            self._release(run, step.index)
        elif step.index in run.in_flight:  # not answered yet
            run.in_flight[step.index] = (target, handle)

    def _refused(self, run: _Run, step: _Step, exc: Exception) -> None:
        """The step could not be sent (refused at once, or a bug on its way): the request fails (rule 3)."""
        self._release(run, step.index)
        if not isinstance(exc, InferenceError):
            log.error("ensemble %s: sending %s failed", self.config.name, step.label, exc_info=exc)
            exc = InferenceError(ErrorKind.INTERNAL, str(exc))
        self._fail(run, step, exc)

    # --- steps sent together (rule 6) ------------------------------------------------------------------------
    def _join(self, run: _Run, step: _Step, inputs: list[InferTensor]) -> bool:
        """Gather the step with the others that this batch's answers make ready (sent by `_flush` when they are
        all out). False when it cannot go with others (no batch dimension): send it alone."""
        if not inputs:
            return False
        r = run.request
        rows = inputs[0].shape[0] if inputs[0].shape else 0
        # The step of the same route (what it asks its model for depends on the outputs wanted: rule 2); parameters
        # none, or the very same mapping (a front end shares one between the requests of one header). Ids are of
        # objects the group holds, so none is reused while it forms.
        key: list = [id(step), r.priority, r.timeout_us, id(r.parameters) if r.parameters else 0]
        for t in inputs:
            shape = t.shape
            if not shape or shape[0] != rows:
                return False
            key += (t.name, t.datatype, shape[1:])
        if rows < 1:
            return False
        key_t = tuple(key)
        group = self._forming.get(key_t)
        if group is None:
            if not self._forming:
                after_delivery(self._flush)
            group = self._forming[key_t] = _Group(step)
        group.add(run, inputs, rows)
        return True

    def _flush(self) -> None:
        forming, self._forming = self._forming, {}
        for group in forming.values():
            members = [m for m in group.members if not m[0].finished]
            if len(members) > 1:
                self._send_group(group.step, members)
            elif members:
                run, inputs, _ = members[0]
                self._send_one(run, group.step, inputs)

    def _send_group(self, step: _Step, members: list[tuple[_Run, list[InferTensor], int]]) -> None:
        """The members' step as requests of at most the step model's max_batch_size rows each; each alone where
        the model does not take groups (or is not there: each then fails as it would alone)."""
        try:
            target = self.route(InferRequest(step.model, [], step.version))
        except Exception:  # noqa: BLE001 - each member's own send says why
            target = None
        if target is None or not target.takes_groups:
            for run, inputs, _ in members:
                if not run.finished:
                    self._send_one(run, step, inputs)
            return
        max_rows = target.config.max_batch_size
        chunk: list[tuple[_Run, list[InferTensor], int]] = []
        rows = 0
        for member in members:
            if chunk and rows + member[2] > max_rows:
                self._submit_group(target, step, chunk)
                chunk, rows = [], 0
            chunk.append(member)
            rows += member[2]
        self._submit_group(target, step, chunk)

    def _submit_group(self, target: Scheduler, step: _Step, chunk: list[tuple[_Run, list[InferTensor], int]]) -> None:
        chunk = [m for m in chunk if not m[0].finished]  # an earlier chunk's submit may have failed some
        if len(chunk) < 2:
            for run, inputs, _ in chunk:
                self._send_one(run, step, inputs)
            return
        first_run, first_inputs, _ = chunk[0]
        tensors = []
        for i, t in enumerate(first_inputs):
            data = _joined([m[1][i].data for m in chunk])
            tensors.append(InferTensor(t.name, t.datatype, data.shape, data))
        request = self._request(first_run, step, tensors)
        group = _Group(step)
        for run, inputs, rows in chunk:
            group.add(run, inputs, rows)
        try:
            handle = target.submit(request, lambda result: self._on_group(group, result), members=len(chunk))
        except Exception as exc:  # noqa: BLE001 - as _send_one: each member fails with the step named
            for run, _, _ in chunk:
                run.in_flight.pop(step.index, None)
                self._refused(run, step, exc)
            return
        if group.abandoned:  # every member failed meanwhile (another of its steps)
            target.cancel(handle)
        elif not group.answered:  # (a scheduler may answer inside submit)
            group.target, group.handle = target, handle

    def _on_group(self, group: _Group, result: Any) -> None:
        """The group's answer, each member's rows to its run as its own step's answer would be."""
        step = group.step
        group.answered = True
        group.target = group.handle = None  # no cycle: its handle's callback holds the group
        if isinstance(result, BaseException):
            for run, _, _ in group.members:
                self._on_step(run, step, result)
            return
        outputs, compute_ns = result.outputs, result.compute_ns
        start = 0
        with gathering():  # the steps its answers make ready go on as a group in turn
            for run, _, rows in group.members:
                stop = start + rows
                if self._limit:
                    self._release(run, step.index)
                if not run.finished:
                    run.in_flight.pop(step.index, None)
                    self._advance(run, step, [(t.name, t.datatype, t.data[start:stop]) for t in outputs],
                                  compute_ns)
                start = stop

    def _on_step(self, run: _Run, step: _Step, result: Any, trace: Any = None) -> None:
        if trace is not None:
            trace.end()
        if self._limit:
            self._release(run, step.index)
        if run.finished:
            return
        run.in_flight.pop(step.index, None)
        if isinstance(result, BaseException):
            self._fail(run, step, result if isinstance(result, InferenceError)
                       else InferenceError(ErrorKind.INTERNAL, str(result)))
            return
        self._advance(run, step, [(t.name, t.datatype, t.data) for t in result.outputs], result.compute_ns)

    def _advance(self, run: _Run, step: _Step, outputs: list[tuple[str, str, Any]],
                 compute_ns: tuple[int, int, int]) -> None:
        """A step's outputs become the run's tensors; the steps they complete are sent; the last answers it."""
        names = step.tensor_of
        compute = run.compute
        ci, cf, co = compute_ns
        compute[0] += ci
        compute[1] += cf
        compute[2] += co
        ready: list[str] = []
        for name, datatype, data in outputs:
            tensor = names.get(name)
            if tensor is not None:
                run.tensors[tensor] = (datatype, data)
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
