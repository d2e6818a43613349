"""The planner: filters with reasons, scores, reservations, plans, re-plans and their diffs, and properties."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gpud.placement.framework import NodeState, score_least_allocated, score_most_allocated, scorer_for
from gpud.placement.model import (
    Assignment, Constraints, ConstraintUnmet, Device, InsufficientResource, ModelDemand, compute_units,
    parse_memory_bytes,
)
from gpud.placement.solver import PlannerConfig, count_moves, diff, plan, relabel
from tests.fakes import FakeClock

GiB = 2**30
HEUR = PlannerConfig(time_limit_seconds=0)  # constructive heuristics only: deterministic and fast


# fluent-ish builders, as in the scheduler's MakePod()/MakeNode()
def gpu(id_, mem_gib=80, compute=1.0, **kw) -> Device:
    return Device(id_, mem_gib * GiB, compute, **kw)


def model(name, mem_gib, n=1, compute=0.0, **cons) -> ModelDemand:
    return ModelDemand(name, int(mem_gib * GiB), instances=n, compute_fraction=compute,
                       constraints=Constraints(**cons) if cons else Constraints())


class TestModel:
    @pytest.mark.parametrize("text,expected", [
        ("80GiB", 80 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), (1200000000, 1200000000),
        ("1.2GiB", 1288490189),  # ceil(1.2 * 2**30) = ceil(1288490188.8)
    ])
    def test_parse_memory(self, text, expected):
        assert parse_memory_bytes(text) == expected

    @pytest.mark.parametrize("bad", ["80 parsecs", "-1GiB", True, [1]])
    def test_parse_memory_rejects(self, bad):
        with pytest.raises(ValueError, match="x.memory"):
            parse_memory_bytes(bad, "x.memory")

    def test_demand_validation_names_the_model(self):
        with pytest.raises(ValueError, match=r"model 'm': need 0 <= min_instances \(3\) <= instances \(2\)"):
            ModelDemand("m", 1, instances=2, min_instances=3)

    def test_compute_units_of_mig_slices(self):
        assert compute_units(3 / 7) == 428571  # round(0.428571.. * 1e6)


class TestFilter:
    def test_insufficient_memory_reason_carries_numbers(self):
        state = NodeState([gpu("g0", 10)])
        state.reserve(model("a", 6), 0, "g0")
        reasons = state.filter_device(model("b", 5), "g0")
        # requested 5 GiB, used 6 GiB, capacity 10 GiB -> free 4 GiB
        assert reasons == [InsufficientResource("memory", 5 * GiB, 6 * GiB, 10 * GiB)]
        assert reasons[0].free == 4 * GiB

    def test_reserve_reduces_capacity(self):
        state = NodeState([gpu("g0", 10)], memory_reserve_bytes=1 * GiB)  # 10 - 1 = 9 GiB usable
        assert state.filter_device(model("a", 9), "g0") == []
        assert state.filter_device(model("a", 9.5), "g0")[0].capacity == 9 * GiB

    def test_constraints_each_give_a_reason(self):
        dev = Device("m0", 10 * GiB, 1 / 7, kind="mig", healthy=False, labels={"gpu.model": "A100"})
        demand = model("a", 1, kinds=frozenset({"gpu"}), labels=(("gpu.model", ("H100",)),))
        reasons = NodeState([dev]).filter_device(demand, "m0")
        assert [r.constraint for r in reasons] == ["health", "kind", "label:gpu.model"]

    def test_compute_filter(self):
        state = NodeState([Device("m0", 10 * GiB, 1 / 7, kind="mig")])
        # requested 0.2 GPU = 200000 units > 1/7 = 142857 units
        assert state.filter_device(model("a", 1, compute=0.2), "m0") == [
            InsufficientResource("compute", 200000, 0, 142857)]

    def test_spread_filter(self):
        devs = [Device("g0/a", 10 * GiB, 0.5, kind="mig", parent_id="g0"),
                Device("g0/b", 10 * GiB, 0.5, kind="mig", parent_id="g0")]
        state = NodeState(devs)
        m = model("a", 1, n=2, spread=True)
        state.reserve(m, 0, "g0/a")
        assert state.filter_device(m, "g0/b") == [ConstraintUnmet(
            "spread", "model already has an instance on physical GPU 'g0'")]


class TestScoreAndReserve:
    def test_scores(self):
        state = NodeState([gpu("g0", 40)])
        state.reserve(model("a", 10), 0, "g0")
        # memory only: (10 + 20) / 40 = 0.75 -> 75; spread: 100 - 75 = 25
        assert score_most_allocated(state, model("b", 20), "g0") == pytest.approx(75.0)
        assert score_least_allocated(state, model("b", 20), "g0") == pytest.approx(25.0)
        # with compute: mean of memory (30/40 = 0.75) and compute (0.5/1.0 = 0.5) -> 62.5
        assert score_most_allocated(state, model("b", 20, compute=0.5), "g0") == pytest.approx(62.5)

    def test_unknown_strategy(self):
        with pytest.raises(ValueError, match="unknown strategy 'fastest'"):
            scorer_for("fastest")

    def test_unreserve_is_idempotent(self):
        state = NodeState([gpu("g0", 40)])
        state.reserve(model("a", 10), 0, "g0")
        state.unreserve("a", 0)
        state.unreserve("a", 0)
        assert state.used_memory["g0"] == 0 and state.where == {}


class TestPlan:
    def test_pack_uses_fewest_devices_and_proves_it(self):
        # 3 x 30 + 4 x 20 = 170 GiB over 80 GiB GPUs: ceil(170/80) = 3, and 3 is achievable
        p = plan([gpu(f"g{i}") for i in range(4)], [model("a", 30, 3), model("b", 20, 4)],
                 config=PlannerConfig(time_limit_seconds=1), clock=FakeClock())
        assert (p.devices_used, p.lower_bound, p.optimal) == (3, 3, True)

    def test_spread_uses_every_device(self):
        p = plan([gpu(f"g{i}") for i in range(4)], [model("a", 10, 4)],
                 config=PlannerConfig(strategy="spread", time_limit_seconds=0))
        assert sorted(a.device for a in p.placements) == ["g0", "g1", "g2", "g3"]
        assert p.optimal is False  # the pack objective is not what spread optimizes

    def test_multidimensional_compute_binds(self):
        # memory would fit 8 per GPU, compute 0.4 allows 2 per GPU: 5 instances -> ceil(5 * 0.4 / 1) = 2 by the
        # bound, but 2 per GPU -> 3 GPUs; the MIP (or greedy) finds 3
        p = plan([gpu(f"g{i}") for i in range(4)], [model("a", 10, 5, compute=0.4)],
                 config=PlannerConfig(time_limit_seconds=1), clock=FakeClock())
        assert p.devices_used == 3
        assert p.lower_bound <= 3

    def test_unplaceable_model_explains_every_device(self):
        devs = [gpu("g0", 80), Device("g1/mig0", 10 * GiB, 1 / 7, kind="mig", parent_id="g1")]
        p = plan(devs, [model("big", 100)], config=HEUR)
        (u,) = p.unplaced
        assert u.closest_device == "g0"
        assert "larger than any allowed device" in u.reason
        assert [r.device for r in u.rejections] == ["g0", "g1/mig0"]
        assert all(isinstance(r.reasons[0], InsufficientResource) for r in u.rejections)

    def test_too_few_devices_leaves_instances_unplaced(self):
        p = plan([gpu("g0", 10)], [model("a", 6, 2)], config=HEUR)
        assert len(p.placements) == 1 and len(p.unplaced) == 1
        assert "no allowed device has room left" in p.unplaced[0].reason

    def test_duplicate_models_rejected(self):
        with pytest.raises(ValueError, match="duplicate model names"):
            plan([gpu("g0")], [model("a", 1), model("a", 2)])


class TestReplan:
    def test_no_change_means_no_moves(self):
        devs = [gpu(f"g{i}") for i in range(3)]
        dem = [model("a", 30, 3), model("b", 20, 2)]
        first = plan(devs, dem, config=HEUR)
        again = plan(devs, dem, current=first.placements, config=HEUR)
        assert again.moves == () and set(again.placements) == set(first.placements)

    def test_device_lost_moves_only_its_instances(self):
        devs = [gpu(f"g{i}") for i in range(3)]
        cur = [Assignment("a", 0, "g0"), Assignment("a", 1, "g1"), Assignment("b", 0, "g2")]
        dem = [model("a", 30, 2, spread=True), model("b", 20, 1)]
        lost = [devs[0].__class__("g0", 80 * GiB, healthy=False), devs[1], devs[2]]
        p = plan(lost, dem, current=cur, config=HEUR)
        kinds = [(m.kind, m.model, m.instance) for m in p.moves]
        assert kinds[0] == ("remove", "a", 0)  # gone with the device, listed first
        assert ("add", "a", 0) in kinds and len(kinds) == 2
        assert {a.device for a in p.placements if a.model == "a"} == {"g1", "g2"}

    def test_scale_down_never_below_min(self):
        devs = [gpu("g0"), gpu("g1")]
        cur = [Assignment("a", i, f"g{i % 2}") for i in range(4)]
        dem = [ModelDemand("a", 10 * GiB, instances=2, min_instances=2)]
        p = plan(devs, dem, current=cur, config=HEUR)
        assert [m.kind for m in p.moves] == ["remove", "remove"]

    def test_moves_are_make_before_break_when_room(self):
        devs = [gpu("g0", 40), gpu("g1", 40), gpu("g2", 40)]
        cur = [Assignment("a", 0, "g0"), Assignment("b", 0, "g1")]
        new = [Assignment("a", 0, "g2"), Assignment("b", 0, "g0")]
        dem = [model("a", 30), model("b", 30)]
        moves = diff(cur, new, devs, dem)
        # b -> g0 needs a's space; a -> g2 must go first
        assert [(m.model, m.to_device) for m in moves] == [("a", "g2"), ("b", "g0")]
        assert all(m.make_before_break for m in moves)

    def test_swap_cycle_breaks_when_model_above_min(self):
        # a (30 GiB) on g0 and b (30 GiB) on g1 swap places on 40 GiB GPUs: neither target has room first.
        # a has a second instance on g2 and min 1, so a[0] may stop first (2 - 1 = 1 >= 1); then b fits on g0.
        devs = [gpu("g0", 40), gpu("g1", 40), gpu("g2", 40)]
        cur = [Assignment("a", 0, "g0"), Assignment("a", 1, "g2"), Assignment("b", 0, "g1")]
        new = [Assignment("a", 0, "g1"), Assignment("a", 1, "g2"), Assignment("b", 0, "g0")]
        dem = [ModelDemand("a", 30 * GiB, 2, min_instances=1), model("b", 30)]
        moves = diff(cur, new, devs, dem)
        assert [(m.kind, m.model, m.to_device) for m in moves] == [
            ("remove", "a", None), ("move", "b", "g0"), ("add", "a", "g1")]
        assert moves[0].make_before_break is False and moves[1].make_before_break is True

    def test_move_current_off_places_only_into_the_room_left(self):
        # a (30) on g0 and b (30) on g1, 40 GiB each, and g2 with 10 GiB: c (15) fits nowhere, moved or not.
        devs = [gpu("g0", 40), gpu("g1", 40), gpu("g2", 10)]
        cur = [Assignment("a", 0, "g0"), Assignment("b", 0, "g1")]
        dem = [model("a", 30), model("b", 30), model("c", 15)]
        p = plan(devs, dem, current=cur, config=PlannerConfig(time_limit_seconds=0, move_current=False))
        # a and b keep their devices; c (15) fits nowhere: 40 - 30 = 10 free on g0 and g1, 10 on g2
        assert {(a.model, a.device) for a in p.placements} == {("a", "g0"), ("b", "g1")}
        assert [u.model for u in p.unplaced] == ["c"] and p.moves == ()
        # allowed to move, it still cannot: every device has at most 40 and a + c = 45, b + c = 45
        p2 = plan(devs, dem, current=cur, config=PlannerConfig(time_limit_seconds=0, move_current=True))
        assert [u.model for u in p2.unplaced] == ["c"]

    def test_move_current_on_moves_to_make_room(self):
        # g0 (40) holds a (20); g1 (40) holds b (20): c (30) fits only on a device emptied by moving a next to b.
        devs = [gpu("g0", 40), gpu("g1", 40)]
        cur = [Assignment("a", 0, "g0"), Assignment("b", 0, "g1")]
        dem = [model("a", 20), model("b", 20), model("c", 30)]
        kept = plan(devs, dem, current=cur, config=PlannerConfig(time_limit_seconds=0, move_current=False))
        assert [u.model for u in kept.unplaced] == ["c"] and kept.moves == ()  # 40 - 20 = 20 < 30 on both
        moved = plan(devs, dem, current=cur, config=PlannerConfig(time_limit_seconds=0, move_current=True))
        assert not moved.unplaced  # a and b share one device (20 + 20 = 40), c takes the other
        assert len(moved.moves) == 2 and {m.kind for m in moved.moves} == {"add", "move"}

    def test_relabel_keeps_devices(self):
        cur = [Assignment("a", 0, "g0"), Assignment("a", 1, "g1")]
        new = [Assignment("a", 0, "g1"), Assignment("a", 1, "g0")]
        assert count_moves(cur, relabel(cur, new)) == 0


# -------------------------------------------------------------------------------------------------------------
# properties

@st.composite
def problems(draw):
    n_gpu = draw(st.integers(1, 4))
    devices = []
    for g in range(n_gpu):
        if draw(st.booleans()):
            devices.append(Device(f"g{g}", draw(st.integers(10, 80)) * GiB, 1.0, "gpu",
                                  healthy=draw(st.booleans()) or g == 0, labels={"zone": draw(st.sampled_from("ab"))}))
        else:
            for k in range(draw(st.integers(1, 3))):
                devices.append(Device(f"g{g}/m{k}", draw(st.integers(5, 40)) * GiB, draw(st.sampled_from([1, 2, 3])) / 7,
                                      "mig", labels={"zone": "a"}, parent_id=f"g{g}"))
    demands = []
    for m in range(draw(st.integers(1, 4))):
        cons = Constraints(kinds=frozenset(draw(st.sampled_from([(), ("gpu",), ("mig",)]))),
                           labels=draw(st.sampled_from([(), (("zone", ("a",)),)])), spread=draw(st.booleans()))
        demands.append(ModelDemand(f"m{m}", draw(st.integers(1, 30)) * GiB, instances=draw(st.integers(0, 4)),
                                   compute_fraction=draw(st.sampled_from([0.0, 0.1, 0.25])), constraints=cons))
    return devices, demands


def _check_plan(devices, demands, p):
    by_id = {d.id: d for d in devices}
    by_name = {d.name: d for d in demands}
    state = NodeState(devices)
    for a in p.placements:
        d = by_name[a.model]
        assert a.device in by_id, a
        reasons = state.filter_device(d, a.device)
        assert reasons == [], (a, reasons)
        state.reserve(d, a.instance, a.device)
    keys = [(a.model, a.instance) for a in p.placements] + [(u.model, u.instance) for u in p.unplaced]
    assert sorted(keys) == sorted((d.name, i) for d in demands for i in range(d.instances))
    assert p.lower_bound <= p.devices_used
    assert p.devices_used == len({a.device for a in p.placements})


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(["pack", "spread"]))
def test_property_plans_respect_capacity_and_constraints(problem, strategy):
    devices, demands = problem
    p = plan(devices, demands, config=PlannerConfig(strategy=strategy, time_limit_seconds=0.05), clock=FakeClock(step=0.001))
    _check_plan(devices, demands, p)


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.data())
def test_property_replan_moves_no_more_than_scratch(problem, data):
    devices, demands = problem
    first = plan(devices, demands, config=HEUR)
    # new demand: change instance counts, maybe lose a device
    new_demands = [ModelDemand(d.name, d.memory_bytes, instances=data.draw(st.integers(0, 4)),
                               compute_fraction=d.compute_fraction, constraints=d.constraints) for d in demands]
    lose = data.draw(st.integers(-1, len(devices) - 1))
    new_devices = [Device(d.id, d.memory_bytes, d.compute_fraction, d.kind, False, d.labels, d.parent_id)
                   if k == lose else d for k, d in enumerate(devices)]
    re = plan(new_devices, new_demands, current=first.placements, config=HEUR)
    _check_plan(new_devices, new_demands, re)
    scratch = plan(new_devices, new_demands, config=HEUR)
    if not scratch.unplaced:
        assert not re.unplaced
        assert count_moves(first.placements, re.placements) <= count_moves(
            first.placements, relabel(first.placements, scratch.placements))
    # the diff never takes a model below its minimum: replay it
    live = {}
    healthy = {d.id for d in new_devices if d.healthy}
    for a in first.placements:
        if a.device in healthy:
            live[a.model] = live.get(a.model, 0) + 1
    mins = {d.name: d.min_instances for d in new_demands}
    for mv in re.moves:
        if mv.kind == "remove" and mv.from_device in healthy:
            live[mv.model] -= 1
            assert live[mv.model] >= mins.get(mv.model, 0)
        elif mv.kind == "add":
            live[mv.model] = live.get(mv.model, 0) + 1
