"""The placement controller's decisions, as pure functions of (policy, state, observation, now): how many instances
each model version should run, and why. `gpud.scaling.controller` feeds them and applies the result through the
placement service; nothing here does I/O or reads a clock.

Rules, per model version, each interval:
1. The wanted count is the autoscaling hint's `desired_instances` (gpud.scaling.hints: the HPA rule over queue time and
   load, already stabilized: a need for more must last the scale-up window, a lull the scale-down window). Without a
   hint yet (its first rate window), the wanted count is the current one: only the bounds are enforced.
2. The target is the wanted count clamped to the version's bounds: `gpud_min_instances` (default: its instance_group
   counts, so by default gpud never runs fewer instances than configured) and `gpud_max_instances` (default: none;
   the node's room is the limit, found by the planner).
3. No removal within `scale_down_cooldown_seconds` of this version's last added instance (by default the hints'
   scale-down window): an instance is never added and removed within one stabilization window, so the controller
   cannot flap. A scale-down removes at most `scale_down_max_ratio` of the running instances (at least one), then
   the next one waits the same cooldown (as HPA's scale-down policies): the hint's load estimate comes from the
   batches the current instances form, and a step at a time lets the next estimate see the larger batches before
   more capacity goes. Adding is held back only after a failed load: the next try waits interval x 2^(failures - 1),
   at most `max_retry_seconds` (the failed step itself was rolled back by the service: the old instance serves on).
4. Scale to zero: a version whose minimum is 0 (`gpud_min_instances: 0`) and that has had no request for
   `idle_unload_seconds` goes to 0 instances (reason idle); its next request loads it again (a cold start, the
   placement service's). Otherwise such a version keeps at least one instance: a hint never takes it to zero.
The reason of a change says which rule made it: scale_up / scale_down (the hint, with its own reason; objective_up /
objective_down when the version's latency objective drove the hint, its detail naming it), min_instances
/ max_instances (the bounds), idle, and for steps the planner adds, make_room (a move that lets more fit),
device_lost and evicted (an idle instance unloaded to make room for a scale-up, or a spare one of a version whose
latency objective holds with margin, for one that misses its own: gpud.scaling.priority).

Which idle instances a load may evict is gpud.scaling.idle's rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpud.executor.model_config import MAX_INSTANCES as MAX_INSTANCES_PARAMETER
from gpud.executor.model_config import MIN_INSTANCES as MIN_INSTANCES_PARAMETER
from gpud.scaling.bounds import InstanceBounds

ScalingMode = Literal["off", "advise", "on"]
SCALING_MODES: tuple[ScalingMode, ...] = ("off", "advise", "on")

Reason = Literal["scale_up", "scale_down", "objective_up", "objective_down", "min_instances", "max_instances",
                 "hold", "idle", "make_room", "device_lost", "evicted"]
OBJECTIVE_HINT = "objective "  # how a hint driven by a latency objective begins its reason (gpud.scaling.hints)


@dataclass(frozen=True)
class ScalingPolicy:
    interval_seconds: float = 10.0
    max_steps_per_interval: int = 4  # adds, removals and moves applied per interval (the rest waits)
    scale_down_cooldown_seconds: float = 300.0  # after an add, no removal of the version's instances for this long
    max_retry_seconds: float = 300.0  # the longest wait before trying again to add after failed loads
    idle_unload_seconds: float = 300.0  # a version with minimum 0 and no request for this long goes to 0 instances
    scale_down_max_ratio: float = 0.5  # one scale-down step removes at most this share of the instances (at least 1)

    def __post_init__(self) -> None:
        if not self.interval_seconds > 0:
            raise ValueError(f"control interval must be > 0 seconds, got {self.interval_seconds}")
        if self.max_steps_per_interval < 1:
            raise ValueError(f"max steps per interval must be >= 1, got {self.max_steps_per_interval}")
        if not self.scale_down_cooldown_seconds >= 0:
            raise ValueError(f"scale-down cooldown must be >= 0 seconds, got {self.scale_down_cooldown_seconds}")
        if not self.idle_unload_seconds > 0:
            raise ValueError(f"idle unload must be > 0 seconds, got {self.idle_unload_seconds}")
        if not 0 < self.scale_down_max_ratio <= 1:
            raise ValueError(f"scale-down max ratio must be in (0, 1], got {self.scale_down_max_ratio}")


@dataclass(frozen=True)
class VersionObservation:
    model: str
    version: str
    instances: int  # live instances now (ready or not)
    bounds: InstanceBounds
    desired: int | None  # the hint; None before its first window
    hint_reason: str = ""
    idle_s: float | None = None  # seconds without a request (nothing queued or running); None: in use now
    objective_s: float | None = None  # its latency objective (gpud.executor.objective), if it has one
    load_s: float | None = None  # how long one of its instances took to load (its cold start); None: not known


@dataclass(frozen=True)
class VersionState:
    last_added_s: float | None = None  # when the controller last added an instance of this version
    failed_loads: int = 0  # loads that failed in a row
    retry_after_s: float | None = None  # no add before this time (back-off after a failed load)
    last_removed_s: float | None = None  # when the controller last scaled this version down


@dataclass(frozen=True)
class Target:
    model: str
    version: str
    current: int
    target: int
    reason: Reason
    detail: str  # for people: the rule and its numbers


def decide_target(policy: ScalingPolicy, state: VersionState, obs: VersionObservation, now_s: float) -> Target:
    lo, hi = obs.bounds.minimum, obs.bounds.maximum
    n = obs.instances
    wanted = n if obs.desired is None else obs.desired

    def out(target: int, reason: Reason, detail: str) -> Target:
        return Target(obs.model, obs.version, n, target, reason, detail)

    # The bounds first: they hold whatever the hint says, and a cooldown does not delay them.
    if hi is not None and n > hi:
        return out(hi, "max_instances", f"{n} running, {MAX_INSTANCES_PARAMETER} is {hi}")
    if n < lo and wanted <= lo and (state.retry_after_s is None or now_s >= state.retry_after_s):
        return out(lo, "min_instances", f"{n} running, {MIN_INSTANCES_PARAMETER} is {lo}")
    if lo == 0 and n > 0 and obs.idle_s is not None and obs.idle_s >= policy.idle_unload_seconds:
        if obs.objective_s is not None and (obs.load_s is None or obs.load_s > obs.objective_s):
            # Its next request would wait out a cold start far past the objective: unloading would break it.
            return out(n, "hold", f"idle {obs.idle_s:.0f} s, but kept: a cold start "
                                  f"({'unmeasured' if obs.load_s is None else f'{obs.load_s:.1f} s'}) would miss "
                                  f"its latency objective of {obs.objective_s * 1e3:g} ms")
        return out(0, "idle", f"no request for {obs.idle_s:.0f} s (>= {policy.idle_unload_seconds:g} s, "
                              f"{MIN_INSTANCES_PARAMETER} is 0): unloaded until its next request")
    floor = lo if lo > 0 or n == 0 else 1  # to zero only when idle (above), never on a hint
    target = max(floor, wanted if hi is None else min(wanted, hi))
    if target > n and state.retry_after_s is not None and now_s < state.retry_after_s:
        return out(n, "hold", f"wants {target}, but {state.failed_loads} load(s) failed in a row; next try in "
                              f"{state.retry_after_s - now_s:.0f} s")
    by_objective = obs.hint_reason.startswith(OBJECTIVE_HINT)  # the version's latency objective, not the queue
    if target > n:
        return out(target, "objective_up" if by_objective else "scale_up", obs.hint_reason or f"hint {wanted}")
    if target < n:
        cooldown = policy.scale_down_cooldown_seconds
        since = None if state.last_added_s is None else now_s - state.last_added_s
        if since is not None and since < cooldown:
            return out(n, "hold", f"hint {wanted}, but an instance was added {since:.0f} s ago "
                                  f"(no removal within {cooldown:g} s of an add)")
        since = None if state.last_removed_s is None else now_s - state.last_removed_s
        if since is not None and since < cooldown:
            return out(n, "hold", f"hint {wanted}, but instances were removed {since:.0f} s ago "
                                  f"(one scale-down step per {cooldown:g} s)")
        step = max(1, int(n * policy.scale_down_max_ratio))
        detail = obs.hint_reason or f"hint {wanted}"
        if target < n - step:
            target, detail = n - step, f"{detail}; {step} of {n} at a time"
        return out(target, "objective_down" if by_objective else "scale_down", detail)
    return out(n, "hold", "at target" if obs.desired is not None else "no hint yet (first rate window)")


def after_added(state: VersionState, now_s: float) -> VersionState:
    return VersionState(last_added_s=now_s)


def after_removed(state: VersionState, now_s: float) -> VersionState:
    """A scale-down step was taken: the next waits scale_down_cooldown_seconds."""
    return VersionState(state.last_added_s, state.failed_loads, state.retry_after_s, last_removed_s=now_s)


def after_failed_load(policy: ScalingPolicy, state: VersionState, now_s: float) -> VersionState:
    """Back off: the k-th failure in a row waits interval x 2^(k-1) seconds, at most max_retry_seconds."""
    failures = state.failed_loads + 1
    wait_s = min(policy.max_retry_seconds, policy.interval_seconds * 2 ** (failures - 1))
    return VersionState(state.last_added_s, failures, now_s + wait_s, state.last_removed_s)
