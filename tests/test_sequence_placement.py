"""A sequence model under the placement controller: the real registry, placement service and control loop, a scripted
pool whose instances run the test's ONNX accumulator in-process (tests/test_sequence_scheduler.OrtWorker).

What users can count on: the controller never scales a sequence model below the instances whose slots its live
sequences hold (nor do evictions), and when it does remove or move an instance, that instance's sequences go on
elsewhere from their last answered request (their state is the daemon's, not the instance's)."""
from __future__ import annotations

import asyncio

import pytest

from gpud.scaling.controller import ScalingController
from gpud.scaling.rules import ScalingPolicy
from gpud.placing.ondemand import eviction_candidates
from gpud.placing.service import PlacementService
from gpud.scheduling import new_registry
from gpud.repository.layout import ModelRepository
from gpud.scaling.hints import HintDecision
from gpud.telemetry.simulated import SimulatedBackend
from tests.daemon_harness import save
from tests.fakes import FakeClock
from tests.sequence_models import accumulator_config, accumulator_model
from tests.test_placement_service import NODE, ScriptedPool
from tests.test_sequence_scheduler import Answers, OrtWorker, request

MIB = 2**20


class RunningPool(ScriptedPool):
    """ScriptedPool whose loaded instances have shared memory and an in-process onnxruntime worker."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    async def load_instance(self, inst, device):
        await super().load_instance(inst, device)
        if inst.ready:
            inst.open_segments()
            inst.worker = OrtWorker(self.model)
        return inst

    async def unload_instance(self, inst):
        await super().unload_instance(inst)
        inst.close_segments()


@pytest.fixture
def node(tmp_path):
    model = accumulator_model()
    config = accumulator_config(max_batch_size=2, instances=2).replace(
        "max_batch_size: 2", 'max_batch_size: 2\nparameters { key: "gpud_min_instances" value: { string_value: "1" } }')
    save(model, tmp_path / "repo", "acc", config)
    (tmp_path / "node.yaml").write_text(NODE)
    registry = new_registry(has_gpus=True)
    pool = RunningPool(model)
    service = PlacementService(SimulatedBackend.from_file(tmp_path / "node.yaml"), pool, registry,
                               device_reserve_bytes=512 * MIB, time_limit_s=0)
    yield registry, service, pool
    for inst in list(pool.loaded.values()):
        inst.close_segments()


def finish_all(vs) -> None:
    while any(i.worker.pending for i in vs.instances):
        for inst in vs.instances:
            if inst.worker.pending:
                inst.worker.finish(inst)


def test_the_controller_keeps_the_slots_of_live_sequences_and_their_state_moves(node, tmp_path):
    registry, service, pool = node
    clock = FakeClock(1000.0)
    hints = {}
    loop = ScalingController(registry.snapshot, lambda: hints, service,
                       ScalingPolicy(interval_seconds=10, scale_down_cooldown_seconds=0), "on", clock=clock)
    got = Answers()

    async def go():
        await service.place(registry.register("acc", ModelRepository(tmp_path / "repo").load("acc")))
        vs = registry.version("acc", "1")
        assert len(vs.instances) == 2 and vs.bounds.minimum == 1
        for cid in (1, 2, 3):  # 2 slots per instance: a0, b0, a1
            vs.scheduler.submit(request("acc", cid, cid, start=True), got(f"{cid}a"))
        finish_all(vs)
        assert vs.scheduler.live_sequences == 3 and vs.minimum_instances == 2  # ceil(3 / 2)
        view = registry.snapshot().models[0].versions[0]
        assert (view.sequences_in_slots, view.sequences_in_backlog, view.min_instances) == (3, 0, 2)

        hints[("acc", "1")] = HintDecision(1, 1, 2, 1, None, 0.1, "load 0.10 < 0.50")  # the load says: one is enough
        await loop.tick()
        assert len(vs.instances) == 2 and not loop.decisions  # held: one instance cannot hold three sequences
        assert loop.targets[0].target == 2

        vs.scheduler.submit(request("acc", 30, 3, end=True), got("3b"))  # sequence 3 ends: two left, one instance
        finish_all(vs)
        assert vs.minimum_instances == 1
        await loop.tick()
        assert [(d.action, d.reason) for d in loop.decisions] == [("remove", "scale_down")]
        assert len(vs.instances) == 1
        (left,) = vs.instances
        assert vs.scheduler.batcher.sequences_on(left.key) == 2  # both sequences are on the instance that stays

        vs.scheduler.submit(request("acc", 10, 1), got("1b"))
        vs.scheduler.submit(request("acc", 20, 2, end=True), got("2b"))
        finish_all(vs)

    asyncio.run(go())
    assert [got.out(t) for t in ("1a", "2a", "3a", "3b", "1b", "2b")] == [1, 2, 3, 33, 11, 22]


def test_evictions_leave_the_instances_live_sequences_need(node, tmp_path):
    registry, service, pool = node

    async def go():
        await service.place(registry.register("acc", ModelRepository(tmp_path / "repo").load("acc")))
        vs = registry.version("acc", "1")
        kinds = {"cpu": "cpu", "gpu0": "gpu", "gpu1": "gpu"}

        def candidates():  # what a cold start of another model on the CPU may evict
            return eviction_candidates(_Beneficiary(vs), [vs], kinds, True, 1e12)

        assert len(candidates()) == 1  # idle, two instances, minimum 1: one may go
        for cid in (1, 2, 3):
            vs.scheduler.submit(request("acc", cid, cid, start=True), Answers()(str(cid)))
        finish_all(vs)
        assert candidates() == []  # three live sequences need both instances' slots

    asyncio.run(go())


class _Beneficiary:
    """Another version wanting room on the CPU (eviction_candidates reads only these)."""

    def __init__(self, vs):
        self.entry = vs.entry
        self.name, self.version = "other", "1"
