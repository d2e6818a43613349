"""The asyncio driver of one sequence model version: gpud.executor.sequence_batcher decides which slot each sequence
holds and what each instance runs; this module parses the sequence parameters of a request, adds the control
tensors and the implicit state to each batch row, runs the batch on its instance (shared memory, as
gpud.executor.dynamic_scheduler does), keeps each sequence's state from its answer, and answers the requests.

Where the implicit state lives: here, in the daemon, one set of arrays per live sequence, and it travels to the
worker and back with each batch through the instance's shared-memory segments, like any input and output. Not in
the worker, on purpose:
  - the state of a sequence is exactly that of its last answered request: a batch that fails (its worker crashed,
    its device was lost) changes nothing, and the sequence goes on, on another instance if it must;
  - so an instance that goes away (the controller removes or moves it, its worker restarts) hands its sequences to
    other instances with their state (gpud.executor.sequence_batcher), and the controller may move sequence models like
    any other;
  - the worker stays stateless and its protocol unchanged.
The price is two copies of each state per request (into the input segment, out of the output segment), as for any
input and output; a large state (a KV cache of hundreds of MB) would want it kept on the device instead.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, cast

import numpy as np

from gpud.executor import protocol
from gpud.executor.batcher import Wait
from gpud.executor.instance import InstanceHandle
from gpud.executor.objective import LatencyObjective
from gpud.executor.model_config import ModelConfig
from gpud.executor.scheduler import Done, Pending, RequestHandle, SchedulerBase
from gpud.executor.sequence_batcher import (CorrelationId, SequenceBatcher, SequenceDispatch, SequenceRequest,
                                       describe_id)
from gpud.executor.sequence_config import CORRID, END, READY, START, control_value, initial_state
from gpud.executor.model_config import execution_config
from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferTensor

log = logging.getLogger("gpud.executor")

# The request parameters of Triton's sequence extension (tritonclient sets all three when sequence_id is not 0/"").
SEQUENCE_ID, SEQUENCE_START, SEQUENCE_END = "sequence_id", "sequence_start", "sequence_end"
_UINT64_LIMIT = 2**64


class _StateShapeError(ValueError):
    """The model returned a state output of another shape than its state's dims."""


def _bad(message: str) -> InferenceError:
    return InferenceError(ErrorKind.INVALID_ARGUMENT, message)


def sequence_parameters(parameters: Mapping[str, Any]) -> tuple[CorrelationId, bool, bool]:
    """(correlation id, start, end) of a request: `sequence_id` an unsigned integer or a string (0 and "": none),
    `sequence_start` / `sequence_end` booleans, as HTTP JSON and gRPC InferParameter carry them."""
    cid = parameters.get(SEQUENCE_ID, 0)
    if isinstance(cid, bool) or not isinstance(cid, (int, str)):
        raise _bad(f"request parameter '{SEQUENCE_ID}' must be an unsigned integer or a string, got {cid!r}")
    if isinstance(cid, int) and not 0 <= cid < _UINT64_LIMIT:
        raise _bad(f"request parameter '{SEQUENCE_ID}' must be an unsigned 64-bit integer or a string, got {cid}")
    if isinstance(cid, str):
        try:
            cid.encode()
        except UnicodeEncodeError:  # a lone surrogate from JSON's \ud800: it could never reach a CORRID tensor
            raise _bad(f"request parameter '{SEQUENCE_ID}' is not valid Unicode text") from None
    flags = []
    for key in (SEQUENCE_START, SEQUENCE_END):
        value = parameters.get(key, False)
        if not isinstance(value, bool):
            raise _bad(f"request parameter '{key}' must be a boolean, got {value!r}")
        flags.append(value)
    return cid, flags[0], flags[1]


class SequenceScheduler(SchedulerBase):
    """Queues, batches and runs the requests of one sequence model version on its instances. A
    gpud.executor.scheduler.Scheduler."""

    def __init__(self, config: ModelConfig, version: str, *, clock=time.monotonic, unready_wait_s: float = 30.0,
                 default_max_queue_size: int = 0, objective: LatencyObjective | None = None):
        if config.sequence_batching is None:
            raise ValueError(f"model '{config.name}' has no sequence_batching")
        super().__init__(config, version, clock, unready_wait_s, objective)
        self.policy = policy = config.sequence_batching
        self.exec_config = execution_config(config)
        self.batcher = SequenceBatcher(policy, model_name=config.name, max_batch_size=config.max_batch_size,
                                       clock=clock, max_queued=default_max_queue_size,
                                       adaptive=config.options.batching == "adaptive")
        self._running: dict[InstanceHandle, SequenceDispatch] = {}
        self._output_types = {o.name: o.datatype for o in self.exec_config.outputs}
        batches = config.batches
        # (input name, kind, its false tensor, its true tensor) of START, END and READY: the same arrays every row
        self._flags = tuple((c.name, c.kind, control_value(c, False, batches), control_value(c, True, batches))
                            for c in policy.controls if c.kind != CORRID)
        self._corrid = policy.control(CORRID)
        self._initial = {s.input_name: initial_state(s, batches) for s in policy.states}
        self._state_outputs = tuple(s.output_name for s in policy.states)

    def _unready_note(self) -> str:
        return "; its sequences keep their state"

    # --- instances -------------------------------------------------------------------------------------------
    def add_instance(self, inst: InstanceHandle) -> None:
        inst.on_ready_change = self._on_ready_change
        self._instances.append(inst)
        if inst.ready:
            self.batcher.add_instance(inst.key)
            self._cancel_unready_deadline()
            self.step()

    def remove_instance(self, inst: InstanceHandle) -> None:
        """It takes no more batches; its sequences go on elsewhere with their state (the one it runs, once
        answered)."""
        inst.on_ready_change = None
        if inst in self._instances:
            self._instances.remove(inst)
        moved = self.batcher.remove_instance(inst.key)
        if moved:
            log.info("model %s version %s: %d sequence(s) of instance %s moved to other instances or the backlog",
                     self.config.name, self.version, len(moved), inst.key)
        self.step()

    def _on_ready_change(self, inst: InstanceHandle) -> None:
        if inst.ready:
            self.batcher.add_instance(inst.key)
            self._cancel_unready_deadline()
        else:
            moved = self.batcher.remove_instance(inst.key)
            if moved:
                log.warning("model %s version %s: instance %s is down; its %d sequence(s) go on elsewhere",
                            self.config.name, self.version, inst.key, len(moved))
        self.step()

    def _queued_requests(self) -> int:
        return self.batcher.queued_requests

    @property
    def pending_requests(self) -> int:
        return self.batcher.queued_requests + sum(len(d.requests) for d in self._running.values())

    @property
    def live_sequences(self) -> int:
        return self.batcher.live_sequences

    @property
    def backlog_sequences(self) -> int:
        """Live sequences waiting for a free slot."""
        return self.batcher.backlog_sequences

    @property
    def instances_needed(self) -> int:
        """Instances whose slots hold every live sequence (the controller keeps at least this many)."""
        return self.batcher.instances_needed

    # --- requests --------------------------------------------------------------------------------------------
    def submit(self, request: InferRequest, done: Done, members: int = 1) -> Pending:
        """Queue `request` in its sequence; `done(response_or_error)` is called once it is answered. A bad request
        (no correlation id, not START for an unknown id, batch size over 1, bad input) raises InferenceError at once
        and changes nothing. Requests come one at a time (takes_groups is False)."""
        if members != 1:
            raise ValueError(f"model '{self.config.name}' takes no groups of requests (sequence batching)")
        cid, start, end = sequence_parameters(request.parameters)
        prepared = self._prepare(request)
        if self.config.batches and prepared.batch_rows != 1:
            raise _bad(f"inference request to model '{self.config.name}' must specify batch-size 1 due to "
                       "requirements of sequence batcher")
        if self._corrid is not None:
            given = "BYTES" if isinstance(cid, str) else "UINT64"
            wants_string = self._corrid.datatype == "BYTES"
            if isinstance(cid, str) != wants_string and cid not in (0, ""):
                raise _bad(f"sequence batching control '{self._corrid.name}' data-type is '{given}', but model "
                           f"'{self.config.name}' expects '{self._corrid.datatype}'")
        pending = Pending(request, prepared, done, time.perf_counter_ns())
        req = SequenceRequest(payload=pending, correlation_id=cid, start=start, end=end,
                              shape_key=prepared.shape_key, timeout_us=request.timeout_us)
        warning = self.batcher.enqueue(req)  # raises at once and changes nothing
        if warning:
            log.warning("%s", warning)
        self.step()
        self._arm_unready_deadline()
        return pending

    def cancel(self, handle: RequestHandle) -> None:
        """The client went away. Its request still runs when its turn comes (the sequence's state goes through it,
        as through every request the sequence accepted); only its answer is dropped."""
        cast(Pending, handle).finished = True  # submit's, by the protocol

    def step(self) -> None:
        expired = self.batcher.expire()
        for req, error in expired.failed:
            self._fail([req.payload], error)
        for cid, why in expired.released:
            log.info("model %s version %s: sequence %s %s", self.config.name, self.version, describe_id(cid), why)
        until_s = self.batcher.next_deadline_s()
        for inst in self.instances:
            if not inst.ready or inst in self._running:
                continue
            decision = self.batcher.decide(inst.key)
            if isinstance(decision, SequenceDispatch):
                self._run(inst, decision)
            elif isinstance(decision, Wait):
                until_s = decision.until_s if until_s is None else min(until_s, decision.until_s)
        self._arm_timer(until_s)
        self._notify_if_idle()

    # --- one batch -------------------------------------------------------------------------------------------
    def _rows(self, d: SequenceDispatch) -> list[dict[str, np.ndarray]]:
        """Each row's model inputs: the request's (zeros for a null row), its control tensors, its state."""
        first = next(row.request.payload.prepared.inputs for row in d.rows if row.request is not None)
        out = []
        for row in d.rows:
            req = row.request
            if req is None:
                inputs = {n: np.full(a.shape, b"", dtype=object) if a.dtype == object else np.zeros_like(a)
                          for n, a in first.items()}
                ready, start, end, cid, state = False, False, False, "" if self._string_ids else 0, None
            else:
                inputs = dict(req.payload.prepared.inputs)
                ready, start, end, cid = True, req.start, req.end, req.correlation_id
                seq = row.sequence
                assert seq is not None  # a row with a request has its sequence
                state = None if req.start else seq.state
            flags = {START: start, END: end, READY: ready}
            for name, kind, false, true in self._flags:
                inputs[name] = true if flags[kind] else false
            if self._corrid is not None:
                inputs[self._corrid.name] = control_value(self._corrid, cid, self.config.batches)
            for name, initial in self._initial.items():
                inputs[name] = initial if state is None else state[name]
            out.append(inputs)
        return out

    @property
    def _string_ids(self) -> bool:
        return self._corrid is not None and self._corrid.datatype == "BYTES"

    def _run(self, inst: InstanceHandle, d: SequenceDispatch) -> None:
        t0 = time.perf_counter_ns()
        batch = [row.request.payload for row in d.rows if row.request is not None]
        try:
            inputs, _ = protocol.write_inputs(self.exec_config, self._rows(d), inst.ensure_capacity)
        except Exception as exc:  # noqa: BLE001 - e.g. /dev/shm full: this batch fails, the instance stays usable
            self.batcher.complete(d)
            self._fail(batch, self._staging_error(exc))
            self.step()
            return
        output_names = tuple(dict.fromkeys([n for p in batch for n in p.prepared.output_names]
                                           + list(self._state_outputs)))
        error = self._submit_batch(inst, batch, d, inputs, output_names, t0, self._on_reply)
        if error is not None:
            self.batcher.complete(d)
            self._fail(batch, error)

    def _on_reply(self, inst: InstanceHandle, d: SequenceDispatch,
                  reply: protocol.Done | protocol.Failed | InferenceError, stage_ns: int) -> None:
        self._running.pop(inst, None)
        batch = [row.request.payload for row in d.rows if row.request is not None]
        answers: list[list[InferTensor]] = []
        timings = (0, 0, 0, 0)
        done = self._done_or_error(reply)
        error = done if isinstance(done, InferenceError) else None
        if not isinstance(done, InferenceError):
            try:
                t0 = time.perf_counter_ns()
                answers = self._keep_states_and_split(d, self._read_outputs(inst, done))
                now_ns = time.perf_counter_ns()
                timings = (stage_ns + done.input_ns, done.infer_ns, done.output_ns + now_ns - t0, now_ns)
            except InferenceError as exc:
                error = exc
            except _StateShapeError as exc:
                log.warning("model %s version %s: %s", self.config.name, self.version, exc)
                error = InferenceError(ErrorKind.INTERNAL, f"model '{self.config.name}' failed: {exc}")
            except Exception as exc:
                log.exception("model %s: reading a batch's outputs failed", self.config.name)
                error = InferenceError(ErrorKind.INTERNAL, f"reading outputs failed: {exc}")
        # The states are in: the sequences' next requests may run (on this instance or another) before these
        # answers are written.
        self.batcher.complete(d)
        self._answering += 1
        try:
            self.step()
        finally:
            self._answering -= 1
            if error is not None:
                self._fail(batch, error)
            else:
                self._answer(batch, answers, *timings)
            self._notify_if_idle()

    def _keep_states_and_split(self, d: SequenceDispatch,
                               outputs: list[tuple[str, str, np.ndarray]]) -> list[list[InferTensor]]:
        """Each real row's state outputs become its sequence's state (dropped after END), and its requested outputs
        its answer."""
        batches = self.config.batches
        produced = {name: arr.shape for name, _, arr in outputs}
        for s in self.policy.states:  # a model that breaks its own state's shape must not poison its sequences
            shape = produced[s.output_name]
            dims = shape[1:] if batches else shape
            if (len(shape) != len(s.dims) + batches or (batches and shape[0] != len(d.rows))
                    or any(want >= 0 and got != want for got, want in zip(dims, s.dims))):
                raise _StateShapeError(f"the model's state output '{s.output_name}' has shape {list(shape)}, not the "
                                 f"state's dims {list(s.dims)}" + (f" for a batch of {len(d.rows)}" if batches else "")
                                 + "; the sequences keep their previous state")
        per_row: list[list[InferTensor]] = []
        for i, row in enumerate(d.rows):
            req = row.request
            if req is None:
                continue
            part = {name: (datatype, arr[i:i + 1] if batches else arr) for name, datatype, arr in outputs}
            if self.policy.states and row.sequence is not None:  # copied: a view would keep the batch alive
                row.sequence.state = None if req.end else {
                    s.input_name: part[s.output_name][1].copy() for s in self.policy.states}
            wanted = req.payload.prepared.output_names
            per_row.append([InferTensor(n, part[n][0], part[n][1].shape, part[n][1]) for n in wanted])
        return per_row

    # --- shutdown / unload -----------------------------------------------------------------------------------
    def fail_all_queued(self, message: str) -> None:
        self._fail([r.payload for r in self.batcher.drain()], InferenceError(ErrorKind.UNAVAILABLE, message))
        self.step()
