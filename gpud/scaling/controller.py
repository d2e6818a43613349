"""The placement controller in the daemon: every interval it reads the core's snapshot and the autoscaling hints,
turns them into a target count per model version (gpud.scaling.rules, pure), and has the placement service re-plan
and carry out the difference, make-before-break, at most `max_steps_per_interval` steps at a time. Instances of a lost
device (the driver's, or a crash-looping worker's) are put back elsewhere at once, whatever the cap and the cooldowns
(recovery, not scaling: gpud.placing.recovery).

Modes (`--placement-control`): `on` applies; `advise` plans the same steps, logs and exports them as not applied, and
changes nothing; `off` runs no loop. Every step is logged with its reason, counted in
`gpud_placement_actions_total{action,reason,applied}`, and kept with the last ones for `gpudctl inspect`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from gpud.scaling.plan import NO_CLAIMS, Claims, ScalingPlan, Spare, Step
from gpud.scaling.priority import ObjectiveStanding, room_order, spare_order
from gpud.scaling.bounds import InstanceBounds
from gpud.scaling.hints import HintDecision
from gpud.scaling.idle import idle_seconds
from gpud.scaling.rules import (ScalingMode, ScalingPolicy, Reason, Target, VersionObservation, VersionState,
                                after_added, after_failed_load, after_removed, decide_target)
from gpud.telemetry.serving import SnapshotSource

log = logging.getLogger("gpud.controller")  # the name operators filter on (before gpud.scaling)

Key = tuple[str, str]  # (model, version)

# The steps each reason can make (see ScalingController._record): their counters are exported at 0 from the start,
# so that a dashboard tells "no action yet" from "no controller", and rate() sees the first step.
ACTION_REASONS: tuple[tuple[str, Reason], ...] = (
    ("add", "scale_up"), ("add", "objective_up"), ("add", "min_instances"), ("add", "make_room"),
    ("remove", "scale_down"), ("remove", "objective_down"), ("remove", "max_instances"), ("remove", "idle"),
    ("remove", "evicted"),
    ("remove", "device_lost"), ("remove", "make_room"),
    ("move", "make_room"), ("move", "device_lost"),
)
REFUSALS = ("no_room", "load_failed")
HintsSource = Callable[[], Mapping[Key, HintDecision]]
StandingsSource = Callable[[], Mapping[Key, ObjectiveStanding]]


class Placer(Protocol):
    """What the loop needs of the placement service."""

    async def rescale(self, totals: Mapping[Key, int], *, max_steps: int, apply: bool,
                      evict_idle_s: float | None = None, claims: Claims = NO_CLAIMS) -> ScalingPlan: ...

    def instances_on_unhealthy_devices(self) -> int: ...


@dataclass(frozen=True)
class ScalingAction:
    """One step the controller took (or, in advise mode, would have taken), for inspect."""

    time_unix_s: float
    action: str  # add | remove | move
    model: str
    version: str
    instance: int
    from_device: str | None
    to_device: str | None
    reason: Reason
    detail: str
    applied: bool
    error: str = ""


def urgent_scale_ups(hints: Mapping[Key, HintDecision], standings: Mapping[Key, ObjectiveStanding],
                     running: Mapping[Key, int]) -> list[Key]:
    """Pure: the running versions missing their latency objective whose hint asks for more instances than they run."""
    return [k for k, n in running.items()
            if k in hints and hints[k].desired_instances > n and k in standings and standings[k].missing]


class ScalingController(Collector):
    """The placement controller: every interval, hints -> targets (gpud.scaling.rules) -> the placement service's
    rescale; its steps, counters and targets for inspect and Prometheus."""

    def __init__(self, snapshot: SnapshotSource, hints: HintsSource, placement: Placer, policy: ScalingPolicy,
                 mode: ScalingMode, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, history: int = 50,
                 registry: CollectorRegistry | None = None, standings: StandingsSource = dict):
        self.snapshot = snapshot
        self.hints = hints
        self.standings = standings
        self.placement = placement
        self.policy = policy
        self.mode = mode
        self.clock = clock
        self.wall_clock = wall_clock
        self._states: dict[Key, VersionState] = {}
        self.targets: list[Target] = []
        self.decisions: deque[ScalingAction] = deque(maxlen=history)
        self.actions: Counter[tuple[str, str, str]] = Counter()  # (action, reason, applied) -> steps
        self.refused: Counter[str] = Counter()  # why a plan left something undone -> plans
        self.plans = 0
        self.last_plan_unix_s: float | None = None
        self._last_unplaced: tuple = ()
        self._wake = asyncio.Event()
        self._woken_s: dict[Key, float] = {}  # when a version last woke the controller (once per interval each)
        if registry is not None:
            registry.register(self)

    async def run(self) -> None:
        """Tick every interval, or sooner when woken (`wake_if_urgent`); cancel to stop. A failing tick is logged
        and the next one runs."""
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.policy.interval_seconds)
            except TimeoutError:
                pass
            self._wake.clear()  # here, not before the wait: a wake during the tick makes the next one at once
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - the controller must not die of one bad interval
                log.exception("placement control: the interval failed")

    def wake_if_urgent(self) -> list[Key]:
        """After each sample of the hints: a version missing its latency objective that is hinted more instances
        than it runs makes the controller tick now instead of at the interval's end (a ramp's every second counts).
        Each version wakes it at most once per interval, so one that cannot grow (no room, its max) does not make
        it plan at every sample. The versions that woke it."""
        now = self.clock()
        interval = self.policy.interval_seconds
        running = {(v.model, v.version): len(v.instances) for v in self.snapshot().versions() if v.instances}
        keys = [k for k in urgent_scale_ups(self.hints(), self.standings(), running)
                if now - self._woken_s.get(k, -interval) >= interval]
        if keys:
            self._woken_s.update((k, now) for k in keys)
            self._woken_s = {k: t for k, t in self._woken_s.items() if now - t < interval}
            log.info("placement control: ticking now for %s (missing its latency objective, more instances hinted)",
                     ", ".join(f"{m} version {v}" for m, v in keys))
            self._wake.set()
        return keys

    async def tick(self) -> None:
        now = self.clock()
        wall_now = self.wall_clock()
        hints = self.hints()
        targets = []
        for v in self.snapshot().versions():
            if not v.instances:
                continue  # not loaded, its load failed, or scaled to zero (its next request loads it)
            key = (v.model, v.version)
            hint = hints.get(key)
            idle_s = idle_seconds(v.last_used_unix_s, v.pending_requests, wall_now)
            obs = VersionObservation(v.model, v.version, len(v.instances),
                                     InstanceBounds(v.min_instances, v.max_instances),
                                     None if hint is None else hint.desired_instances,
                                     "" if hint is None else hint.reason, idle_s,
                                     v.stats.objective_ns / 1e9 if v.stats.objective_ns else None,
                                     v.load_seconds)
            targets.append(decide_target(self.policy, self._states.get(key, VersionState()), obs, now))
        self.targets = targets
        self._states = {k: s for k, s in self._states.items() if any((t.model, t.version) == k for t in targets)}
        changes = {(t.model, t.version): t.target for t in targets if t.target != t.current}
        if not changes and not self.placement.instances_on_unhealthy_devices():
            return
        apply = self.mode == "on"
        # A scale-up with no room may evict instances idle for the scale-down window (least recently used first),
        # and one missing its latency objective the spare instances of versions whose objective holds with margin.
        plan = await self.placement.rescale(changes, max_steps=self.policy.max_steps_per_interval, apply=apply,
                                            evict_idle_s=self.policy.scale_down_cooldown_seconds,
                                            claims=self._claims(targets, now))
        self.plans += 1
        self.last_plan_unix_s = self.wall_clock()
        by_key = {(t.model, t.version): t for t in targets}
        for step in plan.steps:
            self._record(step, by_key.get((step.model, step.version)), plan, apply)
        if any(s.error for s in plan.steps):
            self.refused["load_failed"] += 1
        unplaced = tuple((u.model, u.version, u.index) for u in plan.unplaced)
        if unplaced:
            self.refused["no_room"] += 1
            if unplaced != self._last_unplaced:  # said once, not every interval
                for u in plan.unplaced:
                    log.warning("placement control: model %s version %s instance %d has no room: %s", u.model,
                                u.version, u.index, u.reason)
        self._last_unplaced = unplaced
        if plan.deferred:
            log.info("placement control: %d step(s) left for the next interval(s)", plan.deferred)

    def _claims(self, targets: Sequence[Target], now_s: float) -> Claims:
        """Room first for the versions furthest from their objective (gpud.scaling.priority.room_order), and the
        spare instances of those whose objective holds with margin (`_spare`)."""
        standings = self.standings()
        growing = [(t.model, t.version) for t in targets if t.target > t.current]
        if not standings or not growing:
            return NO_CLAIMS
        urgent = frozenset(k for k in growing if k in standings and standings[k].missing)
        return Claims(tuple(room_order(growing, standings)), urgent, self._spare(standings, targets, now_s))

    def spare_now(self) -> Spare:
        """The spare instances as of the last interval, for a cold start of a version with an objective (the
        placement service's spare_source); none unless the controller acts (mode on)."""
        if self.mode != "on":
            return {}
        return self._spare(self.standings(), self.targets, self.clock())

    def _spare(self, standings: Mapping[Key, ObjectiveStanding], targets: Sequence[Target],
               now_s: float) -> Spare:
        """Versions whose objective holds with margin with fewer instances, the most margin first, and how many each
        keeps (Claims.spare): never one that changes this interval, nor one with an instance added within the
        cooldown (never added and taken within one window: a scale-down's rule)."""
        cooldown = self.policy.scale_down_cooldown_seconds
        steady = [(t.model, t.version) for t in targets if t.target == t.current]
        spare: dict[Key, tuple[int, str]] = {}
        for key in spare_order({k: standings[k] for k in steady if k in standings}):
            added_s = self._states.get(key, VersionState()).last_added_s
            if added_s is not None and now_s - added_s < cooldown:
                continue
            s = standings[key]
            keep = s.instances - s.spare_instances
            spare[key] = (keep, f"{s.describe()}; with {keep} instance(s) it would be predicted at "
                          + ("an unknown latency" if s.spare_predicted_s is None
                             else f"{s.spare_predicted_s * 1e3:.1f} ms"))
        return spare

    def _record(self, step: Step, target: Target | None, plan: ScalingPlan, apply: bool) -> None:
        if step.evicted_for:
            reason: Reason = "evicted"
            detail = (f"spare ({step.evicted_why})" if step.evicted_why else "idle, least recently used") + \
                f": room for model {step.evicted_for}"
        elif step.from_device in plan.unhealthy_devices:
            reason = "device_lost"
            detail = f"device {step.from_device} is unhealthy"
        elif step.kind == "move":
            reason = "make_room"
            detail = f"moved to make room for model {step.room_for}" if step.room_for else \
                "moved so that more instances fit"
        elif target is not None:
            reason, detail = target.reason, target.detail
        else:
            reason, detail = "make_room", "part of the re-plan"
        applied = apply and not step.error
        self.decisions.append(ScalingAction(self.wall_clock(), step.kind, step.model, step.version, step.index,
                                       step.from_device, step.to_device, reason, detail, applied, step.error))
        self.actions[(step.kind, reason, "true" if applied else "false")] += 1
        key = (step.model, step.version)
        # Windows count from when the plan's steps were done (loads can take minutes), not from the tick's start: an
        # instance that began serving late is not removed early.
        now_s = self.clock()
        if reason == "device_lost":
            pass  # recovery, not scaling: no cooldown starts, no back-off (the next interval tries again)
        elif applied and step.kind in ("add", "move"):
            self._states[key] = after_added(self._states.get(key, VersionState()), now_s)
        elif applied and reason in ("scale_down", "objective_down"):
            self._states[key] = after_removed(self._states.get(key, VersionState()), now_s)
        elif step.error:
            self._states[key] = after_failed_load(self.policy, self._states.get(key, VersionState()), now_s)
        where = (f"{step.from_device or '-'} -> {step.to_device or '-'}")
        if step.error:
            log.error("placement control: %s model %s version %s instance %d %s failed (%s: %s): %s", step.kind,
                      step.model, step.version, step.index, where, reason, detail, step.error)
        else:
            log.info("placement control%s: %s model %s version %s instance %d %s (%s: %s)",
                     "" if apply else " (advise: not applied)", step.kind, step.model, step.version, step.index,
                     where, reason, detail)

    # --- views ---------------------------------------------------------------------------------------------------
    def inspect(self) -> dict[str, Any]:
        return {"mode": self.mode, "policy": asdict(self.policy), "plans": self.plans,
                "last_plan_unix_s": self.last_plan_unix_s,
                "targets": [asdict(t) for t in self.targets],
                "decisions": [asdict(d) for d in self.decisions],
                "refused": dict(self.refused)}

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def _families(self) -> tuple[CounterMetricFamily, CounterMetricFamily, CounterMetricFamily, GaugeMetricFamily,
                                 GaugeMetricFamily]:
        return (
            CounterMetricFamily("gpud_placement_actions", "Steps of the placement controller, by action (add, remove, "
                                "move), reason and whether they were applied (advise mode: false).",
                                labels=("action", "reason", "applied")),
            CounterMetricFamily("gpud_placement_plans", "Re-plans the placement controller made."),
            CounterMetricFamily("gpud_placement_plans_refused", "Re-plans that left something undone, by why: "
                                "no_room (a target does not fit), load_failed.", labels=("reason",)),
            GaugeMetricFamily("gpud_placement_last_plan_timestamp_seconds", "When the controller last re-planned "
                              "(Unix time)."),
            GaugeMetricFamily("gpud_placement_target_instances", "The controller's target instance count.",
                              labels=("model", "version")),
        )

    def collect(self) -> Iterable[Metric]:
        actions, plans, refused, last, targets = fams = self._families()
        # Every step the current mode can take is exported, at 0 until taken (a reload may change the mode).
        applied = "true" if self.mode == "on" else "false"
        for key in sorted(self.actions.keys() | {(a, r, applied) for a, r in ACTION_REASONS}):
            actions.add_metric(list(key), self.actions[key])
        plans.add_metric([], self.plans)
        for reason in sorted(self.refused.keys() | set(REFUSALS)):
            refused.add_metric([reason], self.refused[reason])
        if self.last_plan_unix_s is not None:
            last.add_metric([], self.last_plan_unix_s)
        for t in self.targets:
            targets.add_metric([t.model, t.version], float(t.target))
        return fams
