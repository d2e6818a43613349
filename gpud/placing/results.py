"""The placement service's answers, in the model's terms: free room per device (the steps a change took and what a
re-plan did are gpud.scaling.plan's, the controller's contract with the service)."""
from __future__ import annotations

from dataclasses import dataclass

from gpud.placement.model import DeviceKind


@dataclass(frozen=True)
class DeviceRoom:
    """Free memory of one leaf device as placement sees it (also what the hints' headroom reads)."""

    device_id: str
    kind: DeviceKind
    index: int  # GPU index (the parent's for MIG), -1 for the CPU
    free_bytes: int
    total_bytes: int
