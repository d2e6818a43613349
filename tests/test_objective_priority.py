"""Priority under scarcity (issue 26 item 2): when the node cannot hold every version's target, the versions furthest
from their latency objective get the room first, and one missing its objective may take the spare instances of
versions whose objective holds with margin (gpud.scaling.priority, pure; gpud.placing.service.rescale's claims; the
controller's claims from the hints' standings)."""
from __future__ import annotations

import asyncio
import math

from prometheus_client import CollectorRegistry

from gpud.scaling.controller import ScalingController
from gpud.scaling.hints import SCALE_DOWN_LOAD_MARGIN, BatchLine, HintDecision, ModelObservation
from gpud.scaling.plan import Claims, ScalingPlan, Step
from gpud.scaling.priority import ObjectiveStanding, room_order, spare_order, standing_of
from gpud.scaling.rules import ScalingPolicy, VersionState
from gpud.scaling.tail import predicted_latency_s
from tests.fakes import FakeClock
from tests.serving_fakes import FakeServing, instance
from tests.test_placement_service import MIB
from tests.test_scale_to_zero import node

LINE = BatchLine(0.002, 0.0001)  # 2 ms + 0.1 ms a row


def observed(n: int, rate: float, attainment: float | None, objective_ms: float | None = 50.0,
             line: BatchLine | None = LINE) -> ModelObservation:
    return ModelObservation(ready_instances=n, arrival_rate_per_second=rate, throughput_per_instance_per_second=None,
                            queue_seconds=None, objective_seconds=None if objective_ms is None else objective_ms / 1e3,
                            objective_share=0.99, attainment=attainment, batch_line=line, max_batch_size=64)


def standing(shortfall: float = 0.0, predicted_ms: float | None = 10.0, spare: int = 0,
             spare_ms: float | None = None, instances: int = 3) -> ObjectiveStanding:
    return ObjectiveStanding(0.05, 0.99, 0.99 - shortfall, None if predicted_ms is None else predicted_ms / 1e3,
                             instances, spare, None if spare_ms is None else spare_ms / 1e3)


# --- pure ----------------------------------------------------------------------------------------------------------
def test_a_version_without_an_objective_has_no_standing():
    assert standing_of(observed(2, 100.0, None, objective_ms=None), 1) is None


def test_a_missed_objective_is_missing_and_has_nothing_spare():
    s = standing_of(observed(4, 100.0, 0.9), 1)
    assert s is not None and s.missing and math.isclose(s.shortfall, 0.09) and s.spare_instances == 0
    assert "attained 90.00%" in s.describe()


def test_a_held_objective_spares_what_the_margin_allows_and_never_below_the_floor():
    s = standing_of(observed(4, 100.0, 1.0), 1)  # 100 req/s: one instance's 99th percentile is ~4 ms of 50 ms
    assert s is not None and not s.missing and s.spare_instances == 3
    # the one kept meets the objective at 1.1 x the load (the hints' margin for fewer instances)
    assert predicted_latency_s(SCALE_DOWN_LOAD_MARGIN * 100.0, 1, LINE, 64) <= 0.05
    assert s.spare_predicted_s is not None and s.spare_predicted_s <= 0.05
    assert standing_of(observed(4, 100.0, 1.0), 3).spare_instances == 1  # its minimum holds
    assert standing_of(observed(4, 0.0, None), 0).spare_instances == 3  # no requests: all but one
    # Without batch times nothing is predicted: nothing is spare while it serves.
    assert standing_of(observed(4, 100.0, 1.0, line=None), 1).spare_instances == 0


def test_an_unreachable_objective_never_makes_a_version_urgent():
    # LINE: a lone request takes 2.1 ms; an objective of 2 ms is missed whatever the count
    s = standing_of(observed(1, 100.0, 0.0, objective_ms=2.0), 1)
    assert s is not None and not s.reachable and s.shortfall > 0 and not s.missing
    assert "unreachable" in s.describe()
    assert room_order([("plain", "1"), ("bad", "1")], {("bad", "1"): s}) == [("plain", "1"), ("bad", "1")]


def test_a_prediction_past_the_objective_is_missing_even_while_attained():
    s = standing_of(observed(1, 5000.0, 1.0, objective_ms=5.0), 1)
    assert s is not None and s.shortfall == 0 and s.slack < 0 and s.missing


def test_room_goes_first_to_the_furthest_below_its_share_then_the_least_slack_then_the_rest_in_order():
    standings = {("far", "1"): standing(shortfall=0.2), ("near", "1"): standing(shortfall=0.01),
                 ("late", "1"): standing(predicted_ms=80.0), ("later", "1"): standing(predicted_ms=math.inf),
                 ("fine", "1"): standing()}
    growing = [("plain", "1"), ("fine", "1"), ("late", "1"), ("near", "1"), ("later", "1"), ("far", "1")]
    assert room_order(growing, standings) == [("far", "1"), ("near", "1"), ("later", "1"), ("late", "1"),
                                              ("plain", "1"), ("fine", "1")]


def test_spare_instances_go_most_margin_first():
    standings = {("a", "1"): standing(spare=1, spare_ms=30.0), ("b", "1"): standing(spare=2, spare_ms=5.0),
                 ("c", "1"): standing(), ("d", "1"): standing(spare=1, spare_ms=None)}
    assert spare_order(standings) == [("d", "1"), ("b", "1"), ("a", "1")]
    assert spare_order(standings, exclude=[("b", "1")]) == [("d", "1"), ("a", "1")]


# --- the placement service -----------------------------------------------------------------------------------------
def test_when_one_more_fits_the_version_missing_its_objective_gets_it(tmp_path):
    # Room for three 6.8 MiB instances; mlp and cnn run one each and both want one more.
    def grow(first: tuple[str, str], where) -> tuple[list, list]:
        core, pool, _ = node(where, {"mlp": 1, "cnn": 1}, room_bytes=21 * MIB)
        other = ("mlp", "1") if first == ("cnn", "1") else ("cnn", "1")

        async def scenario() -> ScalingPlan:
            await core.start()
            return await core.placement.rescale({("mlp", "1"): 2, ("cnn", "1"): 2}, max_steps=4, apply=True,
                                                evict_idle_s=60.0, claims=Claims((first, other), frozenset([first])))
        plan = asyncio.run(scenario())
        return ([(s.kind, s.model) for s in plan.steps], [(u.model, u.reason) for u in plan.unplaced])

    steps, unplaced = grow(("cnn", "1"), tmp_path / "a")
    assert steps == [("add", "cnn")] and [m for m, _ in unplaced] == ["mlp"]
    assert "the room went first to model cnn (further from their latency objective)" in unplaced[0][1]
    steps, unplaced = grow(("mlp", "1"), tmp_path / "b")
    assert steps == [("add", "mlp")] and [m for m, _ in unplaced] == ["cnn"]


def spare_node(tmp_path, mlp_minimum: int):
    """Room for three instances: mlp runs two (busy: nothing idle to evict), cnn one and wants two."""
    core, pool, wall = node(tmp_path, {"mlp": mlp_minimum, "cnn": 1}, room_bytes=21 * MIB)
    asyncio.run(core.start())
    asyncio.run(core.placement.rescale({("mlp", "1"): 2}, max_steps=4, apply=True))
    assert len(core.registry.version("mlp").instances) == 2
    return core, pool


def test_a_version_missing_its_objective_takes_a_spare_instance_of_one_that_holds_its_with_margin(tmp_path):
    core, pool = spare_node(tmp_path, 1)
    claims = Claims((("cnn", "1"),), frozenset([("cnn", "1")]), {("mlp", "1"): (1, "mlp holds its objective")})
    plan = asyncio.run(core.placement.rescale({("cnn", "1"): 2}, max_steps=4, apply=True, evict_idle_s=60.0,
                                              claims=claims))
    assert [(s.kind, s.model, s.index, s.evicted_for, s.evicted_why) for s in plan.steps] == [
        ("remove", "mlp", 1, "cnn", "mlp holds its objective"), ("add", "cnn", 1, "", "")]
    assert len(core.registry.version("mlp").instances) == 1 and len(core.registry.version("cnn").instances) == 2
    assert core.registry.version("mlp").scheduler.stats.evictions == 1 and plan.unplaced == ()


def test_a_cold_start_with_an_objective_takes_a_spare_instance_and_one_without_does_not(tmp_path):
    def cold(objective_ns: int, where) -> tuple[list, str]:
        core, pool, wall = node(where, {"mlp": 1, "cnn": 0, "two_input": 1}, room_bytes=21 * MIB)
        asyncio.run(core.start())
        service = core.placement
        asyncio.run(service.rescale({("cnn", "1"): 0}, max_steps=4, apply=True))
        asyncio.run(service.rescale({("mlp", "1"): 2}, max_steps=4, apply=True))
        cnn = core.registry.version("cnn")
        assert not cnn.instances and len(core.registry.version("mlp").instances) == 2
        cnn.scheduler.stats.objective_ns = objective_ns
        cnn.estimate_bytes = 6 * MIB  # the 0.6 MiB left does not hold it
        service.spare_source = lambda: {("mlp", "1"): (1, "mlp holds its objective")}
        service._eviction_candidates = lambda vs, **kw: []  # mlp is busy: nothing idle to evict
        pool.events.clear()
        error = asyncio.run(service.cold_start(cnn))
        return [(e[0], e[1]) for e in pool.events], error

    events, error = cold(50_000_000, tmp_path / "a")
    assert error == "" and events == [("unload", "mlp:1:1"), ("load", "cnn:1:0")]
    events, error = cold(0, tmp_path / "b")
    assert events == [] and "no idle instance of another model to evict" in error


def test_spare_instances_go_only_to_a_version_missing_its_objective_and_never_below_a_minimum(tmp_path):
    spare = {("mlp", "1"): (1, "mlp holds its objective")}
    core, pool = spare_node(tmp_path / "a", 1)  # cnn grows by the queue target, not a missed objective
    plan = asyncio.run(core.placement.rescale({("cnn", "1"): 2}, max_steps=4, apply=True, evict_idle_s=60.0,
                                              claims=Claims((("cnn", "1"),), frozenset(), spare)))
    assert plan.steps == () and [u.model for u in plan.unplaced] == ["cnn"]
    core, pool = spare_node(tmp_path / "b", 2)  # mlp's minimum is 2: nothing of it is spare, whatever it says
    plan = asyncio.run(core.placement.rescale({("cnn", "1"): 2}, max_steps=4, apply=True, evict_idle_s=60.0,
                                              claims=Claims((("cnn", "1"),), frozenset([("cnn", "1")]), spare)))
    assert plan.steps == () and len(core.registry.version("mlp").instances) == 2


# --- the controller ------------------------------------------------------------------------------------------------
class ClaimsPlacer:
    """Records the claims; does nothing (or answers `plan`)."""

    def __init__(self) -> None:
        self.claims: list[Claims] = []
        self.plan = ScalingPlan((), (), 0, "test")

    async def rescale(self, totals, *, max_steps, apply, evict_idle_s=None, claims=Claims()):
        self.claims.append(claims)
        return self.plan

    def instances_on_unhealthy_devices(self) -> int:
        return 0


def controller(standings: dict):
    serving = FakeServing()
    for name, n in (("ranker", 1), ("encoder", 1), ("vision", 3), ("fresh", 2)):
        serving.version(name, instances=tuple(instance(i, "cpu", 2**20) for i in range(n)))
    hints = {("ranker", "1"): HintDecision(2, 2, 1, None, None, None, "objective 0.99 <= 50 ms: missed"),
             ("encoder", "1"): HintDecision(2, 2, 1, None, None, None, "queue 30 ms over target 10 ms")}
    placer, clock = ClaimsPlacer(), FakeClock(1000.0)
    loop = ScalingController(serving, lambda: hints, placer, ScalingPolicy(scale_down_cooldown_seconds=60), "on",
                             clock=clock, wall_clock=lambda: 1.7e9, registry=CollectorRegistry(),
                             standings=lambda: standings)
    return loop, placer, clock


def test_the_controller_claims_room_first_for_the_missed_objective_and_offers_the_spare_of_held_ones():
    standings = {("ranker", "1"): standing(shortfall=0.05), ("vision", "1"): standing(spare=2, spare_ms=20.0),
                 ("fresh", "1"): standing(spare=1, spare_ms=10.0)}
    loop, placer, clock = controller(standings)
    loop._states[("fresh", "1")] = VersionState(last_added_s=clock() - 30)
    asyncio.run(loop.tick())
    claims = placer.claims[0]
    assert claims.first == (("ranker", "1"), ("encoder", "1")) and claims.urgent == {("ranker", "1")}
    # fresh had an instance added 30 s ago (cooldown 60 s): not offered
    assert list(claims.spare) == [("vision", "1")] and claims.spare[("vision", "1")][0] == 1  # it keeps 1 of 3
    assert "with 1 instance(s) it would be predicted at 20.0 ms" in claims.spare[("vision", "1")][1]
    assert loop.spare_now() == claims.spare  # what a cold start of a version with an objective may take
    loop.mode = "advise"
    assert loop.spare_now() == {}


def test_without_objectives_the_controller_claims_nothing():
    loop, placer, _ = controller({})
    asyncio.run(loop.tick())
    assert placer.claims == [Claims()]


def test_a_spare_eviction_is_recorded_with_the_objective_that_allowed_it():
    loop, placer, _ = controller({("ranker", "1"): standing(shortfall=0.05)})
    placer.plan = ScalingPlan((Step("remove", "vision", "1", 2, "cpu", None, evicted_for="ranker",
                                    evicted_why="objective 0.99 <= 400 ms, attained 100.00%"),
                               Step("add", "ranker", "1", 1, None, "cpu")), (), 0, "test")
    asyncio.run(loop.tick())
    first = loop.decisions[0]
    assert (first.action, first.model, first.reason, first.detail) == (
        "remove", "vision", "evicted", "spare (objective 0.99 <= 400 ms, attained 100.00%): room for model ranker")
    assert loop.decisions[1].reason == "objective_up"
    assert loop.actions[("remove", "evicted", "true")] == 1


def test_under_the_cap_the_most_urgent_adds_go_first_but_never_before_the_removal_they_may_need():
    from gpud.placement import Move
    from gpud.placing.service import adds_in_order

    def mv(kind: str, model: str, k: int) -> Move:
        return Move(kind, model, k, "gpu0" if kind == "remove" else None, None if kind == "remove" else "gpu0")
    moves = [mv("add", "b", 0), mv("add", "a", 0), mv("remove", "c", 0), mv("add", "b", 1), mv("add", "a", 1)]
    rank = {"a": 0, "b": 1}
    assert [(m.kind, m.model) for m in adds_in_order(moves, lambda m: rank[m.model])] == [
        ("add", "a"), ("add", "b"), ("remove", "c"), ("add", "a"), ("add", "b")]


# --- an early tick: a version missing its objective with more instances hinted wakes the controller ----------------
def test_urgent_scale_ups_are_the_missing_versions_hinted_more_than_they_run():
    from gpud.scaling.controller import urgent_scale_ups

    hints = {("a", "1"): HintDecision(3, 3, 1, None, None, None, ""), ("b", "1"): HintDecision(2, 2, 2, None, None,
                                                                                                None, ""),
             ("c", "1"): HintDecision(4, 4, 1, None, None, None, ""), ("d", "1"): HintDecision(2, 2, 1, None, None,
                                                                                                None, "")}
    standings = {("a", "1"): standing(shortfall=0.05), ("b", "1"): standing(shortfall=0.05),
                 ("c", "1"): standing(spare=1, spare_ms=10.0)}
    running = {("a", "1"): 1, ("b", "1"): 2, ("c", "1"): 1, ("d", "1"): 1}
    # a: missing and hinted 3 > 1; b: hinted what it runs; c: its objective holds; d: no objective
    assert urgent_scale_ups(hints, standings, running) == [("a", "1")]


def test_a_missed_objective_wakes_the_controller_once_per_interval():
    loop, placer, clock = controller({("ranker", "1"): standing(shortfall=0.05)})
    assert loop.wake_if_urgent() == [("ranker", "1")] and loop._wake.is_set()
    loop._wake.clear()
    clock.advance(loop.policy.interval_seconds - 1)
    assert loop.wake_if_urgent() == [] and not loop._wake.is_set()  # it woke the controller this interval already
    clock.advance(1)
    assert loop.wake_if_urgent() == [("ranker", "1")]


def test_no_wake_without_a_missed_objective():
    loop, placer, clock = controller({("vision", "1"): standing(spare=2, spare_ms=20.0)})
    assert loop.wake_if_urgent() == [] and not loop._wake.is_set()


def test_woken_the_controller_ticks_before_its_interval_ends():
    loop, placer, clock = controller({("ranker", "1"): standing(shortfall=0.05)})
    loop.policy = ScalingPolicy(interval_seconds=3600.0)

    async def main() -> int:
        ticked = asyncio.get_running_loop().create_future()
        ticks = []

        async def tick() -> None:
            ticks.append(clock())
            if not ticked.done():
                ticked.set_result(None)

        loop.tick = tick
        runner = asyncio.create_task(loop.run())
        await asyncio.sleep(0)  # it waits for its interval
        assert ticks == []
        loop.wake_if_urgent()
        await asyncio.wait_for(ticked, 10)  # long before the hour
        runner.cancel()
        return len(ticks)

    assert asyncio.run(main()) == 1
