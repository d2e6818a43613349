"""A model's latency objective: the share of its requests whose server-side latency (queue + compute, as the
statistics extension measures it) must stay within a bound, e.g. 99% within 50 ms. Pure values and rules; the
scheduler counts requests within and over it (gpud.executor.stats), caps its batch delay by it, and sheds by it.

Set per model in config.pbtxt (`gpud_latency_objective_ms`, `gpud_latency_objective_share`, default 0.99,
`gpud_latency_objective_shed`), or node-wide for models that set none (`--latency-objective-ms`,
`--latency-objective-share`). A model with neither has none and keeps the node-wide queue target's rules.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gpud.executor.model_config import ModelOptions

DEFAULT_SHARE = 0.99
MAX_OBJECTIVE_MS = 3_600_000.0


def parse_objective_ms(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and 0.0 < value <= MAX_OBJECTIVE_MS):
        raise ValueError(f"{text!r}")
    return value


def parse_objective_share(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and 0.0 < value < 1.0):
        raise ValueError(f"{text!r}")
    return value


@dataclass(frozen=True)
class LatencyObjective:
    seconds: float  # the bound on a request's latency inside gpud
    share: float = DEFAULT_SHARE  # of requests that must be within it
    shed: bool = False  # a request queued past `seconds` is answered UNAVAILABLE at once

    @property
    def ns(self) -> int:
        return round(self.seconds * 1e9)

    def describe(self) -> str:
        return f"{self.share:.4g} of requests within {self.seconds * 1e3:g} ms"


@dataclass(frozen=True)
class ObjectiveDefaults:
    """The node's objective for models whose config sets none (--latency-objective-ms / -share)."""

    ms: float | None = None
    share: float = DEFAULT_SHARE


def objective_of(options: ModelOptions, defaults: ObjectiveDefaults = ObjectiveDefaults()) -> LatencyObjective | None:
    """A model's objective: its own milliseconds, else the node's; its own share, else the node's; None when
    neither sets milliseconds."""
    ms = options.latency_objective_ms if options.latency_objective_ms is not None else defaults.ms
    if ms is None:
        return None
    share = options.latency_objective_share if options.latency_objective_share is not None else defaults.share
    return LatencyObjective(ms / 1e3, share, options.latency_objective_shed)


def delay_budget_s(objective_s: float, expected_run_s: float) -> float:
    """How long the oldest queued request may still wait for its batch to fill and meet the objective: what the
    objective leaves once the batch's expected run time is taken (never below 0: then it goes at once)."""
    return max(0.0, objective_s - expected_run_s)
