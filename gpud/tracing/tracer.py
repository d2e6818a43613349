"""The daemon's tracing (Triton's trace extension): settings for all models and for single models, which requests are
traced (every rate-th, until the count runs out), each trace's timestamps and tensors, and their files.

The core samples a request when it takes it (`Tracer.sample`) and ends its trace when it answers it; the scheduler
adds the queue and compute timestamps (`Trace.computed`). Settings follow Triton's rules: a model's own settings
name some fields and take the others from the global settings, and a change to those reaches them; a setting that
is cleared goes back to the global one (for the global settings: to what gpud started with). A change starts the
settings' sampling anew, keeping the count still to take.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from gpud.executor.errors import ErrorKind, InferenceError
from gpud.executor.types import InferRequest, InferResponse
from gpud.tracing.output import TraceFile
from gpud.tracing.settings import FIELDS, TraceSettings, parse_request

log = logging.getLogger("gpud")

_ALL_FIELDS = frozenset(FIELDS.values()) - {"file"}  # those a request may set (the file is set at start)


class _Scope:
    """One setting as it traces (Triton's TraceSetting): its sampling, the count still to take, and the traces
    collected but not yet written."""

    def __init__(self, settings: TraceSettings, specified: frozenset[str], file: TraceFile):
        self.settings = settings
        self.specified = specified  # a model's: the fields it sets itself; the others are the global setting's
        self.file = file
        self.remaining = settings.count
        self.seen = 0  # requests sampled from
        self.created = 0
        self.collected = 0
        self.pending: list[str] = []
        self.live = not settings.why_not_tracing() and settings.count != 0
        self.retired = False  # replaced: traces of its still running are written as they end

    def current(self) -> TraceSettings:
        return replace(self.settings, count=self.remaining)

    def hit(self, members: int) -> bool:
        """Whether the next `members` requests include a rate-th one (and the count allows a trace)."""
        seen = self.seen
        self.seen = seen + members
        rate = self.settings.rate
        if (seen + members) // rate == seen // rate:
            return False
        if self.remaining > 0:
            self.remaining -= 1
            self.live = self.remaining != 0
        self.created += 1
        return True

    def collect(self, text: str) -> None:
        self.pending.append(text)
        self.collected += 1
        if self.retired:
            self.write()
            return
        frequency = self.settings.log_frequency
        if frequency and len(self.pending) >= frequency:
            self.file.write_indexed(self.pending)
            self.pending = []
        elif self.remaining == 0 and self.collected == self.created:  # the count is done: no reason to wait
            self.write()

    def write(self) -> None:
        """What is collected, written: to the indexed files with a log frequency, else to the file."""
        if self.pending:
            if self.settings.log_frequency:
                self.file.write_indexed(self.pending)
            else:
                self.file.append(self.pending)
            self.pending = []


class Trace:
    """One traced request: its timestamps (Triton's names) and tensors, written as Triton's JSON when it ends."""

    __slots__ = ("id", "scope", "tracer", "timestamps", "tensors", "model_name", "model_version", "request_id",
                 "parent_id", "stamps", "entries", "ended")

    def __init__(self, trace_id: int, scope: _Scope, tracer: Tracer, model_name: str, model_version: str,
                 request_id: str, parent_id: int = 0):
        self.id = trace_id
        self.scope = scope
        self.tracer = tracer
        self.parent_id = parent_id  # an ensemble's trace, for the trace of one of its steps
        level = scope.settings.level
        self.timestamps = "TIMESTAMPS" in level
        self.tensors = "TENSORS" in level
        self.model_name = model_name
        self.model_version = _version_number(model_version)
        self.request_id = request_id
        self.stamps: list[tuple[str, int]] = []  # (Triton's name, ns)
        self.entries: list[dict[str, Any]] = []  # tensors
        self.ended = False

    def stamp(self, name: str, ns: int) -> None:
        if self.timestamps:
            self.stamps.append((name, ns))

    def child(self, model_name: str, model_version: str) -> Trace:
        """The trace of a step of this ensemble's request (traced with it, whatever the rate), started now."""
        trace = Trace(self.tracer.new_id(), self.scope, self.tracer, model_name, model_version, self.request_id,
                      self.id)
        self.scope.created += 1
        trace.stamp("REQUEST_START", self.tracer.clock_ns())
        return trace

    def computed(self, version: str, arrival_ns: int, dispatch_ns: int, input_ns: int, infer_ns: int,
                 output_ns: int) -> None:
        """The scheduler's part: queued at `arrival_ns`, its batch dispatched at `dispatch_ns`, then the batch's
        compute phases (as the statistics count them) laid end to end. What remains before REQUEST_END is the
        way to and from the device worker's process."""
        self.model_version = _version_number(version)  # the version that ran (an ensemble's step may name none)
        if self.timestamps:
            input_end = dispatch_ns + input_ns
            output_start = input_end + infer_ns
            self.stamps += [("QUEUE_START", arrival_ns), ("COMPUTE_START", dispatch_ns),
                            ("COMPUTE_INPUT_END", input_end), ("COMPUTE_OUTPUT_START", output_start),
                            ("COMPUTE_END", output_start + output_ns)]

    def tensor(self, activity: str, name: str, datatype: str, shape: Any, data: Any) -> None:
        """A tensor's values (TENSORS level): TENSOR_QUEUE_INPUT, TENSOR_BACKEND_OUTPUT. Tensors in a client's or a
        front-end process's shared memory, whose bytes the core does not hold, are not written."""
        if not self.tensors or not isinstance(data, np.ndarray) or data.size != int(np.prod(shape, dtype=np.int64)):
            return
        values = data.ravel().tolist()
        if datatype == "BYTES":
            values = [v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else str(v) for v in values]
        self.entries.append({"id": self.id, "activity": activity, "tensor": {
            "name": name, "data": ",".join(map(str, values)), "shape": ",".join(map(str, shape)),
            "dtype": datatype}})

    def follow(self, request: InferRequest, done: Callable[[Any], None]) -> Callable[[Any], None]:
        """`request` traced by this trace (its scheduler adds the queue and compute timestamps): `done`, which ends
        the trace first (with the TENSORS level, the request's inputs now and its answer's outputs then)."""
        request.trace = self
        if self.tensors:
            for t in request.inputs:
                self.tensor("TENSOR_QUEUE_INPUT", t.name, t.datatype, t.shape, t.data)

        def answer(result: Any) -> None:
            try:
                if self.tensors and isinstance(result, InferResponse):
                    for t in result.outputs:
                        self.tensor("TENSOR_BACKEND_OUTPUT", t.name, t.datatype, t.shape, t.data)
                self.end()
            except Exception:  # noqa: BLE001 - a trace that cannot be written must not lose the answer
                log.exception("trace %d of model %s could not be written", self.id, self.model_name)
            done(result)
        return answer

    def end(self) -> None:
        """REQUEST_END, now: the trace is written with its setting's others (once: a request withdrawn after its
        answer has ended)."""
        if self.ended:
            return
        self.ended = True
        self.stamp("REQUEST_END", self.tracer.clock_ns())
        self.scope.collect(self.text())

    def text(self) -> str:
        """Triton's objects for this trace (without the array's brackets): its model, its timestamps, its
        tensors."""
        # written out by hand (json.dumps only for the strings a client chose): about a fifth of the time that
        # json.dumps of the same dictionaries takes (4.8 against 22 µs a trace, measured on the 2-core VM)
        head = f'{{"id":{self.id},"model_name":{json.dumps(self.model_name)},"model_version":{self.model_version}'
        if self.request_id:
            head += f',"request_id":{json.dumps(self.request_id)}'
        if self.parent_id:
            head += f',"parent_id":{self.parent_id}'
        parts = [head + "}"]
        if self.stamps:  # (the names are Triton's, none needs escaping)
            parts.append(f'{{"id":{self.id},"timestamps":[' +
                         ",".join([f'{{"name":"{name}","ns":{ns}}}' for name, ns in self.stamps]) + "]}")
        parts += [json.dumps(o, separators=(",", ":")) for o in self.entries]
        return ",".join(parts)


class Tracer:
    """The daemon's trace settings and what they trace. `on` is False while no setting traces anything: the core
    then samples nothing and pays one attribute read a request."""

    def __init__(self, settings: TraceSettings, clock_ns: Callable[[], int] = time.perf_counter_ns):
        self.started_with = settings  # what a cleared global setting goes back to
        self.clock_ns = clock_ns
        self._file = TraceFile(settings.file) if settings.file else None
        self._global = self._scope(settings, frozenset())
        self._models: dict[str, _Scope] = {}
        self._next_id = 1
        self.on = False
        self._refresh()

    def describe(self) -> str:
        """The global settings, and each model's own, for the log."""
        models = "".join(f"; model {name}: {_describe(s.current())}" for name, s in sorted(self._models.items()))
        return _describe(self._global.current()) + models

    def _scope(self, settings: TraceSettings, specified: frozenset[str]) -> _Scope:
        file = self._file if self._file is not None else TraceFile("")
        return _Scope(settings, specified, file)

    def _refresh(self) -> None:
        self.on = self._global.live or any(s.live for s in self._models.values())

    # --- requests ----------------------------------------------------------------------------------------------
    def sample(self, model_name: str, model_version: str, request_id: str, members: int = 1) -> Trace | None:
        """The trace of a request the core takes (`members` requests, for a front-end process's group), or None.
        Its REQUEST_START is now."""
        scope = self._models.get(model_name) or self._global
        if not scope.live or not scope.hit(members):
            return None
        if not scope.live:
            self._refresh()  # the count ran out
        trace = Trace(self.new_id(), scope, self, model_name, model_version, request_id)
        trace.stamp("REQUEST_START", self.clock_ns())
        return trace

    def new_id(self) -> int:
        trace_id = self._next_id
        self._next_id += 1
        return trace_id

    # --- settings ----------------------------------------------------------------------------------------------
    def settings(self, model_name: str = "") -> TraceSettings:
        """The settings a model's requests are traced by (the global ones for "" or a model without its own)."""
        return (self._models.get(model_name) or self._global).current()

    def update(self, model_name: str, request: Mapping[str, object]) -> TraceSettings:
        """Apply a trace setting request (Triton's names; a null clears a setting) to the global settings ("") or
        to a model's; the settings now. InferenceError for a bad request, or settings that would trace without
        a file or at rate 0, and then nothing changes."""
        changes = parse_request(request)
        if not changes:  # an empty request reads them
            return self.settings(model_name)
        if not model_name:
            return self._update_global(changes)
        old = self._models.get(model_name)
        specified, values = _merged(old, changes)
        if not specified:  # nothing of its own left: the model follows the global settings
            if old is not None:
                self._retire(self._models.pop(model_name))
                log.info("trace settings of model %s: the global settings again", model_name)
                self._refresh()
            return self._global.current()
        new = _checked(replace(self._global.current(), **values))
        self._replace_model(model_name, new, specified)
        log.info("trace settings of model %s: %s", model_name, _describe(new))
        self._refresh()
        return new

    def _update_global(self, changes: Mapping[str, object | None]) -> TraceSettings:
        specified, values = _merged(self._global, changes)
        new = _checked(replace(self.started_with, **values))
        # the models' own settings, their other fields now the new global ones: checked before anything changes
        followers = {name: _checked(replace(new, **{f: getattr(s.current(), f) for f in s.specified}))
                     for name, s in self._models.items() if s.specified != _ALL_FIELDS}
        self._retire(self._global)
        self._global = self._scope(new, specified)
        for name, settings in followers.items():
            self._replace_model(name, settings, self._models[name].specified)
        log.info("trace settings: %s", _describe(new))
        self._refresh()
        return new

    def restart(self, settings: TraceSettings) -> None:
        """New settings to start from (a reload that changed them in the settings file): the global settings become
        them, what a client set included; a model's own settings keep what they set themselves."""
        self.close()  # what was collected, to the file it was collected for
        self.started_with = settings
        if settings.file != (self._file.path if self._file is not None else ""):
            self._file = TraceFile(settings.file) if settings.file else None
        self._retire(self._global)
        self._global = self._scope(settings, frozenset())
        for name, old in list(self._models.items()):
            own = replace(settings, **{f: getattr(old.current(), f) for f in old.specified})
            self._replace_model(name, own, old.specified)
            if own.level and own.why_not_tracing():
                log.warning("trace settings of model %s: traces nothing now: %s", name, own.why_not_tracing())
        log.info("trace settings (reload): %s", self.describe())
        self._refresh()

    def _replace_model(self, model_name: str, settings: TraceSettings, specified: frozenset[str]) -> None:
        old = self._models.get(model_name)
        if old is not None:
            self._retire(old)
        self._models[model_name] = self._scope(settings, specified)

    @staticmethod
    def _retire(scope: _Scope) -> None:
        scope.write()
        scope.live = False
        scope.retired = True

    # --- files -------------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """What the settings without a log frequency collected, written to the trace file (gpud calls this every
        second, so the file is always a valid array of the traces so far)."""
        for scope in [self._global, *self._models.values()]:
            if not scope.settings.log_frequency:
                scope.write()

    def close(self) -> None:
        """Everything collected written (at shutdown, after the last request was answered)."""
        for scope in [self._global, *self._models.values()]:
            scope.write()


def _merged(old: _Scope | None, changes: Mapping[str, object | None]) -> tuple[frozenset[str], dict[str, Any]]:
    """The fields a setting sets itself after `changes` (Triton's rule: those it set and those given, less those
    cleared), with their values (given, else as they were)."""
    before = old.specified if old is not None else frozenset()
    cleared = {f for f, v in changes.items() if v is None}
    given = {f: v for f, v in changes.items() if v is not None}
    specified = (before | frozenset(given)) - cleared
    current = old.current() if old is not None else None
    return specified, {f: given[f] if f in given else getattr(current, f) for f in specified}


def _checked(settings: TraceSettings) -> TraceSettings:
    why = settings.why_not_tracing()
    if settings.level and why:
        hint = " (start gpud with --trace-config triton,file=PATH)" if not settings.file else ""
        raise InferenceError(ErrorKind.INVALID_ARGUMENT, f"Attempting to set invalid trace setting: {why}{hint}")
    return settings


def _version_number(version: str) -> int:
    return int(version) if version.isdigit() else -1  # Triton's: -1 for none


def _describe(settings: TraceSettings) -> str:
    return (f"trace_level {'+'.join(settings.level) or 'OFF'}, trace_rate {settings.rate}, trace_count "
            f"{settings.count}, log_frequency {settings.log_frequency}, trace_file {settings.file or '(none)'}")
