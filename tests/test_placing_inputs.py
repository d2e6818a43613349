"""gpud.placing.inputs: the one translation of model versions, devices and live instances into the planner's problem."""
from __future__ import annotations

import pytest

from gpud.executor.model_config import InstanceGroup
from gpud.placing.inputs import (GroupKey, LiveInstance, VersionDemand, build_inputs, candidate_kinds,
                                 demand_names, locate, pin_errors, planning_devices)
from gpud.placement import Assignment, PlannerConfig, plan
from gpud.telemetry.devices import DeviceInfo

GIB = 2**30
MIB = 2**20


def gpu(index: int, mem_gib: int = 80) -> DeviceInfo:
    return DeviceInfo(f"gpu{index}", "gpu", index, "NVIDIA A100", f"GPU-{index}", "", mem_gib * GIB)


def mig(parent: int, gi: int, mem_gib: int, slices: int) -> DeviceInfo:
    return DeviceInfo(f"gpu{parent}/mig{gi}.0", "mig", parent, "NVIDIA A100", f"MIG-{parent}-{gi}", "",
                      mem_gib * GIB, parent_id=f"gpu{parent}", mig_profile=f"{slices}g.{mem_gib}gb",
                      gpu_instance_id=gi, compute_instance_id=0, compute_fraction=slices / 7)


CPU = DeviceInfo("cpu", "cpu", -1, "CPU", "", "", 64 * GIB)
NODE = [gpu(0), mig(1, 1, 40, 3), mig(1, 2, 20, 2), CPU]


def version(model: str, *groups: InstanceGroup, v: str = "1", mib: int = 100) -> VersionDemand:
    return VersionDemand(model, v, tuple(groups) or (InstanceGroup(),), mib * MIB)


@pytest.mark.parametrize("kind, has_gpus, want", [
    ("KIND_CPU", True, ("cpu",)),
    ("KIND_GPU", False, ("gpu", "mig")),
    ("KIND_AUTO", True, ("gpu", "mig")),
    ("KIND_AUTO", False, ("cpu",)),
])
def test_candidate_kinds(kind, has_gpus, want):
    assert candidate_kinds(kind, has_gpus) == want


class TestDevices:
    def test_bins_keep_the_reserve_and_take_off_what_others_hold(self):
        devs = {d.id: d for d in planning_devices(NODE, device_reserve_bytes=512 * MIB,
                                                  other_used_bytes={"gpu0": 3 * GIB},
                                                  unhealthy=frozenset({"gpu1/mig2.0"}))}
        # 80 GiB - 3 GiB held by another process = 77 GiB bin; the 512 MiB reserve stays a reserve (reasons show it)
        assert devs["gpu0"].memory_bytes == 77 * GIB and devs["gpu0"].memory_reserve_bytes == 512 * MIB
        assert devs["cpu"].memory_reserve_bytes == 0  # no CUDA context on the CPU
        assert devs["gpu1/mig1.0"].compute_fraction == pytest.approx(3 / 7)
        assert devs["gpu1/mig1.0"].parent_id == "gpu1" and devs["gpu1/mig1.0"].label("gpu_index") == "1"
        assert not devs["gpu1/mig2.0"].healthy and devs["gpu0"].healthy


class TestDemands:
    def test_one_group_one_version_is_named_after_the_model(self):
        inputs = build_inputs(planning_devices(NODE, device_reserve_bytes=0),
                              [version("mlp", InstanceGroup(count=2))])
        (d,) = inputs.demands
        assert (d.name, d.instances, d.memory_bytes) == ("mlp", 2, 100 * MIB)
        assert d.constraints.kinds == frozenset({"gpu", "mig"})  # KIND_AUTO on a node with GPUs
        assert d.constraints.devices == frozenset()  # no pins: anywhere of its kinds

    def test_groups_are_demands_with_their_kinds_and_pins(self):
        # group 0: two instances pinned to GPU 1 (its MIG instances); group 1: one on the CPU
        v = version("bert", InstanceGroup(count=2, kind="KIND_GPU", gpus=(1,)), InstanceGroup(count=1, kind="KIND_CPU"))
        inputs = build_inputs(planning_devices(NODE, device_reserve_bytes=0), [v])
        g0, g1 = inputs.demands
        assert (g0.name, g0.instances, g1.name, g1.instances) == ("bert:1:0", 2, "bert:1:1", 1)
        assert g0.constraints.devices == frozenset({"gpu1/mig1.0", "gpu1/mig2.0"})
        assert g1.constraints.kinds == frozenset({"cpu"})
        # instance 2 of the version is the first of group 1 (2 = 0 + count of group 0)
        assert inputs.instance(Assignment("bert:1:1", 0, "cpu")) == (GroupKey("bert", "1", 1), 2)

    def test_two_versions_are_told_apart(self):
        names = demand_names([version("m", v="1"), version("m", v="2"), version("other")])
        assert sorted(names.values()) == ["m:1", "m:2", "other"]

    def test_a_name_clash_is_refused(self):
        with pytest.raises(ValueError, match="same placement name 'm:1'"):
            demand_names([version("m", v="1"), version("m", v="2"), version("m:1")])

    def test_counts_override_the_configured_count(self):
        inputs = build_inputs(planning_devices(NODE, device_reserve_bytes=0), [version("mlp", InstanceGroup(count=2))],
                              counts={GroupKey("mlp", "1", 0): 5})
        assert inputs.demands[0].instances == 5

    def test_kind_auto_on_a_cpu_only_node(self):
        inputs = build_inputs(planning_devices([CPU], device_reserve_bytes=0), [version("mlp")])
        assert inputs.demands[0].constraints.kinds == frozenset({"cpu"})


class TestComputeFraction:
    def test_the_planner_puts_no_more_on_a_device_than_its_compute_holds(self):
        # 0.3 of a GPU per instance: a whole GPU holds 3 (0.9), a 3g MIG instance (3/7 = 0.43) holds 1, a 2g (0.29)
        # none, although memory (100 MiB each) would take them all on one device.
        demand = VersionDemand("m", "1", (InstanceGroup(count=4, kind="KIND_GPU"),), 100 * MIB, compute_fraction=0.3)
        inputs = build_inputs(planning_devices(NODE, device_reserve_bytes=0), [demand])
        assert inputs.demands[0].compute_fraction == 0.3
        result = plan(inputs.devices, inputs.demands, config=PlannerConfig(time_limit_seconds=0))
        per_device = {}
        for a in result.placements:
            per_device[a.device] = per_device.get(a.device, 0) + 1
        assert per_device == {"gpu0": 3, "gpu1/mig1.0": 1} and not result.unplaced


class TestInstances:
    @pytest.mark.parametrize("index, want", [
        (0, (0, 0)), (1, (0, 1)), (2, (1, 0)), (4, (1, 2)),
        (7, (1, 5)),  # past the last group's range: the last group (added at run time)
    ])
    def test_locate(self, index, want):
        # groups of 2 and 3: indices 0-1 in group 0, 2-4 in group 1
        assert locate(index, (InstanceGroup(count=2), InstanceGroup(count=3))) == want

    def test_live_instances_are_the_current_placement(self):
        v = version("bert", InstanceGroup(count=1), InstanceGroup(count=2, kind="KIND_CPU"))
        live = [LiveInstance("bert", "1", 0, "gpu0"), LiveInstance("bert", "1", 2, "cpu"),
                LiveInstance("gone", "1", 0, "gpu0")]  # a version not in the problem is left out
        inputs = build_inputs(planning_devices(NODE, device_reserve_bytes=0), [v], live)
        assert inputs.current == (Assignment("bert:1:0", 0, "gpu0"), Assignment("bert:1:1", 1, "cpu"))
        for a in inputs.current:  # and back
            key, index = inputs.instance(a)
            assert inputs.assignment(key.model, key.version, index, a.device, v.groups) == a


class TestPins:
    def test_pins_to_gpus_the_node_has(self):
        assert pin_errors(version("m", InstanceGroup(gpus=(0, 1))), planning_devices(NODE, device_reserve_bytes=0)) \
            == []

    def test_a_pin_to_a_missing_gpu_is_refused_as_triton_does(self):
        v = version("m", InstanceGroup(), InstanceGroup(gpus=(1, 5)))
        assert pin_errors(v, planning_devices(NODE, device_reserve_bytes=0)) == [
            "instance_group[1] gpus [1, 5]: the node has no GPU 5 (GPUs: 0, 1)"]
        assert pin_errors(version("m", InstanceGroup(gpus=(0,))), planning_devices([CPU], device_reserve_bytes=0)) \
            == ["instance_group[0] gpus [0]: the node has no GPU 0 (GPUs: none)"]


def test_the_registry_carries_the_compute_share_into_demands_and_refuses_a_bad_one(tmp_path):
    from gpud.examples import write_example_repository
    from gpud.scheduling import new_registry
    from gpud.repository.layout import ModelRepository

    write_example_repository(tmp_path, ["mlp", "cnn"])
    (tmp_path / "cnn" / "config.pbtxt").write_text(
        'max_batch_size: 4\nparameters { key: "gpud_compute_fraction" value: { string_value: "0.4" } }\n')
    with open(tmp_path / "mlp" / "config.pbtxt", "a") as f:
        f.write('parameters { key: "gpud_compute_fraction" value: { string_value: "2" } }\n')
    registry = new_registry(has_gpus=True)
    for name, entry in ModelRepository(tmp_path).scan().items():
        registry.register(name, entry)
    assert registry.version("cnn").demand().compute_fraction == 0.4
    assert not registry.models["mlp"].versions  # not served: the error says why
    assert "config.pbtxt: parameter gpud_compute_fraction must be a number in (0, 1]" in registry.models["mlp"].error
