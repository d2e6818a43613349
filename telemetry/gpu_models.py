"""Real GPU models and their MIG profiles as data: what the simulated node and the fake NVML are built from.

Sources (checked, not guessed):
- Whole-GPU memory is what NVML's nvmlDeviceGetMemoryInfo().total reports (nvidia-smi "Memory-Usage" column):
  A100-SXM4-80GB 81920 MiB, A100-SXM4-40GB 40960 MiB, H100 80GB HBM3 81559 MiB. Power caps are the default
  enforced limits nvidia-smi shows for the SXM boards (400 W, 400 W, 700 W).
- Per-profile memory is NVML's nvmlGpuInstanceProfileInfo_t.memorySizeMB, as `nvidia-smi mig -lgip` prints it in
  GiB with two decimals (9.50 GiB -> 9728 MiB). A100-SXM4-40GB: 4.75/9.62/19.50/39.25 GiB; A100-SXM4-80GB:
  9.50/19.50/39.25/79.00 GiB; H100 80GB HBM3: 9.75/19.62/39.50/79.25 GiB. Some drivers report a little more for
  the same profile (e.g. 9.75 GiB for the A100-40GB 2g.10gb): the memory a MIG device really reports is read from
  NVML at run time; these tables are what a simulated node promises.
- Profile ids (the "ID" column of -lgip, NVML's profileId) and placements (start slot, size in memory slices of
  8) follow NVML: 1g = 19, 1g+me = 20, 1g with 2 memory slices = 15, 2g = 14, 3g = 9, 4g = 5, 7g = 0.
"""
from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20

# NVML's nvmlDeviceGetGpuInstanceProfileInfo takes a profile *index* (NVML_GPU_INSTANCE_PROFILE_*), the info
# it returns carries the profile *id*. Index values are from nvml.h / pynvml.
NVML_GPU_INSTANCE_PROFILE_1_SLICE = 0
NVML_GPU_INSTANCE_PROFILE_2_SLICE = 1
NVML_GPU_INSTANCE_PROFILE_3_SLICE = 2
NVML_GPU_INSTANCE_PROFILE_4_SLICE = 3
NVML_GPU_INSTANCE_PROFILE_7_SLICE = 4
NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 = 7
NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 = 9

MEMORY_SLICES = 8  # MIG placements are expressed in eighths of the GPU's memory
COMPUTE_SLICES = 7


@dataclass(frozen=True)
class MigProfileSpec:
    name: str  # "3g.40gb"
    profile_index: int  # NVML_GPU_INSTANCE_PROFILE_* (the argument of nvmlDeviceGetGpuInstanceProfileInfo)
    profile_id: int  # NVML profileId (what nvmlGpuInstanceGetInfo returns, nvidia-smi's "ID")
    compute_slices: int  # of 7
    memory_slices: int  # placement size, of 8
    placement_starts: tuple[int, ...]  # valid start slots
    memory_bytes: int  # NVML memorySizeMB * MiB

    @property
    def compute_fraction(self) -> float:
        return self.compute_slices / COMPUTE_SLICES


@dataclass(frozen=True)
class GpuModelSpec:
    name: str  # exactly as nvmlDeviceGetName reports it
    memory_total_bytes: int
    power_limit_w: float
    mig_profiles: tuple[MigProfileSpec, ...] = ()

    def mig_profile(self, name: str) -> MigProfileSpec | None:
        for p in self.mig_profiles:
            if p.name == name:
                return p
        return None


def _profiles(mib: dict[str, int], names: dict[str, str]) -> tuple[MigProfileSpec, ...]:
    # Placement geometry is the same on A100 and H100: only the names and sizes differ.
    geometry = {  # key: (profile_index, profile_id, compute slices, memory slices, starts)
        "1g": (NVML_GPU_INSTANCE_PROFILE_1_SLICE, 19, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
        "1g+me": (NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
        "1g.2x": (NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, 1, 2, (0, 2, 4, 6)),
        "2g": (NVML_GPU_INSTANCE_PROFILE_2_SLICE, 14, 2, 2, (0, 2, 4)),
        "3g": (NVML_GPU_INSTANCE_PROFILE_3_SLICE, 9, 3, 4, (0, 4)),
        "4g": (NVML_GPU_INSTANCE_PROFILE_4_SLICE, 5, 4, 4, (0,)),
        "7g": (NVML_GPU_INSTANCE_PROFILE_7_SLICE, 0, 7, 8, (0,)),
    }
    out = []
    for key, name in names.items():
        index, pid, cs, ms, starts = geometry[key]
        out.append(MigProfileSpec(name, index, pid, cs, ms, starts, mib[key] * MIB))
    return tuple(out)


A100_SXM4_80GB = GpuModelSpec(
    name="NVIDIA A100-SXM4-80GB",
    memory_total_bytes=81920 * MIB,
    power_limit_w=400.0,
    mig_profiles=_profiles(
        {"1g": 9728, "1g+me": 9728, "1g.2x": 19968, "2g": 19968, "3g": 40192, "4g": 40192, "7g": 80896},
        {"1g": "1g.10gb", "1g+me": "1g.10gb+me", "1g.2x": "1g.20gb", "2g": "2g.20gb", "3g": "3g.40gb",
         "4g": "4g.40gb", "7g": "7g.80gb"},
    ),
)

A100_SXM4_40GB = GpuModelSpec(
    name="NVIDIA A100-SXM4-40GB",
    memory_total_bytes=40960 * MIB,
    power_limit_w=400.0,
    mig_profiles=_profiles(
        {"1g": 4864, "1g+me": 4864, "1g.2x": 9856, "2g": 9856, "3g": 19968, "4g": 19968, "7g": 40192},
        {"1g": "1g.5gb", "1g+me": "1g.5gb+me", "1g.2x": "1g.10gb", "2g": "2g.10gb", "3g": "3g.20gb",
         "4g": "4g.20gb", "7g": "7g.40gb"},
    ),
)

H100_SXM5_80GB = GpuModelSpec(
    name="NVIDIA H100 80GB HBM3",
    memory_total_bytes=81559 * MIB,
    power_limit_w=700.0,
    mig_profiles=_profiles(
        {"1g": 9984, "1g+me": 9984, "1g.2x": 20096, "2g": 20096, "3g": 40448, "4g": 40448, "7g": 81152},
        {"1g": "1g.10gb", "1g+me": "1g.10gb+me", "1g.2x": "1g.20gb", "2g": "2g.20gb", "3g": "3g.40gb",
         "4g": "4g.40gb", "7g": "7g.80gb"},
    ),
)

GPU_MODELS: dict[str, GpuModelSpec] = {m.name: m for m in (A100_SXM4_80GB, A100_SXM4_40GB, H100_SXM5_80GB)}


def place_mig_layout(model: GpuModelSpec, profiles: list[MigProfileSpec]) -> list[int] | None:
    """Start slots for each profile (in the given order) so that no two overlap, or None if the layout cannot
    exist on one GPU. A small backtracking search: at most 7 instances, a handful of starts each."""
    if sum(p.compute_slices for p in profiles) > COMPUTE_SLICES:
        return None
    order = sorted(range(len(profiles)), key=lambda i: -profiles[i].memory_slices)  # big ones first prune most
    used = [False] * MEMORY_SLICES
    starts: list[int] = [0] * len(profiles)

    def fit(k: int) -> bool:
        if k == len(order):
            return True
        p = profiles[order[k]]
        for s in p.placement_starts:
            span = range(s, s + p.memory_slices)
            if span.stop <= MEMORY_SLICES and not any(used[i] for i in span):
                for i in span:
                    used[i] = True
                starts[order[k]] = s
                if fit(k + 1):
                    return True
                for i in span:
                    used[i] = False
        return False

    return starts if fit(0) else None
