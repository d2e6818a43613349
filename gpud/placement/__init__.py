"""gpud's placement engine: pure functions from devices + model demands (+ the current placement) to a plan with
reasons, a lower bound, an optimality flag and a make-before-break diff. No I/O, no asyncio, no NVML."""
from gpud.placement.model import (
    Assignment, Constraints, ConstraintUnmet, Device, DeviceRejection, InsufficientResource, ModelDemand, Move, Plan,
    Unplaced, parse_memory_bytes,
)
from gpud.placement.solver import PlannerConfig, diff, plan

__all__ = [
    "Assignment", "Constraints", "ConstraintUnmet", "Device", "DeviceRejection", "InsufficientResource",
    "ModelDemand", "Move", "Plan", "PlannerConfig", "Unplaced", "diff", "parse_memory_bytes", "plan",
]
