"""Room for one instance by a few make-before-break moves (gpud.placement.shortcut, pure) and how the placement
service's interval uses it (gpud.placing.shortcuts, pure): an add the re-plan leaves behind a re-pack starts after
one or two moves that can each be made now."""
from __future__ import annotations

import asyncio

from gpud.placement import Assignment, Constraints, Device, ModelDemand, Move, Plan
from gpud.placement.shortcut import room_by_few_moves
from gpud.placing.inputs import GroupKey, PlacementInputs
from gpud.placing.shortcuts import shortcuts, then_what_still_fits, unreached_adds
from tests.test_placement_service import node, register_all, where  # noqa: F401  (node: the fixture)

GIB = 2**30


def gpu(name: str, gib: int = 40, **kw) -> Device:
    return Device(name, gib * GIB, **kw)


def demand(name: str, gib: int, **kw) -> ModelDemand:
    return ModelDemand(name, gib * GIB, instances=kw.pop("instances", 4), **kw)


def at(*placed: tuple[str, int, str]) -> list[Assignment]:
    return [Assignment(m, i, d) for m, i, d in placed]


def test_an_instance_that_fits_somewhere_now_needs_no_move():
    found = room_by_few_moves([gpu("g0", 10), gpu("g1")], [demand("big", 20)], at(), "big", 0)
    assert found is not None and found.moves == () and found.add == Move("add", "big", 0, to_device="g1")


def test_one_move_makes_room_the_moved_instance_starting_elsewhere_first():
    devices = [gpu("g0"), gpu("g1")]
    demands = [demand("big", 30), demand("small", 15), demand("other", 20)]
    # g0: small (15) + 15 free; g1: other (20) + 20 free. big (30) fits nowhere; small fits in g1's 20.
    found = room_by_few_moves(devices, demands, at(("small", 0, "g0"), ("other", 0, "g1")), "big", 1)
    assert found is not None
    assert [(m.kind, m.model, m.instance, m.from_device, m.to_device, m.make_before_break) for m in found.steps] == [
        ("move", "small", 0, "g0", "g1", True), ("add", "big", 1, None, "g0", True)]
    assert found.moved_bytes == 15 * GIB


def test_the_fewest_moves_then_the_least_memory_moved():
    devices = [gpu("g0"), gpu("g1"), gpu("spare", 25)]
    demands = [demand("big", 30), demand("a", 12), demand("b", 12), demand("c", 15)]
    # g0: a + b, 16 free: big needs both gone (two moves); g1: c alone, 25 free: one move.
    found = room_by_few_moves(devices, demands, at(("a", 0, "g0"), ("b", 0, "g0"), ("c", 0, "g1")), "big", 0)
    assert found is not None and [(m.model, m.from_device) for m in found.moves] == [("c", "g1")]
    # Two one-move ways: the smaller instance moves.
    demands = [demand("big", 30), demand("a", 12), demand("c", 14)]
    found = room_by_few_moves(devices, demands, at(("a", 0, "g0"), ("c", 0, "g1")), "big", 0)
    assert found is not None and [m.model for m in found.moves] == ["a"] and found.moved_bytes == 12 * GIB


def test_two_moves_to_one_target_count_together():
    devices = [gpu("g0"), gpu("g1", 20)]
    demands = [demand("big", 30), demand("a", 12), demand("b", 12)]
    # g0 holds a and b (16 free): big needs both gone, but g1 (20) takes only one of them.
    assert room_by_few_moves(devices, demands, at(("a", 0, "g0"), ("b", 0, "g0")), "big", 0) is None
    devices[1] = gpu("g1", 24)
    found = room_by_few_moves(devices, demands, at(("a", 0, "g0"), ("b", 0, "g0")), "big", 0)
    assert found is not None and len(found.moves) == 2 and found.add.to_device == "g0"


def test_no_short_way_is_none_and_kept_versions_do_not_move():
    devices = [gpu("g0"), gpu("g1"), gpu("g2", 16)]
    demands = [demand("big", 30), demand("small", 15), demand("other", 28)]
    current = at(("small", 0, "g0"), ("other", 0, "g1"))
    found = room_by_few_moves(devices, demands, current, "big", 0)  # small to g2, then big on g0
    assert found is not None and [(m.model, m.to_device) for m in found.moves] == [("small", "g2")]
    assert room_by_few_moves(devices, demands, current, "big", 0, keep={"small"}) is None
    assert room_by_few_moves(devices, demands, current, "big", 0, max_moves=0) is None
    # Three moves would do it; two are the most.
    demands = [demand("big", 38), demand("a", 5), demand("b", 5), demand("c", 5)]
    current = at(("a", 0, "g0"), ("b", 0, "g0"), ("c", 0, "g0"))
    assert room_by_few_moves([gpu("g0"), gpu("g1", 20)], demands, current, "big", 0) is None


def test_constraints_hold_for_the_added_and_the_moved():
    devices = [gpu("g0"), gpu("g1"), gpu("g2", 16)]
    current = at(("small", 0, "g0"), ("other", 0, "g1"))
    # `small` may only run on g0: it cannot make room there by going to g2.
    pinned = Constraints(devices=frozenset({"g0"}))
    demands = [demand("big", 30), demand("small", 15, constraints=pinned), demand("other", 26)]
    assert room_by_few_moves(devices, demands, current, "big", 0) is None
    demands[1] = demand("small", 15)
    assert room_by_few_moves(devices, demands, current, "big", 0) is not None
    # `big` may only run on g1: g1's `other` must go, to g2 (30) since g0 has 25 free.
    devices = [gpu("g0"), gpu("g1"), gpu("g2", 30)]
    demands[0] = demand("big", 30, constraints=Constraints(devices=frozenset({"g1"})))
    found = room_by_few_moves(devices, demands, current, "big", 0)
    assert found is not None and [(m.model, m.to_device) for m in found.moves] == [("other", "g2")]
    assert found.add.to_device == "g1"
    # An unhealthy device is never a target.
    devices[2] = gpu("g2", 30, healthy=False)
    assert room_by_few_moves(devices, demands, current, "big", 0) is None


def inputs_of(devices, demands, current) -> PlacementInputs:
    groups = {d.name: GroupKey(d.name, "1", 0) for d in demands}
    return PlacementInputs(tuple(devices), tuple(demands), tuple(current), groups,
                           {k: 0 for k in groups.values()}, {k: n for n, k in groups.items()})


def test_the_interval_takes_the_shortcut_then_what_of_the_plan_still_fits():
    devices = [gpu("g0"), gpu("g1"), gpu("g2", 30)]
    demands = [demand("big", 30), demand("small", 15), demand("other", 20), demand("tiny", 5)]
    inputs = inputs_of(devices, demands, at(("small", 0, "g0"), ("other", 0, "g1"), ("tiny", 0, "g2"),
                                            ("tiny", 1, "g2")))
    # The re-plan: a re-pack whose moves come first, then big's add, stuck behind them.
    plan = [Move("move", "tiny", 0, "g2", "g1"), Move("move", "other", 0, "g1", "g2"),
            Move("remove", "tiny", 1, "g2"), Move("add", "tiny", 2, to_device="g2"),
            Move("add", "big", 0, to_device="g1", make_before_break=False, note="needs room freed by other steps")]
    todo = plan[:2]  # a cap of 2: the interval would spend it on moves
    waiting = unreached_adds(plan, todo, inputs.current)
    assert [(m.model, m.instance) for m in waiting] == [("tiny", 2), ("big", 0)]
    # A move the re-plan had to break (stopped, started again) is not a new instance waiting.
    broken = [Move("remove", "tiny", 1, "g2", make_before_break=False), Move("add", "tiny", 1, to_device="g0")]
    assert unreached_adds(broken, broken[:1], inputs.current) == []
    first = shortcuts(waiting, inputs, urgent=set(), rank=lambda m: 0 if m.model == "big" else 1, max_steps=4)
    # big first (its rank): small goes from g0 to g1 (15 of g1's 20 free; g2's 20 is no fuller), then big on g0;
    # tiny then fits on g0 as it is.
    assert [(m.kind, m.model, m.from_device, m.to_device) for m in first] == [
        ("move", "small", "g0", "g1"), ("add", "big", None, "g0"), ("add", "tiny", None, "g0")]
    # The plan's moves are dropped; its removal stays; its adds were taken by the shortcuts already.
    rest = then_what_still_fits(first, [m for m in plan if m.kind != "move"], inputs)
    assert rest == [*first, plan[2]]
    # What no longer fits after the shortcut is left out: g1 holds other and small now (35 of 40).
    assert then_what_still_fits(first, [Move("add", "other", 1, to_device="g1")], inputs) == first
    # Versions missing their objective are never moved to make room: none then.
    urgent = {("small", "1"), ("other", "1"), ("tiny", "1")}
    assert shortcuts([plan[4]], inputs, urgent=urgent, rank=lambda m: 0, max_steps=4) == []
    # The steps cap holds: a shortcut that would pass it is not taken.
    assert shortcuts([plan[4]], inputs, urgent=set(), rank=lambda m: 0, max_steps=1) == []


def test_rescale_starts_an_add_now_rather_than_spend_the_interval_on_the_re_plans_moves(node, monkeypatch):
    """The placement service with a scripted planner: the re-plan moves cnn off gpu0 first and adds mlp's second
    instance on gpu0 after it; with one step per interval the move would take the interval. The add has room as
    things are, so it is the interval's step and nothing moves."""
    repository, registry, pool, service = node
    asyncio.run(service.place(register_all(repository, registry)))
    assert where(registry) == {"mlp": [(0, "gpu0")], "cnn": [(0, "gpu0")]}
    pool.events.clear()

    async def scripted(inputs, config) -> Plan:
        name = {k.model: n for k, n in inputs.names.items()}
        return Plan((Assignment(name["cnn"], 0, "gpu1"), Assignment(name["mlp"], 0, "gpu0"),
                     Assignment(name["mlp"], 1, "gpu0")), (), 2, 1, False)

    monkeypatch.setattr(service, "_plan", scripted)
    # With room in the interval for both steps the re-plan is carried out as it is.
    dry = asyncio.run(service.rescale({("mlp", "1"): 2}, max_steps=2, apply=False))
    assert [(s.kind, s.model, s.index, s.to_device) for s in dry.steps] == [("move", "cnn", 0, "gpu1"),
                                                                           ("add", "mlp", 1, "gpu0")]
    dry = asyncio.run(service.rescale({("mlp", "1"): 2}, max_steps=1, apply=False))
    assert [(s.kind, s.model, s.index, s.to_device) for s in dry.steps] == [("add", "mlp", 1, "gpu0")]
    plan = asyncio.run(service.rescale({("mlp", "1"): 2}, max_steps=1, apply=True))
    assert [(s.kind, s.model, s.index, s.to_device, s.error) for s in plan.steps] == [("add", "mlp", 1, "gpu0", "")]
    assert [e[0] for e in pool.events] == ["load"] and where(registry)["cnn"] == [(0, "gpu0")]
