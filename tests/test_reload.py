"""A reload with no gap in service (GpudCore.load_model on a served model): the new versions load beside the old,
requests go to them once they are ready, then the old ones drain and unload; a reload that fails leaves the old
serving. The executor pool is the scripted double of test_placement_service; everything else is real."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gpud.executor.types import ErrorKind, InferenceError
from gpud.core import GpudCore
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


def core_on(tmp_path: Path, *, room_bytes: int | None = None) -> tuple[GpudCore, ScriptedPool]:
    """One GPU; `room_bytes`: what is left for instances there (the rest reserved)."""
    repo = tmp_path / "repo"
    write_example_repository(repo, ["mlp"])
    (tmp_path / "node.yaml").write_text(ONE_GPU)
    backend = SimulatedBackend.from_file(tmp_path / "node.yaml")
    total = backend.leaf_devices()[0].memory_total_bytes
    reserve = 512 * MIB if room_bytes is None else total - room_bytes
    registry, pool = new_registry(has_gpus=True), ScriptedPool()
    service = PlacementService(backend, pool, registry, device_reserve_bytes=reserve, time_limit_s=0)
    return GpudCore(ModelRepository(repo), registry, service, pool, control=ModelControl("explicit", ("*",))), pool


def test_a_reload_loads_the_new_instance_before_the_old_one_unloads(tmp_path):
    core, pool = core_on(tmp_path)
    asyncio.run(core.start())
    old = core.registry.version("mlp")
    pool.events.clear()
    asyncio.run(core.load_model("mlp"))
    new = core.registry.version("mlp")
    # same model, version and device: the new instance gets its own key on that worker while the old one serves
    assert pool.events == [("load", "mlp:1:0#2", "gpu0"), ("unload", "mlp:1:0", "gpu0")]
    assert new is not old and new.ready and not old.instances and old.state is ModelState.UNLOADING


@replaces_methods_of("gpud.executor.dynamic_scheduler")
def test_requests_accepted_by_the_old_version_finish_there(tmp_path):
    core, pool = core_on(tmp_path)

    async def scenario() -> list[str]:
        await core.start()
        old = core.registry.version("mlp")
        idle = asyncio.Event()
        waited: list[str] = []

        async def wait_idle() -> None:  # the old version still has a request in flight until `idle` is set
            waited.append("drain")
            await idle.wait()
        old.scheduler.wait_idle = wait_idle
        reload = asyncio.create_task(core.load_model("mlp"))
        while not waited:
            await asyncio.sleep(0)
        # routed to the new version already; the old one is draining and its instance still loaded
        assert core.registry.version("mlp") is not old and old.instances
        idle.set()
        await reload
        return [e[0] for e in pool.events]

    assert asyncio.run(scenario()) == ["load", "load", "unload"]


@pytest.mark.parametrize("breaks, error", [
    ("config", "failed to load 'mlp': .*; version\\(s\\) 1 of 'mlp' keep serving"),
    ("load", "out of memory \\(scripted\\); version\\(s\\) 1 of 'mlp' keep serving"),
])
def test_a_reload_that_fails_leaves_the_old_version_serving(tmp_path, breaks, error):
    core, pool = core_on(tmp_path)
    asyncio.run(core.start())
    old = core.registry.version("mlp")
    if breaks == "config":
        (Path(core.repository.path) / "mlp" / "config.pbtxt").write_text("max_batch_size: [")
    else:
        pool.fail_on = {"gpu0"}
    pool.events.clear()
    with pytest.raises(InferenceError, match=error) as exc:
        asyncio.run(core.load_model("mlp"))
    assert exc.value.kind in (ErrorKind.INVALID_ARGUMENT, ErrorKind.UNAVAILABLE)
    assert core.registry.version("mlp") is old and old.ready
    assert [e[0] for e in pool.events] == ([] if breaks == "config" else ["load"])  # the old one never unloaded


def test_with_no_room_beside_the_old_the_new_loads_after_it(tmp_path):
    core, pool = core_on(tmp_path, room_bytes=12 * MIB)  # one instance (10 MiB once loaded) fits, not two
    asyncio.run(core.start())
    pool.events.clear()
    asyncio.run(core.load_model("mlp"))
    assert [e[0] for e in pool.events] == ["unload", "load"]  # break before make: the only way it fits
    assert core.registry.version("mlp").ready
