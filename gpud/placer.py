"""First placement of model instances (pure): each instance on the first device with room for its footprint.

The daemon's first, simple policy: the placement engine (placement/) replaces it. It never puts every model on
every device; an instance that fits nowhere gets a reason a person can read.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceRoom:
    device_id: str
    kind: str  # "gpu" | "mig" | "cpu"
    index: int  # GPU index (parent's for MIG), -1 for the CPU
    free_bytes: int
    total_bytes: int


def candidate_kinds(instance_kind: str, has_gpus: bool) -> tuple[str, ...]:
    """Device kinds an instance group may use: Triton's KIND_GPU / KIND_CPU, and KIND_AUTO = GPUs when there are."""
    if instance_kind == "KIND_CPU":
        return ("cpu",)
    if instance_kind == "KIND_GPU":
        return ("gpu", "mig")
    return ("gpu", "mig") if has_gpus else ("cpu",)


def choose_device(rooms: list[DeviceRoom], need_bytes: int, kinds: tuple[str, ...],
                  gpus: tuple[int, ...] = ()) -> tuple[str | None, str]:
    """(device id, "") for the first device that fits, else (None, reason naming every device it was refused by)."""
    refusals = []
    for room in rooms:
        if room.kind not in kinds:
            continue
        if gpus and room.index not in gpus:
            refusals.append(f"{room.device_id}: not in instance_group gpus {list(gpus)}")
            continue
        if room.free_bytes >= need_bytes:
            return room.device_id, ""
        refusals.append(f"{room.device_id}: {_gib(room.free_bytes)} free of {_gib(room.total_bytes)}")
    if not refusals:
        return None, f"no device of kind {'/'.join(kinds)} on this node"
    return None, f"needs {_gib(need_bytes)}, fits on no device ({'; '.join(refusals)})"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
