"""gpud's inference core: the model registry and the routing of requests to each version's scheduler; the one
implementation of InferenceCore that the HTTP and gRPC front ends adapt. Where instances go is the placement
service's (gpud.placing.service), loading and unloading models gpud.lifecycle's; what the core looks like to others
is its snapshot (gpud.telemetry.serving).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from gpud.executor.client_shm import ClientRegions, place_inputs, worker_gpu
from gpud.executor.direct import DirectRun, start_direct
from gpud.executor.pool import ExecutorPool
from gpud.executor.classification import PARAMETER as CLASSIFICATION
from gpud.executor.classification import class_count, classified
from gpud.executor.scheduler import Done, RequestHandle, Scheduler, answer_of
from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferResponse, RegionSlice
from gpud import __version__
from gpud.core_api import (Applied, ModelMetadata, ModelStatistics, RepositoryModel, RequestedPlacement,
                           ServedModelConfig, ServerMetadata)
from gpud.ensembles import log_ensembles, models_to_load
from gpud.inspect_view import InspectView, inspect_document
from gpud.lifecycle import ModelLifecycle, names_in
from gpud.model_control import ModelControl, check_model_name
from gpud.placing.service import PlacementService
from gpud.registry import RegisteredModel, RegisteredVersion, Registry
from gpud.executor.process_log import LogSettings
from gpud.log_settings import LogControl
from gpud.repository.layout import ModelRepository
from gpud.repository.overrides import LoadOverride
from gpud.telemetry.serving import ModelState, ServingSnapshot
from gpud.tracing.settings import TraceSettings
from gpud.tracing.tracer import Trace, Tracer

log = logging.getLogger("gpud")

# Only what gpud really implements: clients use this list to decide what to call.
EXTENSIONS = ["classification", "model_repository", "model_repository(unload_dependents)", "model_configuration",
              "statistics", "binary_tensor_data", "schedule_policy", "sequence", "sequence(string_id)",
              "system_shared_memory", "cuda_shared_memory"]


class GroupCancel:
    """What `GpudCore.submit` gives back for a group (`members` > 1): called, the whole group goes; `one()`, one
    member went away (Scheduler.withdraw_member)."""

    __slots__ = ("scheduler", "handle")

    def __init__(self, scheduler: Scheduler, handle: RequestHandle):
        self.scheduler = scheduler
        self.handle = handle

    def __call__(self) -> None:
        self.scheduler.cancel(self.handle)

    def one(self) -> None:
        self.scheduler.withdraw_member(self.handle)


class TracedCancel:
    """A traced request's cancel: the request withdrawn, its trace ends (written with what it has). A group's
    `one()` (a member gone) passes through."""

    __slots__ = ("cancel", "trace")

    def __init__(self, cancel: Callable[[], None], trace: Trace):
        self.cancel = cancel
        self.trace = trace

    def __call__(self) -> None:
        self.cancel()
        self.trace.end()

    def one(self) -> None:
        if isinstance(self.cancel, GroupCancel):
            self.cancel.one()


class GpudCore:
    """Implements gpud.core_api.InferenceCore."""

    def __init__(self, repository: ModelRepository, registry: Registry, placement: PlacementService,
                 pool: ExecutorPool, *, views: Mapping[str, InspectView] | None = None,
                 server_name: str = "gpud", control: ModelControl = ModelControl(),
                 client_shm: ClientRegions | None = None):
        self.repository = repository
        self.client_shm = client_shm or ClientRegions()  # clients' shared-memory regions (--allow-client-shm)
        self.control = control  # who may load and unload models (--model-control-mode)
        self.registry = registry
        self.placement = placement
        self.pool = pool
        self.lifecycle = ModelLifecycle(repository, registry, placement)
        registry.step_router = self._route_step  # an ensemble's steps are routed as clients' requests are
        self.views = dict(views or {})  # sections of inspect() from other parts: "hints", "controller"
        self.server_name = server_name
        self.started = False
        self.stopping = False
        # the daemon's log settings (Triton's logging extension); None in an application's process, whose logging
        # is the application's
        self.log_control: LogControl | None = None
        # the daemon's tracing (Triton's trace extension); None in an application's process
        self.tracer: Tracer | None = None

    @property
    def models(self) -> dict[str, RegisteredModel]:
        return self.registry.models

    # --- start-up and shutdown -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Read the repository and load every model it holds; bad models are logged and reported, not fatal.
        All instances are planned together, so the engine packs the whole node at once."""
        new: list[RegisteredVersion] = []
        scanned = self.repository.scan()
        if not scanned:  # a typo'd path or a mount that did not happen reads as an empty directory
            log.warning("the model repository %s holds no model: nothing is served (a model is a directory "
                        "<name>/<version>/model.onnx, with an optional <name>/config.pbtxt)", self.repository.path)
        # The models chosen, and the models their ensembles' steps name (loaded as dependencies, as in Triton).
        for name, explicit in models_to_load(scanned, filter(self.control.loads_at_start, scanned)).items():
            new += self.registry.register(name, scanned[name])
            self.registry.models[name].explicit = explicit
        await self.placement.place(new)
        log_ensembles(self.registry)
        self.started = True
        ready = sum(1 for v in self.registry.versions() if v.ready)
        log.info("%d model version(s) ready, %d model(s) not ready", ready,
                 sum(1 for m in self.models.values() if not any(v.ready for v in m.versions.values())))

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, finish every accepted one (bounded), then stop the workers."""
        self.stopping = True
        schedulers = [v.scheduler for v in self.registry.versions()]
        try:
            await asyncio.wait_for(asyncio.gather(*(s.wait_idle() for s in schedulers)), drain_timeout_s)
        except TimeoutError:
            left = sum(s.pending_requests for s in schedulers)
            if left:  # (a timeout of 0, after a failed start, times out with nothing to wait for)
                log.warning("%d request(s) still running after %.0f s; failing them", left, drain_timeout_s)
            for s in schedulers:
                s.fail_all_queued("the server is shutting down")
        await self.pool.shutdown()

    # --- model control ---------------------------------------------------------------------------------------
    async def load_model(self, name: str, override: LoadOverride | None = None) -> None:
        check_model_name(name)
        self.control.check_api("load", name)
        if override is not None and self.control.mode != "explicit":
            raise InferenceError(ErrorKind.INVALID_ARGUMENT, f"cannot load model '{name}' with a config or files: "
                                 "that needs --model-control-mode explicit (in poll mode the repository decides)")
        if self.stopping:
            raise InferenceError(ErrorKind.UNAVAILABLE, "the server is shutting down")
        await self.lifecycle.load(name, override=override)

    async def unload_model(self, name: str, *, unload_dependents: bool = False) -> None:
        check_model_name(name)
        self.control.check_api("unload", name)
        await self.lifecycle.unload(name, unload_dependents=unload_dependents)

    async def apply_placement(self, requested: Sequence[RequestedPlacement]) -> Applied:
        return await self.placement.apply_requested(requested)

    # --- lookups ---------------------------------------------------------------------------------------------
    def _model(self, name: str) -> RegisteredModel:
        return self.registry.model(name)

    def _version(self, name: str, version: str = "") -> RegisteredVersion:
        return self.registry.version(name, version)

    # --- InferenceCore ---------------------------------------------------------------------------------------
    def server_live(self) -> bool:
        return True

    def server_ready(self) -> bool:
        return self.started and not self.stopping

    def server_metadata(self) -> ServerMetadata:
        logging_extension = ("logging",) if self.log_control is not None else ()
        trace_extension = ("trace",) if self.tracer is not None else ()
        return ServerMetadata(self.server_name, __version__, (*EXTENSIONS, *logging_extension, *trace_extension))

    def _log_control(self) -> LogControl:
        if self.log_control is None:
            raise InferenceError(ErrorKind.UNSUPPORTED, "this server has no log settings: gpud in an application's "
                                 "process logs through the application's logging")
        return self.log_control

    def log_settings(self) -> LogSettings:
        return self._log_control().settings

    def update_log_settings(self, changes: Mapping[str, object]) -> LogSettings:
        return self._log_control().update(changes)

    def _tracer(self) -> Tracer:
        if self.tracer is None:
            raise InferenceError(ErrorKind.UNSUPPORTED, "tracing is not available in this process (gpud.Server "
                                                        "serves no trace extension)")
        return self.tracer

    def trace_settings(self, model_name: str = "") -> TraceSettings:
        tracer = self._tracer()
        if model_name:
            self._model(model_name)  # unknown: NOT_FOUND
        return tracer.settings(model_name)

    def update_trace_settings(self, model_name: str, changes: Mapping[str, object]) -> TraceSettings:
        tracer = self._tracer()
        if model_name:
            self._model(model_name)
        return tracer.update(model_name, changes)

    def model_ready(self, name: str, version: str = "") -> bool:
        model = self._model(name)
        if version and version not in model.versions:
            return False
        try:
            vs = self._version(name, version)
        except InferenceError:
            return False
        return vs.ready or vs.scaled_to_zero  # scaled to zero serves: its next request loads it

    def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        vs = self._version(name, version)
        versions = sorted(self._model(name).versions, key=int) if not version else [version]
        return ModelMetadata.of(vs.entry.config, versions)

    def model_config(self, name: str, version: str = "") -> ServedModelConfig:
        vs = self._version(name, version)
        return ServedModelConfig(vs.entry.config, vs.entry.version_policy, vs.entry.source_config)

    def model_statistics(self, name: str = "", version: str = "") -> list[ModelStatistics]:
        if name:
            selected = [self._version(name, version)] if version else list(self._model(name).versions.values())
        else:
            selected = [v for m in self.models.values() for v in m.versions.values()]
        return [ModelStatistics(v.name, v.version, v.scheduler.stats) for v in selected]

    def repository_index(self, ready_only: bool = False) -> list[RepositoryModel]:
        """Every model and served version with its state, read off the snapshot (one definition of both)."""
        index = []
        models = self.snapshot().models
        if not ready_only:  # in the repository, never loaded (explicit mode): as Triton lists them
            known = {m.name for m in models}
            index += [RepositoryModel(name, "", ModelState.UNAVAILABLE, "unloaded")
                      for name in names_in(self.repository) if name not in known]
        for m in models:
            if not m.versions and not ready_only:
                index.append(RepositoryModel(m.name, "", ModelState.UNAVAILABLE, m.error or "unloaded"))
            index += [RepositoryModel(m.name, v.version, v.state, v.reason) for v in m.versions
                      if not ready_only or v.state is ModelState.READY]
        index.sort(key=lambda r: r.name)  # stable: a model's versions keep their order
        return index

    def _ready_version(self, request: InferRequest, *, accepted: bool = False) -> RegisteredVersion:
        if self.stopping and not accepted:
            raise InferenceError(ErrorKind.UNAVAILABLE, "the server is shutting down")
        vs = self._served_version(request.model_name, request.model_version)
        if vs.state is ModelState.READY and vs.instances:  # the usual case, asked first: served, with instances
            return vs
        if vs.scaled_to_zero:  # the request waits in its queue while an instance loads (bounded: unready_wait_s)
            self.placement.demand(vs)
            return vs
        # A loaded version whose instances are down for now (a worker restarting, a device given up on and its
        # instances being placed elsewhere) queues the request: the scheduler bounds the wait (unready_wait_s).
        if not vs.accepts_requests:
            why = vs.reason or "no instance is ready"
            raise InferenceError(ErrorKind.UNAVAILABLE,
                                 f"Request for unknown model: '{vs.name}' version {vs.version} is not at ready "
                                 f"state: {why}")
        return vs

    def _route_step(self, request: InferRequest) -> Scheduler:
        """An ensemble's step, routed as a client's request is, also while shutting down: the ensemble's request
        was accepted before, and accepted requests finish."""
        return self._ready_version(request, accepted=True).scheduler

    def _served_version(self, name: str, version: str) -> RegisteredVersion:
        """The version a request is for. In poll mode a model new in the repository since the last poll is
        registered now, with no instance: its first request loads it (load on demand). One unloaded stays so."""
        if name not in self.registry.models and self.control.loads_new_on_demand:
            self.lifecycle.register_new(name)
        return self.registry.version(name, version)

    def submit(self, request: InferRequest, done: Done,
               placed: Mapping[str, RegionSlice] | None = None, members: int = 1) -> Callable[[], None]:
        """`placed`: inputs a front-end process put in its shared memory (gpud.frontproc), by name; their data is
        empty here. The version's worker reads them where it can, else they are read now. `members` > 1: the
        request is that many requests' rows (a front-end process's group, at most `group_limit`)."""
        try:
            cancel = self._submit(request, done, placed, members)
        except BaseException:
            if request.trace is not None:  # refused once traced (a full queue): its trace ends here
                request.trace.end()
            raise
        trace = request.trace
        if trace is not None and self.tracer is not None:  # its trace ends when it is withdrawn too
            return TracedCancel(cancel, trace)
        return cancel

    def _submit(self, request: InferRequest, done: Done, placed: Mapping[str, RegionSlice] | None,
                members: int) -> Callable[[], None]:
        vs = self._ready_version(request)
        if _asks_classes(request):
            done = _classifying(vs, request, done)
        scheduler = vs.scheduler
        if placed:
            place_inputs(request, placed, in_worker=scheduler.moves_client_tensors)
        tracer = self.tracer
        if tracer is not None and tracer.on:
            trace = tracer.sample(request.model_name, vs.version, request.id, members)
            if trace is not None:
                done = trace.follow(request, done)
        if not request.uses_shm:
            handle = scheduler.submit(request, done, members)
            if members > 1:  # a group: its members may go away one by one (gpud.frontproc.host)
                return GroupCancel(scheduler, handle)
            return partial(scheduler.cancel, handle)
        # its regions held until answered; their bytes moved by the worker where the scheduler can, else here
        staged = self.client_shm.stage(request, in_worker=scheduler.moves_client_tensors,
                                       worker_gpu=worker_gpu(scheduler))
        try:
            handle = scheduler.submit(request, staged.answering(done))
        except BaseException:
            staged.release()
            raise

        def cancel() -> None:
            scheduler.cancel(handle)
            staged.release()
        return cancel

    def group_limit(self, request: InferRequest) -> int:
        """How many requests like `request` (the same header but for nothing: gpud.frontproc.group) may be submitted
        as one (`submit(..., members=n)`): as many as its version batches in one batch, where it takes groups; 1
        where they go alone (a model that does not batch them, shared memory, classified outputs). Raises what
        submitting `request` would (no such model, not ready, shutting down)."""
        vs = self._ready_version(request)
        scheduler = vs.scheduler
        if not scheduler.takes_groups or request.uses_shm or _asks_classes(request):
            return 1
        rows = request.inputs[0].shape[0] if request.inputs and request.inputs[0].shape else 0
        return max(1, scheduler.config.max_batch_size // rows) if rows > 0 else 1

    async def infer(self, request: InferRequest) -> InferResponse:
        if self.tracer is not None and self.tracer.on:  # sampled where submitted requests are, once
            return await answer_of(partial(self.submit, request))
        vs = self._ready_version(request)
        staged = self.client_shm.stage(request, in_worker=vs.scheduler.moves_client_tensors,
                                       worker_gpu=worker_gpu(vs.scheduler)) \
            if request.uses_shm else None
        try:
            response = await vs.scheduler.infer(request)
            if staged is not None:
                staged.deliver(response)
        finally:
            if staged is not None:
                staged.release()
        if _asks_classes(request):
            _classify(vs, request, response)
        return response

    def submit_direct(self, request: InferRequest, done, loop: asyncio.AbstractEventLoop,
                      quick_only: bool = False) -> DirectRun | Callable[[], None] | None:
        """The in-process server's call from its caller's thread, with the loop's lock held (gpud.executor.direct): a
        DirectRun for the caller to execute; or the cancel of a request queued the loop's way (`done` answers it);
        or None when the request was not taken (a model not served and ready here as a plain, idle one: the
        caller submits it, and gets the loop's answer or error)."""
        if self.stopping or request.uses_shm or request.model_name not in self.registry.models or \
                (self.tracer is not None and self.tracer.on):  # (traced where submitted requests are)
            return None
        try:
            vs = self.registry.version(request.model_name, request.model_version)
        except InferenceError:
            return None
        if vs.scaled_to_zero or not vs.ready:
            return None
        if _asks_classes(request):
            done = _classifying(vs, request, done)
        started = start_direct(vs.scheduler, request, done, loop, quick_only)
        if started is None or isinstance(started, DirectRun):
            return started
        return partial(vs.scheduler.cancel, started)

    # --- gpud's own views ------------------------------------------------------------------------------------
    def snapshot(self) -> ServingSnapshot:
        return self.registry.snapshot()

    def inspect(self) -> dict[str, Any]:
        return inspect_document(self.server_metadata(), self.snapshot(), self.placement, self.pool.worker_info(),
                                self.views)


def _asks_classes(request: InferRequest) -> bool:
    """Whether `request` asks for an output classified (the classification extension)."""
    return request.outputs is not None and any(CLASSIFICATION in o.parameters for o in request.outputs)


def _classify(vs: RegisteredVersion, request: InferRequest, response: InferResponse) -> None:
    """The requested outputs of `response` classified (the classification extension); the counts were checked
    with the request (gpud.executor.validation)."""
    config = vs.entry.config
    counts = {o.name: class_count(o, config) for o in request.outputs or ()}
    response.outputs = classified(response.outputs, counts, vs.entry.labels, config.batches)


def _classifying(vs: RegisteredVersion, request: InferRequest, done: Done) -> Done:
    """`done`, given the response classified (`_classify`)."""

    def answer(result: Any) -> None:
        if isinstance(result, InferResponse):
            try:
                _classify(vs, request, result)
            except InferenceError as exc:
                result = exc
        done(result)
    return answer
