"""Filter / Score / Reserve, after the Kubernetes scheduler framework.

`NodeState` is the ledger of what is allocated where. `filter_device` answers "may this instance go there, and if
not, exactly why" with structured reasons; scorers rank feasible devices 0..100 and are chosen from `SCORERS` by the
strategy name; `reserve` / `unreserve` change the ledger and can always be undone (unreserve is idempotent)."""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Iterable, Sequence

from gpud.placement.model import (
    Assignment, ConstraintUnmet, Device, InsufficientResource, ModelDemand, Reason, compute_units,
)


@dataclass(frozen=True)
class Capacity:
    memory_bytes: int  # usable: total minus the reserve
    compute_units: int
    instances: int | None = None  # the device's instance cap, None: no cap


def usable_capacity(device: Device, memory_reserve_bytes: int) -> Capacity:
    reserve = device.memory_reserve_bytes if device.memory_reserve_bytes is not None else memory_reserve_bytes
    return Capacity(max(0, device.memory_bytes - reserve), compute_units(device.compute_fraction),
                    device.instance_cap)


def static_reasons(demand: ModelDemand, device: Device) -> list[Reason]:
    """Reasons that do not depend on what else is on the device."""
    out: list[Reason] = []
    cons = demand.constraints
    if not device.healthy:
        out.append(ConstraintUnmet("health", "device is unhealthy"))
    if cons.kinds and device.kind not in cons.kinds:
        out.append(ConstraintUnmet("kind", f"device kind {device.kind!r} not in allowed {sorted(cons.kinds)}"))
    if cons.devices and device.id not in cons.devices:
        out.append(ConstraintUnmet("devices", "device not in the model's allowed devices"))
    for name, values in cons.labels:
        have = device.label(name)
        if have not in values:
            out.append(ConstraintUnmet(f"label:{name}", f"device has {name}={have!r}, model needs one of "
                                                        f"{list(values)}"))
    return out


class NodeState:
    """What is reserved on each device. Mutable on purpose: it is the scratch ledger of one planning run."""

    def __init__(self, devices: Sequence[Device], memory_reserve_bytes: int = 0) -> None:
        ids = [d.id for d in devices]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"duplicate device ids: {dup}")
        self.devices = {d.id: d for d in devices}
        self.order = ids
        self.capacity = {d.id: usable_capacity(d, memory_reserve_bytes) for d in devices}
        self.used_memory = {i: 0 for i in ids}
        self.used_compute = {i: 0 for i in ids}
        self.members: dict[str, dict[tuple[str, int], ModelDemand]] = {i: {} for i in ids}
        self.where: dict[tuple[str, int], str] = {}
        self.physical_count: dict[tuple[str, str], int] = {}  # (model, physical gpu) -> instances
        self.physical_used: dict[str, int] = {}  # physical gpu -> instances on any of its leaf devices

    # -- Filter
    def filter_device(self, demand: ModelDemand, device_id: str, *, with_static: bool = True) -> list[Reason]:
        device = self.devices[device_id]
        reasons = static_reasons(demand, device) if with_static else []
        cap = self.capacity[device_id]
        mem = demand.memory_bytes
        if self.used_memory[device_id] + mem > cap.memory_bytes:
            reasons.append(InsufficientResource("memory", mem, self.used_memory[device_id], cap.memory_bytes))
        cu = compute_units(demand.compute_fraction)
        if cu and self.used_compute[device_id] + cu > cap.compute_units:
            reasons.append(InsufficientResource("compute", cu, self.used_compute[device_id], cap.compute_units))
        n = len(self.members[device_id])
        if cap.instances is not None and n + 1 > cap.instances:
            reasons.append(InsufficientResource("instances", 1, n, cap.instances))
        if demand.constraints.spread and self.physical_count.get((demand.name, device.physical_id), 0) > 0:
            reasons.append(ConstraintUnmet("spread", f"model already has an instance on physical GPU "
                                                     f"{device.physical_id!r}"))
        return reasons

    def fits(self, demand: ModelDemand, device_id: str) -> bool:
        """Capacity and spread only (static checks are done once per model by the caller)."""
        cap = self.capacity[device_id]
        if self.used_memory[device_id] + demand.memory_bytes > cap.memory_bytes:
            return False
        cu = compute_units(demand.compute_fraction)
        if cu and self.used_compute[device_id] + cu > cap.compute_units:
            return False
        if cap.instances is not None and len(self.members[device_id]) >= cap.instances:
            return False
        if demand.constraints.spread and \
                self.physical_count.get((demand.name, self.devices[device_id].physical_id), 0) > 0:
            return False
        return True

    # -- Reserve / Unreserve
    def reserve(self, demand: ModelDemand, instance: int, device_id: str) -> Assignment:
        key = (demand.name, instance)
        if key in self.where:
            raise ValueError(f"{demand.name}[{instance}] is already reserved on {self.where[key]!r}")
        self.where[key] = device_id
        self.members[device_id][key] = demand
        self.used_memory[device_id] += demand.memory_bytes
        self.used_compute[device_id] += compute_units(demand.compute_fraction)
        pk = (demand.name, self.devices[device_id].physical_id)
        self.physical_count[pk] = self.physical_count.get(pk, 0) + 1
        self.physical_used[pk[1]] = self.physical_used.get(pk[1], 0) + 1
        return Assignment(demand.name, instance, device_id)

    def unreserve(self, model: str, instance: int) -> None:
        """Undo a reservation; a no-op when there is none."""
        device_id = self.where.pop((model, instance), None)
        if device_id is None:
            return
        demand = self.members[device_id].pop((model, instance))
        self.used_memory[device_id] -= demand.memory_bytes
        self.used_compute[device_id] -= compute_units(demand.compute_fraction)
        pk = (model, self.devices[device_id].physical_id)
        self.physical_count[pk] -= 1
        self.physical_used[pk[1]] -= 1

    def used_devices(self) -> list[str]:
        return [i for i in self.order if self.members[i]]

    def assignments(self) -> list[Assignment]:
        return sorted(Assignment(m, i, d) for (m, i), d in self.where.items())

    def utilization(self, device_id: str, demand: ModelDemand | None = None) -> float:
        """Mean fill over the dimensions that have capacity, after adding `demand` if given (0..1)."""
        cap = self.capacity[device_id]
        mem = self.used_memory[device_id] + (demand.memory_bytes if demand else 0)
        cu = self.used_compute[device_id] + (compute_units(demand.compute_fraction) if demand else 0)
        parts = []
        if cap.memory_bytes:
            parts.append(mem / cap.memory_bytes)
        if cap.compute_units and (cu or self.used_compute[device_id]):
            parts.append(cu / cap.compute_units)
        return sum(parts) / len(parts) if parts else 0.0


# -- Score: 0..100, higher is better. Pure functions of the ledger, chosen by strategy name.

def score_most_allocated(state: NodeState, demand: ModelDemand, device_id: str) -> float:
    """Bin packing: prefer the device that is fullest after placing (best fit). (used + requested) / capacity."""
    return 100.0 * state.utilization(device_id, demand)


def score_least_allocated(state: NodeState, demand: ModelDemand, device_id: str) -> float:
    """The emptiest device by mean fill. 100 - most_allocated."""
    return 100.0 - score_most_allocated(state, demand, device_id)


def contention(state: NodeState, device_id: str, demand: ModelDemand | None = None) -> float:
    """What competes on a device, after adding `demand` if given (0..1): the largest of its memory fill, its
    compute fill (instances that declare compute), and its instance share (n - 1) / n, the part of the device's
    time slices that n instances take from each other (0 with one instance, 1/2 with two, 2/3 with three)."""
    cap = state.capacity[device_id]
    n = len(state.members[device_id]) + (1 if demand else 0)
    mem = state.used_memory[device_id] + (demand.memory_bytes if demand else 0)
    cu = state.used_compute[device_id] + (compute_units(demand.compute_fraction) if demand else 0)
    parts = [(n - 1) / n if n else 0.0]
    if cap.memory_bytes:
        parts.append(mem / cap.memory_bytes)
    if cap.compute_units and cu:
        parts.append(cu / cap.compute_units)
    return max(parts)


def score_balanced(state: NodeState, demand: ModelDemand, device_id: str) -> float:
    """Spreading: prefer the device where the new instance contends least (100 * (1 - contention) after placing),
    ties to the lower mean fill. An idle MIG slice (one instance, 1 GiB of 10 GiB: contention 0.1 -> 90) wins over
    a big GPU already running one (two instances: 0.5 -> 50), so two small models do not share a GPU while a slice
    sits idle; a model that would fill the slice's memory (9 of 10 GiB: 10) goes next to the other instead."""
    return 100.0 * (1.0 - contention(state, device_id, demand)) + 1e-3 * score_least_allocated(state, demand,
                                                                                              device_id)


Scorer = Callable[[NodeState, ModelDemand, str], float]
SCORERS: dict[str, Scorer] = {"pack": score_most_allocated, "spread": score_balanced}


def scorer_for(strategy: str) -> Scorer:
    try:
        return SCORERS[strategy]
    except KeyError:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {sorted(SCORERS)}") from None


def eligible_devices(demand: ModelDemand, devices: Iterable[Device], capacity: dict[str, Capacity],
                     _cache: dict | None = None) -> list[str]:
    """Devices that pass the static filters and could hold one instance when empty. Pass a dict as `_cache` to
    share work between many demands with the same constraints (the returned list is then shared: do not mutate)."""
    devices = list(devices)
    cu = compute_units(demand.compute_fraction)
    if _cache is None:
        _cache = {}
    cons = demand.constraints
    key = (tuple(sorted(cons.kinds)), cons.labels, tuple(sorted(cons.devices))) \
        if (cons.kinds or cons.labels or cons.devices) else None
    static = _cache.get(key)
    if static is None:
        ids = [d.id for d in devices if not static_reasons(demand, d)]
        static = (ids, min((capacity[i].memory_bytes for i in ids), default=0),
                  min((capacity[i].compute_units for i in ids), default=0),
                  any(capacity[i].instances == 0 for i in ids))
        _cache[key] = static
    ids, min_mem, min_cu, some_capped_at_zero = static
    if demand.memory_bytes <= min_mem and cu <= min_cu and not some_capped_at_zero:
        return ids  # every statically eligible device is large enough
    return [i for i in ids if demand.memory_bytes <= capacity[i].memory_bytes and cu <= capacity[i].compute_units
            and capacity[i].instances != 0]
