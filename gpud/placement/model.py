"""The problem model: devices as bins, model demands, assignments, plans. Plain frozen values; bad input raises
ValueError at construction with the field that is wrong."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal, TypeGuard, get_args
from collections.abc import Iterable, Mapping

COMPUTE_UNITS = 1_000_000  # compute is counted in millionths of a full GPU, so capacity checks are exact integers
DeviceKind = Literal["gpu", "mig", "cpu"]  # a GPU with MIG off, a MIG instance, the host CPU
DEVICE_KINDS: frozenset[str] = frozenset(get_args(DeviceKind))
LabelsIn = Mapping[str, str] | Iterable[tuple[str, str]]  # labels as given: a mapping or (name, value) pairs
MoveKind = Literal["add", "remove", "move"]
STRATEGIES = ("pack", "spread")

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory_bytes(value: object, where: str = "memory") -> int:
    """85899345920, 1.2e9, "80GiB", "1.2GiB", "512MiB", "80GB" (decimal) -> bytes (int, rounded up)."""
    if isinstance(value, bool):
        raise ValueError(f"{where}: expected a byte count or a size like '80GiB', got {value!r}")
    if isinstance(value, int):
        number, unit = float(value), 1
        if value < 0:
            raise ValueError(f"{where}: must be >= 0, got {value}")
        return value
    if isinstance(value, float):
        number, unit = value, 1
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{where}: cannot parse size {value!r} (use bytes or e.g. '80GiB', '512MiB', '1.2GB')")
        number, unit = float(m.group(1)), _UNITS[m.group(2).lower()]
    else:
        raise ValueError(f"{where}: expected a byte count or a size like '80GiB', got {type(value).__name__}")
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{where}: must be a finite size >= 0, got {value!r}")
    return int(math.ceil(number * unit - 1e-6))


def compute_units(fraction: float) -> int:
    """A compute fraction of a full GPU as integer units (3/7 -> 428571)."""
    return int(round(fraction * COMPUTE_UNITS))


def is_device_kind(value: object) -> TypeGuard[DeviceKind]:
    return isinstance(value, str) and value in DEVICE_KINDS


def _labels(value: LabelsIn | None, where: str) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    out = []
    for k, v in items:
        if not isinstance(k, str):
            raise ValueError(f"{where}: label names must be strings, got {k!r}")
        out.append((k, str(v)))
    return tuple(sorted(out))


@dataclass(frozen=True)
class Device:
    """A leaf device a model instance can be placed on: a GPU with MIG off, a MIG instance, or the CPU."""
    id: str
    memory_bytes: int  # total memory of the device
    compute_fraction: float = 1.0  # of a full GPU: a 3g instance on a 7-slice GPU is 3/7
    kind: DeviceKind = "gpu"
    healthy: bool = True
    labels: tuple[tuple[str, str], ...] = ()  # e.g. (("gpu.model", "A100-SXM4-80GB"), ("mig.profile", "3g.40gb"))
    parent_id: str | None = None  # the physical GPU of a MIG instance
    memory_reserve_bytes: int | None = None  # overrides the planner's per-device reserve (CUDA context, workspace)
    instance_cap: int | None = None  # a declared cap on the model instances this device holds (None: no cap)

    def __post_init__(self) -> None:
        where = f"device {self.id!r}"
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"device id must be a non-empty string, got {self.id!r}")
        if not isinstance(self.memory_bytes, int) or self.memory_bytes < 0:
            raise ValueError(f"{where}: memory_bytes must be an integer >= 0, got {self.memory_bytes!r}")
        if not (0.0 <= float(self.compute_fraction) <= 1.0 + 1e-9):
            raise ValueError(f"{where}: compute_fraction must be within [0, 1], got {self.compute_fraction!r}")
        if self.kind not in DEVICE_KINDS:
            raise ValueError(f"{where}: kind must be one of {sorted(DEVICE_KINDS)}, got {self.kind!r}")
        if self.memory_reserve_bytes is not None and self.memory_reserve_bytes < 0:
            raise ValueError(f"{where}: memory_reserve_bytes must be >= 0, got {self.memory_reserve_bytes}")
        if self.instance_cap is not None and (isinstance(self.instance_cap, bool)
                                              or not isinstance(self.instance_cap, int) or self.instance_cap < 0):
            raise ValueError(f"{where}: instance_cap must be an integer >= 0 or None, got {self.instance_cap!r}")
        object.__setattr__(self, "labels", _labels(self.labels, where))

    @property
    def physical_id(self) -> str:
        return self.parent_id or self.id

    def label(self, name: str, default: str | None = None) -> str | None:
        for k, v in self.labels:
            if k == name:
                return v
        return default


@dataclass(frozen=True)
class Constraints:
    """Where a model's instances may go. Empty fields mean "anywhere"."""
    kinds: frozenset[str] = frozenset()  # allowed device kinds
    labels: tuple[tuple[str, tuple[str, ...]], ...] = ()  # label name -> allowed values
    devices: frozenset[str] = frozenset()  # allowed device ids
    spread: bool = False  # instances on distinct physical GPUs

    def __post_init__(self) -> None:
        kinds = frozenset(self.kinds)
        bad = kinds - DEVICE_KINDS
        if bad:
            raise ValueError(f"constraints.kinds: unknown kind(s) {sorted(bad)}; use {sorted(DEVICE_KINDS)}")
        object.__setattr__(self, "kinds", kinds)
        object.__setattr__(self, "devices", frozenset(self.devices))
        labels = self.labels.items() if isinstance(self.labels, Mapping) else self.labels
        norm = []
        for k, vs in labels:
            vals = (vs,) if isinstance(vs, str) else tuple(str(v) for v in vs)
            norm.append((str(k), vals))
        object.__setattr__(self, "labels", tuple(sorted(norm)))


@dataclass(frozen=True)
class ModelDemand:
    """What one model needs: memory and compute per instance, how many instances, and where they may go."""
    name: str
    memory_bytes: int  # per instance
    instances: int = 1
    compute_fraction: float = 0.0  # per instance, of a full GPU
    min_instances: int | None = None  # never fewer live instances during a re-plan; default min(1, instances)
    max_instances: int | None = None  # default: instances
    constraints: Constraints = field(default_factory=Constraints)

    def __post_init__(self) -> None:
        where = f"model {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"model name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.memory_bytes, int) or self.memory_bytes < 0:
            raise ValueError(f"{where}: memory_bytes must be an integer >= 0, got {self.memory_bytes!r}")
        if not isinstance(self.instances, int) or self.instances < 0:
            raise ValueError(f"{where}: instances must be an integer >= 0, got {self.instances!r}")
        if not (0.0 <= float(self.compute_fraction) <= 1.0 + 1e-9):
            raise ValueError(f"{where}: compute_fraction must be within [0, 1], got {self.compute_fraction!r}")
        lo = min(1, self.instances) if self.min_instances is None else self.min_instances
        hi = self.instances if self.max_instances is None else self.max_instances
        if not (0 <= lo <= self.instances <= hi):
            raise ValueError(f"{where}: need 0 <= min_instances ({lo}) <= instances ({self.instances}) "
                             f"<= max_instances ({hi})")
        object.__setattr__(self, "min_instances", lo)
        object.__setattr__(self, "max_instances", hi)


@dataclass(frozen=True, order=True)
class Assignment:
    model: str
    instance: int
    device: str


@dataclass(frozen=True)
class InsufficientResource:
    """The device lacks `resource` (memory in bytes, compute in millionths of a GPU, instances by count)."""
    resource: str
    requested: int
    used: int
    capacity: int

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.used)

    def message(self) -> str:
        if self.resource == "memory":
            return (f"insufficient memory: requested {_fmt_bytes(self.requested)}, free {_fmt_bytes(self.free)} "
                    f"of {_fmt_bytes(self.capacity)}")
        if self.resource == "instances":
            return f"instance cap reached: {self.used} of {self.capacity} instances on the device"
        return (f"insufficient compute: requested {self.requested / COMPUTE_UNITS:.3f}, free "
                f"{self.free / COMPUTE_UNITS:.3f} of {self.capacity / COMPUTE_UNITS:.3f} GPU")


@dataclass(frozen=True)
class ConstraintUnmet:
    constraint: str  # "health", "kind", "label:<name>", "devices", "spread"
    detail: str

    def message(self) -> str:
        return f"{self.constraint}: {self.detail}"


Reason = InsufficientResource | ConstraintUnmet


@dataclass(frozen=True)
class DeviceRejection:
    device: str
    reasons: tuple[Reason, ...]

    def message(self) -> str:
        return "; ".join(r.message() for r in self.reasons)


@dataclass(frozen=True)
class Unplaced:
    model: str
    instance: int
    reason: str  # one line for people
    rejections: tuple[DeviceRejection, ...] = ()  # why each device said no
    closest_device: str | None = None  # the device that came closest (least memory shortfall)


@dataclass(frozen=True)
class Move:
    """One step of a re-plan. `kind` is add, remove or move; a move starts the new instance before stopping the
    old one (make_before_break) unless the transition cannot be ordered that way."""
    kind: MoveKind
    model: str
    instance: int
    from_device: str | None = None
    to_device: str | None = None
    make_before_break: bool = True
    note: str = ""


@dataclass(frozen=True)
class Plan:
    placements: tuple[Assignment, ...]
    unplaced: tuple[Unplaced, ...]
    devices_used: int
    lower_bound: int  # no placement of the placed instances uses fewer devices
    optimal: bool  # devices_used is proven minimal (pack strategy)
    moves: tuple[Move, ...] = ()
    strategy: str = "pack"
    method: str = ""
    elapsed_seconds: float = 0.0
    # the lower bound of each kind that was computed (memory, compute, instances: per dimension; conflicts: items
    # that pairwise cannot share a device; spread; exact: the exact solver's proof), the largest is `lower_bound`
    bounds: tuple[tuple[str, int], ...] = ()
    exact_solver: str | None = None  # the exact solver the planner could use ("highs"), None: heuristics only
    first_plan_seconds: float = 0.0  # time to the first complete plan (the heuristic incumbent)
    proof_seconds: float | None = None  # time until optimality was proven, None when it was not

    @property
    def gap(self) -> int:
        """Devices used beyond the lower bound (0 when proven optimal)."""
        return max(0, self.devices_used - self.lower_bound)

    def by_device(self) -> dict[str, list[Assignment]]:
        out: dict[str, list[Assignment]] = {}
        for a in self.placements:
            out.setdefault(a.device, []).append(a)
        return out

    def to_dict(self) -> dict:
        return {
            "placements": [{"model": a.model, "instance": a.instance, "device": a.device} for a in self.placements],
            "unplaced": [{"model": u.model, "instance": u.instance, "reason": u.reason,
                          "closest_device": u.closest_device,
                          "rejections": [{"device": r.device, "reasons": [x.message() for x in r.reasons]}
                                         for r in u.rejections]} for u in self.unplaced],
            "devices_used": self.devices_used,
            "lower_bound": self.lower_bound,
            "optimal": self.optimal,
            "moves": [{"kind": m.kind, "model": m.model, "instance": m.instance, "from": m.from_device,
                       "to": m.to_device, "make_before_break": m.make_before_break,
                       **({"note": m.note} if m.note else {})} for m in self.moves],
            "strategy": self.strategy,
            "method": self.method,
            "gap": self.gap,
            "bounds": dict(self.bounds),
            "exact_solver": self.exact_solver,
            "first_plan_seconds": round(self.first_plan_seconds, 6),
            "proof_seconds": None if self.proof_seconds is None else round(self.proof_seconds, 6),
        }


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


fmt_bytes = _fmt_bytes
