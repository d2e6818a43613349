"""How few and how many instances of a model version may run: the one bounds system that the hints, the controller,
evictions and inspect all read.

A version's own config.pbtxt parameters (`gpud_min_instances`, `gpud_max_instances`) come first; where it sets
none, the node's defaults (`--min-instances`, `--max-instances`); where those are unset too, the minimum is the
version's instance_group count (by default gpud never runs fewer instances than configured, as Triton) and there is
no maximum but the node's room. A node default never overrides what the model's own config says: where a default
would cross the model's own bound, the model's bound holds (read_options already refuses a model whose own two
bounds cross).
"""
from __future__ import annotations

from dataclasses import dataclass

from gpud.executor.model_config import ModelConfig


@dataclass(frozen=True)
class InstanceBounds:
    """`minimum` may exceed `maximum` only where a version's live sequences need more instances than its maximum
    (RegisteredVersion.minimum_instances): the maximum wins, as in the controller's rules."""

    minimum: int
    maximum: int | None  # None: as many as the node has room for

    def clamp(self, n: int) -> int:
        n = max(self.minimum, n)
        return n if self.maximum is None else min(n, self.maximum)

    def describe(self) -> str:
        return f"[{self.minimum}, {'no limit' if self.maximum is None else self.maximum}]"


NO_INSTANCES = InstanceBounds(0, 0)  # an ensemble: its steps' models have the instances


@dataclass(frozen=True)
class BoundsDefaults:
    """The node's defaults for versions whose config sets no bound (`--min-instances`, `--max-instances`)."""

    min_instances: int | None = None  # None: the version's instance_group count
    max_instances: int | None = None  # None: as many as the node has room for

    def __post_init__(self) -> None:
        lo, hi = self.min_instances, self.max_instances
        if (lo is not None and lo < 0) or (hi is not None and hi < 0):
            raise ValueError(f"min_instances and max_instances must be >= 0, got {lo} and {hi}")
        if lo is not None and hi is not None and hi < lo:
            raise ValueError(f"max_instances ({hi}) must be >= min_instances ({lo})")


def instance_bounds(config: ModelConfig, defaults: BoundsDefaults = BoundsDefaults()) -> InstanceBounds:
    """The bounds of a version with this configuration on a node with these defaults (see the module docstring)."""
    own_lo, own_hi = config.options.min_instances, config.options.max_instances
    lo = own_lo if own_lo is not None else defaults.min_instances
    lo_is_own = lo is None or own_lo is not None
    if lo is None:
        lo = sum(g.count for g in config.instance_groups)  # the model's own config
    hi = own_hi if own_hi is not None else defaults.max_instances
    if hi is not None and hi < lo:  # one of the two is the node's default: it yields
        if lo_is_own:
            hi = lo
        else:
            lo = hi
    return InstanceBounds(lo, hi)
