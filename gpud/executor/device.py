"""The device a worker process serves, as the pool and the worker see it (the worker gets it as JSON on its command
line)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerDevice:
    """What a worker needs to know about its device. `simulated` devices execute on the CPU."""

    id: str
    kind: str  # "gpu" | "mig" | "cpu"
    uuid: str = ""
    simulated: bool = False

    @property
    def has_cuda(self) -> bool:
        return self.kind in ("gpu", "mig") and not self.simulated
