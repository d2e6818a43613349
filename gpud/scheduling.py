"""The one place that decides what serves a model version, from its configuration: which scheduler
(gpud.executor.scheduler.Scheduler) and which record in the registry.

- `ensemble_scheduling`: an EnsembleScheduler, whose steps go through the core's routing; the record is a
  RegisteredEnsemble (no instances: ready while its steps' models serve).
- `sequence_batching`: a SequenceScheduler.
- anything else: a DynamicScheduler (dynamic batching when the config has it, else one request per batch).

The wiring builds one `VersionMaker` from the settings and gives it to the registry; offline tools
(`gpudctl place`) and tests use `new_registry`.
"""
from __future__ import annotations

import logging

from gpud.ensembles import RegisteredEnsemble, step_route
from gpud.executor.objective import ObjectiveDefaults, objective_of
from gpud.executor.dynamic_scheduler import DynamicScheduler
from gpud.executor.ensemble import EnsembleScheduler
from gpud.executor.scheduler import Scheduler
from gpud.executor.sequence_scheduler import SequenceScheduler
from gpud.registry import RegisteredVersion, Registry, VersionMaker
from gpud.repository.layout import ModelEntry
from gpud.scaling.bounds import NO_INSTANCES, BoundsDefaults, instance_bounds
from gpud.telemetry.serving import ModelState

log = logging.getLogger("gpud")


def version_maker(*, unready_wait_s: float = 30.0, default_max_queue_size: int = 0,
                  bounds_defaults: BoundsDefaults = BoundsDefaults(),
                  objective_defaults: ObjectiveDefaults = ObjectiveDefaults()) -> VersionMaker:
    """`unready_wait_s`: how long requests wait while no instance of their version is ready; `default_max_queue_size`:
    the queue bound where a model's config sets none (0: unbounded); `bounds_defaults`, `objective_defaults`: the
    node's instance bounds and latency objective where a model's config sets none."""

    def make(registry: Registry, entry: ModelEntry, version: str) -> RegisteredVersion:
        config = entry.config
        objective = objective_of(config.options, objective_defaults)
        if config.ensemble is not None:
            return RegisteredEnsemble(entry.name, version, entry,
                                      EnsembleScheduler(config, version, step_route(registry), objective),
                                      NO_INSTANCES, state=ModelState.READY, registry=registry)
        scheduler: Scheduler
        if objective is None and (config.options.latency_objective_share is not None
                                  or config.options.latency_objective_shed):
            log.warning("model %s: gpud_latency_objective_share / _shed are set but no objective is "
                        "(gpud_latency_objective_ms, or --latency-objective-ms): they have no effect", entry.name)
        if config.sequence_batching is not None:
            scheduler = SequenceScheduler(config, version, unready_wait_s=unready_wait_s,
                                          default_max_queue_size=default_max_queue_size, objective=objective)
        else:
            scheduler = DynamicScheduler(config, version, unready_wait_s=unready_wait_s,
                                         default_max_queue_size=default_max_queue_size, objective=objective)
        return RegisteredVersion(entry.name, version, entry, scheduler, instance_bounds(config, bounds_defaults))

    return make


def new_registry(has_gpus: bool, *, unready_wait_s: float = 30.0, default_max_queue_size: int = 0,
                 bounds_defaults: BoundsDefaults = BoundsDefaults(),
                 objective_defaults: ObjectiveDefaults = ObjectiveDefaults()) -> Registry:
    """A registry whose versions are made by `version_maker` with these settings."""
    return Registry(has_gpus, version_maker(unready_wait_s=unready_wait_s,
                                            default_max_queue_size=default_max_queue_size,
                                            bounds_defaults=bounds_defaults, objective_defaults=objective_defaults))
