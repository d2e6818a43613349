"""MIG as data: GPU instance profile tables, layout validation, expansion into leaf devices, and a layout recommender.

This module is gpud's single table of GPU models and their MIG profiles: the planner, `gpudctl place`, the simulated
node (gpud.telemetry.simulated) and the test fake of NVML all read it. It is pure data and computation (no I/O, no
NVML).

Sources (checked while writing these tables; the kind of source is named next to each value below):
- Profile names, profile ids, slice counts, instance counts and placements (start:size on the memory-slot axis):
  NVIDIA MIG user guide, "Supported MIG Profiles" (docs.nvidia.com/datacenter/tesla/mig-user-guide/), and real
  `nvidia-smi mig -lgip` / `-lgipp` outputs (ids: 19 = 1g, 20 = 1g+me, 15 = 1g with 2 memory slices, 14 = 2g,
  9 = 3g, 5 = 4g, 0 = 7g; A30: 14 = 1g.6gb, 21 = 1g.6gb+me, 5 = 2g.12gb, 6 = 2g.12gb+me, 0 = 4g.24gb).
  NVIDIA's go-nvml mock tables (pkg/nvml/mock/shared/gpus/*.go) are NOT used for ids or placements: they key
  profiles by NVML profile *index*, give 1g.2x profiles size-1 placements and 3g size 3, which real drivers don't.
- Memory in MiB as NVML reports it (nvmlGpuInstanceProfileInfo_t.memorySizeMB; `nvidia-smi mig -lgip` prints it
  in GiB with two decimals, MiB = GiB * 1024, and the MIG device's "Memory-Usage" total shows the MiB directly).
  Values differ by a few hundred MiB between driver branches (e.g. A100-SXM4-80GB 7g.80gb: 78.75 / 79.00 /
  79.12 GiB seen): a live gpud reads them from NVML; these tables are what placement and a simulated node assume.
- Whole-GPU memory is nvmlDeviceGetMemoryInfo().total (nvidia-smi "Memory-Usage" column) with MIG off, and the
  NVML name is nvmlDeviceGetName() (nvidia-smi "Name" column, `nvidia-smi -L`), both from real nvidia-smi outputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence

from gpud.placement.model import Device, ModelDemand, Plan

MIB = 2**20


@dataclass(frozen=True)
class MigProfile:
    profile_id: int  # NVML profileId, the "ID" column of `nvidia-smi mig -lgip`
    name: str  # e.g. "3g.40gb"
    memory_mib: int  # as NVML reports it (memorySizeMB)
    compute_slices: int
    max_count: int  # the "Instances Total" column of -lgip
    placements: tuple[tuple[int, int], ...]  # valid (start, size) on the memory-slot axis

    @property
    def media_extensions(self) -> bool:
        return self.name.endswith("+me")

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB

    @property
    def memory_slices(self) -> int:
        """Placement size on the memory-slot axis (the same for every valid start)."""
        return self.placements[0][1]

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.placements)


@dataclass(frozen=True)
class GpuModel:
    name: str  # gpud's short name, e.g. "A100-SXM4-80GB" (what `gpudctl place` and spec files use)
    nvml_name: str  # exactly as nvmlDeviceGetName reports it, e.g. "NVIDIA A100-SXM4-80GB"
    memory_mib: int  # the full GPU with MIG off, as NVML reports it
    compute_slices: int  # 7 (4 on A30)
    memory_slots: int  # 8 (4 on A30)
    profiles: tuple[MigProfile, ...]

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB

    def find_profile(self, name: str) -> MigProfile | None:
        """The profile named `name` ("3g.40gb", "MIG 3g.40gb" or its profile id as a string), or None."""
        key = name.removeprefix("MIG ").strip()
        for p in self.profiles:
            if p.name == key or str(p.profile_id) == key:
                return p
        return None

    def profile(self, name: str) -> MigProfile:
        p = self.find_profile(name)
        if p is None:
            raise ValueError(f"{self.name}: unknown MIG profile {name!r}; known: {[p.name for p in self.profiles]}")
        return p


def _p(pid, name, mib, slices, count, starts, size) -> MigProfile:
    return MigProfile(pid, name, mib, slices, count, tuple((s, size) for s in starts))


_SEVEN = range(7)
GPU_MODELS: dict[str, GpuModel] = {g.name: g for g in (
    # A100-SXM4-40GB. Whole GPU 40960 MiB (nvidia-smi). Profile MiB: real -lgip outputs (4.75 / 9.62 / 19.50 /
    # 39.25 GiB; some drivers print 9.75 / 19.62 for the 2-slice and 3-slice sizes), same as go-nvml's a100.go.
    GpuModel("A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", 40960, 7, 8, (
        _p(19, "1g.5gb", 4864, 1, 7, _SEVEN, 1), _p(20, "1g.5gb+me", 4864, 1, 1, _SEVEN, 1),
        _p(15, "1g.10gb", 9856, 1, 4, (0, 2, 4, 6), 2), _p(14, "2g.10gb", 9856, 2, 3, (0, 2, 4), 2),
        _p(9, "3g.20gb", 19968, 3, 2, (0, 4), 4), _p(5, "4g.20gb", 19968, 4, 1, (0,), 4),
        _p(0, "7g.40gb", 40192, 7, 1, (0,), 8))),
    # A100-SXM4-80GB. Whole GPU 81920 MiB (nvidia-smi). Profile MiB: real -lgip outputs on A100 80GB boards
    # (driver 515: 9.50 / 19.50 / 39.25 / 79.00 GiB, and the MIG devices' Memory-Usage totals 9728 / 19968 /
    # 40192 MiB). go-nvml's mock says 9856 and 80384 MiB for 1g.10gb and 7g.80gb; no real output shows those.
    GpuModel("A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB", 81920, 7, 8, (
        _p(19, "1g.10gb", 9728, 1, 7, _SEVEN, 1), _p(20, "1g.10gb+me", 9728, 1, 1, _SEVEN, 1),
        _p(15, "1g.20gb", 19968, 1, 4, (0, 2, 4, 6), 2), _p(14, "2g.20gb", 19968, 2, 3, (0, 2, 4), 2),
        _p(9, "3g.40gb", 40192, 3, 2, (0, 4), 4), _p(5, "4g.40gb", 40192, 4, 1, (0,), 4),
        _p(0, "7g.80gb", 80896, 7, 1, (0,), 8))),
    # A30 (NVML name "NVIDIA A30"). Whole GPU 24576 MiB (nvidia-smi; an old driver showed 24258). Profile MiB: real
    # -lgip outputs (5.81 / 11.69 / 23.44 GiB -> 5952 / 11968 / 24000 MiB) and -lgipp placements ({0,1,2,3}:1,
    # {0,2}:2, {0}:4). go-nvml's mock says 5836 / 11672 / 23344 MiB; no real output shows those.
    GpuModel("A30-24GB", "NVIDIA A30", 24576, 4, 4, (
        _p(14, "1g.6gb", 5952, 1, 4, (0, 1, 2, 3), 1), _p(21, "1g.6gb+me", 5952, 1, 1, (0, 1, 2, 3), 1),
        _p(5, "2g.12gb", 11968, 2, 2, (0, 2), 2), _p(6, "2g.12gb+me", 11968, 2, 1, (0, 2), 2),
        _p(0, "4g.24gb", 24000, 4, 1, (0,), 4))),
    # H100 SXM5 80GB (NVML name "NVIDIA H100 80GB HBM3"). Whole GPU 81559 MiB (nvidia-smi). Profile MiB: real
    # -lgip outputs 9.75 / 19.62 / 39.50 / 79.25 GiB -> 9984 / 20096 / 40448 / 81152 MiB (newer drivers print
    # 9.62 / 19.50 for the two small sizes).
    GpuModel("H100-80GB", "NVIDIA H100 80GB HBM3", 81559, 7, 8, (
        _p(19, "1g.10gb", 9984, 1, 7, _SEVEN, 1), _p(20, "1g.10gb+me", 9984, 1, 1, _SEVEN, 1),
        _p(15, "1g.20gb", 20096, 1, 4, (0, 2, 4, 6), 2), _p(14, "2g.20gb", 20096, 2, 3, (0, 2, 4), 2),
        _p(9, "3g.40gb", 40448, 3, 2, (0, 4), 4), _p(5, "4g.40gb", 40448, 4, 1, (0,), 4),
        _p(0, "7g.80gb", 81152, 7, 1, (0,), 8))),
    # H100 NVL 94GB (NVML name "NVIDIA H100 NVL"). Whole GPU 95830 MiB (nvidia-smi). Profile MiB: real -lgip output
    # on driver 550 (10.62 / 21.50 / 46.12 / 92.62 GiB -> 10880 / 22016 / 47232 / 94848 MiB; the 1g.12gb MIG
    # devices' Memory-Usage total reads 10880 MiB). Other drivers print 10.75 / 21.62 / 46.38.
    GpuModel("H100-94GB", "NVIDIA H100 NVL", 95830, 7, 8, (
        _p(19, "1g.12gb", 10880, 1, 7, _SEVEN, 1), _p(20, "1g.12gb+me", 10880, 1, 1, _SEVEN, 1),
        _p(15, "1g.24gb", 22016, 1, 4, (0, 2, 4, 6), 2), _p(14, "2g.24gb", 22016, 2, 3, (0, 2, 4), 2),
        _p(9, "3g.47gb", 47232, 3, 2, (0, 4), 4), _p(5, "4g.47gb", 47232, 4, 1, (0,), 4),
        _p(0, "7g.94gb", 94848, 7, 1, (0,), 8))),
    # H200 SXM 141GB (NVML name "NVIDIA H200", `nvidia-smi -L`). Whole GPU 143771 MiB (nvidia-smi). Profile MiB
    # from a real `nvidia-smi mig -lgip` (an 8x H200 node, NVIDIA/mig-parted issue 120): 16.00 / 32.25 / 69.50 /
    # 139.75 GiB. (go-nvml's mock has nominal sizes x 1024, e.g. 7g.141gb 144384 MiB, more than the whole GPU.)
    GpuModel("H200-141GB", "NVIDIA H200", 143771, 7, 8, (
        _p(19, "1g.18gb", 16384, 1, 7, _SEVEN, 1), _p(20, "1g.18gb+me", 16384, 1, 1, _SEVEN, 1),
        _p(15, "1g.35gb", 33024, 1, 4, (0, 2, 4, 6), 2), _p(14, "2g.35gb", 33024, 2, 3, (0, 2, 4), 2),
        _p(9, "3g.71gb", 71168, 3, 2, (0, 4), 4), _p(5, "4g.71gb", 71168, 4, 1, (0,), 4),
        _p(0, "7g.141gb", 143104, 7, 1, (0,), 8))),
)}
ALIASES = {"A100-40GB": "A100-SXM4-40GB", "A100-80GB": "A100-SXM4-80GB", "A30": "A30-24GB",
           "H100": "H100-80GB", "H100-SXM5-80GB": "H100-80GB", "H100-NVL": "H100-94GB", "H100-94GB-NVL": "H100-94GB",
           "H200": "H200-141GB"}
# NVML device name -> model, for what nvmlDeviceGetName reports (node files spell GPUs this way)
NVML_NAMES: dict[str, GpuModel] = {g.nvml_name: g for g in GPU_MODELS.values()}


def find_gpu_model(name: str) -> GpuModel | None:
    """The model for a short name ("A100-SXM4-80GB"), an alias ("A100-80GB") or an NVML device name
    ("NVIDIA A100-SXM4-80GB"); None if unknown."""
    return GPU_MODELS.get(ALIASES.get(name, name)) or NVML_NAMES.get(name)


def gpu_model(name: str) -> GpuModel:
    model = find_gpu_model(name)
    if model is None:
        raise ValueError(f"unknown GPU model {name!r}; known: {sorted(GPU_MODELS)} "
                         f"(aliases {sorted(ALIASES)}; NVML names {sorted(NVML_NAMES)})")
    return model


def gpu_model_by_nvml_name(nvml_name: str) -> GpuModel | None:
    """The model whose nvmlDeviceGetName is exactly `nvml_name`, or None."""
    return NVML_NAMES.get(nvml_name)


@dataclass(frozen=True)
class PlacedInstance:
    profile: MigProfile
    start: int
    size: int


def validate_layout(model: GpuModel, layout: Sequence[str | tuple[str, int]]) -> tuple[PlacedInstance, ...]:
    """Check a MIG layout (profile names, optionally with a start slot) and give every instance a placement.
    Raises ValueError naming the instance that does not fit. Placement is a small exact search, so any layout that
    has a valid arrangement is accepted."""
    wanted: list[tuple[MigProfile, int | None]] = []
    for k, entry in enumerate(layout):
        name, start = (entry, None) if isinstance(entry, str) else entry
        p = model.profile(name)
        if start is not None and (start, p.placements[0][1]) not in p.placements:
            raise ValueError(f"{model.name}: instance {k} ({p.name}) cannot start at slot {start}; valid starts: "
                             f"{[s for s, _ in p.placements]}")
        wanted.append((p, start))
    counts: dict[str, int] = {}
    for p, _ in wanted:
        counts[p.name] = counts.get(p.name, 0) + 1
        if counts[p.name] > p.max_count:
            raise ValueError(f"{model.name}: at most {p.max_count} x {p.name}, layout has {counts[p.name]}")
    if sum(1 for p, _ in wanted if p.media_extensions) > 1:
        raise ValueError(f"{model.name}: at most one +me instance per GPU")
    slices = sum(p.compute_slices for p, _ in wanted)
    if slices > model.compute_slices:
        raise ValueError(f"{model.name}: layout needs {slices} compute slices, the GPU has {model.compute_slices}")
    order = sorted(range(len(wanted)), key=lambda k: (wanted[k][1] is None, -wanted[k][0].placements[0][1]))
    used = [False] * model.memory_slots
    chosen: dict[int, tuple[int, int]] = {}

    def place(j: int) -> bool:
        if j == len(order):
            return True
        k = order[j]
        p, start = wanted[k]
        for s, size in p.placements:
            if start is not None and s != start:
                continue
            if s + size > model.memory_slots or any(used[s:s + size]):
                continue
            for x in range(s, s + size):
                used[x] = True
            chosen[k] = (s, size)
            if place(j + 1):
                return True
            for x in range(s, s + size):
                used[x] = False
        return False

    if not place(0):
        raise ValueError(f"{model.name}: no valid placement for layout {[p.name for p, _ in wanted]} "
                         f"(memory slots overlap)")
    return tuple(PlacedInstance(wanted[k][0], *chosen[k]) for k in range(len(wanted)))


def place_layout(model: GpuModel, layout: Sequence[str | tuple[str, int]]) -> list[int] | None:
    """Start slots for each instance of a layout (in the given order), or None if the layout cannot exist on one
    GPU of this model (unknown profile, too many of a profile, more than one +me, too many compute slices, or no
    non-overlapping placement). validate_layout says why."""
    try:
        return [p.start for p in validate_layout(model, layout)]
    except ValueError:
        return None


def expand_gpu(gpu_id: str, model: GpuModel, layout: Sequence[str | tuple[str, int]] | None, *,
               healthy: bool = True, labels: dict[str, str] | None = None) -> list[Device]:
    """Leaf devices of one GPU: itself with MIG off (layout None), else one device per MIG instance."""
    base = {"gpu.model": model.name, **(labels or {})}
    if layout is None:
        return [Device(gpu_id, model.memory_mib * MIB, 1.0, "gpu", healthy, tuple(base.items()))]
    placed = validate_layout(model, layout)
    out = []
    for k, inst in enumerate(sorted(placed, key=lambda x: x.start)):
        p = inst.profile
        out.append(Device(f"{gpu_id}/mig{k}:{p.name}@{inst.start}", p.memory_mib * MIB,
                          p.compute_slices / model.compute_slices, "mig", healthy,
                          tuple({**base, "mig.profile": p.name, "mig.start": str(inst.start)}.items()),
                          parent_id=gpu_id))
    return out


def enumerate_layouts(model: GpuModel) -> list[tuple[str, ...]]:
    """Every maximal valid layout (no +me profiles): no further instance can be added to it."""
    profiles = [p for p in model.profiles if not p.media_extensions]
    results: set[tuple[str, ...]] = set()

    def valid(names: list[str]) -> bool:
        try:
            validate_layout(model, names)
            return True
        except ValueError:
            return False

    def grow(names: list[str], start_index: int) -> None:
        extended = False
        for k in range(len(profiles)):
            cand = names + [profiles[k].name]
            if valid(cand):
                extended = True
                if k >= start_index:
                    grow(cand, k)
        if not extended:
            results.add(tuple(sorted(names)))

    grow([], 0)
    return sorted(results)


def balanced_layout(model: GpuModel) -> tuple[str, ...]:
    """mig-parted's "all-balanced": 2 x 1g, 1 x 2g, 1 x 3g on 7-slice GPUs; 2 x 1g, 1 x 2g on the A30."""
    one = next(p.name for p in model.profiles if p.compute_slices == 1 and not p.media_extensions)
    two = next(p.name for p in model.profiles if p.compute_slices == 2 and not p.media_extensions)
    if model.compute_slices == 4:
        return (one, one, two)
    three = next(p.name for p in model.profiles if p.compute_slices == 3)
    return (one, one, two, three)


# -------------------------------------------------------------------------------------------------------------
# layout recommender

@dataclass(frozen=True)
class GpuLayout:
    gpu_id: str
    model: str
    layout: tuple[str, ...] | None  # None = MIG off


@dataclass(frozen=True)
class MigRecommendation:
    layouts: tuple[GpuLayout, ...]
    gpus_used: int  # physical GPUs holding at least one instance
    unplaced_instances: int
    plan: Plan  # over the expanded devices


def _gpus_used(plan: Plan, devices: Sequence[Device]) -> int:
    phys = {d.id: d.physical_id for d in devices}
    return len({phys[a.device] for a in plan.placements})


def evaluate_layouts(gpus: Sequence[tuple[str, str]], layouts: Sequence[tuple[str, ...] | None],
                     demands: Sequence[ModelDemand], *, config=None, clock=None) -> MigRecommendation:
    """Plan the demands on the given per-GPU layouts and count the physical GPUs used."""
    from gpud.placement.solver import PlannerConfig, plan

    devices: list[Device] = []
    for (gpu_id, model_name), layout in zip(gpus, layouts):
        devices += expand_gpu(gpu_id, gpu_model(model_name), layout)
    kwargs = {"clock": clock} if clock else {}
    p = plan(devices, demands, config=config or PlannerConfig(time_limit_seconds=0.5), **kwargs)
    return MigRecommendation(
        tuple(GpuLayout(g, m, tuple(lay) if lay is not None else None) for (g, m), lay in zip(gpus, layouts)),
        _gpus_used(p, devices), sum(1 for _ in p.unplaced), p)


def recommend_layouts(gpus: Sequence[tuple[str, str]], demands: Sequence[ModelDemand], *, config=None,
                      clock=None) -> MigRecommendation:
    """Choose per GPU a MIG layout (or MIG off) so the demand is served on the fewest GPUs. Greedy over GPUs: each
    next GPU takes the candidate layout (all maximal layouts and MIG off) that places the most remaining memory
    demand, preferring MIG off on ties (fewer CUDA contexts); the final placement is re-planned over all GPUs."""
    from gpud.placement.framework import NodeState, eligible_devices
    from gpud.placement.solver import PlannerConfig, greedy

    remaining = [(d, i) for d in demands for i in range(d.instances)]
    chosen: list[tuple[str, ...] | None] = []
    cache: dict[str, list[tuple[str, ...] | None]] = {}
    for gpu_id, model_name in gpus:
        model = gpu_model(model_name)
        if not remaining:
            chosen.append(None)
            continue
        cands = cache.setdefault(model.name, [None] + enumerate_layouts(model))
        best, best_key, best_left = None, None, remaining
        for layout in cands:
            devs = expand_gpu(gpu_id, model, layout)
            state = NodeState(devs)
            eligible = {d.name: eligible_devices(d, devs, state.capacity) for d in demands}
            greedy(state, [it for it in remaining if eligible[it[0].name]], eligible, "pack", demands)
            placed_mem = sum(state.used_memory.values())
            placed_n = len(state.where)
            key = (placed_mem, placed_n, layout is None, -len(devs))
            if best_key is None or key > best_key:
                best, best_key = layout, key
                best_left = [it for it in remaining if (it[0].name, it[1]) not in state.where]
        chosen.append(best)
        remaining = best_left
    rec = evaluate_layouts(gpus, chosen, demands, config=config or PlannerConfig(time_limit_seconds=0.5),
                           clock=clock)
    # a GPU the plan leaves empty keeps MIG off: nothing gains from partitioning it (the plan does not change)
    devices = [d for (gpu_id, model_name), layout in zip(gpus, chosen)
               for d in expand_gpu(gpu_id, gpu_model(model_name), layout)]
    phys = {d.id: d.physical_id for d in devices}
    used = {phys[a.device] for a in rec.plan.placements}
    layouts = tuple(g if g.gpu_id in used else GpuLayout(g.gpu_id, g.model, None) for g in rec.layouts)
    rec = MigRecommendation(layouts, rec.gpus_used, rec.unplaced_instances, rec.plan)
    # a GPU split into one full-size instance (7g) whose instances could all run on the GPU itself: MIG off gives
    # the same compute and more memory; keep the change when the re-plan is no worse
    needs_mig = {d.name for d in demands if d.constraints.kinds and "gpu" not in d.constraints.kinds}
    on_gpu: dict[str, set[str]] = {}
    for a in rec.plan.placements:
        on_gpu.setdefault(phys[a.device], set()).add(a.model)
    whole = [g.gpu_id for g in layouts if g.layout is not None and len(g.layout) == 1
             and gpu_model(g.model).profile(g.layout[0]).compute_slices == gpu_model(g.model).compute_slices
             and not (on_gpu.get(g.gpu_id, set()) & needs_mig)]
    if whole:
        simpler = [None if g.gpu_id in whole else g.layout for g in layouts]
        alt = evaluate_layouts(gpus, simpler, demands, config=config or PlannerConfig(time_limit_seconds=0.5),
                               clock=clock)
        if (alt.unplaced_instances, alt.gpus_used) <= (rec.unplaced_instances, rec.gpus_used):
            return alt
    return rec


def mig_parted_yaml(rec: MigRecommendation, config_name: str = "gpud-recommended") -> str:
    """The recommendation as a mig-parted config (github.com/NVIDIA/mig-parted); device indices follow the order
    of the GPUs given to the recommender."""
    lines = ["version: v1", "mig-configs:", f"  {config_name}:"]
    for k, g in enumerate(rec.layouts):
        lines.append(f"    - devices: [{k}]  # {g.gpu_id} {g.model}")
        if g.layout is None:
            lines.append("      mig-enabled: false")
            continue
        lines.append("      mig-enabled: true")
        lines.append("      mig-devices:")
        counts: dict[str, int] = {}
        for name in g.layout:
            counts[name] = counts.get(name, 0) + 1
        for name, n in counts.items():
            lines.append(f'        "{name}": {n}')
    return "\n".join(lines) + "\n"



@dataclass(frozen=True)
class LayoutSummary:
    """What a set of per-GPU layouts does for a demand, for people comparing layouts."""
    gpus_used: int  # physical GPUs holding at least one instance
    devices_used: int  # leaf devices (GPUs with MIG off, MIG instances) holding at least one instance
    instances_placed: int
    instances: int
    memory_fill: float  # memory of the placed instances / memory of the used GPUs (0..1)
    compute_fill: float  # declared compute of the placed instances / the used GPUs (0..1)


def summarize(rec: MigRecommendation, demands: Sequence[ModelDemand]) -> LayoutSummary:
    by_name = {d.name: d for d in demands}
    gpu_of = {}
    for g in rec.layouts:
        for dev in expand_gpu(g.gpu_id, gpu_model(g.model), g.layout):
            gpu_of[dev.id] = g
    used_gpus = {gpu_of[a.device].gpu_id: gpu_of[a.device] for a in rec.plan.placements}
    mem = sum(by_name[a.model].memory_bytes for a in rec.plan.placements)
    cu = sum(by_name[a.model].compute_fraction for a in rec.plan.placements)
    cap_mem = sum(gpu_model(g.model).memory_bytes for g in used_gpus.values())
    return LayoutSummary(gpus_used=len(used_gpus), devices_used=rec.plan.devices_used,
                         instances_placed=len(rec.plan.placements), instances=sum(d.instances for d in demands),
                         memory_fill=mem / cap_mem if cap_mem else 0.0,
                         compute_fill=cu / len(used_gpus) if used_gpus else 0.0)
