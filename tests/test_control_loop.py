"""gpud.scaling.controller: hints -> targets -> the placement service, with a scripted placer and a fake clock: what it asks
for, what it records (decisions, metrics, inspect), advise mode, and the cooldown across intervals."""
from __future__ import annotations

import asyncio
from prometheus_client import CollectorRegistry, generate_latest

from gpud.scaling.controller import ScalingController
from gpud.scaling.rules import ScalingPolicy
from gpud.scaling.plan import NO_CLAIMS, Claims, ScalingPlan, Step, Unplaced
from gpud.scaling.hints import HintDecision
from tests.fakes import FakeClock
from tests.promtool_check import promtool_check
from tests.serving_fakes import FakeServing, instance

POLICY = ScalingPolicy(interval_seconds=10, max_steps_per_interval=4, scale_down_cooldown_seconds=60)


def hint(desired: int, current: int = 1, reason: str = "queue 30.0 ms > target 10.0 ms") -> HintDecision:
    return HintDecision(desired, desired, current, None, desired, None, reason)


class ScriptedPlacer:
    """Does what it is asked: each requested count change becomes adds or removes on `cpu` (instance numbers follow
    the snapshot's), or, given `plan`, answers that."""

    def __init__(self, serving: FakeServing) -> None:
        self.serving = serving
        self.calls: list[tuple[dict, bool]] = []
        self.claims: list[Claims] = []
        self.unhealthy = 0
        self.plan: ScalingPlan | None = None
        self.clock: FakeClock | None = None
        self.load_s = 0.0

    async def rescale(self, totals, *, max_steps, apply, evict_idle_s=None, claims=NO_CLAIMS):
        self.calls.append((dict(totals), apply))
        self.claims.append(claims)
        if self.clock is not None:
            self.clock.now += self.load_s  # the steps' loads take time
        if self.plan is not None:
            return self.plan
        steps = []
        for (model, version), total in totals.items():
            v = self.serving.version(model, version)
            n = len(v.instances)
            if total > n:
                steps += [Step("add", model, version, i, None, "cpu") for i in range(n, total)]
            else:
                steps += [Step("remove", model, version, i, "cpu", None) for i in range(total, n)]
            if apply:
                v.instances = tuple(instance(i, "cpu", 2**20) for i in range(total))
        return ScalingPlan(tuple(steps[:max_steps]), (), max(0, len(steps) - max_steps), "replan:incremental")

    def instances_on_unhealthy_devices(self) -> int:
        return self.unhealthy


def setup(mode="on", hints=None):
    serving = FakeServing()
    serving.version("mlp", instances=(instance(0, "cpu", 2**20),))
    placer, clock, registry = ScriptedPlacer(serving), FakeClock(1000.0), CollectorRegistry()
    hints = {} if hints is None else hints
    loop = ScalingController(serving, lambda: hints, placer, POLICY, mode, clock=clock, wall_clock=lambda: 1.7e9,
                       registry=registry)
    return serving, placer, clock, registry, loop, hints


def test_no_hint_and_within_bounds_asks_for_nothing():
    _, placer, _, _, loop, _ = setup()
    asyncio.run(loop.tick())
    assert placer.calls == [] and loop.plans == 0
    assert [(t.model, t.current, t.target, t.reason) for t in loop.targets] == [("mlp", 1, 1, "hold")]


def test_a_hint_for_more_is_applied_with_its_reason():
    serving, placer, _, registry, loop, hints = setup()
    hints[("mlp", "1")] = hint(3)
    asyncio.run(loop.tick())
    assert placer.calls == [({("mlp", "1"): 3}, True)]
    assert [(d.action, d.instance, d.reason, d.applied) for d in loop.decisions] == [
        ("add", 1, "scale_up", True), ("add", 2, "scale_up", True)]
    assert loop.decisions[0].detail == "queue 30.0 ms > target 10.0 ms"
    value = registry.get_sample_value
    assert value("gpud_placement_actions_total", {"action": "add", "reason": "scale_up", "applied": "true"}) == 2
    assert value("gpud_placement_target_instances", {"model": "mlp", "version": "1"}) == 3
    assert value("gpud_placement_last_plan_timestamp_seconds") == 1.7e9


def test_no_removal_within_the_cooldown_after_an_add():
    serving, placer, clock, _, loop, hints = setup()
    hints[("mlp", "1")] = hint(3)
    asyncio.run(loop.tick())  # up to 3
    hints[("mlp", "1")] = hint(1, current=3, reason="load 0.0 req/s")
    clock.now += 50  # 50 s < 60 s cooldown
    asyncio.run(loop.tick())
    assert len(placer.calls) == 1 and loop.targets[0].reason == "hold"
    clock.now += 10  # 60 s: the window has passed; one step of at most 3 // 2 = 1 instance
    asyncio.run(loop.tick())
    assert placer.calls[-1] == ({("mlp", "1"): 2}, True)
    assert [d.action for d in loop.decisions][-2:] == ["add", "remove"]
    assert loop.decisions[-1].reason == "scale_down"
    hints[("mlp", "1")] = hint(1, current=2, reason="load 0.0 req/s")
    clock.now += 30  # the next step waits the cooldown again (60 s)
    asyncio.run(loop.tick())
    assert placer.calls[-1] == ({("mlp", "1"): 2}, True) and loop.targets[0].reason == "hold"
    clock.now += 30
    asyncio.run(loop.tick())
    assert placer.calls[-1] == ({("mlp", "1"): 1}, True)


def test_the_cooldown_counts_from_when_the_loads_were_done():
    # The add's loads take 40 s (tick at 1000, instances serve from 1040): a removal waits 60 s from 1040, not 1000.
    serving, placer, clock, _, loop, hints = setup()
    placer.clock, placer.load_s = clock, 40.0
    hints[("mlp", "1")] = hint(3)
    asyncio.run(loop.tick())
    assert clock.now == 1040.0
    placer.load_s = 0.0
    hints[("mlp", "1")] = hint(1, current=3, reason="load 0.0 req/s")
    clock.now = 1090.0  # 50 s after the loads were done (90 s after the tick began): still held
    asyncio.run(loop.tick())
    assert loop.targets[0].reason == "hold" and "added 50 s ago" in loop.targets[0].detail
    clock.now = 1100.0  # 60 s after: a scale-down step
    asyncio.run(loop.tick())
    assert loop.targets[0].reason == "scale_down"


def test_advise_asks_without_applying_and_says_so():
    _, placer, _, registry, loop, hints = setup(mode="advise")
    hints[("mlp", "1")] = hint(2)
    asyncio.run(loop.tick())
    assert placer.calls == [({("mlp", "1"): 2}, False)]
    assert [(d.action, d.applied) for d in loop.decisions] == [("add", False)]
    assert registry.get_sample_value("gpud_placement_actions_total",
                                     {"action": "add", "reason": "scale_up", "applied": "false"}) == 1
    asyncio.run(loop.tick())  # nothing changed, so it advises the same again (and no cooldown starts)
    assert len(placer.calls) == 2


def test_instances_on_a_lost_device_trigger_a_plan_and_are_recorded_as_device_lost():
    _, placer, _, registry, loop, _ = setup()
    placer.unhealthy = 1
    placer.plan = ScalingPlan((Step("remove", "mlp", "1", 0, "gpu1", None), Step("add", "mlp", "1", 0, None, "cpu")),
                              (), 0, "replan:incremental", frozenset({"gpu1"}))
    asyncio.run(loop.tick())
    assert placer.calls == [({}, True)]
    assert [(d.action, d.reason) for d in loop.decisions] == [("remove", "device_lost"), ("add", "hold")]


def test_no_room_and_failed_loads_are_counted_as_refusals():
    _, placer, _, registry, loop, hints = setup()
    hints[("mlp", "1")] = hint(9)
    placer.plan = ScalingPlan((Step("add", "mlp", "1", 1, None, "cpu", error="out of memory"),),
                              (Unplaced("mlp", "1", 8, "needs 80 GiB, no device has it"),), 0, "replan:incremental")
    asyncio.run(loop.tick())
    value = registry.get_sample_value
    assert value("gpud_placement_plans_refused_total", {"reason": "no_room"}) == 1
    assert value("gpud_placement_plans_refused_total", {"reason": "load_failed"}) == 1
    assert loop.decisions[0].error == "out of memory" and not loop.decisions[0].applied
    assert loop.inspect()["refused"] == {"load_failed": 1, "no_room": 1}


def test_bounds_from_the_snapshot():
    serving, placer, _, _, loop, _ = setup()
    serving.version("mlp").min_instances = 2  # gpud_min_instances: 2, one running, no hint yet
    asyncio.run(loop.tick())
    assert placer.calls == [({("mlp", "1"): 2}, True)] and loop.decisions[0].reason == "min_instances"


def test_exposition_passes_promtool():
    _, _, _, registry, loop, hints = setup()
    hints[("mlp", "1")] = hint(2)
    asyncio.run(loop.tick())
    promtool_check(generate_latest(registry))


def test_gpudctl_inspect_renders_the_controller():
    from gpud.cli.inspect import render_inspect

    _, _, _, _, loop, hints = setup(mode="advise")
    hints[("mlp", "1")] = hint(2)
    asyncio.run(loop.tick())
    data = {"server": {"version": "x"}, "device_source": "simulated", "devices": [], "models": [],
            "time_unix_s": 1.7e9 + 5, "controller": loop.inspect()}
    text = render_inspect(data)
    assert "CONTROLLER advise (plans are logged, not applied); every 10 s, at most 4 steps; last plan 5 s ago" in text
    assert "mlp" in text and "scale_up: queue 30.0 ms > target 10.0 ms" in text
    assert "add    mlp:1#1 - -> cpu  scale_up: queue 30.0 ms > target 10.0 ms  (not applied)" in text
    assert "CONTROLLER" not in render_inspect({k: v for k, v in data.items() if k != "controller"})


def test_a_failed_load_backs_off_before_trying_again():
    _, placer, clock, _, loop, hints = setup()
    hints[("mlp", "1")] = hint(2)
    placer.plan = ScalingPlan((Step("add", "mlp", "1", 1, None, "cpu", error="out of memory"),), (), 0, "x")
    asyncio.run(loop.tick())
    clock.now += 5  # within the first wait (one interval, 10 s)
    asyncio.run(loop.tick())
    assert len(placer.calls) == 1 and "next try in 5 s" in loop.targets[0].detail
    clock.now += 5
    asyncio.run(loop.tick())
    assert len(placer.calls) == 2  # 10 s after the failure: tried again


def test_the_counters_are_exported_at_zero_before_any_step():
    # A dashboard must tell "no step yet" from "no controller": every step the mode can take is a series from the
    # first scrape, at 0 (applied "true" in mode on, "false" in advise).
    for mode, applied in (("on", "true"), ("advise", "false")):
        _, _, _, registry, loop, _ = setup(mode)
        assert registry.get_sample_value("gpud_placement_actions_total",
                                         {"action": "add", "reason": "scale_up", "applied": applied}) == 0
        assert registry.get_sample_value("gpud_placement_actions_total",
                                         {"action": "remove", "reason": "idle", "applied": applied}) == 0
        for reason in ("no_room", "load_failed"):
            assert registry.get_sample_value("gpud_placement_plans_refused_total", {"reason": reason}) == 0
        assert registry.get_sample_value("gpud_placement_plans_total") == 0
        assert loop.inspect()["refused"] == {}  # inspect shows what happened, not the zeros


def test_a_step_adds_to_its_zero_series():
    _, _, _, registry, loop, hints = setup()
    hints[("mlp", "1")] = hint(3)
    asyncio.run(loop.tick())
    assert registry.get_sample_value("gpud_placement_actions_total",
                                     {"action": "add", "reason": "scale_up", "applied": "true"}) == 2
    assert registry.get_sample_value("gpud_placement_actions_total",
                                     {"action": "remove", "reason": "scale_down", "applied": "true"}) == 0


def test_putting_back_a_lost_devices_instance_starts_no_cooldown_and_no_back_off():
    # Recovery, not scaling: a move off a lost device (done, or failed) leaves the version's windows as they were.
    serving, placer, clock, _, loop, hints = setup()
    hints[("mlp", "1")] = hint(3)
    asyncio.run(loop.tick())  # up to 3 at 1000
    clock.now += 60  # the cooldown after that add is over
    placer.unhealthy = 1
    placer.plan = ScalingPlan((Step("move", "mlp", "1", 0, "gpu1", "cpu"),
                               Step("move", "mlp", "1", 1, "gpu1", "cpu", error="out of memory")),
                              (), 0, "replan:incremental", frozenset({"gpu1"}))
    asyncio.run(loop.tick())
    assert [(d.action, d.reason, d.applied) for d in loop.decisions][-2:] == [("move", "device_lost", True),
                                                                              ("move", "device_lost", False)]
    placer.plan, placer.unhealthy = None, 0
    hints[("mlp", "1")] = hint(1, current=3, reason="load 0.0 req/s")
    asyncio.run(loop.tick())
    assert loop.targets[0].reason == "scale_down" and placer.calls[-1] == ({("mlp", "1"): 2}, True)
