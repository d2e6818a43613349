"""The placement service: the one way gpud decides where model instances go and makes it so.

Every placement change goes through here: start-up and model loads (`place`), `POST /v2/gpud/placement`
(`apply_requested`), unloads and reloads (`retire`), and next the controller. Each builds its problem with
`gpud.placing.inputs` from the registry's versions, the device inventory and the live instances, asks
`placement.plan` (pure, off the event loop: it may search for its time limit), turns the result into steps with
`placement.diff`, and applies them in order through the executor pool:
- an add loads the new instance and routes to it once it is ready;
- a move is make-before-break: the new instance loads and serves before the old one is drained and unloaded (the
  scheduler finishes the batch it may be running);
- memory promised to an instance being loaded counts as used (a reservation) until the load ends, so the free memory
  the hints and inspect report never hands it out twice;
- `atomic` changes (a requested placement, the controller's) roll back when a load fails: the steps done so far are
  undone in reverse and the node is as it was. Start-up and model loads are not atomic: what loads serves, and each
  instance that did not is recorded with its reason.
One change at a time (`lock`): a plan is always made against the node as it is.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import replace
from functools import partial

from gpud.executor.device import WorkerDevice
from gpud.executor.pool import ExecutorPool
from gpud.executor.instance import InstanceHandle
from gpud.executor.types import ErrorKind, InferenceError
from gpud.core_api import Applied, PlacedInstance, RequestedPlacement
from gpud.placing.ondemand import OnDemand, spare_count, unplaced_of
from gpud.placing.inputs import (GroupKey, LiveInstance, PlacementInputs, VersionDemand, build_inputs, locate,
                                 pin_errors, planning_devices, reserve_bytes_for)
from gpud.placing.recovery import as_moves_off_lost_devices, recovering, steps_for_interval
from gpud.placing.shortcuts import shortcuts, steps_of, then_what_still_fits, unreached_adds
from gpud.placing.requested import check_allowed, check_fits, desired_assignments, resolve_versions
from gpud.placing.results import DeviceRoom
from gpud.scaling.plan import NO_CLAIMS, Claims, ScalingPlan, Spare, Step, Unplaced
from gpud.registry import RegisteredVersion, Registry
from gpud.placement import Assignment, Move, Plan, PlannerConfig, diff, plan
from gpud.telemetry.devices import DeviceBackend, DeviceInfo
from gpud.telemetry.serving import ModelState

log = logging.getLogger("gpud")


class PlacementService(OnDemand):
    def __init__(self, devices: DeviceBackend, pool: ExecutorPool, registry: Registry, *,
                 device_reserve_bytes: int = 0, strategy: str = "pack", time_limit_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 cold_start_log_s: float = 60.0):
        self.devices = devices
        self.clock = clock
        # A load on demand that failed is tried again by the next request only once the node has changed (an
        # instance started or stopped): until then requests fail at once with its reason, with no plan and no log
        # line each (a busy client would otherwise flood both). The same failure is logged again after this long.
        self.cold_start_log_s = cold_start_log_s
        self.spare_source: Callable[[], Spare] = dict  # none until the wiring's
        self._changes = 0  # instances started or stopped so far
        self._cold_failed: dict[RegisteredVersion, tuple[int, str, float]] = {}  # changes then, why, when logged
        self.wall_clock = wall_clock
        self._cold: dict[RegisteredVersion, asyncio.Task] = {}  # cold starts under way
        self.pool = pool
        self.registry = registry
        self.device_reserve_bytes = device_reserve_bytes
        self.config = PlannerConfig(strategy=strategy, time_limit_seconds=time_limit_s)
        self.lock = asyncio.Lock()
        self._loading: dict[str, int] = {}  # bytes promised to instances being loaded, per device
        # Versions no longer routed to that finish their accepted requests (an unload, a reload's old versions):
        # their instances still hold memory until they stop.
        self._retiring: list[RegisteredVersion] = []

    # --- what placement sees ----------------------------------------------------------------------------------------
    def _live(self) -> list[RegisteredVersion]:
        return [v for v in self.registry.versions() if v.instances]

    def _gpu_used_bytes(self, d: DeviceInfo) -> int | None:
        """What the driver says is used on a real GPU (other processes too), sampled now; None elsewhere."""
        if d.simulated or d.kind == "cpu":
            return None
        return self.devices.sample(d.id).memory_used_bytes or 0

    def rooms(self) -> list[DeviceRoom]:
        """Free memory per leaf device: total - reserve - used - promised to loads in flight."""
        out = []
        for d in self.devices.leaf_devices():
            used = self._gpu_used_bytes(d)
            if used is None:
                used = self.pool.memory_used_bytes(d.id) or 0
            free = (d.memory_total_bytes - reserve_bytes_for(d.kind, self.device_reserve_bytes) - used
                    - self._loading.get(d.id, 0))
            out.append(DeviceRoom(d.id, d.kind, d.index, max(0, free), d.memory_total_bytes))
        return out

    def inputs(self, versions: Sequence[RegisteredVersion] | None = None,
               totals: Mapping[tuple[str, str], int] | None = None,
               beside: Sequence[RegisteredVersion] = (), without: Collection[InstanceHandle] = ()) -> PlacementInputs:
        """The planning problem of the live versions (and `versions`, which ask their configured counts): devices
        with what is not ours taken off, demands, and the live instances as the current placement. `totals`
        sets a version's instance count (the controller's target); the change goes to its last instance group.
        `beside`: versions being replaced (a reload): their instances hold memory but are not planned. `without`:
        live instances to plan as if they were unloaded (is evicting them worth it?)."""
        beside = [*beside, *self._retiring]
        live = [v for v in self._live() if v not in beside]
        new = [v for v in versions or () if v not in live]
        gone = {id(i) for i in without}
        # A live group asks for what it runs, holes included (an instance that failed to load keeps its number).
        counts: dict[GroupKey, int] = {GroupKey(v.name, v.version, g): 0 for v in live
                                       for g in range(len(v.entry.config.instance_groups))} if gone else {}
        for v in live:
            for i in v.instances:
                if id(i) in gone:
                    continue
                g, k = locate(i.index, v.entry.config.instance_groups)
                key = GroupKey(v.name, v.version, g)
                counts[key] = max(counts.get(key, 0), k + 1)
        ours: dict[str, int] = {}
        for v in live:
            for i in v.instances:
                ours[i.device_id] = ours.get(i.device_id, 0) + i.footprint_bytes
        replaced: dict[str, int] = {}
        for v in beside:
            for i in v.instances:
                replaced[i.device_id] = replaced.get(i.device_id, 0) + i.footprint_bytes
        other: dict[str, int] = {}
        for d in self.devices.leaf_devices():
            used = self._gpu_used_bytes(d)
            if used is not None:  # a real GPU: what others hold is what the driver sees beyond our instances
                other[d.id] = max(0, used - ours.get(d.id, 0))
            else:  # elsewhere the replaced instances' memory is known only from them
                other[d.id] = replaced.get(d.id, 0)
            other[d.id] += self._loading.get(d.id, 0)
        unhealthy = self.unhealthy_devices()
        devices = planning_devices(self.devices.leaf_devices(), device_reserve_bytes=self.device_reserve_bytes,
                                   other_used_bytes=other, unhealthy=frozenset(unhealthy))
        demands: list[VersionDemand] = [v.demand() for v in live + new]
        current = [LiveInstance(v.name, v.version, i.index, i.device_id) for v in live for i in v.instances
                   if id(i) not in gone]
        counts = {**_config_counts(new), **counts}
        # What runs stays through a re-plan: only a version whose count is set (the controller's target) may lose
        # instances, down to it. Otherwise a re-plan that fits more of one model could drop a busy one's instance.
        running: dict[GroupKey, int] = {}
        for v in live:
            for i in v.instances:
                if id(i) not in gone:
                    key = GroupKey(v.name, v.version, locate(i.index, v.entry.config.instance_groups)[0])
                    running[key] = running.get(key, 0) + 1
        for (model, version), total in (totals or {}).items():
            vs = self.registry.version(model, version)
            last = len(vs.entry.config.instance_groups) - 1
            others = sum(counts.get(GroupKey(model, version, g), 0) for g in range(last))
            counts[GroupKey(model, version, last)] = max(0, total - others)
            for g in range(last + 1):
                key = GroupKey(model, version, g)
                running[key] = min(running.get(key, 0), counts.get(key, 0))
        return build_inputs(devices, demands, current, counts=counts, minimums=running)

    async def _plan(self, inputs: PlacementInputs, config: PlannerConfig) -> Plan:
        # The engine is pure and may search for up to its time limit: off the event loop, so serving goes on.
        return await asyncio.to_thread(plan, inputs.devices, inputs.demands, current=inputs.current, config=config)

    # --- start-up and model loads ---------------------------------------------------------------------------------
    async def place(self, new: Sequence[RegisteredVersion], *,
                    beside: Sequence[RegisteredVersion] = ()) -> list[RegisteredVersion]:
        """Plan every instance of `new` into the room the live instances leave (they stay where they are) and load
        them. Each version ends READY with what loaded, or UNAVAILABLE with why each instance did not. `beside`:
        the versions `new` replaces (a reload), which serve on until it is ready: they only take room. Returns the
        versions of `new` left with no instance for want of room (not for a failed load)."""
        async with self.lock:
            new = self._refuse_bad_pins(new)
            if not new:
                return []
            inputs = self.inputs(new, beside=beside)
            result = await self._plan(inputs, replace(self.config, move_current=False))
            log.info("placement: %d instance(s) on %d device(s) (%s, lower bound %d%s), %d not placed",
                     len(result.placements), result.devices_used, result.method, result.lower_bound,
                     ", optimal" if result.optimal else "", len(result.unplaced))
            reasons: dict[RegisteredVersion, list[str]] = {v: [] for v in new}
            by_key = {(v.name, v.version): v for v in new}  # not the registry's: a reload's are not installed yet
            for u in result.unplaced:
                key, index = inputs.instance(Assignment(u.model, u.instance, ""))
                vs = by_key.get((key.model, key.version)) or self.registry.version(key.model, key.version)
                why = f"instance {index} not placed: {u.reason}"
                reasons.setdefault(vs, []).append(why)
                log.error("model %s version %s %s", vs.name, vs.version, why)
            # Only the new versions' steps: filling another version's holes or re-placing what sits on a lost
            # device is the controller's to decide, not a side effect of loading a model.
            placing = {inputs.names[GroupKey(v.name, v.version, k)] for v in new
                       for k in range(len(v.entry.config.instance_groups))}
            moves = [m for m in diff(inputs.current, result.placements, inputs.devices, inputs.demands)
                     if m.model in placing]
            for step in await self._apply(inputs, moves, atomic=False, staged=new):
                if step.error:
                    vs = by_key[(step.model, step.version)]
                    reasons.setdefault(vs, []).append(f"instance {step.index} on {step.to_device}: {step.error}")
            for vs in new:
                vs.state = ModelState.READY if vs.instances else ModelState.UNAVAILABLE
                vs.reason = "; ".join(reasons.get(vs, [])) or ("" if vs.instances else "no instance could be loaded")
            no_room = {by_key.get((k.model, k.version)) for k, _ in
                       (inputs.instance(Assignment(u.model, u.instance, "")) for u in result.unplaced)}
            no_room_now = [vs for vs in new if not vs.instances and vs in no_room]
            for vs in no_room_now:
                if vs.bounds.minimum == 0:  # it may wait for room: its first request loads it, evicting idle ones
                    vs.state, vs.reason = ModelState.READY, ""
                    log.info("model %s version %s: no room now; scaled to zero, its first request loads it",
                             vs.name, vs.version)
            return no_room_now

    def _refuse_bad_pins(self, versions: Sequence[RegisteredVersion]) -> list[RegisteredVersion]:
        """Versions pinned to GPUs the node lacks are UNAVAILABLE with the reason, not placed anywhere."""
        devices = planning_devices(self.devices.leaf_devices(), device_reserve_bytes=0)
        ok = []
        for vs in versions:
            errors = pin_errors(vs.demand(), devices)
            if errors:
                vs.state, vs.reason = ModelState.UNAVAILABLE, "; ".join(errors)
                log.error("model %s version %s: %s", vs.name, vs.version, vs.reason)
            else:
                ok.append(vs)
        return ok

    # --- the controller ----------------------------------------------------------------------------------------
    async def rescale(self, totals: Mapping[tuple[str, str], int], *, max_steps: int, apply: bool,
                      evict_idle_s: float | None = None, incremental: bool = True,
                      claims: Claims = NO_CLAIMS) -> ScalingPlan:
        """Re-plan the node with these versions' instance counts (the others keep theirs), keeping moves few
        (placement's incremental re-plan: what runs stays where it is unless moving it lets more fit; instances on
        unhealthy devices are placed again elsewhere), and carry out the first `max_steps` steps in order, each
        move make-before-break, stopping at a failed load (or, not `apply`, only say what they would be). Putting
        back a lost device's instances is not capped and a failed one stops nothing (gpud.placing.recovery).
        `evict_idle_s`: an added instance with no room may evict instances of other versions idle this long
        (least recently used first, never below their minimum); None: never. `claims` (the controller's, from the
        latency objectives): when not every growing version fits, room goes to them in `claims.first`'s order, and
        one missing its objective may also take the spare instances of versions whose objective holds with margin.
        `incremental` False plans the node from scratch, blind to where instances run, and moves them to that plan
        (what a re-plan that ignores the current placement does: the replay benchmark's comparison, bench/replay)."""
        async with self.lock:
            wanted = [self.registry.version(m, v) for m, v in totals]
            placeable = [vs for vs in wanted if vs.state in (ModelState.READY, ModelState.UNAVAILABLE)]
            rank = {k: n for n, k in enumerate(claims.first)}
            wanted.sort(key=lambda vs: rank.get((vs.name, vs.version), len(rank)))
            counts = dict(totals)  # what is planned: `totals`, less what claims hold back
            held_back: dict[tuple[str, str], str] = {}
            ordered = False
            evicted: list[Step] = []
            while True:
                inputs = self.inputs(placeable, counts)
                result = await self._plan(inputs if incremental else replace(inputs, current=()),
                                          replace(self.config, move_current=True))
                growing = [vs for vs in wanted if counts[(vs.name, vs.version)] > len(vs.instances)]
                short = [vs for vs in growing if unplaced_of(vs, inputs, result)]
                if not short:
                    break
                if apply and evict_idle_s is not None and len(evicted) < max_steps:
                    victims, beneficiary, spares = await self._victims_for(short, growing, placeable, counts,
                                                                           claims, evict_idle_s)
                    if victims:
                        evicted += await self._evict_all(victims, beneficiary, spares, claims.spare)
                        continue
                if claims.urgent and not ordered:
                    # Not all fit: the most urgent take the room first; the rest get what is left.
                    counts, held_back = await self._by_claims(placeable, counts, wanted, claims)
                    ordered = True
                    continue
                break
            lost = {d.id for d in inputs.devices if not d.healthy}
            moves = as_moves_off_lost_devices(diff(inputs.current, result.placements, inputs.devices,
                                                   inputs.demands), lost)
            # A step with no room until others have moved would overcommit the device: left for a later interval.
            doable = [m for m in moves if m.make_before_break or m.kind == "remove"]
            def urgency(m: Move) -> int:  # claims.first's order; versions not in it after
                return rank.get(inputs.version_of(m.model), len(rank))

            if claims.first:  # under the cap, the most urgent version's adds go first
                doable = adds_in_order(doable, urgency)
            # Recovery is not capped (gpud.placing.recovery). Evictions count as steps, but the load they made room
            # for is always taken.
            cap = max(1 if evicted else 0, max_steps - len(evicted))
            todo = steps_for_interval(doable, lost, cap)
            waiting = unreached_adds(moves, todo, inputs.current) if not lost and not evicted else []
            room_for: dict[tuple[str, str, int, str | None], str] = {}
            if waiting and (any(m.kind == "move" for m in todo) or any(not m.make_before_break for m in waiting)):
                # Adds this interval would not reach (capped, or behind a re-pack that cannot finish make-before-
                # break): room by a move or two now where there is such a way; the re-plan's moves wait.
                found = shortcuts(waiting, inputs, claims.urgent, urgency, cap, self._spare_counts(inputs, claims))
                if found:
                    rest = [m for m in doable if m.kind != "move"]
                    todo = steps_for_interval(then_what_still_fits(steps_of(found), rest, inputs), lost, cap)
                for s in found:
                    gains = inputs.version_of(s.add.model)
                    log.info("model %s version %s: room on %s by %d step(s) now, ahead of the re-plan's moves",
                             *gains, s.add.to_device, len(s.moves))
                    for m in s.moves:
                        if m.kind == "move":  # it says whom it made room for (the log, inspect)
                            key, index = inputs.instance(Assignment(m.model, m.instance, ""))
                            room_for[(key.model, key.version, index, m.from_device)] = gains[0]
                        elif apply:  # a spare instance given up for an urgent add: an eviction, said so
                            evicted.append(await self._evict_spare(inputs, m, gains, claims))
                            todo = [t for t in todo if t != m]
            if apply:
                steps = evicted + await self._apply(inputs, todo, atomic=False, stop_at_failure=True)
            else:
                steps = []
                for m in todo:
                    key, index = inputs.instance(Assignment(m.model, m.instance, ""))
                    steps.append(Step(m.kind, key.model, key.version, index, m.from_device, m.to_device))
            if room_for:
                steps = [replace(s, room_for=room_for.get((s.model, s.version, s.index, s.from_device), ""))
                         if s.kind == "move" else s for s in steps]
            unplaced = []
            for u in result.unplaced:
                key, index = inputs.instance(Assignment(u.model, u.instance, ""))
                unplaced.append(Unplaced(key.model, key.version, index, u.reason))
            for vs in wanted:
                held = held_back.get((vs.name, vs.version))
                if held:
                    unplaced += [Unplaced(vs.name, vs.version, i, held)
                                 for i in range(counts[(vs.name, vs.version)], totals[(vs.name, vs.version)])]
            why = {(u.model, u.instance): u.reason for u in result.unplaced}
            recovered: set[RegisteredVersion] = set()
            for m in todo:
                if not recovering(m, lost):
                    continue
                key, index = inputs.instance(Assignment(m.model, m.instance, ""))
                recovered.add(self.registry.version(key.model, key.version))
                if m.kind == "remove" and apply and (m.model, m.instance) in why:
                    # Said here, with the device: the controller's no-room warning does not name it.
                    log.error("model %s version %s instance %d on lost device %s: not placed elsewhere: %s",
                              key.model, key.version, index, m.from_device, why[(m.model, m.instance)])
        # Requests came while its last instance was being unloaded (idle) or its device was lost with no room
        # elsewhere: load it again where there is (or fail them with why not).
        for vs in [*wanted, *recovered]:
            if vs.scaled_to_zero and vs.scheduler.pending_requests:
                self.demand(vs)
        return ScalingPlan(tuple(steps), tuple(unplaced), len(moves) - len(todo), result.method,
                           frozenset(lost))

    async def _evict_spare(self, inputs: PlacementInputs, removal: Move, beneficiary: tuple[str, str],
                           claims: Claims) -> Step:
        """Unload the spare instance of `removal` for `beneficiary`'s add, with its version's reason."""
        group, index = inputs.instance(Assignment(removal.model, removal.instance, ""))
        owner = self.registry.version(group.model, group.version)
        # Under the service's lock: the instance the plan saw is still there.
        inst = next(i for i in owner.instances if i.index == index and i.device_id == removal.from_device)
        return await self._evict((owner, inst), self.registry.version(*beneficiary),
                                 claims.spare[(owner.name, owner.version)][1])

    def _spare_counts(self, inputs: PlacementInputs, claims: Claims) -> dict[str, int]:
        """How many instances of each demand (a version's last instance group) the claims' spare versions may give
        up for an urgent one: beyond what each keeps, never below its minimum nor one."""
        out = {}
        for (model, version), (keep, _) in claims.spare.items():
            vs = self.registry.version(model, version)
            groups = len(vs.entry.config.instance_groups)
            name = inputs.names.get(GroupKey(model, version, groups - 1))
            count = spare_count(vs, keep)
            if name is not None and count > 0:
                out[name] = count
        return out

    async def _victims_for(self, short: Sequence[RegisteredVersion], growing: Sequence[RegisteredVersion],
                           versions: Sequence[RegisteredVersion], totals: Mapping[tuple[str, str], int],
                           claims: Claims, evict_idle_s: float
                           ) -> tuple[list[tuple[RegisteredVersion, InstanceHandle]], RegisteredVersion,
                                      list[tuple[RegisteredVersion, InstanceHandle]]]:
        """The first of `short` (the most urgent first) that evicting instances would give room, and those
        instances: idle ones of other versions (least recently used first), and for a version missing its latency
        objective, then the spare instances of versions whose objective holds with margin. Checked with the
        growing versions after it asking for no more than they run, so the room is for it. The last: the spare
        instances it could take (for _evict_all)."""
        for vs in short:
            after = growing[growing.index(vs) + 1:]
            trial = {**totals, **{(g.name, g.version): len(g.instances) for g in after}}
            idle = self._eviction_candidates(vs, exclude=growing, min_idle_s=evict_idle_s)
            spare = self._spare_candidates(vs, claims.spare, exclude=[*growing, *(c for c, _ in idle)]) \
                if (vs.name, vs.version) in claims.urgent else []
            victims = await self._victims(vs, versions, trial, idle + spare)
            if victims:
                return victims, vs, spare
        return [], short[0], []

    async def _by_claims(self, versions: Sequence[RegisteredVersion], totals: Mapping[tuple[str, str], int],
                         wanted: Sequence[RegisteredVersion], claims: Claims
                         ) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], str]]:
        """`totals` cut so that the growing versions get room in `wanted`'s order (claims.first): each in turn
        asks for its total with the ones before it holding theirs; what does not fit is held back, with why. Checked
        with the planner's heuristics alone (the plan itself follows, with these totals)."""
        config = replace(self.config, move_current=True, time_limit_seconds=0.0)
        cut = dict(totals)
        growing = [vs for vs in wanted if totals[(vs.name, vs.version)] > len(vs.instances)]
        for vs in growing:
            cut[(vs.name, vs.version)] = len(vs.instances)
        held: dict[tuple[str, str], str] = {}
        before: list[str] = []
        granted: list[RegisteredVersion] = []
        for vs in growing:
            key = (vs.name, vs.version)
            granted.append(vs)
            reason = ""
            # Its whole total first, then one fewer at a time: the heuristics may place it by leaving out one that
            # came before, so what counts is that nothing granted so far is left out.
            for total in range(totals[key], len(vs.instances) - 1, -1):
                cut[key] = total
                inputs = self.inputs(versions, cut)
                result = await self._plan(inputs, config)
                if not any(unplaced_of(g, inputs, result) for g in granted):
                    break
                reason = reason or next((u.reason for u in result.unplaced if inputs.version_of(u.model) == key),
                                        "no room")
            if cut[key] < totals[key]:
                held[key] = reason + (f"; the room went first to {', '.join(before)} (further from their latency "
                                      "objective)" if before else "")
            if key in claims.urgent:
                before.append(f"model {vs.name}")
        return cut, held

    def unhealthy_devices(self) -> set[str]:
        """Leaf devices that read unhealthy: lost to the driver, or given up on by gpud (a crash-looping worker)."""
        return {d.id for d in self.devices.leaf_devices() if not self.devices.sample(d.id).healthy}

    def instances_on_unhealthy_devices(self) -> int:
        """Live instances on unhealthy devices: the controller re-plans while there are any."""
        lost = self.unhealthy_devices()
        return sum(1 for v in self._live() for i in v.instances if i.device_id in lost)

    async def retire(self, versions: Sequence[RegisteredVersion], *, drain_timeout_s: float = 30.0) -> None:
        """Unload `versions`, which requests no longer reach (an unload, or a reload's old versions): each
        finishes what it accepted (queued requests failed after `drain_timeout_s`), then its instances stop. Their
        memory counts as used until then."""
        self._retiring += versions
        try:
            for vs in versions:
                vs.state = ModelState.UNLOADING
                try:
                    await asyncio.wait_for(vs.scheduler.wait_idle(), drain_timeout_s)
                except TimeoutError:
                    vs.scheduler.fail_all_queued(f"model '{vs.name}' version {vs.version} is being unloaded")
                async with self.lock:
                    for inst in list(vs.instances):
                        await self._stop(vs, inst)
        finally:
            self._retiring = [v for v in self._retiring if v not in versions]

    # --- requested placements -------------------------------------------------------------------------------------
    async def apply_requested(self, requested: Sequence[RequestedPlacement]) -> Applied:
        """Make the named model versions' instances exactly `requested` (versions not named are untouched), in the
        order `placement.diff` gives, make-before-break. Refused before anything changes (InferenceError) when a
        request is malformed or the placement does not fit; if a load fails, everything is rolled back."""
        async with self.lock:
            named = resolve_versions(requested, self.registry, {d.id for d in self.devices.leaf_devices()})
            inputs = self.inputs(list(named.values()))
            desired = desired_assignments(inputs, requested, named)
            check_allowed(inputs, desired, {(v.name, v.version) for v in named.values()})
            check_fits(inputs, desired)
            moves = diff(inputs.current, desired, inputs.devices, inputs.demands)
            stuck = [m for m in moves if m.note == "needs room freed by other steps"]
            if stuck:
                m = stuck[0]
                raise InferenceError(ErrorKind.INVALID_ARGUMENT, f"placement not applied: no order of steps keeps "
                                     f"every model serving: '{m.model}' instance {m.instance} has no room on "
                                     f"{m.to_device} until other instances it waits for have moved; nothing changed")
            steps = await self._apply(inputs, moves, atomic=True)
            for vs in set(named.values()):
                vs.state = ModelState.READY if vs.instances else ModelState.UNAVAILABLE
                if vs.instances:
                    vs.reason = ""
            return Applied(tuple(PlacedInstance(s.model, s.version, s.index, s.to_device) for s in steps
                                 if s.to_device is not None),
                           tuple(PlacedInstance(s.model, s.version, s.index, s.from_device) for s in steps
                                 if s.from_device is not None))

    # --- applying steps -------------------------------------------------------------------------------------------
    async def _apply(self, inputs: PlacementInputs, moves: Sequence[Move], *, atomic: bool,
                     stop_at_failure: bool = False, staged: Sequence[RegisteredVersion] = ()) -> list[Step]:
        """Carry out `moves` in order and say what each did; consecutive adds on different devices load at once
        (load_waves). A failed load: atomic, every step done so far is undone in reverse and InferenceError raised;
        else it is a Step with its error, and the rest goes on (or, with `stop_at_failure`, stops: later steps may
        count on room this one was to free). `staged`: versions not in the registry yet (a reload's), which the
        moves of their model and version are for."""
        undo: list[Callable[[], Awaitable[None]]] = []
        steps: list[Step] = []
        lost = {d.id for d in inputs.devices if not d.healthy}
        by_key = {(v.name, v.version): v for v in staged}
        for wave in load_waves(moves):
            started = []
            for mv in wave:
                key, index = inputs.instance(Assignment(mv.model, mv.instance, ""))
                vs = by_key.get((key.model, key.version)) or self.registry.version(key.model, key.version)
                started.append((mv, vs, index, Step(mv.kind, vs.name, vs.version, index, mv.from_device,
                                                    mv.to_device)))
            if wave[0].kind == "remove":
                mv, vs, index, step = started[0]
                await self._remove(vs, index, mv.from_device, undo)
                steps.append(step)
                continue
            for mv, vs, index, _ in started:
                log.info("model %s version %s instance %d -> device %s%s (%.1f MiB)", vs.name, vs.version, index,
                         mv.to_device, f" (from {mv.from_device})" if mv.from_device else "",
                         vs.footprint_bytes() / 2**20)
            # An add or a move has a destination (placement.diff).
            loaded = await asyncio.gather(*(self._start(vs, index, mv.to_device or "")
                                            for mv, vs, index, _ in started))
            if atomic and not all(inst.ready for inst in loaded):
                # Roll back: the node stays as it was, the wave's loaded ones too.
                undo += [partial(self._stop, vs, inst) for (_, vs, _, _), inst in zip(started, loaded) if inst.ready]
                for done in reversed(undo):
                    await done()
                (mv, vs, index, _), inst = next((s, i) for s, i in zip(started, loaded) if not i.ready)
                raise InferenceError(ErrorKind.UNAVAILABLE, f"placement not applied: instance {index} of "
                                     f"'{vs.name}' could not load on {mv.to_device}: {inst.error}; nothing changed")
            failed = False
            for (mv, vs, index, step), inst in zip(started, loaded):
                if inst.ready:
                    undo.append(partial(self._stop, vs, inst))
                    if mv.kind == "move":  # make-before-break: the new one serves, now the old one goes
                        await self._remove(vs, index, mv.from_device, undo)
                    steps.append(step)
                    continue
                steps.append(replace(step, error=inst.error or "not ready"))
                # A move off a lost device frees no room a later step counts on: the other recoveries go on.
                failed = failed or not recovering(mv, lost)
            if failed and stop_at_failure:
                break
        return steps

    async def _remove(self, vs: RegisteredVersion, index: int, device: str | None, undo: list) -> None:
        old = next((i for i in vs.instances if i.index == index and i.device_id == device), None)
        if old is None:
            return
        await self._stop(vs, old)
        log.info("model %s version %s instance %d on %s stopped", vs.name, vs.version, index, device)

        async def restore() -> None:
            again = await self._start(vs, index, old.device_id)
            if not again.ready:  # the node cannot be put back exactly: say so, loudly
                log.error("rolling back: instance %d of model %s version %s could not be restarted on %s: %s",
                          index, vs.name, vs.version, old.device_id, again.error)
        undo.append(restore)

    async def _start(self, vs: RegisteredVersion, index: int, device: str) -> InstanceHandle:
        """Load one instance of `vs` on `device`; once it is ready it serves. `inst.error` says why it is not."""
        footprint = vs.footprint_bytes()
        key = f"{vs.name}:{vs.version}:{index}"
        if any(i.key == key for i in vs.instances):  # its predecessor still serves (make-before-break)
            key += f"@{device}"
        key = self._free_key(key, device)
        inst = InstanceHandle(key=key, model=vs.name, version=vs.version, index=index, device_id=device,
                              model_path=vs.model_path, config=vs.entry.config, estimate_bytes=footprint)
        # Promised memory counts as used while the load runs, so nothing else is planned into it.
        self._loading[device] = self._loading.get(device, 0) + footprint
        try:
            await self.pool.load_instance(inst, self._worker_device(device))
        finally:
            self._loading[device] -= footprint
        if inst.ready:
            self._changes += 1
            vs.loaded_unix_s = self.wall_clock()
            vs.scheduler.add_instance(inst)  # it serves from now on
        return inst

    def _free_key(self, key: str, device: str) -> str:
        """`key`, or key#2, #3...: one not in use on the device's worker (the same version of a model being
        reloaded: its predecessor serves there until this one is ready)."""
        taken = self.pool.instance_keys(device)
        n, free = 1, key
        while free in taken:
            n += 1
            free = f"{key}#{n}"
        return free

    def _worker_device(self, device_id: str) -> WorkerDevice:
        d = next(d for d in self.devices.leaf_devices() if d.id == device_id)
        return WorkerDevice(d.id, d.kind, d.uuid, d.simulated)

    async def _stop(self, vs: RegisteredVersion, inst: InstanceHandle) -> None:
        """No new batches go to `inst`; its worker unloads it after the batch it may be running."""
        self._changes += 1
        vs.scheduler.remove_instance(inst)
        await self.pool.unload_instance(inst)


def load_waves(moves: Sequence[Move]) -> list[list[Move]]:
    """`moves` in waves that may run at once: a run of consecutive adds on different devices (each one's room was
    counted with the ones before it, and nothing between them frees room), every other step alone. A device's
    loads stay one at a time: its worker measures each instance's footprint as the memory its load took."""
    waves: list[list[Move]] = []
    for m in moves:
        last = waves[-1] if waves else None
        if m.kind == "add" and last is not None and last[0].kind == "add" and \
                all(w.to_device != m.to_device for w in last):
            last.append(m)
        else:
            waves.append([m])
    return waves


def adds_in_order(moves: Sequence[Move], rank: Callable[[Move], int]) -> list[Move]:
    """`moves` with each run of consecutive adds sorted by `rank` (stable): an add never passes the removal or move
    before it, whose room it may count on."""
    out: list[Move] = []
    run: list[Move] = []
    for m in [*moves, None]:
        if m is not None and m.kind == "add":
            run.append(m)
            continue
        out += sorted(run, key=rank)
        run = []
        if m is not None:
            out.append(m)
    return out


def _config_counts(versions: Sequence[RegisteredVersion]) -> dict[GroupKey, int]:
    return {GroupKey(v.name, v.version, k): g.count for v in versions
            for k, g in enumerate(v.entry.config.instance_groups)}
