"""gpud's inference core: the model registry and the one implementation of InferenceCore that the HTTP and gRPC
front ends adapt. It wires the repository, the placement engine, the executor pool and the device inventory.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from executor.model_config import InstanceGroup
from executor.pool import ExecutorPool, InstanceHandle
from executor.scheduler import ModelScheduler
from executor.types import ErrorKind, InferenceError, InferRequest, InferResponse
from gpud import __version__
from gpud.model_repository import (ModelConfigError, ModelEntry, ModelLoadError, ModelRepository, config_to_json,
                                   estimate_footprint_bytes, model_metadata_json)
from gpud.placer import DeviceRoom, candidate_kinds
from placement import Constraints, Device, ModelDemand, PlannerConfig, plan
from telemetry.devices import DeviceBackend
from telemetry.serving import InstanceView, ModelState, ModelView, ServingSnapshot, VersionView

log = logging.getLogger("gpud")

# Only what gpud really implements: clients use this list to decide what to call.
EXTENSIONS = ["model_repository", "model_configuration", "statistics", "binary_tensor_data", "schedule_policy"]


@dataclass(eq=False)
class RegisteredVersion:
    """One served version of a model: its scheduler and instances, and why it is not ready when it is not."""

    name: str
    version: str
    entry: ModelEntry
    scheduler: ModelScheduler
    instances: list[InstanceHandle] = field(default_factory=list)
    state: str = "LOADING"  # LOADING | READY | UNAVAILABLE | UNLOADING
    reason: str = ""

    @property
    def ready(self) -> bool:
        return self.state == "READY" and self.scheduler.has_ready_instance


@dataclass(eq=False)
class _Group:
    """One instance group of one model version, waiting to be placed."""

    vs: RegisteredVersion
    group_index: int
    group: InstanceGroup
    estimate_bytes: int
    first_index: int  # the instance index of the group's first instance within its model version

    @property
    def demand_name(self) -> str:
        return f"{self.vs.name}:{self.vs.version}:{self.group_index}"


@dataclass(eq=False)
class RegisteredModel:
    name: str
    versions: dict[str, RegisteredVersion] = field(default_factory=dict)
    error: str = ""  # the repository error when the model could not be read at all
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class GpudCore:
    """Implements gpud.core_api.InferenceCore."""

    def __init__(self, repository: ModelRepository, pool: ExecutorPool, devices: DeviceBackend, *,
                 device_reserve_bytes: int = 0, server_name: str = "gpud",
                 placement_strategy: str = "pack", placement_time_limit_s: float = 2.0):
        self.repository = repository
        self.pool = pool
        self.devices = devices
        self.device_reserve_bytes = device_reserve_bytes
        self.placement_strategy = placement_strategy
        self.placement_time_limit_s = placement_time_limit_s
        self.server_name = server_name
        self.models: dict[str, RegisteredModel] = {}
        self._reserved: dict[str, int] = {}  # bytes promised to instances being loaded, per device
        self.started = False
        self.stopping = False
        # --- autoscaling hints (gpud.autoscale.HintsSampler), set by the daemon; None: no "hints" in inspect() ---
        self.hints: Any = None

    # --- start-up and shutdown -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Read the repository and load every model it holds; bad models are logged and reported, not fatal.
        All instances are planned together, so the engine packs the whole node at once."""
        groups = []
        for name, result in self.repository.scan().items():
            groups += self._prepare(name, result)
        await self._place_and_load(groups)
        self.started = True
        ready = sum(1 for m in self.models.values() for v in m.versions.values() if v.ready)
        log.info("%d model version(s) ready, %d model(s) not ready", ready,
                 sum(1 for m in self.models.values() if not any(v.ready for v in m.versions.values())))

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, finish every accepted one (bounded), then stop the workers."""
        self.stopping = True
        schedulers = [v.scheduler for m in self.models.values() for v in m.versions.values()]
        try:
            await asyncio.wait_for(asyncio.gather(*(s.wait_idle() for s in schedulers)), drain_timeout_s)
        except asyncio.TimeoutError:
            log.warning("requests still running after %.0f s; failing them", drain_timeout_s)
            for s in schedulers:
                s.fail_all_queued("the server is shutting down")
        await self.pool.shutdown()

    # --- loading ---------------------------------------------------------------------------------------------
    def device_rooms(self) -> list[DeviceRoom]:
        """Free memory per leaf device as placement sees it (gpud.autoscale's headroom reads the same figures)."""
        rooms = []
        for d in self.devices.leaf_devices():
            if d.simulated or d.kind == "cpu":
                used = self.pool.memory_used_bytes(d.id) or 0
            else:  # a real GPU: what the driver says is used (other processes too), sampled now
                used = self.devices.sample(d.id).memory_used_bytes or 0
            reserve = self.device_reserve_bytes if d.kind != "cpu" else 0
            free = d.memory_total_bytes - reserve - used - self._reserved.get(d.id, 0)
            rooms.append(DeviceRoom(d.id, d.kind, d.index, max(0, free), d.memory_total_bytes))
        return rooms

    def _prepare(self, name: str, result: ModelEntry | ModelLoadError) -> list[_Group]:
        """Register the model's versions and return what each instance group asks of the placement engine."""
        model = self.models.setdefault(name, RegisteredModel(name))
        if isinstance(result, ModelLoadError):
            model.error = result.reason
            log.error("model %s: %s", name, result.reason)
            return []
        model.error = ""
        entry = result
        groups: list[_Group] = []
        for version in entry.versions:
            v = str(version)
            model_path = entry.model_path(version)
            try:
                scheduler = ModelScheduler(entry.config, v)
            except ValueError as exc:  # a batching policy the repository let through but the batcher refuses
                model.error = f"{entry.config_path or entry.path}: {exc}"
                log.error("model %s: %s", name, model.error)
                return []
            vs = RegisteredVersion(name, v, entry, scheduler)
            model.versions[v] = vs
            try:
                estimate = estimate_footprint_bytes(model_path, entry.config)
            except (ModelConfigError, OSError) as exc:
                vs.state, vs.reason = "UNAVAILABLE", str(exc)
                continue
            first = 0
            for gi, group in enumerate(entry.config.instance_groups):
                groups.append(_Group(vs, gi, group, estimate, first))
                first += group.count
        return groups

    def _planning_devices(self) -> list[Device]:
        """Leaf devices as the placement engine sees them: memory already in use (our instances, instances being
        loaded, and on a real GPU other processes) is taken off; the CUDA reserve stays a reserve."""
        out = []
        rooms = {r.device_id: r for r in self.device_rooms()}
        for d in self.devices.leaf_devices():
            room = rooms[d.id]
            reserve = self.device_reserve_bytes if d.kind != "cpu" else 0
            out.append(Device(id=d.id, memory_bytes=room.free_bytes + reserve, compute_fraction=d.compute_fraction,
                              kind=d.kind, labels={"gpu_index": str(d.index)}, parent_id=d.parent_id,
                              memory_reserve_bytes=reserve))
        return out

    async def _place_and_load(self, groups: list[_Group]) -> None:
        """Plan every instance of `groups` with the placement engine, then load them; record why any is not."""
        if not groups:
            return
        leaves = self.devices.leaf_devices()
        has_gpus = any(d.kind in ("gpu", "mig") for d in leaves)
        demands = []
        for g in groups:
            allowed = frozenset(d.id for d in leaves if d.index in g.group.gpus) if g.group.gpus else frozenset()
            demands.append(ModelDemand(name=g.demand_name, memory_bytes=max(1, g.estimate_bytes),
                                       instances=g.group.count,
                                       constraints=Constraints(kinds=frozenset(candidate_kinds(g.group.kind, has_gpus)),
                                                               devices=allowed)))
        config = PlannerConfig(strategy=self.placement_strategy, time_limit_seconds=self.placement_time_limit_s)
        # The engine is pure and may search for up to its time limit: off the event loop, so serving goes on.
        result = await asyncio.to_thread(plan, self._planning_devices(), demands, config=config)
        log.info("placement: %d instance(s) on %d device(s) (%s, lower bound %d%s), %d not placed",
                 len(result.placements), result.devices_used, result.method, result.lower_bound,
                 ", optimal" if result.optimal else "", len(result.unplaced))
        by_name = {g.demand_name: g for g in groups}
        reasons: dict[RegisteredVersion, list[str]] = {}
        for u in result.unplaced:
            g = by_name[u.model]
            why = f"instance {g.first_index + u.instance} not placed: {u.reason}"
            reasons.setdefault(g.vs, []).append(why)
            log.error("model %s version %s %s", g.vs.name, g.vs.version, why)
        for a in sorted(result.placements, key=lambda a: (a.model, a.instance)):
            g = by_name[a.model]
            vs, index = g.vs, g.first_index + a.instance
            log.info("model %s version %s instance %d -> device %s (estimated %.1f MiB)", vs.name, vs.version, index,
                     a.device, g.estimate_bytes / 2**20)
            inst = await self._start_instance(vs, index, a.device, g.estimate_bytes)
            if not inst.ready:
                reasons.setdefault(vs, []).append(f"instance {index} on {a.device}: {inst.error}")
        for vs in {g.vs for g in groups}:
            vs.state = "READY" if vs.instances else "UNAVAILABLE"
            vs.reason = "; ".join(reasons.get(vs, [])) or ("" if vs.instances else "no instance could be loaded")

    async def _start_instance(self, vs: RegisteredVersion, index: int, device: str, estimate_bytes: int,
                              key: str | None = None) -> InstanceHandle:
        """Load one instance of `vs` on `device`; once it is ready it serves. `inst.error` says why it is not."""
        inst = InstanceHandle(key=key or f"{vs.name}:{vs.version}:{index}", model=vs.name, version=vs.version,
                              index=index, device_id=device, model_path=vs.entry.model_path(int(vs.version)),
                              config=vs.entry.config, estimate_bytes=estimate_bytes)
        # Promised memory counts as used while the load runs, so a concurrent plan does not hand it out twice.
        self._reserved[device] = self._reserved.get(device, 0) + estimate_bytes
        try:
            await self.pool.load_instance(inst)
        finally:
            self._reserved[device] -= estimate_bytes
        if inst.ready:
            vs.instances.append(inst)
            vs.scheduler.add_instance(inst)
        return inst

    async def _stop_instance(self, vs: RegisteredVersion, inst: InstanceHandle) -> None:
        """No new batches go to `inst`; its worker unloads it after the batch it may be running."""
        vs.scheduler.remove_instance(inst)
        vs.instances.remove(inst)
        await self.pool.unload_instance(inst)

    async def _load(self, name: str, result: ModelEntry | ModelLoadError) -> None:
        await self._place_and_load(self._prepare(name, result))

    async def _unload_versions(self, model: RegisteredModel) -> None:
        for vs in list(model.versions.values()):
            vs.state = "UNLOADING"
            try:
                await asyncio.wait_for(vs.scheduler.wait_idle(), 30.0)
            except asyncio.TimeoutError:
                vs.scheduler.fail_all_queued(f"model '{model.name}' is being unloaded")
            for inst in list(vs.instances):
                await self._stop_instance(vs, inst)
        model.versions.clear()

    async def load_model(self, name: str) -> None:
        if self.stopping:
            raise InferenceError(ErrorKind.UNAVAILABLE, "the server is shutting down")
        try:
            result: ModelEntry | ModelLoadError = self.repository.load(name)
        except ModelConfigError as exc:
            if name not in self.models and not _exists(self.repository, name):
                raise InferenceError(ErrorKind.NOT_FOUND, f"failed to load '{name}', no version is available") \
                    from None
            result = ModelLoadError(name=name, path=exc.path, reason=str(exc), error=exc)
        model = self.models.setdefault(name, RegisteredModel(name))
        async with model.lock:
            await self._unload_versions(model)  # a load of a loaded model is a reload, as in Triton
            await self._load(name, result)
        if isinstance(result, ModelLoadError):
            raise InferenceError(ErrorKind.INVALID_ARGUMENT, f"failed to load '{name}': {result.reason}")
        if not any(v.ready for v in model.versions.values()):
            reasons = "; ".join(v.reason for v in model.versions.values())
            raise InferenceError(ErrorKind.UNAVAILABLE, f"failed to load '{name}': {reasons}")

    async def apply_placement(self, placements: list[dict[str, Any]]) -> dict[str, Any]:
        desired = self._parse_placements(placements)
        added: list[tuple[RegisteredVersion, InstanceHandle]] = []
        removed: list[tuple[RegisteredVersion, InstanceHandle]] = []
        for vs, wanted in desired.items():
            have = {i.index: i for i in vs.instances}
            for index, device in sorted(wanted.items()):
                if index in have and have[index].device_id == device:
                    continue
                old = have.get(index)
                log.info("apply: model %s version %s instance %d -> %s%s", vs.name, vs.version, index, device,
                         f" (from {old.device_id})" if old else "")
                # The key names the device too: the old instance of this index keeps serving until the new is up.
                inst = await self._start_instance(vs, index, device,
                                                  old.footprint_bytes if old else self._estimate(vs),
                                                  key=f"{vs.name}:{vs.version}:{index}@{device}")
                if not inst.ready:
                    for v2, done in added:  # roll back: the node stays as it was
                        await self._stop_instance(v2, done)
                    raise InferenceError(ErrorKind.UNAVAILABLE, f"placement not applied: instance {index} of "
                                         f"'{vs.name}' could not load on {device}: {inst.error}; nothing changed")
                added.append((vs, inst))
            # New instances sit where they are wanted, so this picks exactly the ones they replace or drop.
            removed += [(vs, i) for i in vs.instances if wanted.get(i.index) != i.device_id]
        for vs, inst in removed:  # break only after every make succeeded
            await self._stop_instance(vs, inst)
            log.info("apply: model %s version %s instance %d on %s stopped", vs.name, vs.version, inst.index,
                     inst.device_id)
        for vs in desired:
            vs.state = "READY" if vs.instances else "UNAVAILABLE"
            if vs.instances:
                vs.reason = ""
        return {"added": [{"model": v.name, "instance": i.index, "device": i.device_id} for v, i in added],
                "removed": [{"model": v.name, "instance": i.index, "device": i.device_id} for v, i in removed]}

    def _estimate(self, vs: RegisteredVersion) -> int:
        measured = [i.memory_bytes for i in vs.instances if i.memory_bytes]
        return max(measured) if measured else estimate_footprint_bytes(vs.entry.model_path(int(vs.version)),
                                                                       vs.entry.config)

    def _parse_placements(self, placements: Any) -> dict[RegisteredVersion, dict[int, str]]:
        """Validate a placement document before anything changes (bad input changes nothing)."""
        if not isinstance(placements, list):
            raise InferenceError(ErrorKind.INVALID_ARGUMENT, "'placements' must be a list")
        leaves = {d.id for d in self.devices.leaf_devices()}
        out: dict[RegisteredVersion, dict[int, str]] = {}
        for k, p in enumerate(placements):
            where = f"placements[{k}]"
            if not isinstance(p, dict) or not isinstance(p.get("model"), str) \
                    or not isinstance(p.get("instance"), int) or not isinstance(p.get("device"), str):
                raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                     f"{where}: expected {{\"model\": str, \"instance\": int, \"device\": str}}")
            if p["device"] not in leaves:
                raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                     f"{where}: unknown device '{p['device']}' (devices: {', '.join(sorted(leaves))})")
            if p["instance"] < 0:
                raise InferenceError(ErrorKind.INVALID_ARGUMENT, f"{where}: instance must be >= 0")
            vs = self._version(p["model"])
            if vs.state not in ("READY", "UNAVAILABLE"):
                raise InferenceError(ErrorKind.UNAVAILABLE, f"{where}: model '{vs.name}' is {vs.state.lower()}")
            wanted = out.setdefault(vs, {})
            if p["instance"] in wanted:
                raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                     f"{where}: instance {p['instance']} of '{vs.name}' placed twice")
            wanted[p["instance"]] = p["device"]
        return out

    async def unload_model(self, name: str) -> None:
        model = self.models.get(name)
        if model is None:
            raise InferenceError(ErrorKind.NOT_FOUND, f"failed to unload '{name}': unknown model")
        async with model.lock:
            await self._unload_versions(model)
        log.info("model %s unloaded", name)

    # --- lookups ---------------------------------------------------------------------------------------------
    def _model(self, name: str) -> RegisteredModel:
        model = self.models.get(name)
        if model is None:
            raise InferenceError(ErrorKind.NOT_FOUND, f"Request for unknown model: '{name}' is not found")
        return model

    def _version(self, name: str, version: str = "") -> RegisteredVersion:
        model = self._model(name)
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

    # --- InferenceCore ---------------------------------------------------------------------------------------
    def server_live(self) -> bool:
        return True

    def server_ready(self) -> bool:
        return self.started and not self.stopping

    def server_metadata(self) -> dict[str, Any]:
        return {"name": self.server_name, "version": __version__, "extensions": list(EXTENSIONS)}

    def model_ready(self, name: str, version: str = "") -> bool:
        model = self._model(name)
        if version and version not in model.versions:
            return False
        try:
            return self._version(name, version).ready
        except InferenceError:
            return False

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        vs = self._version(name, version)
        versions = sorted(self._model(name).versions, key=int) if not version else [version]
        return model_metadata_json(vs.entry.config, versions)

    def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        vs = self._version(name, version)
        return config_to_json(vs.entry.config, vs.entry.version_policy)

    def model_statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        if name:
            selected = [self._version(name, version)] if version else list(self._model(name).versions.values())
        else:
            selected = [v for m in self.models.values() for v in m.versions.values()]
        return {"model_stats": [v.scheduler.stats.json(v.name, v.version) for v in selected]}

    def repository_index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        index = []
        for name in sorted(self.models):
            model = self.models[name]
            if not model.versions:
                if not ready_only:
                    index.append({"name": name, "version": "", "state": "UNAVAILABLE",
                                  "reason": model.error or "unloaded"})
                continue
            for v in sorted(model.versions.values(), key=lambda x: int(x.version)):
                state = "READY" if v.ready else ("UNAVAILABLE" if v.state == "READY" else v.state)
                if ready_only and state != "READY":
                    continue
                reason = v.reason if state != "READY" else ""
                if state == "UNAVAILABLE" and v.state == "READY":
                    reason = "no instance is ready (a worker is restarting)"
                index.append({"name": name, "version": v.version, "state": state, "reason": reason})
        return index

    def _ready_scheduler(self, request: InferRequest):
        if self.stopping:
            raise InferenceError(ErrorKind.UNAVAILABLE, "the server is shutting down")
        vs = self._version(request.model_name, request.model_version)
        if not vs.ready:
            why = vs.reason or "no instance is ready"
            raise InferenceError(ErrorKind.UNAVAILABLE,
                                 f"Request for unknown model: '{vs.name}' version {vs.version} is not at ready "
                                 f"state: {why}")
        return vs.scheduler

    def submit(self, request: InferRequest, done) -> None:
        self._ready_scheduler(request).submit(request, done)

    async def infer(self, request: InferRequest) -> InferResponse:
        return await self._ready_scheduler(request).infer(request)

    # --- gpud's own views ------------------------------------------------------------------------------------
    def snapshot(self) -> ServingSnapshot:
        """The registry as a typed, read-only value (telemetry.serving): what the metrics collectors, the hints and
        inspect read. Cheap (no device reads): the collectors call it at every scrape."""
        has_gpus = any(d.kind in ("gpu", "mig") for d in self.devices.leaf_devices())
        return ServingSnapshot(tuple(
            ModelView(name, m.error, tuple(_version_view(v, has_gpus)
                                           for v in sorted(m.versions.values(), key=lambda x: int(x.version))))
            for name, m in sorted(self.models.items())))

    def inspect(self) -> dict[str, Any]:
        devices = []
        for d in self.devices.devices():
            r = self.devices.sample(d.id)
            devices.append({
                "id": d.id, "kind": d.kind, "index": d.index, "name": d.name, "uuid": d.uuid,
                "parent_id": d.parent_id, "mig_profile": d.mig_profile, "mig_enabled": d.mig_enabled,
                "leaf": d.is_leaf, "simulated": d.simulated, "compute_fraction": d.compute_fraction,
                "memory_total_bytes": d.memory_total_bytes, "memory_used_bytes": r.memory_used_bytes,
                "utilization_ratio": r.utilization_ratio, "power_w": r.power_w,
                "temperature_c": r.temperature_c, "healthy": r.healthy, "labels": dict(d.labels),
            })
        models = []
        for name in sorted(self.models):
            m = self.models[name]
            if not m.versions:
                models.append({"name": name, "version": "", "state": "UNAVAILABLE", "reason": m.error or "unloaded",
                               "instances": []})
            for v in m.versions.values():
                st = v.scheduler.stats
                n = st.success.count
                models.append({
                    "name": name, "version": v.version, "state": "READY" if v.ready else v.state,
                    "reason": v.reason, "max_batch_size": v.entry.config.max_batch_size,
                    "pending_requests": v.scheduler.pending_requests,
                    "requests_success": n, "requests_failed": st.fail.count,
                    "executions": st.execution_count, "inferences": st.inference_count,
                    "queue_seconds_avg": st.queue.ns / n / 1e9 if n else None,
                    "compute_seconds_avg": (st.compute_input.ns + st.compute_infer.ns + st.compute_output.ns)
                    / n / 1e9 if n else None,
                    "instances": [{"index": i.index, "device": i.device_id, "ready": i.ready,
                                   "memory_bytes": i.footprint_bytes, "measured_by": i.measured_by or "estimate",
                                   "provider": i.provider, "error": i.error} for i in v.instances],
                })
        out = {"server": self.server_metadata(), "device_source": self.devices.source,
               "time_unix_s": time.time(), "devices": devices, "models": models,
               "workers": self.pool.worker_info()}
        # --- autoscaling hints (gpud.autoscale) ---
        if self.hints is not None:
            out["hints"] = self.hints.inspect()
        return out


def _version_view(v: RegisteredVersion, has_gpus: bool) -> VersionView:
    if v.ready:
        state, reason = ModelState.READY, ""
    elif v.state == "READY":  # loaded, but no instance ready now
        state, reason = ModelState.UNAVAILABLE, "no instance is ready (a worker is restarting)"
    else:
        state, reason = ModelState(v.state), v.reason
    kinds = frozenset(k for g in v.entry.config.instance_groups for k in candidate_kinds(g.kind, has_gpus))
    instances = tuple(InstanceView(i.index, i.device_id, i.ready, i.memory_bytes, i.estimate_bytes, i.measured_by,
                                   i.load_seconds, i.provider, i.error) for i in v.instances)
    return VersionView(v.name, v.version, state, reason, v.entry.config.max_batch_size, kinds,
                       v.scheduler.pending_requests, instances, v.scheduler.stats)


def _exists(repository: ModelRepository, name: str) -> bool:
    try:
        return name in repository.model_names()
    except OSError:
        return False
