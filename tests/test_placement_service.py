"""gpud.placing.service: plans applied in order, make-before-break, with reservations and rollback. The executor
pool is a scripted double (loads succeed or fail as told, and can be held mid-load); everything else is real."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gpud.executor.device import WorkerDevice
from gpud.executor.instance import InstanceHandle
from gpud.executor.types import ErrorKind, InferenceError
from gpud.api.http_encode import placements_from_json
from gpud.examples import write_example_repository
from gpud.core_api import RequestedPlacement
from gpud.placing.service import PlacementService
from gpud.scheduling import new_registry
from gpud.repository.layout import ModelRepository
from gpud.telemetry.serving import ModelState
from gpud.telemetry.simulated import SimulatedBackend

MIB = 2**20
NODE = """
gpus:
  - model: NVIDIA A100-SXM4-40GB
  - model: NVIDIA A100-SXM4-40GB
"""


class ScriptedPool:
    """Loads succeed at once with a 10 MiB footprint, unless the device is in `fail_on`; `hold` makes loads on a
    device wait for its event. `events` records ("load" | "unload", key, device) in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []
        self.fail_on: set[str] = set()
        self.fail_models: set[str] = set()  # loads of these models fail wherever they go
        self.hold: dict[str, asyncio.Event] = {}
        self.loaded: dict[str, InstanceHandle] = {}
        self.load_started: asyncio.Event | None = None  # set when a load begins
        self.footprint_bytes = 10 * MIB  # what a loaded instance measures
        self.lost: dict[str, str] = {}  # device -> why gpud gave up on it (a crash loop)

    async def load_instance(self, inst: InstanceHandle, device: WorkerDevice) -> InstanceHandle:
        # described by the service, from the device inventory
        assert (device.id, device.kind) == (inst.device_id, "cpu" if inst.device_id == "cpu" else "gpu")
        self.events.append(("load", inst.key, inst.device_id))
        if self.load_started is not None:
            self.load_started.set()
        if inst.device_id in self.hold:
            await self.hold[inst.device_id].wait()
        if inst.device_id in self.fail_on or inst.model in self.fail_models:
            inst.error = "out of memory (scripted)"
            return inst
        inst.ready, inst.memory_bytes, inst.measured_by = True, self.footprint_bytes, "process_rss"
        self.loaded[inst.key] = inst
        return inst

    def instance_keys(self, device_id: str) -> set[str]:
        return {k for k, i in self.loaded.items() if i.device_id == device_id}

    async def unload_instance(self, inst: InstanceHandle) -> None:
        self.events.append(("unload", inst.key, inst.device_id))
        inst.ready = False
        self.loaded.pop(inst.key, None)

    def memory_used_bytes(self, device_id: str) -> int:
        return sum(i.footprint_bytes for i in self.loaded.values() if i.device_id == device_id and i.ready)

    def utilization_ratio(self, device_id: str) -> float | None:
        return None

    def unhealthy_reason(self, device_id: str) -> str | None:
        return self.lost.get(device_id)

    def crash_loop(self, device_id: str) -> None:
        """What the supervisor does when the device's worker crash-loops: its instances go unready, it is given up
        on."""
        self.lost[device_id] = "crash loop: its worker died 3 times within 120 s (last: exit code 1)"
        for inst in self.loaded.values():
            if inst.device_id == device_id:
                inst.ready = False


@pytest.fixture
def node(tmp_path):
    repo = tmp_path / "repo"
    write_example_repository(repo, ["mlp", "cnn"])
    (tmp_path / "node.yaml").write_text(NODE)
    pool = ScriptedPool()
    backend = SimulatedBackend.from_file(tmp_path / "node.yaml", usage=pool)
    registry = new_registry(has_gpus=True)
    service = PlacementService(backend, pool, registry, device_reserve_bytes=512 * MIB, time_limit_s=0)
    return ModelRepository(repo), registry, pool, service


def register_all(repository, registry):
    new = []
    for name, entry in repository.scan().items():
        new += registry.register(name, entry)
    return new


def where(registry) -> dict[str, list[tuple[int, str]]]:
    return {m.name: sorted((i.index, i.device_id) for v in m.versions.values() for i in v.instances)
            for m in registry.models.values()}


def test_start_up_places_and_loads_everything(node):
    repository, registry, pool, service = node
    asyncio.run(service.place(register_all(repository, registry)))
    placed = where(registry)
    assert set(placed) == {"mlp", "cnn"} and all(len(v) == 1 for v in placed.values())
    assert all(v.state is ModelState.READY and v.ready for v in registry.versions())
    assert [e[0] for e in pool.events] == ["load", "load"]


def test_a_failed_load_at_start_up_is_recorded_and_the_rest_serves(node):
    repository, registry, pool, service = node
    pool.fail_on = {"gpu0"}  # pack puts both on gpu0 (the first device): both fail there
    asyncio.run(service.place(register_all(repository, registry)))
    for v in registry.versions():
        assert v.state is ModelState.UNAVAILABLE and "out of memory (scripted)" in v.reason


def test_a_model_loaded_later_goes_into_the_room_left_and_moves_nothing(node):
    repository, registry, pool, service = node
    asyncio.run(service.place(registry.register("mlp", repository.load("mlp"))))
    before = where(registry)["mlp"]
    pool.events.clear()
    asyncio.run(service.place(registry.register("cnn", repository.load("cnn"))))
    assert where(registry)["mlp"] == before
    assert [(e[0], e[1].split(":")[0]) for e in pool.events] == [("load", "cnn")]


def test_requested_move_is_make_before_break(node):
    repository, registry, pool, service = node
    asyncio.run(service.place(register_all(repository, registry)))
    src = where(registry)["mlp"][0][1]
    dst = "gpu1" if src == "gpu0" else "gpu0"
    pool.events.clear()
    applied = asyncio.run(service.apply_requested([RequestedPlacement("mlp", 0, dst)]))
    # the new instance loads (key marks the device: its predecessor still serves), then the old one goes
    assert pool.events == [("load", f"mlp:1:0@{dst}", dst), ("unload", "mlp:1:0", src)]
    assert [(i.model, i.index, i.device) for i in applied.added] == [("mlp", 0, dst)]
    assert [(i.model, i.index, i.device) for i in applied.removed] == [("mlp", 0, src)]
    assert where(registry)["mlp"] == [(0, dst)]


def test_a_failed_load_rolls_everything_back(node):
    repository, registry, pool, service = node
    asyncio.run(service.place(register_all(repository, registry)))
    before = where(registry)
    src = before["mlp"][0][1]
    dst = "gpu1" if src == "gpu0" else "gpu0"
    pool.fail_models = {"cnn"}
    with pytest.raises(InferenceError) as err:
        # mlp moves to the other GPU (succeeds), then cnn's move there fails: mlp's move is undone
        asyncio.run(service.apply_requested([RequestedPlacement("mlp", 0, dst), RequestedPlacement("cnn", 0, dst)]))
    assert err.value.kind is ErrorKind.UNAVAILABLE and "nothing changed" in err.value.message
    assert f"could not load on {dst}" in err.value.message
    assert where(registry) == before
    assert all(v.ready for v in registry.versions())


def test_a_placement_that_does_not_fit_changes_nothing(node):
    repository, registry, pool, service = node
    asyncio.run(service.place(register_all(repository, registry)))
    before, events = where(registry), list(pool.events)
    # 10 MiB measured each: 5000 instances are ~49 GiB on a 40 GiB GPU (minus the 512 MiB reserve)
    with pytest.raises(InferenceError, match=r"puts 48\.83 GiB of model instances on gpu1, which has 39\.\d+ GiB"):
        asyncio.run(service.apply_requested([RequestedPlacement("mlp", i, "gpu1") for i in range(5000)]))
    assert where(registry) == before and pool.events == events


@pytest.mark.parametrize("requested, kind, message", [
    ([RequestedPlacement("mlp", 0, "gpu9")], ErrorKind.INVALID_ARGUMENT, "unknown device 'gpu9'"),
    ([RequestedPlacement("nope", 0, "gpu0")], ErrorKind.NOT_FOUND, "unknown model"),
    ([RequestedPlacement("mlp", -1, "gpu0")], ErrorKind.INVALID_ARGUMENT, "instance must be >= 0"),
    ([RequestedPlacement("mlp", 0, "gpu0"), RequestedPlacement("mlp", 0, "cpu")], ErrorKind.INVALID_ARGUMENT,
     "placed twice"),
    ([RequestedPlacement("mlp:7", 0, "gpu0")], ErrorKind.NOT_FOUND, "version 7 is not found"),
])
def test_bad_requests_change_nothing(node, requested, kind, message):
    repository, registry, pool, service = node
    asyncio.run(service.place(register_all(repository, registry)))
    before, events = where(registry), list(pool.events)
    with pytest.raises(InferenceError) as err:
        asyncio.run(service.apply_requested(requested))
    assert err.value.kind is kind and message in err.value.message
    assert where(registry) == before and pool.events == events


@pytest.mark.parametrize("doc, message", [
    ("all of them", "must be a list"),
    ([{"model": "mlp", "instance": True, "device": "gpu0"}], "expected"),  # a bool is not an instance index
    ([{"model": "mlp", "instance": "0", "device": "gpu0"}], "expected"),
])
def test_malformed_placement_documents(doc, message):
    with pytest.raises(InferenceError, match=message):
        placements_from_json(doc)


def test_memory_of_a_load_in_flight_is_reserved(node):
    repository, registry, pool, service = node
    new = registry.register("mlp", repository.load("mlp"))

    async def scenario() -> tuple[int, int]:
        gate = pool.hold["gpu0"] = asyncio.Event()
        pool.load_started = asyncio.Event()
        free_before = next(r.free_bytes for r in service.rooms() if r.device_id == "gpu0")
        task = asyncio.create_task(service.place(new))
        await pool.load_started.wait()  # the load has started and waits on the gate
        during = next(r.free_bytes for r in service.rooms() if r.device_id == "gpu0")
        gate.set()
        await task
        return free_before, during

    free_before, during = asyncio.run(scenario())
    assert free_before - during == new[0].estimate_bytes  # promised while loading, not handed out twice


def test_a_model_pinned_to_a_missing_gpu_is_unavailable_with_the_reason(node):
    repository, registry, pool, service = node
    config = Path(repository.path) / "mlp" / "config.pbtxt"
    text = config.read_text()
    start = text.index("instance_group")
    config.write_text(text[:start] + "instance_group [ { kind: KIND_GPU, gpus: [ 7 ] } ]"
                      + text[text.index("]", start) + 1:])
    new = registry.register("mlp", repository.load("mlp"))
    asyncio.run(service.place(new))
    assert new[0].state is ModelState.UNAVAILABLE and "the node has no GPU 7 (GPUs: 0, 1)" in new[0].reason
    assert not pool.events  # not placed anywhere


class TestControl:
    """The controller's entry: re-plan with target counts, carry out at most max_steps steps."""

    def started(self, node):
        repository, registry, pool, service = node
        asyncio.run(service.place(register_all(repository, registry)))
        pool.events.clear()
        return registry, pool, service

    def test_scale_up_adds_instances_and_keeps_the_others_where_they_are(self, node):
        registry, pool, service = self.started(node)
        before = where(registry)
        plan = asyncio.run(service.rescale({("mlp", "1"): 3}, max_steps=4, apply=True))
        assert [(s.kind, s.model, s.index, s.error) for s in plan.steps] == [("add", "mlp", 1, ""), ("add", "mlp", 2, "")]
        assert [e[0] for e in pool.events] == ["load", "load"] and plan.deferred == 0
        assert where(registry)["cnn"] == before["cnn"] and len(where(registry)["mlp"]) == 3

    def test_the_cap_leaves_the_rest_for_later(self, node):
        registry, pool, service = self.started(node)
        plan = asyncio.run(service.rescale({("mlp", "1"): 5}, max_steps=2, apply=True))
        assert len(plan.steps) == 2 and plan.deferred == 2  # 4 adds wanted, 2 done
        plan = asyncio.run(service.rescale({("mlp", "1"): 5}, max_steps=2, apply=True))
        assert len(plan.steps) == 2 and plan.deferred == 0 and len(where(registry)["mlp"]) == 5

    def test_scale_down_removes_the_newest(self, node):
        registry, pool, service = self.started(node)
        asyncio.run(service.rescale({("mlp", "1"): 3}, max_steps=4, apply=True))
        pool.events.clear()
        plan = asyncio.run(service.rescale({("mlp", "1"): 1}, max_steps=4, apply=True))
        assert sorted((s.kind, s.index) for s in plan.steps) == [("remove", 1), ("remove", 2)]
        assert [i for i, _ in where(registry)["mlp"]] == [0] and [e[0] for e in pool.events] == ["unload", "unload"]

    def test_advise_changes_nothing(self, node):
        registry, pool, service = self.started(node)
        before = where(registry)
        plan = asyncio.run(service.rescale({("mlp", "1"): 3}, max_steps=4, apply=False))
        assert [s.kind for s in plan.steps] == ["add", "add"]
        assert where(registry) == before and pool.events == []

    def test_from_scratch_moves_what_an_incremental_re_plan_keeps(self, node):
        # mlp moved off the device a fresh pack would choose: an incremental re-plan of the same counts keeps it
        # there (no step); a plan from scratch (incremental=False, the replay's baseline) moves it back.
        registry, pool, service = self.started(node)
        src = where(registry)["mlp"][0][1]
        other = "gpu1" if src == "gpu0" else "gpu0"
        asyncio.run(service.apply_requested([RequestedPlacement("mlp", 0, other)]))
        pool.events.clear()
        assert asyncio.run(service.rescale({("mlp", "1"): 1}, max_steps=4, apply=True)).steps == ()
        plan = asyncio.run(service.rescale({("mlp", "1"): 1}, max_steps=4, apply=True, incremental=False))
        assert [(s.kind, s.from_device, s.to_device) for s in plan.steps] == [("move", other, src)]
        assert where(registry)["mlp"] == [(0, src)]

    def test_a_re_plan_keeps_what_runs_unless_its_target_is_lower(self, node):
        # mlp runs 3, cnn 1. Re-planning for cnn's target of 2, mlp may keep no fewer than its 3 (a re-plan that fits
        # more of cnn must not take a busy model's instance); cnn may lose none either (target 2 > 1 running). With
        # mlp's target at 1, it may go down to 1.
        registry, pool, service = self.started(node)
        asyncio.run(service.rescale({("mlp", "1"): 3}, max_steps=4, apply=True))
        mins = {d.name: d.min_instances for d in service.inputs(totals={("cnn", "1"): 2}).demands}
        assert mins == {"mlp": 3, "cnn": 1}
        mins = {d.name: d.min_instances for d in service.inputs(totals={("mlp", "1"): 1}).demands}
        assert mins == {"mlp": 1, "cnn": 1}

    def test_a_failed_load_stops_the_interval(self, node):
        registry, pool, service = self.started(node)
        pool.fail_on = {"gpu0", "gpu1", "cpu"}
        plan = asyncio.run(service.rescale({("mlp", "1"): 3}, max_steps=4, apply=True))
        assert len(plan.steps) == 1 and "out of memory (scripted)" in plan.steps[0].error
        assert len(where(registry)["mlp"]) == 1  # the running one still serves


def test_a_requested_placement_on_a_device_the_model_may_not_use_is_refused_whole(node):
    repository, registry, pool, service = node
    asyncio.run(service.place(register_all(repository, registry)))  # KIND_AUTO on a GPU node: GPUs only
    before, events = where(registry), list(pool.events)
    with pytest.raises(InferenceError) as exc:
        asyncio.run(service.apply_requested([RequestedPlacement("mlp", 0, "gpu1"),
                                             RequestedPlacement("mlp", 1, "cpu")]))
    assert exc.value.kind is ErrorKind.INVALID_ARGUMENT
    assert "model 'mlp' instance 1 may not run on cpu: kind: device kind 'cpu' not in allowed" in exc.value.message
    assert where(registry) == before and pool.events == events  # nothing changed


class TestRecovery:
    """A lost device's instances are put back elsewhere at once: recovery, not scaling (gpud.placing.recovery)."""

    def on_gpu0(self, node, tmp_path):
        """mlp, cnn and two_input serving on gpu0, gpu1 empty."""
        repository, registry, pool, service = node
        write_example_repository(tmp_path / "repo", ["two_input"])
        asyncio.run(service.place(register_all(repository, registry)))
        assert {d for placed in where(registry).values() for _, d in placed} == {"gpu0"}  # pack: the first device
        pool.events.clear()
        return registry, pool, service

    def test_every_instance_of_a_crash_looping_device_moves_in_one_interval_whatever_the_cap(self, node, tmp_path):
        registry, pool, service = self.on_gpu0(node, tmp_path)
        pool.crash_loop("gpu0")
        assert service.instances_on_unhealthy_devices() == 3
        plan = asyncio.run(service.rescale({}, max_steps=1, apply=True))
        assert sorted((s.kind, s.model, s.from_device, s.to_device, s.error) for s in plan.steps) == [
            ("move", m, "gpu0", "gpu1", "") for m in ("cnn", "mlp", "two_input")]
        assert plan.deferred == 0 and plan.unhealthy_devices == {"gpu0"}
        assert where(registry) == {"mlp": [(0, "gpu1")], "cnn": [(0, "gpu1")], "two_input": [(0, "gpu1")]}
        assert all(v.ready for v in registry.versions()) and service.instances_on_unhealthy_devices() == 0
        # make-before-break: each lost instance goes once its replacement serves
        for model in ("mlp", "cnn", "two_input"):
            load = pool.events.index(("load", f"{model}:1:0@gpu1", "gpu1"))
            assert pool.events.index(("unload", f"{model}:1:0", "gpu0")) > load

    def test_scaling_steps_stay_capped_beside_a_recovery(self, node, tmp_path):
        registry, pool, service = self.on_gpu0(node, tmp_path)
        pool.crash_loop("gpu0")
        plan = asyncio.run(service.rescale({("mlp", "1"): 3}, max_steps=1, apply=True))
        moved = [s for s in plan.steps if s.kind == "move"]
        added = [s for s in plan.steps if s.kind == "add"]
        assert len(moved) == 3 and len(added) == 1 and plan.deferred == 1  # mlp's second new instance: next time

    def test_a_failed_recovery_load_stops_no_other_and_is_tried_again_next_interval(self, node, tmp_path):
        registry, pool, service = self.on_gpu0(node, tmp_path)
        pool.crash_loop("gpu0")
        pool.fail_models = {"cnn"}
        plan = asyncio.run(service.rescale({}, max_steps=1, apply=True))
        assert sorted((s.model, bool(s.error)) for s in plan.steps) == [("cnn", True), ("mlp", False),
                                                                        ("two_input", False)]
        # the lost instance stays (down) until its replacement serves: its requests queue, the next interval retries
        assert where(registry)["cnn"] == [(0, "gpu0")] and service.instances_on_unhealthy_devices() == 1
        pool.fail_models = set()
        plan = asyncio.run(service.rescale({}, max_steps=1, apply=True))
        assert [(s.kind, s.model, s.error) for s in plan.steps] == [("move", "cnn", "")]
        assert where(registry)["cnn"] == [(0, "gpu1")]

    def test_what_finds_no_room_elsewhere_is_said_with_why(self, node, tmp_path, caplog):
        registry, pool, service = self.on_gpu0(node, tmp_path)
        pool.crash_loop("gpu0")
        service.device_reserve_bytes = 40 * 2**30  # gpu1 has no room left
        with caplog.at_level("ERROR", logger="gpud"):
            plan = asyncio.run(service.rescale({}, max_steps=1, apply=True))
        assert sorted((s.kind, s.model) for s in plan.steps) == [("remove", m) for m in ("cnn", "mlp", "two_input")]
        assert sorted(u.model for u in plan.unplaced) == ["cnn", "mlp", "two_input"]
        said = [r.getMessage() for r in caplog.records if "lost device gpu0: not placed elsewhere" in r.getMessage()]
        assert len(said) == 3 and all("gpu1 with 0 B usable" in m for m in said), said
        # nothing is left on the lost device; each is scaled to zero: its next request loads it where there is room
        assert all(v.scaled_to_zero for v in registry.versions())
