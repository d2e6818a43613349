"""Scale to zero and load on demand (gpud.placing.service cold starts, GpudCore routing): a model with
gpud_min_instances 0 that has no room, or was unloaded for idleness, is loaded by its next request, evicting the
least recently used idle instances of other models when the node is full. The executor pool is the scripted double
of test_placement_service (instances of 6.8 MiB); everything else is real."""
from __future__ import annotations

import asyncio
from pathlib import Path

from gpud.core import GpudCore
from gpud.core_api import RequestedPlacement
from gpud.examples import write_example_repository
from gpud.model_control import ModelControl
from gpud.placing.service import PlacementService
from gpud.scheduling import new_registry
from gpud.repository.layout import ModelRepository
from gpud.telemetry.serving import ModelState
from gpud.telemetry.simulated import SimulatedBackend
from tests.test_placement_service import MIB, ScriptedPool
from tests.fakes import replaces_methods_of

ONE_GPU = """
gpus:
  - model: NVIDIA A100-SXM4-40GB
"""
MIN_0 = '\nparameters { key: "gpud_min_instances" value: { string_value: "0" } }\n'


class Clock:
    def __init__(self) -> None:
        self.now_s = 5000.0

    def __call__(self) -> float:
        return self.now_s


def node(tmp_path: Path, models: dict[str, int], *, room_bytes: int) -> tuple[GpudCore, ScriptedPool, Clock]:
    """One GPU with `room_bytes` for instances; `models`: name -> gpud_min_instances."""
    repo = tmp_path / "repo"
    write_example_repository(repo, list(models))
    for name, minimum in models.items():
        config = repo / name / "config.pbtxt"
        text = config.read_text() if config.exists() else ""  # no config: completed from the model, as in Triton
        config.write_text(text + MIN_0.replace('"0"', f'"{minimum}"'))
    (tmp_path / "node.yaml").write_text(ONE_GPU)
    backend = SimulatedBackend.from_file(tmp_path / "node.yaml")
    total = backend.leaf_devices()[0].memory_total_bytes
    registry, pool, wall = new_registry(has_gpus=True), ScriptedPool(), Clock()
    pool.footprint_bytes = int(6.8 * MIB)  # measured once loaded: one fits in 7 MiB, not two
    service = PlacementService(backend, pool, registry, device_reserve_bytes=total - room_bytes, time_limit_s=0,
                               wall_clock=wall)
    core = GpudCore(ModelRepository(repo), registry, service, pool, control=ModelControl("poll"))
    return core, pool, wall


async def cold_start(core: GpudCore, name: str) -> None:
    vs = core.registry.version(name)
    core.placement.demand(vs)
    await core.placement._cold[vs]


def test_a_model_without_room_at_start_is_scaled_to_zero_and_loads_on_demand_evicting_the_lru(tmp_path):
    core, pool, wall = node(tmp_path, {"mlp": 0, "cnn": 0}, room_bytes=7 * MIB)  # one instance (estimates 6.6 and 0.5 MiB)

    async def scenario() -> None:
        await core.start()
        loaded = [v for v in core.registry.versions() if v.instances]
        waiting = [v for v in core.registry.versions() if not v.instances]
        assert len(loaded) == 1 and len(waiting) == 1
        first, second = loaded[0], waiting[0]
        assert second.scaled_to_zero and core.model_ready(second.name)  # it serves: its next request loads it
        view = next(v for v in core.snapshot().versions() if v.model == second.name)
        assert (view.state, view.reason) == (ModelState.READY, "scaled to zero: its next request loads it")
        pool.events.clear()
        wall.now_s += 60
        await cold_start(core, second.name)
        assert [(e[0], e[1].split(":")[0]) for e in pool.events] == [("unload", first.name), ("load", second.name)]
        assert second.ready and first.scaled_to_zero
        assert (second.scheduler.stats.cold_starts, first.scheduler.stats.evictions) == (1, 1)
        # and back: the least recently used is now `second` (loaded at +60 s; `first` was never used since start)
        wall.now_s += 60
        await cold_start(core, first.name)
        assert first.ready and second.scaled_to_zero and second.scheduler.stats.evictions == 1

    asyncio.run(scenario())


@replaces_methods_of("gpud.executor.dynamic_scheduler")
def test_with_nothing_to_evict_the_waiting_requests_hear_why(tmp_path):
    core, pool, _ = node(tmp_path, {"mlp": 1, "cnn": 0}, room_bytes=7 * MIB)

    async def scenario() -> str:
        await core.start()
        cnn = core.registry.version("cnn")
        assert core.registry.version("mlp").ready and cnn.scaled_to_zero  # mlp has its minimum: not evictable
        failed: list[str] = []
        cnn.scheduler.fail_all_queued = failed.append  # what the queued requests would be told
        await cold_start(core, "cnn")
        assert not cnn.instances and cnn.scheduler.stats.cold_starts == 0
        return failed[0]

    message = asyncio.run(scenario())
    assert message.startswith("model 'cnn' version 1 could not be loaded on demand: ")
    assert "no idle instance of another model to evict" in message


def test_in_poll_mode_a_model_new_in_the_repository_is_registered_by_its_first_request(tmp_path):
    core, pool, _ = node(tmp_path, {"mlp": 1}, room_bytes=1024 * MIB)
    asyncio.run(core.start())
    write_example_repository(Path(core.repository.path), ["cnn"])  # added while gpud runs
    vs = core._served_version("cnn", "")
    assert vs.scaled_to_zero and vs.state is ModelState.READY
    asyncio.run(cold_start(core, "cnn"))
    assert vs.ready and [e[0] for e in pool.events][-1] == "load"


def test_a_scale_up_with_no_room_evicts_only_instances_idle_for_the_window(tmp_path):
    core, pool, wall = node(tmp_path, {"mlp": 0, "cnn": 0}, room_bytes=14 * MIB)  # both fit; a third does not

    async def scenario(idle_s: float) -> list[tuple[str, str, str]]:
        await core.start()
        assert all(v.ready for v in core.registry.versions())
        wall.now_s += idle_s  # neither has served a request since it loaded
        plan = await core.placement.rescale({("cnn", "1"): 2}, max_steps=4, apply=True, evict_idle_s=60.0)
        return [(s.kind, s.model, s.evicted_for) for s in plan.steps]

    assert asyncio.run(scenario(30.0)) == []  # idle 30 s < 60 s: nothing evicted, the add has no room
    core, pool, wall = node(tmp_path / "again", {"mlp": 0, "cnn": 0}, room_bytes=14 * MIB)
    assert asyncio.run(scenario(90.0)) == [("remove", "mlp", "cnn"), ("add", "cnn", "")]
    assert core.registry.version("mlp").scheduler.stats.evictions == 1


@replaces_methods_of("gpud.executor.dynamic_scheduler")
def test_nothing_is_evicted_when_evicting_would_not_make_room(tmp_path):
    # 7 MiB for instances; mlp (6.8 MiB measured once loaded) is idle and evictable, but cnn now needs 8 MiB: even an
    # empty device would not hold it, so mlp keeps serving and the waiting requests hear why.
    core, pool, wall = node(tmp_path, {"mlp": 0, "cnn": 0}, room_bytes=7 * MIB)

    async def scenario() -> str:
        await core.start()
        mlp, cnn = core.registry.version("mlp"), core.registry.version("cnn")
        assert mlp.ready and cnn.scaled_to_zero
        cnn.estimate_bytes = 8 * MIB
        failed: list[str] = []
        cnn.scheduler.fail_all_queued = failed.append
        pool.events.clear()
        wall.now_s += 600
        await cold_start(core, "cnn")
        assert pool.events == [] and mlp.ready and mlp.scheduler.stats.evictions == 0
        return failed[0]

    assert "unloading the idle instances of other models would not make room either" in asyncio.run(scenario())


def test_only_the_instances_that_make_room_are_evicted(tmp_path):
    # Two GPUs with 7 MiB each. gpu0: cnn instance 1 (3 MiB, idle) beside mlp (3.5 MiB, its minimum: kept); gpu1: cnn
    # instance 0 (3 MiB, idle). two_input, scaled to zero, needs 5 MiB. The least recently used first would be cnn 1
    # (equal use, higher index), but unloading it leaves gpu0 only 0.5 + 3 = 3.5 MiB: cnn 0 is the one that makes
    # room (gpu1: 4 + 3 = 7). One eviction, not two.
    core, pool, wall = node(tmp_path, {"mlp": 1, "cnn": 0, "two_input": 0}, room_bytes=7 * MIB)
    (tmp_path / "node.yaml").write_text(ONE_GPU + "  - model: NVIDIA A100-SXM4-40GB\n")
    backend = SimulatedBackend.from_file(tmp_path / "node.yaml")
    core.placement.devices = backend
    core.placement.device_reserve_bytes = backend.leaf_devices()[0].memory_total_bytes - 7 * MIB
    pool.footprint_bytes = 3 * MIB

    async def scenario() -> None:
        await core.start()
        service = core.placement
        await service.rescale({("two_input", "1"): 0}, max_steps=4, apply=True)
        await service.rescale({("cnn", "1"): 2}, max_steps=4, apply=True)
        await service.apply_requested([RequestedPlacement("mlp", 0, "gpu0"), RequestedPlacement("cnn", 1, "gpu0"),
                                       RequestedPlacement("cnn", 0, "gpu1")])
        mlp, cnn, two = (core.registry.version(n) for n in ("mlp", "cnn", "two_input"))
        mlp.instances[0].memory_bytes = int(3.5 * MIB)
        assert two.scaled_to_zero and sorted((i.index, i.device_id) for i in cnn.instances) == [(0, "gpu1"),
                                                                                             (1, "gpu0")]
        two.estimate_bytes = 5 * MIB
        pool.events.clear()
        wall.now_s += 600
        await cold_start(core, "two_input")
        assert pool.events[0] == ("unload", "cnn:1:0", "gpu1")
        assert [e[0] for e in pool.events] == ["unload", "load"] and two.ready
        assert [(i.index, i.device_id) for i in cnn.instances] == [(1, "gpu0")] and cnn.scheduler.stats.evictions == 1

    asyncio.run(scenario())


@replaces_methods_of("gpud.executor.dynamic_scheduler")
def test_after_a_failed_load_on_demand_requests_fail_at_once_until_the_node_changes(tmp_path):
    # mlp holds its minimum; cnn has no room. The first demand plans and fails; the next fails at once with the same
    # reason (no plan); once an instance has stopped (the node changed), the next demand plans again.
    core, pool, _ = node(tmp_path, {"mlp": 1, "cnn": 0}, room_bytes=7 * MIB)

    async def scenario() -> list[str]:
        await core.start()
        cnn, mlp = core.registry.version("cnn"), core.registry.version("mlp")
        failed: list[str] = []
        cnn.scheduler.fail_all_queued = failed.append
        planned = []
        real_plan = core.placement._plan

        async def counting_plan(*args, **kwargs):
            planned.append(1)
            return await real_plan(*args, **kwargs)

        core.placement._plan = counting_plan
        await cold_start(core, "cnn")
        plans = len(planned)
        core.placement.demand(cnn)  # nothing changed: at once
        assert cnn not in core.placement._cold and len(planned) == plans
        await core.placement._stop(mlp, mlp.instances[0])  # room now
        await cold_start(core, "cnn")
        assert len(planned) > plans and cnn.ready
        return failed

    failed = asyncio.run(scenario())
    assert len(failed) == 2 and failed[1] == failed[0]  # the same reason, said at once
