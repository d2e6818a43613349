"""Loading and unloading whole models from the repository (the repository API, poll mode, a model new in the
repository that is loaded on its first request), with no gap in service on a reload. The core checks who may do it
(gpud.model_control) and routes requests; this module changes what is registered, through the placement service."""
from __future__ import annotations

import logging

from gpud.executor.types import ErrorKind, InferenceError
from gpud.ensembles import step_models, step_names_of, unload_candidates
from gpud.model_control import check_model_name
from gpud.placing.service import PlacementService
from gpud.registry import RegisteredModel, Registry
from gpud.repository.errors import ModelConfigError
from gpud.repository.layout import ModelEntry, ModelLoadError, ModelRepository
from gpud.repository.overrides import LoadOverride
from gpud.telemetry.serving import ModelState

log = logging.getLogger("gpud")


class ModelLifecycle:
    def __init__(self, repository: ModelRepository, registry: Registry, placement: PlacementService):
        self.repository = repository
        self.registry = registry
        self.placement = placement

    async def load(self, name: str, *, explicit: bool = True, override: LoadOverride | None = None,
                   _chain: tuple[str, ...] = ()) -> None:
        """Load (or reload) model `name` from the repository, or as a load request's `override` gives it;
        InferenceError says why it does not serve. An ensemble's step models that are not loaded load first, as its
        dependencies (`explicit` False: loaded only for it, which unload_dependents may unload with it)."""
        try:
            result: ModelEntry | ModelLoadError = self.repository.load(name, override)
        except ModelConfigError as exc:
            if override is None and name not in self.registry.models and not _exists(self.repository, name):
                raise InferenceError(ErrorKind.NOT_FOUND, f"failed to load '{name}', no version is available") \
                    from None
            result = ModelLoadError(name=name, path=exc.path, reason=str(exc), error=exc)
        written = result.path if override is not None and override.files and isinstance(result, ModelEntry) \
            else None
        try:
            await self._load(name, result, explicit, _chain)
        finally:
            self._serving_from(name, written)

    def _serving_from(self, name: str, written: str | None) -> None:
        """Keep the override directory the versions of `name` use; remove the others (gpud.repository.overrides)."""
        model = self.registry.models.get(name)
        dirs = {v.entry.path for v in model.versions.values()} if model is not None else set()
        store = self.repository.overrides
        previous = store.dirs.get(name)
        if written is not None and written not in dirs:  # the load with files did not take: its files go
            store.remove(written)
        current = written if written in dirs else previous if previous in dirs else None
        store.serving(name, current)

    async def _load(self, name: str, result: ModelEntry | ModelLoadError, explicit: bool,
                    _chain: tuple[str, ...]) -> None:
        if isinstance(result, ModelEntry):
            await self._load_steps(result, (*_chain, name))
        fresh = name not in self.registry.models or not self.registry.models[name].versions
        model = self.registry.models.setdefault(name, RegisteredModel(name))
        model.explicit = explicit if fresh else (model.explicit or explicit)
        async with model.lock:
            await self._reload(model, result)
        if isinstance(result, ModelLoadError):
            raise InferenceError(ErrorKind.INVALID_ARGUMENT, f"failed to load '{name}': {result.reason}")
        if not any(v.ready for v in model.versions.values()):
            reasons = "; ".join(v.reason for v in model.versions.values())
            raise InferenceError(ErrorKind.UNAVAILABLE, f"failed to load '{name}': {reasons}")

    async def _reload(self, model: RegisteredModel, result: ModelEntry | ModelLoadError) -> None:
        """Load `result` as `model` with no gap in service (as Triton): its new versions load beside the ones that
        serve, requests go to them once they are ready, and then the old ones finish what they accepted and unload.
        A new model that does not load (a bad config, failed loads) leaves the old one serving, and says why."""
        serving = [v for v in model.versions.values() if v.instances]
        keep = f"version(s) {', '.join(v.version for v in serving)} of '{model.name}' keep serving"
        if isinstance(result, ModelLoadError) and serving:
            log.error("model %s: reload refused: %s; %s", model.name, result.reason, keep)
            raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                 f"failed to load '{model.name}': {result.reason}; {keep}")
        staged, placeable = self.registry.stage(model.name, result)
        no_room = await self.placement.place(placeable, beside=serving)
        if serving and not no_room and not any(v.instances for v in placeable):
            reasons = "; ".join(f"version {v.version}: {v.reason}" for v in staged.versions.values()) \
                or staged.error or "no version to serve"
            log.error("model %s: reload failed (%s); %s", model.name, reasons, keep)
            raise InferenceError(ErrorKind.UNAVAILABLE, f"failed to load '{model.name}': {reasons}; {keep}")
        old = list(model.versions.values())
        self.registry.install(staged)
        if old:
            log.info("model %s: version(s) %s now serve; the previous version(s) %s finish their requests and "
                     "unload", model.name, ", ".join(v.version for v in placeable if v.instances) or "none",
                     ", ".join(v.version for v in old))
            await self.placement.retire(old)
        if no_room and serving:  # no room beside the old ones: these load now that those are gone (a gap)
            log.warning("model %s: no room to load version(s) %s beside the serving ones: loaded after them",
                        model.name, ", ".join(v.version for v in no_room))
            await self.placement.place(no_room)

    async def unload(self, name: str, *, unload_dependents: bool = False) -> None:
        """Stop routing to every version of `name`; each finishes what it accepted, then its instances stop. With
        `unload_dependents`, an ensemble's step models loaded only as its dependencies, which no other loaded
        ensemble uses, unload after it (and theirs after them), as Triton's unload_dependents does."""
        model = self.registry.models.get(name)
        if model is None or not model.versions:
            log.info("model %s: not loaded, nothing to unload", name)  # as Triton: a success
            return
        steps = step_names_of(model)
        async with model.lock:
            versions = list(model.versions.values())
            for vs in versions:
                vs.state = ModelState.UNLOADING  # refused from now on; what was accepted finishes
            await self.placement.retire(versions)
            model.versions.clear()
        self.repository.overrides.serving(name, None)  # files it was loaded with, if any, go
        log.info("model %s unloaded", name)
        if unload_dependents:
            for step in unload_candidates(self.registry.models, steps):
                log.info("model %s: unloaded with ensemble %s (unload_dependents; it was loaded as its step)",
                         step, name)
                await self.unload(step, unload_dependents=True)

    async def _load_steps(self, entry: ModelEntry, chain: tuple[str, ...]) -> None:
        """Load the models an ensemble's steps name that are not loaded (a model already served is left as it is,
        as Triton does). One that fails is logged; the ensemble then says which step is not ready."""
        for step in step_models(entry.config):
            model = self.registry.models.get(step)
            if step in chain or (model is not None and model.versions):
                continue  # a cycle (the ensemble reports it) or already served
            log.info("ensemble %s: loading model %s for its steps", entry.name, step)
            try:
                await self.load(step, explicit=False, _chain=chain)
            except InferenceError as exc:
                log.error("ensemble %s: model %s of its steps did not load: %s", entry.name, step, exc.message)

    def register_new(self, name: str) -> None:
        """A model in the repository that gpud has not registered (new since the last poll): register it with no
        instance, so that its first request loads it (load on demand). Nothing happens for an unknown name."""
        if name in self.registry.models or not _valid_name(name) or not _exists(self.repository, name):
            return
        try:
            result: ModelEntry | ModelLoadError = self.repository.load(name)
        except ModelConfigError as exc:
            result = ModelLoadError(name=name, path=exc.path, reason=str(exc), error=exc)
        staged, placeable = self.registry.stage(name, result)
        for vs in placeable:
            vs.state = ModelState.READY  # scaled to zero: the request loads it
        self.registry.install(staged)
        log.info("model %s: new in the repository; registered, and loaded on its first request", name)
        if isinstance(result, ModelEntry):  # an ensemble's steps: registered too, so that it can serve
            for step in step_models(result.config):
                self.register_new(step)


def names_in(repository: ModelRepository) -> list[str]:
    try:
        return repository.model_names()
    except OSError:
        return []


def _exists(repository: ModelRepository, name: str) -> bool:
    return name in names_in(repository)


def _valid_name(name: str) -> bool:
    try:
        check_model_name(name)
    except InferenceError:
        return False
    return True
