"""What a rescale did, in the model's terms: the contract between the controller (gpud.scaling.controller) and the
placement service that carries it out (gpud.placing.service.PlacementService.rescale)."""
from __future__ import annotations

from dataclasses import dataclass

from gpud.placement.model import MoveKind


@dataclass(frozen=True)
class Step:
    """One step of a plan as it was carried out, in the model's terms."""

    kind: MoveKind  # add | remove | move
    model: str
    version: str
    index: int  # the instance's index within its version
    from_device: str | None
    to_device: str | None
    error: str = ""  # why the new instance did not load; "" when the step was done
    evicted_for: str = ""  # a removal to make room for this model's load (least recently used, idle)


@dataclass(frozen=True)
class Unplaced:
    model: str
    version: str
    index: int
    reason: str


@dataclass(frozen=True)
class ScalingPlan:
    steps: tuple[Step, ...]  # done (or, in advise mode, what would be done), in order
    unplaced: tuple[Unplaced, ...]  # instances of the targets the node has no room for
    deferred: int  # steps left for later intervals (the cap on steps, or no room until others move)
    method: str  # how the planner made it
    unhealthy_devices: frozenset[str] = frozenset()
