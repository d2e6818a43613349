"""MIG tables against the published values, layout validation, expansion, and the layout recommender."""
from __future__ import annotations

import pytest

from gpud.placement import mig
from gpud.placement.model import ModelDemand
from gpud.placement.solver import PlannerConfig

GiB = 2**30

# Published values, written out from the sources rather than from gpud/placement/mig.py, for every GPU model and profile.
# Sources, by kind:
# - whole-GPU MiB and NVML names: real `nvidia-smi` / `nvidia-smi -L` outputs ("NVIDIA A100-SXM4-80GB ... 81920MiB",
#   "NVIDIA H100 80GB HBM3 ... 81559MiB", "NVIDIA H100 NVL ... 95830MiB", "NVIDIA H200 ... 143771MiB",
#   "NVIDIA A30 ... 24576MiB").
# - profile ids, instance counts, placements: NVIDIA MIG user guide "Supported MIG Profiles" and real
#   `nvidia-smi mig -lgip` / `-lgipp` outputs ({0..6}:1, {0,2,4,6}:2, {0,2,4}:2, {0,4}:4, {0}:4, {0}:8; A30
#   {0,1,2,3}:1, {0,2}:2, {0}:4).
# - profile MiB = `nvidia-smi mig -lgip` GiB x 1024, real outputs: A100-40GB 4.75 / 9.62 / 19.50 / 39.25;
#   A100-80GB 9.50 / 19.50 / 39.25 / 79.00 (driver 515; MIG devices read 9728 / 19968 / 40192 MiB); A30 5.81 /
#   11.69 / 23.44; H100-80GB 9.75 / 19.62 / 39.50 / 79.25; H100 NVL 10.62 / 21.50 / 46.12 / 92.62 (driver 550).
# - H200 profile MiB: real -lgip 16.00 / 32.25 / 69.50 / 139.75 GiB (NVIDIA/mig-parted issue 120).
GPUS = [  # (model, NVML name, whole-GPU MiB, compute slices, memory slots)
    ("A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", 40960, 7, 8),
    ("A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB", 81920, 7, 8),
    ("A30-24GB", "NVIDIA A30", 24576, 4, 4),
    ("H100-80GB", "NVIDIA H100 80GB HBM3", 81559, 7, 8),
    ("H100-94GB", "NVIDIA H100 NVL", 95830, 7, 8),
    ("H200-141GB", "NVIDIA H200", 143771, 7, 8),
]
_7 = (0, 1, 2, 3, 4, 5, 6)
# (GPU, profile, id, memory MiB, compute slices, max count, starts, size)
PUBLISHED = [
    ("A100-SXM4-40GB", "1g.5gb", 19, 4864, 1, 7, _7, 1),
    ("A100-SXM4-40GB", "1g.5gb+me", 20, 4864, 1, 1, _7, 1),
    ("A100-SXM4-40GB", "1g.10gb", 15, 9856, 1, 4, (0, 2, 4, 6), 2),
    ("A100-SXM4-40GB", "2g.10gb", 14, 9856, 2, 3, (0, 2, 4), 2),
    ("A100-SXM4-40GB", "3g.20gb", 9, 19968, 3, 2, (0, 4), 4),
    ("A100-SXM4-40GB", "4g.20gb", 5, 19968, 4, 1, (0,), 4),
    ("A100-SXM4-40GB", "7g.40gb", 0, 40192, 7, 1, (0,), 8),
    # A100-80GB 1g.10gb and 7g.80gb: real lgip 9.50 and 79.00 GiB (was 9856 / 80384, go-nvml's mock values)
    ("A100-SXM4-80GB", "1g.10gb", 19, 9728, 1, 7, _7, 1),
    ("A100-SXM4-80GB", "1g.10gb+me", 20, 9728, 1, 1, _7, 1),
    ("A100-SXM4-80GB", "1g.20gb", 15, 19968, 1, 4, (0, 2, 4, 6), 2),
    ("A100-SXM4-80GB", "2g.20gb", 14, 19968, 2, 3, (0, 2, 4), 2),
    ("A100-SXM4-80GB", "3g.40gb", 9, 40192, 3, 2, (0, 4), 4),
    ("A100-SXM4-80GB", "4g.40gb", 5, 40192, 4, 1, (0,), 4),
    ("A100-SXM4-80GB", "7g.80gb", 0, 80896, 7, 1, (0,), 8),
    # A30: real lgip 5.81 / 11.69 / 23.44 GiB (was 5836 / 11672 / 23344, go-nvml's mock values)
    ("A30-24GB", "1g.6gb", 14, 5952, 1, 4, (0, 1, 2, 3), 1),
    ("A30-24GB", "1g.6gb+me", 21, 5952, 1, 1, (0, 1, 2, 3), 1),
    ("A30-24GB", "2g.12gb", 5, 11968, 2, 2, (0, 2), 2),
    ("A30-24GB", "2g.12gb+me", 6, 11968, 2, 1, (0, 2), 2),
    ("A30-24GB", "4g.24gb", 0, 24000, 4, 1, (0,), 4),
    ("H100-80GB", "1g.10gb", 19, 9984, 1, 7, _7, 1),
    ("H100-80GB", "1g.10gb+me", 20, 9984, 1, 1, _7, 1),
    ("H100-80GB", "1g.20gb", 15, 20096, 1, 4, (0, 2, 4, 6), 2),
    ("H100-80GB", "2g.20gb", 14, 20096, 2, 3, (0, 2, 4), 2),
    ("H100-80GB", "3g.40gb", 9, 40448, 3, 2, (0, 4), 4),
    ("H100-80GB", "4g.40gb", 5, 40448, 4, 1, (0,), 4),
    ("H100-80GB", "7g.80gb", 0, 81152, 7, 1, (0,), 8),
    ("H100-94GB", "1g.12gb", 19, 10880, 1, 7, _7, 1),
    ("H100-94GB", "1g.12gb+me", 20, 10880, 1, 1, _7, 1),
    ("H100-94GB", "1g.24gb", 15, 22016, 1, 4, (0, 2, 4, 6), 2),
    ("H100-94GB", "2g.24gb", 14, 22016, 2, 3, (0, 2, 4), 2),
    ("H100-94GB", "3g.47gb", 9, 47232, 3, 2, (0, 4), 4),
    ("H100-94GB", "4g.47gb", 5, 47232, 4, 1, (0,), 4),
    ("H100-94GB", "7g.94gb", 0, 94848, 7, 1, (0,), 8),
    ("H200-141GB", "1g.18gb", 19, 16384, 1, 7, _7, 1),
    ("H200-141GB", "1g.18gb+me", 20, 16384, 1, 1, _7, 1),
    ("H200-141GB", "1g.35gb", 15, 33024, 1, 4, (0, 2, 4, 6), 2),
    ("H200-141GB", "2g.35gb", 14, 33024, 2, 3, (0, 2, 4), 2),
    ("H200-141GB", "3g.71gb", 9, 71168, 3, 2, (0, 4), 4),
    ("H200-141GB", "4g.71gb", 5, 71168, 4, 1, (0,), 4),
    ("H200-141GB", "7g.141gb", 0, 143104, 7, 1, (0,), 8),
]


@pytest.mark.parametrize("gpu,name,pid,mib,slices,count,starts,size", PUBLISHED)
def test_profile_tables_match_published_values(gpu, name, pid, mib, slices, count, starts, size):
    p = mig.gpu_model(gpu).profile(name)
    assert (p.profile_id, p.memory_mib, p.compute_slices, p.max_count) == (pid, mib, slices, count)
    assert p.placements == tuple((s, size) for s in starts)
    assert (p.starts, p.memory_slices, p.memory_bytes) == (starts, size, mib * 2**20)


@pytest.mark.parametrize("gpu,nvml_name,mib,compute,slots", GPUS)
def test_gpu_tables_match_published_values(gpu, nvml_name, mib, compute, slots):
    g = mig.gpu_model(gpu)
    assert (g.nvml_name, g.memory_mib, g.compute_slices, g.memory_slots) == (nvml_name, mib, compute, slots)
    assert mig.gpu_model_by_nvml_name(nvml_name) is g and mig.gpu_model(nvml_name) is g


def test_published_table_covers_every_model_and_profile():
    assert sorted(g for g, *_ in GPUS) == sorted(mig.GPU_MODELS)
    assert sorted((g, n) for g, n, *_ in PUBLISHED) == sorted(
        (g.name, p.name) for g in mig.GPU_MODELS.values() for p in g.profiles)


@pytest.mark.parametrize("gpu", sorted(mig.GPU_MODELS))
def test_every_profile_fits_the_slot_axis(gpu):
    g = mig.gpu_model(gpu)
    for p in g.profiles:
        assert all(s + size <= g.memory_slots for s, size in p.placements)
        assert p.compute_slices <= g.compute_slices
        assert p.memory_mib < g.memory_mib  # a MIG instance never has more memory than the GPU with MIG off


def test_lookup_by_alias_short_and_nvml_name():
    assert mig.gpu_model("A100-80GB") is mig.gpu_model("NVIDIA A100-SXM4-80GB") is mig.GPU_MODELS["A100-SXM4-80GB"]
    assert mig.find_gpu_model("NVIDIA Z9000") is None and mig.gpu_model_by_nvml_name("A100-SXM4-80GB") is None
    with pytest.raises(ValueError, match="unknown GPU model 'NVIDIA Z9000'"):
        mig.gpu_model("NVIDIA Z9000")


@pytest.mark.parametrize("gpu,layout,starts", [
    ("A100-80GB", ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"], [4, 0, 2, 3]),  # in the given order
    ("A100-80GB", ["4g.40gb", "3g.40gb"], [0, 4]),
    ("A100-80GB", ["1g.20gb"] * 4, [0, 2, 4, 6]),
    ("A30", ["2g.12gb", "1g.6gb", "1g.6gb"], [0, 2, 3]),
    ("A100-80GB", ["4g.40gb", "4g.40gb"], None),
    ("A100-80GB", ["3g.40gb", "3g.40gb", "1g.10gb"], None),
    ("A100-80GB", ["1g.10gb+me", "1g.10gb+me"], None),  # at most one +me instance
    ("A100-80GB", ["5g.50gb"], None),
])
def test_place_layout_gives_start_slots(gpu, layout, starts):
    got = mig.place_layout(mig.gpu_model(gpu), layout)
    assert got == starts
    if got is not None:
        sizes = [mig.gpu_model(gpu).profile(n).memory_slices for n in layout]
        used = [x for s, n in zip(got, sizes) for x in range(s, s + n)]
        assert len(used) == len(set(used))


class TestValidate:
    @pytest.mark.parametrize("gpu,layout", [
        ("A100-80GB", ["1g.10gb"] * 7),
        ("A100-80GB", ["3g.40gb", "3g.40gb"]),
        ("A100-80GB", ["4g.40gb", "2g.20gb", "1g.10gb"]),  # slots 0-3, 4-5, 6
        ("H100", ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]),  # mig-parted all-balanced
        ("A30", ["2g.12gb", "1g.6gb", "1g.6gb"]),
        ("H100", [("3g.40gb", 4), ("2g.20gb", 0), ("1g.10gb", 2)]),
    ])
    def test_valid(self, gpu, layout):
        placed = mig.validate_layout(mig.gpu_model(gpu), layout)
        slots = [x for p in placed for x in range(p.start, p.start + p.size)]
        assert len(slots) == len(set(slots))

    @pytest.mark.parametrize("gpu,layout,message", [
        ("A100-80GB", ["1g.10gb"] * 8, "at most 7 x 1g.10gb"),
        ("A100-80GB", ["4g.40gb", "4g.40gb"], "at most 1 x 4g.40gb"),
        ("A100-80GB", ["3g.40gb", "3g.40gb", "1g.10gb"], "memory slots overlap"),  # 3g takes 4 slots each
        ("H100", ["7g.80gb", "1g.10gb"], "needs 8 compute slices"),
        ("H100", [("3g.40gb", 2)], "cannot start at slot 2"),
        ("H100", ["5g.50gb"], "unknown MIG profile"),
    ])
    def test_invalid(self, gpu, layout, message):
        with pytest.raises(ValueError, match=message):
            mig.validate_layout(mig.gpu_model(gpu), layout)

    def test_seven_one_slice_placements_and_seven_slice_at_zero(self):
        g = mig.gpu_model("A100-SXM4-40GB")
        assert len(g.profile("1g.5gb").placements) == 7
        assert g.profile("7g.40gb").placements == ((0, 8),)


def test_expand_gpu_gives_leaf_devices_with_fractions():
    devs = mig.expand_gpu("gpu0", mig.gpu_model("H100"), ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"])
    assert [d.label("mig.profile") for d in devs] == ["2g.20gb", "1g.10gb", "1g.10gb", "3g.40gb"]  # by start
    assert devs[-1].compute_fraction == pytest.approx(3 / 7) and devs[-1].memory_bytes == 40448 * 2**20
    assert {d.physical_id for d in devs} == {"gpu0"}
    (full,) = mig.expand_gpu("gpu1", mig.gpu_model("H100"), None)
    assert full.kind == "gpu" and full.memory_bytes == 81559 * 2**20


def test_enumerated_layouts_are_valid_and_maximal():
    g = mig.gpu_model("A30")
    # A30: 4 x 1g | 2 x 1g + 2g | 2 x 2g | 4g
    assert mig.enumerate_layouts(g) == [("1g.6gb",) * 4, ("1g.6gb", "1g.6gb", "2g.12gb"), ("2g.12gb", "2g.12gb"),
                                        ("4g.24gb",)]


class TestRecommender:
    GPUS = [(f"gpu{i}", "A100-SXM4-80GB") for i in range(8)]

    def test_isolated_small_models_need_mig(self):
        # 14 small models that require a MIG instance: MIG off cannot serve them at all. A 7g instance holds
        # 1.0 / 0.1 = 10 by compute, so 10 + 4 -> 2 GPUs
        demands = [ModelDemand(f"s{i}", 4 * GiB, 1, compute_fraction=0.1,
                               constraints=__import__("gpud.placement.model").placement.model.Constraints(kinds=frozenset({"mig"})))
                   for i in range(14)]
        cfg = PlannerConfig(time_limit_seconds=0)
        rec = mig.recommend_layouts(self.GPUS, demands, config=cfg)
        off = mig.evaluate_layouts(self.GPUS, [None] * 8, demands, config=cfg)
        bal = mig.evaluate_layouts(self.GPUS, [mig.balanced_layout(mig.gpu_model("A100-80GB"))] * 8, demands,
                                   config=cfg)
        assert off.unplaced_instances == 14
        assert (rec.unplaced_instances, rec.gpus_used) == (0, 2)
        # balanced GPU by compute (0.1 each): 1g 1/7 -> 1, 1g -> 1, 2g 2/7 -> 2, 3g 3/7 -> 4: 8 per GPU, ceil(14/8) = 2
        assert bal.unplaced_instances == 0 and bal.gpus_used == 2
        yaml_text = mig.mig_parted_yaml(rec)
        assert "mig-enabled: true" in yaml_text and "mig-enabled: false" in yaml_text
        assert yaml_text.startswith("version: v1\nmig-configs:\n")

    def test_big_models_keep_mig_off(self):
        demands = [ModelDemand("llm", 60 * GiB, 3, compute_fraction=0.5)]
        rec = mig.recommend_layouts(self.GPUS, demands, config=PlannerConfig(time_limit_seconds=0))
        assert rec.gpus_used == 3 and all(g.layout is None for g in rec.layouts)
