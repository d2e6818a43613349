"""What a rescale did, in the model's terms: the contract between the controller (gpud.scaling.controller) and the
placement service that carries it out (gpud.placing.service.PlacementService.rescale)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpud.placement.model import MoveKind

Key = tuple[str, str]  # (model, version)
# Versions that may give up instances for an urgent one: how many each keeps, and why (for the log)
Spare = Mapping[Key, tuple[int, str]]


@dataclass(frozen=True)
class Claims:
    """What the controller tells the placement service about room when the node cannot hold every target (from the
    versions' latency objectives: gpud.scaling.priority)."""

    first: tuple[Key, ...] = ()  # growing versions, most urgent first: the room goes to them in this order
    urgent: frozenset[Key] = frozenset()  # of those, the ones missing their objective: they may take spare instances
    # Versions that may give up instances for an urgent one, the most margin first: how many instances each keeps
    # (what its objective needs: the rest is spare), and why (for the log).
    spare: Spare = field(default_factory=dict)


NO_CLAIMS = Claims()


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
    evicted_for: str = ""  # a removal to make room for this model's load (an idle or a spare instance)
    evicted_why: str = ""  # what made it the one to go, when not idleness (its objective's margin)
    room_for: str = ""  # a move made to give this model's new instance its room (gpud.placing.shortcuts)


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
