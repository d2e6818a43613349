"""The asyncio driver of one model version with dynamic batching (or none): queue (gpud.executor.batcher),
instances, batches in shared memory. A `gpud.executor.scheduler.Scheduler`.

Three events move it: a request arrives, an instance finishes a batch (or becomes ready), a timer fires. After each
it runs the batcher's step: fail expired requests, dispatch batches while instances are free, arm one timer.
Completion is a callback from the worker channel's reader, not a task per batch. Putting a batch into shared memory
and taking its outputs out is gpud.executor.protocol's; this module decides what runs where and when, and answers the
requests.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import cast

import numpy as np
from mypy_extensions import mypyc_attr

from gpud.executor import protocol
from gpud.executor.batcher import BatchQueue, Dispatch, QueuedRequest, Wait, timeout_error
from gpud.executor.instance import InstanceHandle
from gpud.executor.model_config import ModelConfig
from gpud.executor.objective import LatencyObjective
from gpud.executor.scheduler import Done, Pending, RequestHandle, SchedulerBase, defer_step
from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferTensor

log = logging.getLogger("gpud.executor")

# While requests pour in, look for finished batches at most this often (one non-blocking poll of the worker pipe).
_POLL_INTERVAL_S = 50e-6


def direct_capable(config: ModelConfig) -> bool:
    """Whether a model's requests may run in their caller's thread (gpud.executor.direct): a plain model (no
    sequence, no ensemble) without BYTES tensors (those are encoded for shared memory; a direct run would hand the
    model other element types)."""
    return (config.sequence_batching is None and config.ensemble is None
            and all(t.datatype != "BYTES" for t in (*config.inputs, *config.outputs)))


@mypyc_attr(allow_interpreted_subclasses=True)  # the replay's SimScheduler (bench/replay)
class DynamicScheduler(SchedulerBase):
    """Queues, batches and runs the requests of one model version on its instances."""

    def __init__(self, config: ModelConfig, version: str, *, clock: Callable[[], float] = time.monotonic,
                 unready_wait_s: float = 30.0, default_max_queue_size: int = 0,
                 objective: LatencyObjective | None = None):
        super().__init__(config, version, clock, unready_wait_s, objective)
        adaptive = config.options.batching == "adaptive"  # "triton": Triton's exact dynamic batcher
        self.queue = BatchQueue(max_batch_size=config.max_batch_size, dynamic_batching=config.dynamic_batching,
                                clock=clock, dispatch_lone_request=adaptive, quiet_dispatch=adaptive,
                                default_max_queue_size=default_max_queue_size,
                                latency_budget_s=objective.seconds if objective is not None else None,
                                shed=objective is not None and objective.shed)
        self._free: deque[InstanceHandle] = deque()
        self._running: dict[InstanceHandle, list[Pending]] = {}
        self._polled_s = 0.0
        self._output_types = {o.name: o.datatype for o in config.outputs}
        self._direct_capable = direct_capable(config)

    def _queued_requests(self) -> int:
        return len(self.queue)

    # --- instances -------------------------------------------------------------------------------------------
    def add_instance(self, inst: InstanceHandle) -> None:
        inst.on_ready_change = self._on_ready_change
        self._instances.append(inst)
        if inst.ready:
            self._free.append(inst)
            self._cancel_unready_deadline()
            self.step()

    def remove_instance(self, inst: InstanceHandle) -> None:
        inst.on_ready_change = None
        if inst in self._instances:
            self._instances.remove(inst)
        if inst in self._free:
            self._free.remove(inst)

    def _on_ready_change(self, inst: InstanceHandle) -> None:
        if inst.ready and inst not in self._free and inst not in self._running:
            self._free.append(inst)
            self._cancel_unready_deadline()
            self.step()
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

    @property
    def moves_client_tensors(self) -> bool:
        return True  # its batches go to a worker as they are: the worker reads and writes the regions (_run)

    def _enqueue(self, request: InferRequest, done: Done, members: int = 1) -> Pending:
        """`request` checked and queued; bad input and a full queue raise InferenceError and change nothing."""
        prepared = self._prepare(request)
        pending = Pending(request, prepared, done, time.perf_counter_ns(), members)
        # (payload, batch_rows, shape_key, priority, timeout_us): by position, which a dataclass takes faster
        queued = QueuedRequest(pending, prepared.batch_rows, prepared.shape_key, request.priority, request.timeout_us,
                               members)
        self.queue.enqueue(queued)  # raises at once (queue full, bad priority) and changes nothing
        pending.queued = queued
        return pending

    def submit(self, request: InferRequest, done: Done, members: int = 1) -> Pending:
        """Queue `request`; `done(response_or_error)` is called once when it is answered (from the event loop).
        Bad input and a full queue raise InferenceError at once and change nothing. The returned handle is for
        `cancel`. A callback, not a future: a front end that answers from it needs no task per request.
        `members` > 1 (only where `takes_groups`): the request is that many requests' rows, concatenated (an
        ensemble's step for several of its requests): it is batched and answered as one, and counted as that many
        requests in the statistics."""
        pending = self._enqueue(request, done, members)
        # deferred: batched once the answers being delivered are all out. With no instance free and no deadline to
        # watch, a step would decide nothing (the batcher's Idle): the next instance free steps it.
        if not defer_step(self) and (self._free or self.queue.watches_deadlines):
            self.step()
        if not self._free and self._unready_timer is None:
            self._arm_unready_deadline()
        if self._running:
            now_s = time.perf_counter()
            if now_s - self._polled_s >= _POLL_INTERVAL_S:
                self._polled_s = now_s
                for inst in list(self._running):
                    if inst.worker is not None:
                        inst.worker.poll()
        return pending

    def direct_path(self) -> DynamicScheduler | None:
        return self if self._direct_capable else None

    # --- a request run by its caller (gpud.executor.direct; the loop's lock held) -----------------------------------
    def idle_instance(self) -> InstanceHandle | None:
        """The instance a caller may take for its request: the first free one while nothing is queued."""
        return self._free[0] if self._free and not self.queue else None

    def begin_direct(self, request: InferRequest, done: Done, inst: InstanceHandle) -> tuple[Pending, bool]:
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

    def end_direct(self, inst: InstanceHandle, pending: Pending, outputs: list[np.ndarray] | InferenceError,
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

    def cancel(self, handle: RequestHandle) -> None:
        """The client went away: if the request is still queued it never runs; its callback is not called."""
        pending = cast(Pending, handle)  # submit's, by the protocol
        pending.finished = True
        if pending.queued is not None:
            self.queue.remove(pending.queued)
            pending.queued = None
            self._notify_if_idle()  # the queue may just have emptied: a shutdown waiting for idle goes on

    def withdraw_member(self, handle: RequestHandle) -> None:
        pending = cast(Pending, handle)  # submit's, by the protocol
        if pending.queued is not None and pending.members > 1:
            pending.members -= 1

    def step(self) -> None:
        for q in self.queue.expire():
            self._fail([q.payload], self._shed_error() if q.shed else timeout_error())
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

    def _ran(self, seconds: float) -> None:
        self.queue.note_run(seconds)

    def _shed_error(self) -> InferenceError:
        assert self.objective is not None
        return InferenceError(ErrorKind.UNAVAILABLE,
                              f"request queued past model '{self.config.name}''s latency objective of "
                              f"{self.objective.seconds * 1e3:g} ms: answered now instead of late "
                              "(gpud_latency_objective_shed); retry, or add instances")

    # --- one batch -------------------------------------------------------------------------------------------
    def _run(self, inst: InstanceHandle, batch: list[Pending]) -> None:
        t0 = time.perf_counter_ns()
        ios = [p.request.client_io for p in batch]
        has_io = any(ios)
        try:
            inputs, reads = protocol.write_inputs(self.config, [p.prepared.inputs for p in batch], inst.ensure_capacity,
                                                  [io.inputs if io else None for io in ios] if has_io else ())
        except Exception as exc:  # noqa: BLE001 - e.g. /dev/shm full: this batch fails, the instance stays usable
            self._free.appendleft(inst)
            self._fail(batch, self._staging_error(exc))
            return
        output_names = tuple(dict.fromkeys(n for p in batch for n in p.prepared.output_names))
        writes = self._client_writes(batch, output_names)[0] if has_io else ()
        error = self._submit_batch(inst, batch, batch, inputs, output_names, t0, self._on_reply, reads, writes)
        if error is not None:
            if error.kind is ErrorKind.INTERNAL:  # not sent for a bug of ours: its worker is fine, and so is it
                self._free.appendleft(inst)
            self._fail(batch, error)

    def _client_writes(self, batch: list[Pending], output_names: tuple[str, ...]) -> tuple[tuple, list[int]]:
        """The outputs the worker writes into clients' regions (protocol.Infer.writes), and the request of each."""
        writes: list[tuple[int, int, int, str, int, int, int]] = []
        owners: list[int] = []
        start = 0
        for i, p in enumerate(batch):
            rows = p.prepared.batch_rows
            io = p.request.client_io
            if io is not None:
                for name, (_, where) in io.outputs.items():
                    if name in p.prepared.output_names:
                        stop = start + rows if self.config.batches else -1
                        writes.append((output_names.index(name), start, stop, where.path, where.offset,
                                       where.byte_size, i))
                        owners.append(i)
            start += rows
        return tuple(writes), owners

    def _on_reply(self, inst: InstanceHandle, batch: list[Pending],
                  reply: protocol.Done | protocol.Failed | InferenceError, stage_ns: int) -> None:
        self._running.pop(inst, None)
        answers = self._collect(inst, batch, reply, stage_ns)
        if inst.ready and inst in self.instances:
            self._free.append(inst)
        # The outputs are out of shared memory: hand the instance its next batch before answering this one, so the
        # worker computes while the front end encodes and writes the answers.
        self._answering += 1
        try:
            self.step()
        finally:
            self._answering -= 1
            if isinstance(answers, InferenceError):
                self._fail(batch, answers)
            else:
                if isinstance(reply, protocol.Done) and any(p.request.client_io for p in batch):
                    batch, answers = self._written_to_regions(batch, reply, answers)
                if batch:  # (none left when every request's write into its region failed: each answered so)
                    self._answer(batch, *answers)
            self._notify_if_idle()

    def _written_to_regions(self, batch: list[Pending], done: protocol.Done, answers: tuple) -> tuple[list, tuple]:
        """The requests whose outputs the worker wrote into their regions: those outputs answered by shape alone,
        and the requests whose write failed (too small a region) or whose input could not be read failed, out of
        the batch that is answered."""
        per_request = answers[0]
        failed: dict[int, InferenceError] = {owner: InferenceError(ErrorKind[kind], message)
                                             for owner, kind, message in done.read_errors}
        if done.write_errors:
            owners = self._client_writes(batch, tuple(m.name for m in done.outputs))[1]  # Infer's output order
            for index, kind, message in done.write_errors:
                failed.setdefault(owners[index], InferenceError(ErrorKind[kind], message))
        for i, p in enumerate(batch):
            io = p.request.client_io
            if io is not None and i not in failed:
                for tensor in per_request[i]:
                    target = io.outputs.get(tensor.name)
                    if target is not None:
                        tensor.shm = target[0]
        if not failed:
            return batch, answers
        for i, error in failed.items():
            self._fail([batch[i]], error)
        keep = [i for i in range(len(batch)) if i not in failed]
        return [batch[i] for i in keep], ([per_request[i] for i in keep], *answers[1:])

    def _collect(self, inst: InstanceHandle, batch: list[Pending],
                 reply: protocol.Done | protocol.Failed | InferenceError,
                 stage_ns: int) -> tuple[list[list[InferTensor]], int, int, int, int] | InferenceError:
        """The batch's outputs copied out of shared memory (the instance's output segment is reused by the next
        batch), split per request, and its timings (input, infer, output ns; time read); or why there are none."""
        done = self._done_or_error(reply)
        if isinstance(done, InferenceError):
            return done
        t0 = time.perf_counter_ns()
        try:
            per_request = self._split(batch, self._read_outputs(inst, done))
        except InferenceError as refused:  # (a name per exception type: compiled code types each name once)
            return refused
        except Exception as exc:
            log.exception("model %s: reading a batch's outputs failed", self.config.name)
            return InferenceError(ErrorKind.INTERNAL, f"reading outputs failed: {exc}")
        now_ns = time.perf_counter_ns()
        return (per_request, stage_ns + done.input_ns, done.infer_ns, done.output_ns + (now_ns - t0), now_ns)

    def _split(self, batch: list[Pending], outputs: list[tuple[str, str, np.ndarray]]) -> list[list[InferTensor]]:
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
        self.step()
