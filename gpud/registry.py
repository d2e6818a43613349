"""The model registry: every model the repository holds, its served versions with their schedulers and instances,
and why a version is not ready. The core routes requests over it, the placement service starts and stops its
instances, and everyone else reads it through `snapshot()` (gpud.telemetry.serving).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gpud.executor.pool import InstanceHandle
from gpud.executor.scheduler import ModelScheduler
from gpud.executor.sequence_scheduler import SequenceScheduler
from gpud.executor.types import ErrorKind, InferenceError, InferRequest
from gpud.model_control import check_model_name
from gpud.placing.inputs import VersionDemand, candidate_kinds
from gpud.repository.errors import ModelConfigError
from gpud.repository.footprint import estimate_footprint_bytes
from gpud.repository.layout import ModelEntry, ModelLoadError
from gpud.scaling.bounds import BoundsDefaults, InstanceBounds, instance_bounds
from gpud.telemetry.serving import InstanceView, ModelState, ModelView, ServingSnapshot, VersionView

log = logging.getLogger("gpud")


@dataclass(eq=False)
class RegisteredVersion:
    """One served version of a model: its scheduler and instances, and why it is not ready when it is not."""

    name: str
    version: str
    entry: ModelEntry
    scheduler: ModelScheduler | SequenceScheduler
    estimate_bytes: int = 0  # one instance's footprint estimated from the model file
    bounds: InstanceBounds = InstanceBounds(1, None)  # how few and how many instances the controller may run
    instances: list[InstanceHandle] = field(default_factory=list)
    state: ModelState = ModelState.LOADING
    reason: str = ""
    loaded_unix_s: float = 0.0  # when an instance last loaded (a version never used counts as used then)

    @property
    def ready(self) -> bool:
        return self.state is ModelState.READY and self.scheduler.has_ready_instance

    @property
    def accepts_requests(self) -> bool:
        """Whether a request is queued for it: ready, or loaded with its instances down for now (a worker
        restarting, instances being placed elsewhere), whose scheduler bounds the wait (unready_wait_s)."""
        return self.ready or (self.state is ModelState.READY and bool(self.instances))

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
        in_backlog = s.backlog_sequences if isinstance(s, SequenceScheduler) else 0
        return VersionView(self.name, self.version, state, reason, self.entry.config.max_batch_size, kinds,
                           s.pending_requests, instances, s.stats, self.minimum_instances, self.bounds.maximum,
                           self.last_used_unix_s,
                           s.live_sequences - in_backlog if isinstance(s, SequenceScheduler) else None, in_backlog)


@dataclass(eq=False)
class RegisteredModel:
    name: str
    versions: dict[str, RegisteredVersion] = field(default_factory=dict)
    error: str = ""  # the repository error when the model could not be read at all
    explicit: bool = True  # loaded for itself, not only as an ensemble's step (unload_dependents keeps it)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one load or unload of this model at a time


class Registry:
    def __init__(self, has_gpus: bool, *, unready_wait_s: float = 30.0, default_max_queue_size: int = 0,
                 bounds_defaults: BoundsDefaults = BoundsDefaults()) -> None:
        self.models: dict[str, RegisteredModel] = {}
        self.bounds_defaults = bounds_defaults  # the node's instance bounds where a model's config sets none
        self.has_gpus = has_gpus  # KIND_AUTO means GPUs on such a node
        self.unready_wait_s = unready_wait_s  # how long requests wait while no instance of their version is ready
        self.default_max_queue_size = default_max_queue_size  # queue bound where a model's config sets none
        # How an ensemble's steps reach their models: the core's routing (GpudCore sets it). None: straight to the
        # version's scheduler.
        self.step_router: Callable[[InferRequest], Any] | None = None

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
        if entry.config.ensemble is not None:  # no instances to place: its scheduler runs its steps
            from gpud.ensembles import stage_ensemble  # builds on this module
            return model, stage_ensemble(self, model, entry)
        placeable: list[RegisteredVersion] = []
        for version in entry.versions:
            v = str(version)
            make = SequenceScheduler if entry.config.sequence_batching is not None else ModelScheduler
            scheduler = make(entry.config, v, unready_wait_s=self.unready_wait_s,
                             default_max_queue_size=self.default_max_queue_size)
            vs = model.versions[v] = RegisteredVersion(name, v, entry, scheduler,
                                                       bounds=instance_bounds(entry.config, self.bounds_defaults))
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
