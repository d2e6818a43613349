"""Room for one instance by a few make-before-break moves (gpud.placement.shortcut, pure) and how the placement
service's interval uses it (gpud.placing.shortcuts, pure; PlacementService.rescale): an add the re-plan leaves behind
a re-pack starts after one or two moves that can each be made now, or, for a version missing its latency objective,
after a spare instance is evicted. And the service's steps in waves: adds on different devices load at once."""
from __future__ import annotations

import asyncio

import pytest

from gpud.core_api import RequestedPlacement
from gpud.executor.types import InferenceError
from gpud.placement import Assignment, Constraints, Device, ModelDemand, Move, Plan
from gpud.placement.shortcut import room_by_few_moves
from gpud.placing.inputs import GroupKey, PlacementInputs
from gpud.placing.service import PlacementService, load_waves
from gpud.placing.shortcuts import shortcuts, steps_of, then_what_still_fits, unreached_adds
from gpud.examples import write_example_repository
from gpud.repository.layout import ModelRepository
from gpud.scaling.plan import Claims
from gpud.scheduling import new_registry
from gpud.telemetry.simulated import SimulatedBackend
from tests.test_placement_service import (  # noqa: F401  (node: the fixture)
    MIB, NODE, ScriptedPool, node, register_all, where,
)

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
    first = steps_of(shortcuts(waiting, inputs, urgent=set(), rank=lambda m: 0 if m.model == "big" else 1,
                               max_steps=4))
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


def test_spare_instances_may_go_instead_of_moving_no_load_first():
    devices = [gpu("g0"), gpu("g1", 20)]
    demands = [demand("big", 30), demand("a", 12), demand("b", 12)]
    current = at(("a", 0, "g0"), ("b", 0, "g0"), ("a", 1, "g1"))
    # g0 has 16 free, g1 8: big needs a#0 and b#0 off g0, and neither fits on g1.
    assert room_by_few_moves(devices, demands, current, "big", 0) is None
    assert room_by_few_moves(devices, demands, current, "big", 0, removable={"a": 1}) is None  # b still cannot go
    found = room_by_few_moves(devices, demands, current, "big", 0, removable={"a": 1, "b": 1})
    assert found is not None and found.cost == (0, 2, 0)
    assert sorted((m.kind, m.model, m.instance) for m in found.moves) == [("remove", "a", 0), ("remove", "b", 0)]
    assert found.applied(current) == [Assignment("a", 1, "g1"), Assignment("big", 0, "g0")]
    # A removal beats a move (no load).
    devices = [gpu("g0"), gpu("g1")]
    demands = [demand("big", 28), demand("a", 12), demand("b", 12), demand("c", 20)]
    current = at(("a", 0, "g0"), ("b", 0, "g0"), ("c", 0, "g1"))  # 16 and 20 free
    found = room_by_few_moves(devices, demands, current, "big", 0)
    assert found is not None and [m.kind for m in found.moves] == ["move"]
    found = room_by_few_moves(devices, demands, current, "big", 0, removable={"b": 1})
    assert found is not None and [(m.kind, m.model) for m in found.moves] == [("remove", "b")]


def test_spares_are_only_for_urgent_adds_and_counted_across_them():
    devices = [gpu("g0"), gpu("g1")]
    demands = [demand("big", 30), demand("big2", 30), demand("a", 12), demand("b", 12)]
    # g0: a#0, 28 free; g1: b#0, a#1, b#1, 4 free.
    inputs = inputs_of(devices, demands, at(("a", 0, "g0"), ("b", 0, "g1"), ("a", 1, "g1"), ("b", 1, "g1")))
    adds = [Move("add", "big", 0, to_device="g0", make_before_break=False),
            Move("add", "big2", 0, to_device="g1", make_before_break=False)]
    # Not urgent: spares are not touched, and no move makes room.
    assert shortcuts(adds[:1], inputs, urgent=set(), rank=lambda m: 0, max_steps=4, spare={"a": 1}) == []
    # Urgent: a#0 goes for big; for big2 the one spare `a` is used up and nothing else makes room.
    first = steps_of(shortcuts(adds, inputs, urgent={("big", "1"), ("big2", "1")}, rank=lambda m: 0, max_steps=4,
                               spare={"a": 1}))
    assert [(m.kind, m.model, m.instance) for m in first] == [("remove", "a", 0), ("add", "big", 0)]
    # What the plan adds after it is checked against the node with the removal and the add done.
    assert then_what_still_fits(first, [Move("add", "b", 2, to_device="g0")], inputs) == first  # 30 + 12 > 40
    assert steps_of(shortcuts(adds, inputs, urgent={("big", "1"), ("big2", "1")}, rank=lambda m: 0, max_steps=4,
                              spare={"a": 2}))[2:] == []  # a#1 alone does not make room for big2 on g1 either


def tight_node(tmp_path, pin_mlp_to_gpu0: bool = False) -> tuple:
    """mlp and cnn placed on two GPUs with room for three instances each (6.8 MiB measured each): registry, pool,
    service."""
    repo = tmp_path / "repo"
    write_example_repository(repo, ["mlp", "cnn"])
    if pin_mlp_to_gpu0:
        config = repo / "mlp" / "config.pbtxt"
        text = config.read_text()
        start = text.index("instance_group")
        config.write_text(text[:start] + "instance_group [ { kind: KIND_GPU, gpus: [ 0 ] } ]"
                          + text[text.index("]", start) + 1:])
    (tmp_path / "node.yaml").write_text(NODE)
    pool = ScriptedPool()
    pool.footprint_bytes = int(6.8 * MIB)
    backend = SimulatedBackend.from_file(tmp_path / "node.yaml", usage=pool)
    total = backend.leaf_devices()[0].memory_total_bytes
    registry = new_registry(has_gpus=True)
    service = PlacementService(backend, pool, registry, device_reserve_bytes=total - 21 * MIB, time_limit_s=0)
    asyncio.run(service.place(register_all(ModelRepository(repo), registry)))
    return registry, pool, service


def mlp_added_on(device: str):
    """A scripted planner: what runs stays, and mlp gets one instance more, on `device`."""
    async def scripted(inputs, config) -> Plan:
        name = inputs.names[GroupKey("mlp", "1", 0)]
        running = sum(1 for a in inputs.current if a.model == name)
        return Plan((*inputs.current, Assignment(name, running, device)), (), 2, 2, False)
    return scripted


def test_rescale_evicts_a_spare_instance_for_an_urgent_add_rather_than_wait(tmp_path, monkeypatch):
    """Two GPUs with room for three instances each, both full; the (scripted) re-plan puts an urgent version's new
    instance on gpu0 with no room there. The spare instances of a version whose objective holds with margin may go
    for it: one is evicted (said so, counted), and the add follows in the same interval."""
    registry, pool, service = tight_node(tmp_path)
    asyncio.run(service.rescale({("cnn", "1"): 5}, max_steps=8, apply=True))
    full = where(registry)
    assert len(full["cnn"]) == 5 and len(full["mlp"]) == 1
    assert sorted(d for _, d in full["cnn"] + full["mlp"]).count("gpu0") == 3  # both GPUs full
    pool.events.clear()

    mlp_device = full["mlp"][0][1]
    monkeypatch.setattr(service, "_plan", mlp_added_on(mlp_device))
    claims = Claims(first=(("mlp", "1"),), urgent=frozenset({("mlp", "1")}),
                    spare={("cnn", "1"): (2, "objective 150 ms holds with margin at 2 instances")})
    plan = asyncio.run(service.rescale({("mlp", "1"): 2}, max_steps=4, apply=True, claims=claims))
    assert [(s.kind, s.model, s.evicted_for, s.error) for s in plan.steps] == [
        ("remove", "cnn", "mlp", ""), ("add", "mlp", "", "")]
    assert plan.steps[0].evicted_why == "objective 150 ms holds with margin at 2 instances"
    assert plan.steps[0].from_device == plan.steps[1].to_device == mlp_device
    assert [e[0] for e in pool.events] == ["unload", "load"]
    assert registry.version("cnn").scheduler.stats.evictions == 1 and len(where(registry)["cnn"]) == 4
    # Without the claims (not urgent) nothing is evicted: mlp's third instance waits for room.
    before = where(registry)
    plan = asyncio.run(service.rescale({("mlp", "1"): 3}, max_steps=4, apply=True))
    assert plan.steps == () and where(registry) == before


def test_rescale_moves_an_instance_to_make_room_and_says_for_whom(tmp_path, monkeypatch):
    """mlp may only run on GPU 0, which is full; GPU 1 has one slot. The (scripted) re-plan wants mlp's second
    instance on gpu0 with no step to free it: a cnn instance moves to gpu1 first (make-before-break), then mlp's
    loads; the move's step names the model it made room for (the controller's log and `gpudctl inspect`)."""
    registry, pool, service = tight_node(tmp_path, pin_mlp_to_gpu0=True)
    asyncio.run(service.rescale({("cnn", "1"): 4}, max_steps=8, apply=True))
    placed = where(registry)
    on_gpu0 = [i for i, d in placed["cnn"] if d == "gpu0"]
    assert placed["mlp"] == [(0, "gpu0")] and len(on_gpu0) == 2 and len(placed["cnn"]) == 4  # gpu0 full, gpu1 2/3
    pool.events.clear()

    monkeypatch.setattr(service, "_plan", mlp_added_on("gpu0"))
    plan = asyncio.run(service.rescale({("mlp", "1"): 2}, max_steps=4, apply=True))
    assert [(s.kind, s.model, s.from_device, s.to_device, s.room_for, s.error) for s in plan.steps] == [
        ("move", "cnn", "gpu0", "gpu1", "mlp", ""), ("add", "mlp", None, "gpu0", "", "")]
    assert [e[0] for e in pool.events] == ["load", "unload", "load"]  # the copy serves before the original goes
    assert where(registry)["mlp"] == [(0, "gpu0"), (1, "gpu0")]


def test_load_waves_are_runs_of_adds_on_different_devices():
    add = lambda i, d: Move("add", "m", i, to_device=d)  # noqa: E731
    moves = [add(0, "g0"), add(1, "g1"), add(2, "g0"), Move("remove", "n", 0, "g1"), add(3, "g1"),
             Move("move", "n", 1, "g0", "g2"), add(4, "g2"), add(5, "g3")]
    assert [[(m.kind, m.instance) for m in w] for w in load_waves(moves)] == [
        [("add", 0), ("add", 1)], [("add", 2)], [("remove", 0)], [("add", 3)], [("move", 1)],
        [("add", 4), ("add", 5)]]


def test_adds_on_different_devices_load_at_once(node, monkeypatch):
    """Two new instances on two GPUs: the second load starts while the first is still loading (a device's worker
    loads one at a time, different devices' workers at once); a failed one is said, the other serves."""
    repository, registry, pool, service = node
    asyncio.run(service.place(register_all(repository, registry)))
    pool.events.clear()

    async def scripted(inputs, config) -> Plan:
        name = inputs.names[GroupKey("mlp", "1", 0)]
        return Plan((*inputs.current, Assignment(name, 1, "gpu0"), Assignment(name, 2, "gpu1")), (), 2, 1, False)

    monkeypatch.setattr(service, "_plan", scripted)
    both = asyncio.Event()
    started = pool.load_instance

    async def load_instance(inst, device):
        if sum(1 for e in pool.events if e[0] == "load") == 1:  # this is the second load: the first still loads
            both.set()
        return await started(inst, device)

    monkeypatch.setattr(pool, "load_instance", load_instance)

    async def scenario():
        pool.hold["gpu0"] = asyncio.Event()
        pool.hold["gpu1"] = asyncio.Event()
        pool.fail_on = {"gpu1"}
        task = asyncio.create_task(service.rescale({("mlp", "1"): 3}, max_steps=4, apply=True))
        await asyncio.wait_for(both.wait(), 10)  # sequential loads would never get here
        assert not task.done()
        pool.hold["gpu0"].set()
        pool.hold["gpu1"].set()
        return await task

    plan = asyncio.run(scenario())
    assert [(s.kind, s.index, s.to_device, s.error) for s in plan.steps] == [
        ("add", 1, "gpu0", ""), ("add", 2, "gpu1", "out of memory (scripted)")]
    assert where(registry)["mlp"] == [(0, "gpu0"), (1, "gpu0")]


def test_a_failed_load_in_a_wave_rolls_back_the_waves_other_loads_too(node):
    """A requested placement (atomic): two new instances on two GPUs load at once; the one on gpu0 fails, so the one
    that loaded on gpu1 is unloaded again and nothing changed."""
    repository, registry, pool, service = node
    asyncio.run(service.place(register_all(repository, registry)))
    before = where(registry)
    pool.events.clear()
    pool.fail_on = {"gpu0"}
    requested = [RequestedPlacement("mlp", 0, "gpu0"), RequestedPlacement("cnn", 0, "gpu0"),
                 RequestedPlacement("mlp", 1, "gpu0"), RequestedPlacement("mlp", 2, "gpu1")]
    with pytest.raises(InferenceError) as err:
        asyncio.run(service.apply_requested(requested))
    assert "nothing changed" in err.value.message and "could not load on gpu0" in err.value.message
    assert sorted(e[0] for e in pool.events) == ["load", "load", "unload"]  # both loaded at once, gpu1's undone
    assert where(registry) == before and not pool.instance_keys("gpu1")
