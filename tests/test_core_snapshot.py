"""Registry.snapshot() (what GpudCore.snapshot() returns): the registry as the typed, read-only value that metrics,
hints and inspect read."""
from __future__ import annotations

import dataclasses

import pytest

from gpud.executor.instance import InstanceHandle
from gpud.examples import write_example_repository
from gpud.scheduling import new_registry
from gpud.repository.layout import ModelRepository
from gpud.telemetry.serving import ModelState


@pytest.fixture
def core(tmp_path):
    write_example_repository(tmp_path, ["mlp", "cnn"])
    registry = new_registry(has_gpus=True)
    for name, entry in ModelRepository(tmp_path).scan().items():
        registry.register(name, entry)  # registered, nothing loaded: no worker process is started
    return registry


def _instance(vs, index: int, device: str, *, ready: bool, memory_bytes: int | None) -> InstanceHandle:
    return InstanceHandle(key=f"{vs.name}:{vs.version}:{index}", model=vs.name, version=vs.version, index=index,
                          device_id=device, model_path="", config=vs.entry.config, estimate_bytes=5 * 2**20,
                          ready=ready, memory_bytes=memory_bytes, measured_by="process_rss" if memory_bytes else "",
                          load_seconds=0.25, provider="CPUExecutionProvider")


def test_versions_instances_and_records(core):
    mlp = core.models["mlp"].versions["1"]
    mlp.state = ModelState.READY
    for inst in (_instance(mlp, 0, "gpu0", ready=True, memory_bytes=7 * 2**20),
                 _instance(mlp, 1, "gpu1/mig1.0", ready=False, memory_bytes=None)):
        mlp.scheduler.add_instance(inst)  # what serves: the scheduler's list, which the version reads
    snap = core.snapshot()
    assert [m.name for m in snap.models] == ["cnn", "mlp"]
    v = snap.models[1].versions[0]
    assert (v.model, v.version, v.state, v.reason) == ("mlp", "1", ModelState.READY, "")
    assert v.device_kinds == frozenset({"gpu", "mig"})  # KIND_AUTO on a node with GPUs
    assert v.stats is mlp.scheduler.stats  # the executor's one record, not a copy
    assert [(i.index, i.device_id, i.ready, i.footprint_bytes) for i in v.instances] == [
        (0, "gpu0", True, 7 * 2**20), (1, "gpu1/mig1.0", False, 5 * 2**20)]  # unmeasured: the estimate
    assert v.ready_instances == 1 and v.pending_requests == 0
    cnn = snap.models[0].versions[0]
    assert cnn.state == ModelState.LOADING and not cnn.instances
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.state = ModelState.UNLOADING  # type: ignore[misc]


def test_loaded_version_with_no_ready_instance_reads_unavailable(core):
    mlp = core.models["mlp"].versions["1"]
    mlp.state = ModelState.READY  # loaded, but its only instance is down (its worker restarting)
    mlp.scheduler.add_instance(_instance(mlp, 0, "cpu", ready=False, memory_bytes=2**20))
    v = next(v for v in core.snapshot().versions() if v.model == "mlp")
    assert v.state == ModelState.UNAVAILABLE and "worker is restarting" in v.reason
