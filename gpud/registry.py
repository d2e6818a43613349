"""The model registry: every model the repository holds, its served versions with their schedulers and instances,
and why a version is not ready. The core routes requests over it, the placement service starts and stops its
instances, and everyone else reads it through `snapshot()` (gpud.telemetry.serving).

What serves a version (its scheduler, and for an ensemble its record) is not chosen here: the registry is given a
`VersionMaker` (gpud.scheduling's, passed in by the wiring).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from mypy_extensions import mypyc_attr

from gpud.executor.instance import InstanceHandle
from gpud.executor.scheduler import Scheduler
from gpud.executor.types import ErrorKind, InferenceError, InferRequest
from gpud.model_control import check_model_name
from gpud.placing.inputs import VersionDemand, candidate_kinds
from gpud.repository.errors import ModelConfigError
from gpud.repository.footprint import estimate_footprint_bytes
from gpud.repository.layout import ModelEntry, ModelLoadError
from gpud.scaling.bounds import InstanceBounds
from gpud.telemetry.serving import InstanceView, ModelState, ModelView, ServingSnapshot, VersionView

log = logging.getLogger("gpud")


@mypyc_attr(allow_interpreted_subclasses=True)  # RegisteredEnsemble (gpud.ensembles)
@dataclass(eq=False)
class RegisteredVersion:
    """One served version of a model: its scheduler and instances, and why it is not ready when it is not."""

    name: str
    version: str
    entry: ModelEntry
    scheduler: Scheduler
    bounds: InstanceBounds  # how few and how many instances may run (gpud.scaling.bounds)
    estimate_bytes: int = 0  # one instance's footprint estimated from the model file
    state: ModelState = ModelState.LOADING
    _reason: str = ""  # `reason`
    loaded_unix_s: float = 0.0  # when an instance last loaded (a version never used counts as used then)

    @property
    def reason(self) -> str:
        """Why it is not ready ("" when it is)."""
        return self._reason

    @reason.setter
    def reason(self, value: str) -> None:
        self._reason = value

    @property
    def instances(self) -> Sequence[InstanceHandle]:
        """What serves it: its scheduler's list (the one list; the placement service adds and removes there)."""
        return self.scheduler.instances

    @property
    def places_instances(self) -> bool:
        """Whether it has instances to place (an ensemble has none: its steps' models do)."""
        return True

    @property
    def ready(self) -> bool:
        return self.state is ModelState.READY and self.scheduler.has_ready_instance

    @property
    def accepts_requests(self) -> bool:
        """Whether a request is queued for it: ready, or loaded with its instances down for now (a worker
        restarting, instances being placed elsewhere), whose scheduler bounds the wait (unready_wait_s)."""
        # (ready, or loaded with instances not ready now: either way loaded with instances; asked on every request)
        return self.state is ModelState.READY and bool(self.instances)

    @property
    def scaled_to_zero(self) -> bool:
        """Served, with no instance now: its next request loads one (a cold start)."""
        return self.state is ModelState.READY and not self.instances

    @property
    def minimum_instances(self) -> int:
        """Its bound (gpud_min_instances), or more while its live sequences need more instances' slots: the
        controller and evictions never take a sequence model below it (its sequences would wait in the backlog)."""
        return max(self.bounds.minimum, self.scheduler.instances_needed)

    @property
    def last_used_unix_s(self) -> float:
        return max(self.scheduler.stats.last_inference_ms / 1000, self.loaded_unix_s)

    @property
    def compute_fraction(self) -> float:
        """Of a device's compute, per instance (gpud_compute_fraction); 0: not limited."""
        return self.entry.config.options.compute_fraction

    @property
    def model_path(self) -> str:
        return self.entry.model_path(int(self.version))

    def footprint_bytes(self) -> int:
        """What one more instance needs: the largest measured footprint of its instances, else the estimate."""
        measured = [i.memory_bytes for i in self.instances if i.memory_bytes]
        return max(measured) if measured else self.estimate_bytes

    def demand(self) -> VersionDemand:
        return VersionDemand(self.name, self.version, self.entry.config.instance_groups, self.footprint_bytes(),
                             self.compute_fraction)

    def view(self, has_gpus: bool) -> VersionView:
        if self.ready:
            state, reason = ModelState.READY, ""
        elif self.scaled_to_zero:
            state, reason = ModelState.READY, "scaled to zero: its next request loads it"
        elif self.state is ModelState.READY:  # loaded, but no instance ready now
            state, reason = ModelState.UNAVAILABLE, "no instance is ready (a worker is restarting)"
        else:
            state, reason = self.state, self.reason
        kinds = frozenset(k for g in self.entry.config.instance_groups for k in candidate_kinds(g.kind, has_gpus))
        instances = tuple(InstanceView(i.index, i.device_id, i.ready, i.memory_bytes, i.estimate_bytes,
                                       i.measured_by, i.load_seconds, i.provider, i.error) for i in self.instances)
        s = self.scheduler
        in_backlog = s.backlog_sequences
        sequences = s.live_sequences - in_backlog if self.entry.config.sequence_batching is not None else None
        return VersionView(self.name, self.version, state, reason, self.entry.config.max_batch_size, kinds,
                           s.pending_requests, instances, s.stats, self.minimum_instances, self.bounds.maximum,
                           self.last_used_unix_s, sequences, in_backlog)


@dataclass(eq=False)
class RegisteredModel:
    name: str
    versions: dict[str, RegisteredVersion] = field(default_factory=dict)
    error: str = ""  # the repository error when the model could not be read at all
    explicit: bool = True  # loaded for itself, not only as an ensemble's step (unload_dependents keeps it)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one load or unload of this model at a time


class VersionMaker(Protocol):
    """What serves `version` of `entry`'s model on `registry`: a new record with its scheduler (gpud.scheduling)."""

    def __call__(self, registry: Registry, entry: ModelEntry, version: str) -> RegisteredVersion: ...


class Registry:
    def __init__(self, has_gpus: bool, make_version: VersionMaker) -> None:
        self.models: dict[str, RegisteredModel] = {}
        self.has_gpus = has_gpus  # KIND_AUTO means GPUs on such a node
        self.make_version = make_version
        # How an ensemble's steps reach their models: the core's routing (GpudCore sets it). None: straight to the
        # version's scheduler.
        self.step_router: Callable[[InferRequest], Scheduler] | None = None

    def register(self, name: str, result: ModelEntry | ModelLoadError) -> list[RegisteredVersion]:
        """Register the model's versions (nothing loaded yet) and return those that can be placed; the others are
        UNAVAILABLE with the reason."""
        staged, placeable = self.stage(name, result)
        self.install(staged)
        return placeable

    def stage(self, name: str, result: ModelEntry | ModelLoadError) -> tuple[RegisteredModel, list[RegisteredVersion]]:
        """The model's versions as `register` would make them, outside the registry: a reload places them beside
        the versions that serve, and `install`s them once they are ready (no gap in service)."""
        model = RegisteredModel(name)
        if isinstance(result, ModelLoadError):
            model.error = result.reason
            log.error("model %s: %s", name, result.reason)
            return model, []
        entry = result
        placeable: list[RegisteredVersion] = []
        for version in entry.versions:
            v = str(version)
            vs = model.versions[v] = self.make_version(self, entry, v)
            if not vs.places_instances:  # an ensemble: its scheduler runs its steps
                continue
            try:
                vs.estimate_bytes = estimate_footprint_bytes(vs.model_path, entry.config)
            except (ModelConfigError, OSError) as exc:
                vs.state, vs.reason = ModelState.UNAVAILABLE, str(exc)
                continue
            placeable.append(vs)
        return model, placeable

    def install(self, staged: RegisteredModel) -> RegisteredModel:
        """Make the staged versions the ones served (and routed to) under the model's name; returns the model.
        The model object (and its lock) stays the same; versions it held and `staged` lacks are no longer routed."""
        model = self.models.setdefault(staged.name, RegisteredModel(staged.name))
        model.versions = dict(staged.versions)
        model.error = staged.error
        return model

    def versions(self) -> Iterator[RegisteredVersion]:
        for m in self.models.values():
            yield from m.versions.values()

    # --- lookups: errors a client gets --------------------------------------------------------------------------
    def model(self, name: str) -> RegisteredModel:
        model = self.models.get(name)
        if model is None:
            check_model_name(name)  # a name that could reach outside the repository: 400, not 404
            raise InferenceError(ErrorKind.NOT_FOUND, f"Request for unknown model: '{name}' is not found")
        return model

    def version(self, name: str, version: str = "") -> RegisteredVersion:
        """`version` "" is the newest served version."""
        model = self.model(name)
        if not version:
            if not model.versions:
                raise InferenceError(ErrorKind.UNAVAILABLE,
                                     f"Request for unknown model: '{name}' has no available versions"
                                     + (f" ({model.error})" if model.error else ""))
            if len(model.versions) == 1:  # the usual case, asked on every request: no numbers compared
                return next(iter(model.versions.values()))
            return model.versions[max(model.versions, key=int)]
        vs = model.versions.get(version)
        if vs is None:
            raise InferenceError(ErrorKind.NOT_FOUND,
                                 f"Request for unknown model: '{name}' version {version} is not found")
        return vs

    # --- the read-only view -------------------------------------------------------------------------------------
    def snapshot(self) -> ServingSnapshot:
        """Typed and frozen (gpud.telemetry.serving): what the metrics collectors, the hints and inspect read. Cheap: no
        device reads, so the collectors call it at every scrape."""
        return ServingSnapshot(tuple(
            ModelView(name, m.error, tuple(v.view(self.has_gpus)
                                           for v in sorted(m.versions.values(), key=lambda x: int(x.version))))
            for name, m in sorted(self.models.items())))
