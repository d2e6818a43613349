"""Ensembles in the registry: an ensemble version is served by an `gpud.executor.ensemble.EnsembleScheduler`, has no
instances (placement and the controller never see it; its steps' models are placed and scaled by their own load),
and is ready while every step's model serves and matches the ensemble's config.

As in Triton:
- readiness follows the steps: while a step's model is unloaded, failed or not ready, the ensemble reads not ready
  (model ready, the repository index, inspect) with the step and the reason, and its new requests are refused with
  them; once the model serves again so does the ensemble. A step's model that is reloaded with a config that no
  longer fits the ensemble makes it not ready with that reason (gpud.repository.ensemble.check_against_steps, run
  once per set of step configs). Ensembles that reach themselves through their steps are not ready ("circular
  dependency between ensembles");
- loading an ensemble (start-up, the load API) loads the models its steps name that are not loaded, as
  dependencies: they are not "explicitly loaded";
- unloading an ensemble with `unload_dependents` also unloads those of its steps' models that were loaded only as
  its dependencies and that no other loaded ensemble uses (transitively).
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace

from gpud.executor.ensemble import Route
from gpud.executor.model_config import ModelConfig
from gpud.executor.scheduler import Scheduler
from gpud.executor.types import InferRequest
from gpud.registry import RegisteredModel, RegisteredVersion, Registry
from gpud.repository.ensemble import check_against_steps, step_label
from gpud.repository.layout import ModelEntry, ModelLoadError
from gpud.telemetry.serving import ModelState, PipelineStep, VersionView

log = logging.getLogger("gpud")


def step_models(config: ModelConfig) -> list[str]:
    """The models an ensemble's steps name, each once, in step order ([] for a model that is not an ensemble)."""
    if config.ensemble is None:
        return []
    return list(dict.fromkeys(s.model_name for s in config.ensemble.steps))


def models_to_load(scanned: Mapping[str, ModelEntry | ModelLoadError], chosen: Iterable[str]) -> dict[str, bool]:
    """Start-up: the `chosen` models and, transitively, those their ensembles' steps name (that the repository
    holds), each with whether it was chosen (explicitly loaded) or is loaded only as a step. In repository order."""
    explicit = set(chosen)
    wanted = set(explicit)
    todo = list(explicit)
    while todo:
        entry = scanned.get(todo.pop())
        if isinstance(entry, ModelEntry):
            for name in step_models(entry.config):
                if name in scanned and name not in wanted:
                    wanted.add(name)
                    todo.append(name)
    return {name: name in explicit for name in scanned if name in wanted}


def users_of(models: Mapping[str, RegisteredModel], name: str) -> list[str]:
    """The loaded ensembles that have a step on model `name`."""
    return sorted(m.name for m in models.values()
                  if any(name in step_models(v.entry.config) for v in m.versions.values()))


@dataclass(eq=False)
class RegisteredEnsemble(RegisteredVersion):
    """An ensemble version in the registry (see the module docstring)."""

    registry: Registry | None = None
    _checked: tuple[tuple[ModelConfig, ...], str] | None = None  # step configs last checked, and the problem
    _checking: bool = False  # its readiness is being worked out: meeting it again is a circular dependency

    @property
    def ready(self) -> bool:
        return self.state is ModelState.READY and not self.unready_reason()

    @property
    def places_instances(self) -> bool:
        return False  # its steps' models have the instances

    @property
    def scaled_to_zero(self) -> bool:
        return False  # it never has instances: nothing to load on demand

    @property
    def reason(self) -> str:  # why it is not ready: the steps' state, live
        if self.state is ModelState.READY:
            return self.unready_reason()
        return self._reason

    @reason.setter
    def reason(self, value: str) -> None:
        self._reason = value

    def footprint_bytes(self) -> int:
        return 0

    @property
    def accepts_requests(self) -> bool:
        """Loaded, and every step's model accepts requests (also one whose instances are down for now: the step's
        request waits in its queue as a client's would, bounded by its unready_wait_s)."""
        return self.state is ModelState.READY and not self.unready_reason(accepting=True)

    def unready_reason(self, accepting: bool = False) -> str:
        """"" while every step's model serves (`accepting`: accepts requests) and fits the ensemble; else the first
        step that does not and why."""
        if self._checking:
            return f"circular dependency between ensembles: '{self.name}' reaches itself through its steps"
        self._checking = True
        try:
            configs = []
            for i, step in enumerate(self.entry.config.ensemble.steps):  # type: ignore[union-attr]
                vs, why = self._step_version(step.model_name, step.model_version, accepting)
                if vs is None:
                    return f"{step_label(i, step.model_name)}: {why}"
                configs.append(vs.entry.config)
        finally:
            self._checking = False
        key = tuple(configs)
        checked = self._checked
        if checked is None or len(checked[0]) != len(key) or any(a is not b for a, b in zip(checked[0], key)):
            try:
                check_against_steps(self.entry.config, key)
                problem = ""
            except ValueError as exc:
                problem = str(exc)
                log.error("ensemble %s version %s: %s", self.name, self.version, problem)
            checked = self._checked = (key, problem)
        return checked[1]

    def _step_version(self, model: str, version: int,
                      accepting: bool = False) -> tuple[RegisteredVersion | None, str]:
        """The version that serves a step (`accepting`: accepts its requests), or None and why none does."""
        registry = self.registry
        m = registry.models.get(model) if registry is not None else None
        if m is None:
            return None, f"model '{model}' is not loaded"
        if not m.versions:
            return None, f"model '{model}' has no loaded version" + (f" ({m.error})" if m.error else "")
        found: RegisteredVersion | None
        if version < 0:
            found = m.versions[max(m.versions, key=int)]
        else:
            found = m.versions.get(str(version))
            if found is None:
                return None, (f"version {version} of model '{model}' is not loaded (loaded: "
                              f"{', '.join(sorted(m.versions, key=int))})")
        vs = found
        if vs.ready or vs.scaled_to_zero or (accepting and vs.accepts_requests):
            return vs, ""  # scaled to zero serves: its next request loads it
        why = vs.reason or "no instance is ready"
        return None, f"model '{model}' version {vs.version} is not ready: {why}"

    def pipeline(self) -> tuple[PipelineStep, ...]:
        out = []
        for i, step in enumerate(self.entry.config.ensemble.steps):  # type: ignore[union-attr]
            self._checking = True
            try:
                vs, _ = self._step_version(step.model_name, step.model_version)
            finally:
                self._checking = False
            out.append(PipelineStep(i, step.model_name, str(step.model_version), vs.version if vs else "",
                                    vs is not None, step.input_map, step.output_map))
        return tuple(out)

    def view(self, has_gpus: bool) -> VersionView:
        v = super().view(has_gpus)
        if self.state is ModelState.READY and v.state is not ModelState.READY:
            v = replace(v, reason=self.reason)  # the steps' reason, not the instances' of a model
        return replace(v, pipeline=self.pipeline())


def step_route(registry: Registry) -> Route:
    """How an ensemble's steps reach their models: through `registry.step_router` (the core's routing)."""

    def route(request: InferRequest) -> Scheduler:
        router = registry.step_router
        if router is not None:
            return router(request)
        # No core (a registry built offline, tests): straight to the version's scheduler.
        return registry.version(request.model_name, request.model_version).scheduler
    return route


def log_ensembles(registry: Registry) -> None:
    """Say at start-up which ensembles serve, with their steps, and why the others do not."""
    for vs in registry.versions():
        if isinstance(vs, RegisteredEnsemble):
            steps = " -> ".join(f"{s.model}" for s in vs.pipeline())
            if vs.ready:
                log.info("ensemble %s version %s ready: steps %s", vs.name, vs.version, steps)
            else:
                log.error("ensemble %s version %s not ready: %s", vs.name, vs.version, vs.reason)


def step_names_of(model: RegisteredModel | None) -> list[str]:
    """The models the steps of every version of `model` name (none when it is not an ensemble)."""
    if model is None:
        return []
    return list(dict.fromkeys(n for v in model.versions.values() for n in step_models(v.entry.config)))


def unload_candidates(models: Mapping[str, RegisteredModel], steps: Collection[str]) -> list[str]:
    """Of an unloaded ensemble's step models: those loaded only as dependencies that no loaded ensemble uses
    (Triton's unload_dependents). They may be ensembles themselves: their own steps are the caller's next round."""
    return [n for n in steps if (m := models.get(n)) is not None and m.versions and not m.explicit
            and not users_of(models, n)]

