"""gpud.scaling.rules: the pure per-version decision (target count and its reason)."""
from __future__ import annotations

import pytest

from gpud.scaling.rules import (ScalingPolicy, VersionObservation, VersionState, after_added, after_failed_load,
    after_removed, decide_target)
from gpud.scaling.idle import EvictionCandidate, eviction_order
from gpud.scaling.bounds import InstanceBounds

POLICY = ScalingPolicy(interval_seconds=10, max_steps_per_interval=4, scale_down_cooldown_seconds=300)
NOW = 1000.0


def obs(instances: int, desired: int | None, lo: int = 1, hi: int | None = None, why: str = "hint says so"):
    return VersionObservation("m", "1", instances, InstanceBounds(lo, hi), desired, why)


class TestDecideTarget:
    @pytest.mark.parametrize("instances, desired, lo, hi, target, reason", [
        (1, 3, 1, None, 3, "scale_up"),  # hint 3 > 1 running, no maximum
        (1, 6, 1, 4, 4, "scale_up"),  # min(6, max 4) = 4
        (4, 1, 1, None, 2, "scale_down"),  # no add in the cooldown: towards the hint, 4 // 2 = 2 at a time
        (3, 1, 2, None, 2, "scale_down"),  # max(min 2, hint 1) = 2 (3 - 1: within one step of 3 // 2 = 1)
        (2, 2, 1, None, 2, "hold"),  # at target
        (1, None, 1, None, 1, "hold"),  # no hint yet: the current count stands
        (0, None, 2, None, 2, "min_instances"),  # below the minimum with no hint: up to 2
        (1, 1, 3, None, 3, "min_instances"),  # the hint wants 1, the minimum 3
        (1, 5, 3, None, 5, "scale_up"),  # below the minimum, but the hint wants more: the hint's reason
        (6, 6, 1, 4, 4, "max_instances"),  # above the maximum: down to it, whatever the hint
        (6, None, 1, 4, 4, "max_instances"),
    ])
    def test_target_and_reason(self, instances, desired, lo, hi, target, reason):
        t = decide_target(POLICY, VersionState(), obs(instances, desired, lo, hi), NOW)
        assert (t.current, t.target, t.reason) == (instances, target, reason)

    def test_scale_up_carries_the_hints_reason(self):
        t = decide_target(POLICY, VersionState(), obs(1, 2, why="queue 30.0 ms > target 10.0 ms"), NOW)
        assert t.detail == "queue 30.0 ms > target 10.0 ms"

    @pytest.mark.parametrize("added_ago_s, target, reason", [
        (0.0, 4, "hold"),  # just added: 0 < 300 s, no removal
        (299.0, 4, "hold"),  # 299 < 300
        (300.0, 2, "scale_down"),  # 300 >= 300: the window has passed; 4 // 2 = 2 go at once
    ])
    def test_no_removal_within_the_cooldown_of_an_add(self, added_ago_s, target, reason):
        state = after_added(VersionState(), NOW - added_ago_s)
        t = decide_target(POLICY, state, obs(4, 1), NOW)
        assert (t.target, t.reason) == (target, reason)

    def test_a_scale_down_takes_half_then_waits_the_cooldown(self):
        # 8 running, hint 1: 8 // 2 = 4 go (8 -> 4); 299 s later nothing (a step per 300 s); at 300 s 4 // 2 = 2 more
        # (4 -> 2); then 2 -> 1 (max(1, 2 // 2) = 1)
        state = VersionState()
        t = decide_target(POLICY, state, obs(8, 1), NOW)
        assert (t.target, t.reason) == (4, "scale_down") and t.detail == "hint says so; 4 of 8 at a time"
        state = after_removed(state, NOW)
        t = decide_target(POLICY, state, obs(4, 1), NOW + 299)
        assert (t.target, t.reason) == (4, "hold") and "one scale-down step per 300 s" in t.detail
        assert decide_target(POLICY, state, obs(4, 1), NOW + 300).target == 2
        assert decide_target(POLICY, after_removed(state, NOW + 300), obs(2, 1), NOW + 600).target == 1

    def test_a_scale_down_ratio_of_one_goes_to_the_hint_at_once(self):
        policy = ScalingPolicy(scale_down_cooldown_seconds=300, scale_down_max_ratio=1.0)
        assert decide_target(policy, VersionState(), obs(8, 1), NOW).target == 1
        with pytest.raises(ValueError, match="scale-down max ratio must be in"):
            ScalingPolicy(scale_down_max_ratio=0)

    def test_adding_is_never_held_back(self):
        state = after_added(VersionState(), NOW)  # an add this very second
        assert decide_target(POLICY, state, obs(2, 5), NOW).target == 5

    def test_the_maximum_is_not_delayed_by_the_cooldown(self):
        state = after_added(VersionState(), NOW)
        t = decide_target(POLICY, state, obs(6, 6, hi=4), NOW)
        assert (t.target, t.reason) == (4, "max_instances")

    def test_no_flapping_under_an_oscillating_hint(self):
        # The hint alternates 4, 1, 4, 1 every interval: instances go up at once and never come down within the
        # cooldown; no instance is added and removed within one window.
        state, n, history = VersionState(), 1, []
        for k in range(30):  # 30 intervals of 10 s = 300 s
            now = NOW + 10 * k
            t = decide_target(POLICY, state, obs(n, 4 if k % 2 == 0 else 1), now)
            if t.target > n:
                state = after_added(state, now)
            n = t.target
            history.append(n)
        assert history == [4] * 30  # up at the first interval, held for the rest of the 300 s window


class TestPolicy:
    @pytest.mark.parametrize("kwargs, message", [
        ({"interval_seconds": 0}, "interval"), ({"max_steps_per_interval": 0}, "max steps"),
        ({"scale_down_cooldown_seconds": -1}, "cooldown"),
    ])
    def test_refused(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            ScalingPolicy(**kwargs)


class TestBackOff:
    def test_a_failed_load_holds_adds_back_then_retries(self):
        # interval 10 s: the 1st failure waits 10 s, the 2nd 20 s, the 3rd 40 s
        state = after_failed_load(POLICY, VersionState(), NOW)
        assert (state.failed_loads, state.retry_after_s) == (1, NOW + 10)
        held = decide_target(POLICY, state, obs(1, 3), NOW + 5)
        assert (held.target, held.reason) == (1, "hold") and "next try in 5 s" in held.detail
        assert decide_target(POLICY, state, obs(1, 3), NOW + 10).target == 3  # 10 s later: try again
        state = after_failed_load(POLICY, state, NOW + 10)
        assert state.retry_after_s == NOW + 10 + 20
        state = after_failed_load(POLICY, state, NOW + 30)
        assert state.retry_after_s == NOW + 30 + 40

    def test_the_wait_is_capped(self):
        state = VersionState()
        for _ in range(20):
            state = after_failed_load(POLICY, state, NOW)
        assert state.retry_after_s == NOW + 300  # 10 * 2**19 s capped at max_retry_seconds

    def test_a_success_clears_the_back_off(self):
        state = after_added(after_failed_load(POLICY, VersionState(), NOW), NOW + 10)
        assert (state.failed_loads, state.retry_after_s) == (0, None)

    def test_removals_are_not_held_by_the_back_off(self):
        state = after_failed_load(POLICY, VersionState(), NOW)
        assert decide_target(POLICY, state, obs(4, 1), NOW + 1).target == 2  # 4 // 2 at a time


class TestScaleToZero:
    """gpud_min_instances 0: to zero after idle_unload_seconds without a request, never on a hint alone."""

    IDLE = ScalingPolicy(interval_seconds=10, scale_down_cooldown_seconds=300, idle_unload_seconds=60)

    @pytest.mark.parametrize("instances, desired, lo, idle_s, target, reason", [
        (1, 1, 0, 60.0, 0, "idle"),  # 60 s without a request >= 60 s: unloaded
        (2, 1, 0, 600.0, 0, "idle"),  # every instance goes, whatever the hint
        (1, 1, 0, 59.0, 1, "hold"),  # 59 < 60: stays
        (1, 0, 0, 30.0, 1, "hold"),  # a hint of 0 does not take it to zero: only idleness does
        (1, 1, 0, None, 1, "hold"),  # requests queued or running: not idle
        (1, 1, 1, 600.0, 1, "hold"),  # minimum 1: never unloaded for idleness
        (3, 1, 0, 10.0, 2, "scale_down"),  # in use: towards the hint (floor 1), max(1, 3 // 2) = 1 at a time
    ])
    def test_idle_unload(self, instances, desired, lo, idle_s, target, reason):
        o = VersionObservation("m", "1", instances, InstanceBounds(lo, None), desired, "hint", idle_s)
        t = decide_target(self.IDLE, VersionState(), o, NOW)
        assert (t.target, t.reason) == (target, reason)

    def test_idle_unload_ignores_the_cooldown_of_an_add(self):
        # an instance added (a cold start) and then unused for the idle time: idleness is the longer window here
        o = VersionObservation("m", "1", 1, InstanceBounds(0, None), 1, "", 60.0)
        assert decide_target(self.IDLE, after_added(VersionState(), NOW - 60), o, NOW).target == 0

    def test_a_non_positive_idle_time_is_refused(self):
        with pytest.raises(ValueError, match="idle unload must be > 0"):
            ScalingPolicy(idle_unload_seconds=0)


def cand(model: str, last_used_s: float, *, index: int = 0, busy: bool = False, n: int = 1, lo: int = 0,
         footprint: int = 100) -> EvictionCandidate:
    return EvictionCandidate(model, "1", index, "gpu0", footprint, last_used_s, busy, n, lo)


class TestEvictionOrder:
    def test_least_recently_used_first(self):
        order = eviction_order([cand("b", 20.0), cand("a", 10.0), cand("c", 30.0)])
        assert [c.model for c in order] == ["a", "b", "c"]

    def test_busy_versions_and_minimums_are_kept(self):
        order = eviction_order([cand("busy", 1.0, busy=True),  # requests waiting: never
                                cand("min1", 2.0, lo=1),  # 1 instance, minimum 1: never
                                cand("two", 3.0, index=0, n=2, lo=1), cand("two", 3.0, index=1, n=2, lo=1),
                                cand("idle", 4.0)])
        # of "two" (2 running, minimum 1) one may go: the highest index
        assert [(c.model, c.index) for c in order] == [("two", 1), ("idle", 0)]

    def test_the_larger_goes_first_among_equally_old(self):
        order = eviction_order([cand("small", 5.0, footprint=10), cand("large", 5.0, footprint=1000)])
        assert [c.model for c in order] == ["large", "small"]
