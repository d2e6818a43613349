"""The simulated node: node files, MIG layout validation, readings only from the UsageSource."""
from __future__ import annotations

import filecmp
from pathlib import Path

import pytest

from gpud.telemetry.devices import DeviceBackend
from gpud.placement.mig import GPU_MODELS, MIB, balanced_layout, gpu_model, place_layout
from gpud.telemetry.simulated import DEFAULT_NODE_FILE, SimulatedBackend, load_node

REPO = Path(__file__).resolve().parent.parent
A100_SXM4_40GB = gpu_model("NVIDIA A100-SXM4-40GB")  # node files name GPUs as NVML does
A100_SXM4_80GB = gpu_model("NVIDIA A100-SXM4-80GB")
H100_SXM5_80GB = gpu_model("NVIDIA H100 80GB HBM3")


class RecordedUsage:
    """What the executor would report: per-device memory held and busy ratio."""

    def __init__(self, memory: dict[str, int], busy: dict[str, float]):
        self.memory, self.busy = memory, busy

    def memory_used_bytes(self, device_id: str) -> int | None:
        return self.memory.get(device_id)

    def utilization_ratio(self, device_id: str) -> float | None:
        return self.busy.get(device_id)

    def unhealthy_reason(self, device_id: str) -> str | None:
        return None


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "node.yaml"
    p.write_text(text)
    return str(p)


class TestDefaultNode:
    def test_layout(self):
        b = SimulatedBackend.from_file(DEFAULT_NODE_FILE)
        assert isinstance(b, DeviceBackend)
        assert [d.id for d in b.devices()] == [
            "gpu0", "gpu1", "gpu1/mig1.0", "gpu1/mig2.0", "gpu1/mig3.0", "gpu1/mig4.0", "cpu"]
        assert [d.id for d in b.leaf_devices()] == [
            "gpu0", "gpu1/mig1.0", "gpu1/mig2.0", "gpu1/mig3.0", "gpu1/mig4.0", "cpu"]
        by_id = {d.id: d for d in b.devices()}
        assert by_id["gpu0"].memory_total_bytes == 81920 * MIB
        # NVML memorySizeMB: 3g.40gb 40192, 2g.20gb 19968, 1g.10gb 9728 MiB on A100-SXM4-80GB
        assert [by_id[f"gpu1/mig{i}.0"].memory_total_bytes // MIB for i in (1, 2, 3, 4)] == [40192, 19968, 9728, 9728]
        # 3/7 + 2/7 + 1/7 + 1/7 = 1: the whole GPU's compute
        assert sum(d.compute_fraction for d in b.devices() if d.kind == "mig") == pytest.approx(1.0)
        assert all(d.simulated for d in b.devices())
        assert by_id["gpu1/mig1.0"].uuid.startswith("MIG-") and by_id["gpu1"].uuid.startswith("GPU-")
        assert b.source == f"simulated:{DEFAULT_NODE_FILE}"

    def test_ids_and_uuids_are_stable(self):
        a = SimulatedBackend.from_file(DEFAULT_NODE_FILE).devices()
        b = SimulatedBackend.from_file(DEFAULT_NODE_FILE).devices()
        assert [(d.id, d.uuid) for d in a] == [(d.id, d.uuid) for d in b]

    def test_packaged_copies_match_config(self):
        for f in (REPO / "config" / "nodes").glob("*.yaml"):
            packaged = REPO / "gpud" / "telemetry" / "nodes" / f.name
            assert packaged.is_file() and filecmp.cmp(f, packaged, shallow=False), f.name

    @pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "config" / "nodes").glob("*.yaml")))
    def test_every_shipped_node_loads(self, name):
        assert load_node(REPO / "config" / "nodes" / name)[-1].id == "cpu"

    def test_h100_node(self):
        devices = load_node(REPO / "config" / "nodes" / "hgx-h100-4gpu-mig.yaml")
        migs = [d for d in devices if d.kind == "mig"]
        assert len(migs) == 2 + 7
        assert {d.name for d in devices if d.kind == "gpu"} == {"NVIDIA H100 80GB HBM3"}
        assert migs[0].memory_total_bytes == 40448 * MIB and migs[-1].memory_total_bytes == 9984 * MIB


class TestReadings:
    def test_only_from_usage_source(self):
        usage = RecordedUsage({"gpu0": 5 * 2**30, "gpu1/mig1.0": 2**30, "gpu1/mig3.0": 2**29},
                              {"gpu0": 0.5, "gpu1/mig1.0": 0.125})
        b = SimulatedBackend.from_file(DEFAULT_NODE_FILE, usage)
        r = b.sample("gpu0")
        assert (r.memory_used_bytes, r.utilization_ratio) == (5 * 2**30, 0.5)
        # the board follows the load through the A100-SXM4-80GB power model: 60 + 0.5 * (400 - 60) W, 32 + 0.5 * 38 C
        assert (r.power_w, r.power_limit_w, r.temperature_c) == (230.0, 400.0, 51.0)
        assert b.sample("gpu1/mig2.0").memory_used_bytes is None  # nothing loaded there: unknown, not invented
        parent = b.sample("gpu1")
        assert parent.memory_used_bytes == 2**30 + 2**29  # sum of its MIG instances
        assert parent.utilization_ratio is None

    def test_no_usage_means_all_none(self):
        r = SimulatedBackend.from_file(DEFAULT_NODE_FILE).sample("cpu")
        assert (r.memory_used_bytes, r.utilization_ratio) == (None, None) and r.healthy

    def test_unknown_device(self):
        with pytest.raises(KeyError):
            SimulatedBackend.from_file(DEFAULT_NODE_FILE).sample("gpu7")


class TestValidation:
    @pytest.mark.parametrize("text, field_words", [
        ("gpus: [\n", "not valid YAML"),
        ("- 1\n", "top level must be a mapping"),
        ("gpus:\n  - model: NVIDIA A100-SXM4-80GB\ncolour: red\n", "top level: unknown field 'colour'"),
        ("gpus:\n  - model: NVIDIA A100-SXM4-80GB\n    memroy: 1\n", "gpus[0]: unknown field 'memroy'"),
        ("gpus:\n  - pci_bus_id: x\n", "gpus[0].model: required"),
        ("gpus:\n  - model: NVIDIA Z9000\n", "gpus[0].model: unknown GPU model 'NVIDIA Z9000'"),
        ("gpus:\n  - model: NVIDIA A100-SXM4-80GB\n    mig: [5g.50gb]\n", "gpus[0].mig[0]: unknown MIG profile '5g.50gb'"),
        ("gpus:\n  - model: NVIDIA A100-SXM4-80GB\n    mig: [4g.40gb, 4g.40gb]\n", "gpus[0].mig: layout 4g.40gb + 4g.40gb does not fit"),
        ("gpus:\n  - model: NVIDIA A100-SXM4-80GB\n    mig: [3g.40gb, 3g.40gb, 1g.10gb, 1g.10gb]\n", "8 of 7 compute slices"),
        ("gpus:\n  - model: NVIDIA A100-SXM4-80GB\n    mig: []\n", "gpus[0].mig: must be a non-empty list"),
        ("gpus:\n  - model: Some GPU\n    memory_total_bytes: 1024\n    mig: [1g.10gb]\n", "has no known MIG profiles"),
        ("gpus:\n  - model: NVIDIA A100-SXM4-80GB\n    memory_total_bytes: -1\n", "memory_total_bytes: must be a positive integer"),
        ("gpus:\n  - model: NVIDIA A100-SXM4-80GB\n    mig:\n      - {profile: 3g.40gb, gpu_instance_id: 2}\n      - {profile: 3g.40gb, gpu_instance_id: 2}\n", "gpu_instance_id: 2 is used twice"),
        ("gpus: 3\n", "gpus: must be a list"),
    ])
    def test_errors_name_file_and_field(self, tmp_path, text, field_words):
        path = write(tmp_path, text)
        with pytest.raises(ValueError) as exc:
            load_node(path)
        assert str(exc.value).startswith(f"{path}: ")
        assert field_words in str(exc.value)

    def test_missing_file(self, tmp_path):
        with pytest.raises(ValueError, match="cannot read node file"):
            load_node(tmp_path / "nope.yaml")

    def test_unknown_model_with_memory_is_allowed(self, tmp_path):
        devices = load_node(write(tmp_path, "gpus:\n  - model: NVIDIA L4\n    memory_total_bytes: 24000000000\n"))
        assert devices[0].memory_total_bytes == 24_000_000_000 and not devices[0].mig_enabled


class TestMigPlacement:
    """Real MIG geometry: 8 memory slots; 1g anywhere in 0..6, 2g at 0/2/4, 3g at 0/4, 4g at 0, 7g at 0."""

    @pytest.mark.parametrize("model, layout, fits", [
        (A100_SXM4_80GB, ["1g.10gb"] * 7, True),            # seven 1-slice instances
        (A100_SXM4_80GB, ["1g.10gb"] * 8, False),           # 8 > 7 compute slices
        (A100_SXM4_80GB, ["7g.80gb"], True),
        (A100_SXM4_80GB, ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"], True),  # 3g at 4, 2g at 0, 1g at 2 and 3
        (A100_SXM4_80GB, ["4g.40gb", "3g.40gb"], True),     # 4g at 0 (0-3), 3g at 4 (4-7)
        (A100_SXM4_80GB, ["4g.40gb", "2g.20gb", "2g.20gb"], False),  # 8 compute slices
        (A100_SXM4_80GB, ["3g.40gb", "3g.40gb", "1g.10gb"], False),  # 3g+3g take all 8 memory slots
        (A100_SXM4_80GB, ["1g.20gb"] * 4, True),            # 2 memory slots each, at 0/2/4/6
        (A100_SXM4_40GB, ["2g.10gb"] * 3 + ["1g.5gb"], True),
        (H100_SXM5_80GB, ["3g.40gb", "3g.40gb"], True),
    ])
    def test_layouts(self, model, layout, fits):
        assert (place_layout(model, layout) is not None) == fits


class TestOneTable:
    """The simulated node reads gpud.placement.mig, the planner's table: every model there is a valid node-file GPU."""

    @pytest.mark.parametrize("name", sorted(GPU_MODELS))
    def test_every_placement_model_loads_by_nvml_name(self, tmp_path, name):
        model = GPU_MODELS[name]
        layout = balanced_layout(model)
        devices = load_node(write(tmp_path, f"gpus:\n  - model: {model.nvml_name}\n    mig: [{', '.join(layout)}]\n"))
        gpu, migs = devices[0], [d for d in devices if d.kind == "mig"]
        assert (gpu.name, gpu.memory_total_bytes) == (model.nvml_name, model.memory_mib * MIB)
        assert [(d.mig_profile, d.memory_total_bytes) for d in migs] == [
            (p, model.profile(p).memory_mib * MIB) for p in layout]
        assert sum(d.compute_fraction for d in migs) == pytest.approx(
            sum(model.profile(p).compute_slices for p in layout) / model.compute_slices)

    def test_a30_has_four_compute_slices(self, tmp_path):
        path = write(tmp_path, "gpus:\n  - model: NVIDIA A30\n    mig: [2g.12gb, 2g.12gb, 1g.6gb]\n")
        with pytest.raises(ValueError, match="5 of 4 compute slices"):
            load_node(path)
