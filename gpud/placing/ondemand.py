"""Scale to zero's other half: loads on demand (a request for a version with no instance loads one) and evictions
(which idle instances a load may unload, in the order it may: the pure rule is gpud.scaling.idle.eviction_order; and
only those that make room). A part of the placement service (`OnDemand` is one of its bases), in a module of its own.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace

from gpud.executor.instance import InstanceHandle
from gpud.placement import Move, Plan, PlannerConfig, diff
from gpud.placing.inputs import GroupKey, PlacementInputs, candidate_kinds
from gpud.registry import RegisteredVersion, Registry
from gpud.scaling.idle import EvictionCandidate, eviction_order, idle_seconds
from gpud.scaling.plan import Spare, Step
from gpud.telemetry.devices import DeviceBackend
from gpud.telemetry.serving import ModelState

log = logging.getLogger("gpud")


class OnDemand:
    """Loads on demand and evictions, for PlacementService, its one subclass, which provides what is declared
    below."""

    lock: asyncio.Lock
    registry: Registry
    devices: DeviceBackend
    config: PlannerConfig
    clock: Callable[[], float]
    wall_clock: Callable[[], float]
    cold_start_log_s: float
    _changes: int  # instances started or stopped so far
    _cold: dict[RegisteredVersion, asyncio.Task[None]]  # cold starts under way
    _cold_failed: dict[RegisteredVersion, tuple[int, str, float]]  # changes then, why, when logged
    # What versions may give up for a cold start of one with a latency objective (the controller's spare_now, set by
    # the wiring when the controller acts; Claims.spare's form).
    spare_source: Callable[[], Spare]

    def inputs(self, versions: Sequence[RegisteredVersion] | None = None,
               totals: Mapping[tuple[str, str], int] | None = None,
               beside: Sequence[RegisteredVersion] = (), without: Collection[InstanceHandle] = ()) -> PlacementInputs:
        raise NotImplementedError

    async def _plan(self, inputs: PlacementInputs, config: PlannerConfig) -> Plan:
        raise NotImplementedError

    async def _apply(self, inputs: PlacementInputs, moves: Sequence[Move], *, atomic: bool,
                     stop_at_failure: bool = False, staged: Sequence[RegisteredVersion] = ()) -> list[Step]:
        raise NotImplementedError

    async def _stop(self, vs: RegisteredVersion, inst: InstanceHandle) -> None:
        raise NotImplementedError

    def _live(self) -> list[RegisteredVersion]:
        raise NotImplementedError

    def demand(self, vs: RegisteredVersion) -> None:
        """A request waits for `vs`, which has no instance: load one (once, however many requests wait). If that
        cannot be done, the waiting requests fail with the reason."""
        if vs in self._cold or vs.instances:
            return
        failed = self._cold_failed.get(vs)
        if failed is not None and failed[0] == self._changes:  # nothing has moved since it failed: it would again
            vs.scheduler.fail_all_queued(f"model '{vs.name}' version {vs.version} could not be loaded on demand: "
                                         f"{failed[1]}")
            return
        self._cold[vs] = asyncio.get_running_loop().create_task(self._cold_start(vs))

    async def _cold_start(self, vs: RegisteredVersion) -> None:
        started_s = self.clock()
        try:
            error = await self.cold_start(vs)
        except Exception as exc:  # noqa: BLE001 - the waiting requests must hear why, whatever failed
            log.exception("model %s version %s: cold start failed", vs.name, vs.version)
            error = str(exc)
        finally:
            self._cold.pop(vs, None)
        if error:
            before = self._cold_failed.get(vs)
            logged_s = before[2] if before is not None and before[1] == error else None
            if logged_s is None or self.clock() - logged_s >= self.cold_start_log_s:
                log.error("model %s version %s: cannot load on demand: %s (tried again once the node changes)",
                          vs.name, vs.version, error)
                logged_s = self.clock()
            self._cold_failed[vs] = (self._changes, error, logged_s)
            vs.scheduler.fail_all_queued(f"model '{vs.name}' version {vs.version} could not be loaded on demand: "
                                         f"{error}")
            return
        self._cold_failed.pop(vs, None)
        seconds = self.clock() - started_s
        vs.scheduler.stats.record_cold_start(seconds)
        log.info("model %s version %s: cold start in %.2f s (loaded on demand)", vs.name, vs.version, seconds)

    async def cold_start(self, vs: RegisteredVersion) -> str:
        """Load one instance of `vs` (which has none) where there is room, evicting the least recently used idle
        instances of other versions that make room where there is not. Returns "" once it serves, else why not."""
        async with self.lock:
            evicted: list[str] = []
            while not vs.instances:
                if vs.state is not ModelState.READY:
                    return f"it is {vs.state.value.lower()}"
                inputs = self.inputs([vs], {(vs.name, vs.version): 1})
                result = await self._plan(inputs, replace(self.config, move_current=False))
                mine = {inputs.names[GroupKey(vs.name, vs.version, k)]
                        for k in range(len(vs.entry.config.instance_groups))}
                moves = [m for m in diff(inputs.current, result.placements, inputs.devices, inputs.demands)
                         if m.model in mine and m.kind == "add" and m.make_before_break]  # room now
                if moves:
                    steps = await self._apply(inputs, moves[:1], atomic=False)
                    if steps and steps[0].error:
                        return f"instance {steps[0].index} on {steps[0].to_device}: {steps[0].error}"
                    continue
                candidates = self._eviction_candidates(vs)
                # With a latency objective, a request waiting for a cold start misses it: it may also take the spare
                # instances of versions whose objective holds with margin (the controller's, when it acts).
                spare = self.spare_source() if vs.scheduler.stats.objective_ns else {}
                spares = self._spare_candidates(vs, spare, exclude=[c for c, _ in candidates])
                candidates += spares
                victims = await self._victims(vs, [vs], {(vs.name, vs.version): 1}, candidates)
                if not victims:
                    why = next((u.reason for u in result.unplaced), "no room")
                    return why + ("; unloading the idle instances of other models would not make room either"
                                  if candidates else "; no idle instance of another model to evict") \
                        + (f" (evicted {', '.join(evicted)})" if evicted else "")
                for step in await self._evict_all(victims, vs, spares, spare):
                    evicted.append(f"{step.model}:{step.version}:{step.index}")
            return ""

    async def _evict_all(self, victims: Sequence[tuple[RegisteredVersion, InstanceHandle]],
                         beneficiary: RegisteredVersion, spares: Sequence[tuple[RegisteredVersion, InstanceHandle]],
                         spare: Spare) -> list[Step]:
        """Evict `victims` for `beneficiary`: those among `spares` (_spare_candidates of `spare`) with their
        version's reason, the others as idle ones."""
        spare_ids = {id(i) for _, i in spares}
        return [await self._evict(v, beneficiary, spare[(v[0].name, v[0].version)][1] if id(v[1]) in spare_ids
                                  else "") for v in victims]

    async def _evict(self, victim: tuple[RegisteredVersion, InstanceHandle], beneficiary: RegisteredVersion,
                     why: str = "") -> Step:
        """Unload `victim` for `beneficiary`'s load: an idle instance (least recently used), or, with `why`, a spare
        one (its version's latency objective holds with margin without it)."""
        owner, inst = victim
        log.info("model %s version %s: evicting %s instance %d of model %s version %s on %s to make room",
                 beneficiary.name, beneficiary.version, "a spare" if why else "the idle (least recently used)",
                 inst.index, owner.name, owner.version, inst.device_id + (f" ({why})" if why else ""))
        await self._stop(owner, inst)
        owner.scheduler.stats.evictions += 1
        return Step("remove", owner.name, owner.version, inst.index, inst.device_id, None,
                    evicted_for=beneficiary.name, evicted_why=why)

    async def _victims(self, vs: RegisteredVersion, versions: Sequence[RegisteredVersion],
                       totals: Mapping[tuple[str, str], int],
                       candidates: Sequence[tuple[RegisteredVersion, InstanceHandle]]
                       ) -> list[tuple[RegisteredVersion, InstanceHandle]]:
        """The instances to evict so that `vs` places more of its instances: the shortest least-recently-used-first
        prefix of `candidates` whose unloading lets it, then without those of them it does not need (they may sit
        on another device). Empty when even all of them would not: nothing is unloaded for nothing. Checked with
        the planner's heuristics alone (a check, not the plan)."""
        config = replace(self.config, move_current=False, time_limit_seconds=0.0)

        async def short(without: Sequence[tuple[RegisteredVersion, InstanceHandle]]) -> int:
            inputs = self.inputs(versions, totals, without=[i for _, i in without])
            return unplaced_of(vs, inputs, await self._plan(inputs, config))

        before = await short(())
        chosen: list[tuple[RegisteredVersion, InstanceHandle]] = []
        for k in range(1, len(candidates) + 1):
            if await short(candidates[:k]) < before:
                chosen = list(candidates[:k])
                break
        for c in reversed(chosen[:-1]):  # the last of the prefix is needed: the one before it was not enough
            trial = [x for x in chosen if x is not c]
            if await short(trial) < before:
                chosen = trial
        return chosen

    def _eviction_candidates(self, vs: RegisteredVersion, *, exclude: Collection[RegisteredVersion] = frozenset(),
                             min_idle_s: float = 0.0) -> list[tuple[RegisteredVersion, InstanceHandle]]:
        kinds = {d.id: d.kind for d in self.devices.leaf_devices()}
        return eviction_candidates(vs, self._live(), kinds, self.registry.has_gpus, self.wall_clock(),
                                   exclude=exclude, min_idle_s=min_idle_s)

    def _spare_candidates(self, vs: RegisteredVersion, spare: Spare, *,
                          exclude: Collection[RegisteredVersion] = frozenset()
                          ) -> list[tuple[RegisteredVersion, InstanceHandle]]:
        """The instances versions in `spare` can give up for `vs` (those beyond what each keeps, their highest
        numbers, on device kinds `vs` can use), in `spare`'s order (the most margin first); never below a version's
        minimum nor one instance."""
        kinds = {k for g in vs.entry.config.instance_groups for k in candidate_kinds(g.kind, self.registry.has_gpus)}
        device_kinds = {d.id: d.kind for d in self.devices.leaf_devices()}
        out = []
        for (model, version), (keep, _) in spare.items():
            other = self.registry.version(model, version)
            if other is vs or other in exclude or other not in self._live():
                continue
            mine = [i for i in sorted(other.instances, key=lambda i: -i.index)
                    if device_kinds.get(i.device_id) in kinds]
            out += [(other, i) for i in mine[:spare_count(other, keep)]]
        return out



def spare_count(vs: RegisteredVersion, keep: int) -> int:
    """How many of `vs`'s instances it may give up when its objective needs `keep` (Claims.spare): never below its
    minimum nor one."""
    return max(0, len(vs.instances) - max(keep, 1, vs.minimum_instances))


def eviction_candidates(vs: RegisteredVersion, live: Iterable[RegisteredVersion], device_kinds: Mapping[str, str],
                        has_gpus: bool, now_unix_s: float, *, exclude: Collection[RegisteredVersion] = frozenset(),
                        min_idle_s: float = 0.0) -> list[tuple[RegisteredVersion, InstanceHandle]]:
    """The instances of `live` versions on device kinds `vs` can use, least recently used first, of versions not in
    `exclude` that have had no request for `min_idle_s` (and never one of a busy version, never below a version's
    minimum: eviction_order). `device_kinds`: device id -> kind."""
    kinds = {k for g in vs.entry.config.instance_groups for k in candidate_kinds(g.kind, has_gpus)}
    handles: dict[tuple[str, str, int, str], tuple[RegisteredVersion, InstanceHandle]] = {}
    candidates = []
    for other in live:
        if other is vs or other in exclude:
            continue
        idle_s = idle_seconds(other.last_used_unix_s, other.scheduler.pending_requests, now_unix_s)
        if idle_s is None or idle_s < min_idle_s:  # busy (eviction_order would skip it too) or not idle long enough
            continue
        for inst in other.instances:
            if device_kinds.get(inst.device_id) not in kinds:
                continue
            handles[(other.name, other.version, inst.index, inst.device_id)] = (other, inst)
            candidates.append(EvictionCandidate(
                other.name, other.version, inst.index, inst.device_id, inst.footprint_bytes,
                other.last_used_unix_s, other.scheduler.pending_requests > 0, len(other.instances),
                other.minimum_instances))
    return [handles[(c.model, c.version, c.index, c.device_id)] for c in eviction_order(candidates)]


def unplaced_of(vs: RegisteredVersion, inputs: PlacementInputs, result: Plan) -> int:
    """How many of `vs`'s instances the plan left without a device."""
    return sum(1 for u in result.unplaced if inputs.version_of(u.model) == (vs.name, vs.version))
