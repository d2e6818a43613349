"""What gpud tells the placement engine, written once: devices as bins, model versions as demands (one per instance
group, with its device kinds and GPU pins), and the live instances as the current placement. Pure.

The daemon (start-up, model load, `POST /v2/gpud/placement`, the controller) and `gpudctl place` (a repository or
node file offline, or a running gpud's own inputs) all build their planning problem here, so an offline plan of a
repository is the plan the daemon makes of it.

Instances and demands. A model version's instances are numbered across its instance groups in order (Triton's
`instance_group` list): group 0 holds indices 0..count0-1, group 1 the next count1, and so on; indices past the last
group's range (instances added at run time) belong to the last group. Each group is one demand, so an instance is
(demand, index within the group) to the planner and (model, version, index) to everyone else. A demand is named
after its model when the model has one version with one group (nearly always, and what a person reads in
`gpudctl place`), else `model:version` or `model:version:group`.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpud.executor.model_config import InstanceGroup
from gpud.placement import Assignment, Constraints, Device, ModelDemand
from gpud.placement.model import DeviceKind
from gpud.telemetry.devices import DeviceInfo

GPU_KINDS: tuple[DeviceKind, ...] = ("gpu", "mig")
GPU_INDEX_LABEL = "gpu_index"  # the NVML index of a device's physical GPU: what instance_group.gpus pins


def candidate_kinds(instance_kind: str, has_gpus: bool) -> tuple[DeviceKind, ...]:
    """Device kinds an instance group may use: Triton's KIND_GPU / KIND_CPU, and KIND_AUTO = GPUs when there are."""
    if instance_kind == "KIND_CPU":
        return ("cpu",)
    if instance_kind == "KIND_GPU":
        return GPU_KINDS
    return GPU_KINDS if has_gpus else ("cpu",)


def has_gpus(devices: Iterable[Device | DeviceInfo]) -> bool:
    return any(d.kind in GPU_KINDS for d in devices)


def reserve_bytes_for(kind: DeviceKind, device_reserve_bytes: int) -> int:
    """Memory kept free for the CUDA context and workspace: on GPUs and MIG instances, not on the CPU."""
    return 0 if kind == "cpu" else device_reserve_bytes


def planning_devices(leaves: Sequence[DeviceInfo], *, device_reserve_bytes: int,
                     other_used_bytes: Mapping[str, int] | None = None,
                     unhealthy: frozenset[str] = frozenset()) -> list[Device]:
    """Leaf devices as bins. `other_used_bytes`: memory held by what is not in the plan's current placement (other
    processes on a real GPU, instances being loaded): taken off the bin. The reserve stays a reserve (the plan's
    reasons show it)."""
    other = other_used_bytes or {}
    return [Device(id=d.id, memory_bytes=max(0, d.memory_total_bytes - other.get(d.id, 0)),
                   compute_fraction=d.compute_fraction, kind=d.kind, healthy=d.id not in unhealthy,
                   labels=((GPU_INDEX_LABEL, str(d.index)),), parent_id=d.parent_id,
                   memory_reserve_bytes=reserve_bytes_for(d.kind, device_reserve_bytes))
            for d in leaves]


@dataclass(frozen=True)
class VersionDemand:
    """One model version as placement sees it: its instance groups and the memory one instance needs."""

    model: str
    version: str
    groups: tuple[InstanceGroup, ...]
    footprint_bytes: int  # per instance: measured at load when an instance was, else estimated from the model file
    compute_fraction: float = 0.0  # per instance, of a device's compute (gpud_compute_fraction); 0: not limited


@dataclass(frozen=True, order=True)
class GroupKey:
    model: str
    version: str
    group: int


@dataclass(frozen=True)
class LiveInstance:
    model: str
    version: str
    index: int  # within its model version
    device: str


@dataclass(frozen=True)
class PlacementInputs:
    """One planning problem and the way back from its demands to model versions."""

    devices: tuple[Device, ...]
    demands: tuple[ModelDemand, ...]
    current: tuple[Assignment, ...]
    groups: Mapping[str, GroupKey]  # demand name -> its instance group
    first_index: Mapping[GroupKey, int]  # version index of the group's first instance
    names: Mapping[GroupKey, str] = field(default_factory=dict)  # instance group -> demand name

    def version_of(self, demand: str) -> tuple[str, str]:
        """The (model, version) a demand of this problem is an instance group of."""
        key = self.groups[demand]
        return key.model, key.version

    def instance(self, a: Assignment) -> tuple[GroupKey, int]:
        """An assignment's instance group and its index within its model version."""
        key = self.groups[a.model]
        return key, self.first_index[key] + a.instance

    def assignment(self, model: str, version: str, index: int, device: str,
                   groups: Sequence[InstanceGroup]) -> Assignment:
        """Instance `index` of a model version (whose instance groups are `groups`) as the planner names it.
        KeyError for a model version that is not in this problem."""
        g, k = locate(index, groups)
        return Assignment(self.names[GroupKey(model, version, g)], k, device)


def locate(index: int, groups: Sequence[InstanceGroup]) -> tuple[int, int]:
    """(group, index within the group) of a version's instance `index`: the last group starting at or before it."""
    g, first = 0, 0
    for k, start in enumerate(first_indices(groups)):
        if start <= index:
            g, first = k, start
    return g, index - first


def first_indices(groups: Sequence[InstanceGroup]) -> list[int]:
    out, first = [], 0
    for g in groups:
        out.append(first)
        first += g.count
    return out


def pin_errors(version: VersionDemand, devices: Sequence[Device]) -> list[str]:
    """Why the version's GPU pins (instance_group.gpus) name GPUs this node does not have, as Triton refuses them;
    empty when they are all there."""
    present = sorted({int(i) for d in devices if d.kind in GPU_KINDS
                      for i in [d.label(GPU_INDEX_LABEL)] if i is not None and i.lstrip("-").isdigit()})
    out = []
    for k, group in enumerate(version.groups):
        missing = [i for i in group.gpus if i not in present]
        if missing:
            out.append(f"instance_group[{k}] gpus {list(group.gpus)}: the node has no GPU "
                       f"{', '.join(map(str, missing))} (GPUs: {', '.join(map(str, present)) or 'none'})")
    return out


def demand_names(versions: Sequence[VersionDemand]) -> dict[GroupKey, str]:
    """`model` when the model has one version with one group, else `model:version`, else `model:version:group`."""
    per_model: dict[str, int] = {}
    for v in versions:
        per_model[v.model] = per_model.get(v.model, 0) + 1
    names: dict[GroupKey, str] = {}
    for v in versions:
        for k in range(len(v.groups)):
            if len(v.groups) > 1:
                name = f"{v.model}:{v.version}:{k}"
            elif per_model[v.model] > 1:
                name = f"{v.model}:{v.version}"
            else:
                name = v.model
            names[GroupKey(v.model, v.version, k)] = name
    taken: dict[str, GroupKey] = {}
    for key, name in names.items():
        if name in taken:  # only a model named like another's "model:version": refuse rather than mix them up
            raise ValueError(f"models {taken[name].model!r} and {key.model!r} give the same placement name {name!r}")
        taken[name] = key
    return names


def build_inputs(devices: Sequence[Device], versions: Sequence[VersionDemand], live: Iterable[LiveInstance] = (),
                 *, counts: Mapping[GroupKey, int] | None = None,
                 minimums: Mapping[GroupKey, int] | None = None) -> PlacementInputs:
    """The planning problem of `versions` on `devices`, with `live` as the current placement. A group asks for
    `counts[key]` instances when given, else its configured count; `minimums[key]` is how few it may keep through a
    re-plan (the planner's default otherwise: one). Live instances of versions not in `versions` are left out
    (their memory is the caller's to take off the devices)."""
    gpus = has_gpus(devices)
    names = demand_names(versions)
    demands, groups, firsts = [], {}, {}
    for v in versions:
        for k, (group, first) in enumerate(zip(v.groups, first_indices(v.groups))):
            key = GroupKey(v.model, v.version, k)
            firsts[key] = first
            groups[names[key]] = key
            pins = frozenset(d.id for d in devices if d.label(GPU_INDEX_LABEL) in {str(i) for i in group.gpus}) \
                if group.gpus else frozenset()
            count = counts.get(key, group.count) if counts is not None else group.count
            minimum = min(count, minimums[key]) if minimums is not None and key in minimums else None
            demands.append(ModelDemand(name=names[key], memory_bytes=max(1, v.footprint_bytes), instances=count,
                                       compute_fraction=v.compute_fraction, min_instances=minimum,
                                       constraints=Constraints(kinds=frozenset(candidate_kinds(group.kind, gpus)),
                                                               devices=pins)))
    inputs = PlacementInputs(tuple(devices), tuple(demands), (), groups, firsts, names)
    by_version = {(v.model, v.version): v.groups for v in versions}
    current = tuple(sorted(inputs.assignment(i.model, i.version, i.index, i.device, by_version[(i.model, i.version)])
                           for i in live if (i.model, i.version) in by_version))
    return PlacementInputs(inputs.devices, inputs.demands, current, groups, firsts, names)
