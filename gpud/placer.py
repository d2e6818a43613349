"""What the daemon tells the placement engine (pure): free memory per device, and which device kinds an instance
group may use. The plan itself comes from placement.plan."""
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
