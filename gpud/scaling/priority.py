"""Who gets the room when the node cannot hold every target, and who may give some up: pure functions of the
versions' latency objectives (gpud.executor.objective) as the hints observed them.

- `standing_of`: where a version stands against its objective over the last window: the share of requests within
  it, the latency quantile predicted at its current instance count (gpud.scaling.tail.predicted_latency_s), and how
  many instances it could give up with the objective still predicted met at SCALE_DOWN_LOAD_MARGIN x its load (its
  spare: the hints' own rule for fewer instances).
- `room_order`: versions that want more instances, most urgent first: those missing their objective (furthest below
  its share first, then the least slack), then those predicted to miss it (least slack first), then every other in
  the order given. The placement service gives room in this order (gpud.placing.service.rescale).
- `spare_order`: the versions that may give up instances for a version missing its objective, the most margin
  first. Only versions whose objective held over the window and whose prediction with fewer instances keeps the
  margin: a model with no objective is never made to give up a busy instance (idle ones go by gpud.scaling.idle).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpud.scaling.hints import SCALE_DOWN_LOAD_MARGIN, ModelObservation, lone_request_s
from gpud.scaling.tail import instances_for_objective, predicted_latency_s
from gpud.scaling.plan import Key


@dataclass(frozen=True)
class ObjectiveStanding:
    objective_s: float
    share: float
    attainment: float | None  # over the window; None: no request counted
    predicted_s: float | None  # at the current instance count (inf: it cannot keep up); None: no batch times yet
    instances: int  # it runs now
    spare_instances: int  # it could run this many fewer with its objective predicted within the margin
    spare_predicted_s: float | None = None  # the prediction with that many fewer
    reachable: bool = True  # False: a lone request takes longer than the objective (no count meets it)

    @property
    def shortfall(self) -> float:
        """How far the window's attainment is below the share (0 when it is not, or not known)."""
        return max(0.0, self.share - self.attainment) if self.attainment is not None else 0.0

    @property
    def slack(self) -> float:
        """1 - predicted / objective: below 0 the prediction misses it; 0 when nothing is predicted yet."""
        if self.predicted_s is None:
            return 0.0
        return -math.inf if math.isinf(self.predicted_s) else 1.0 - self.predicted_s / self.objective_s

    @property
    def missing(self) -> bool:
        """Below its share or predicted to be, and instances could change that: an unreachable objective (one a
        lone request misses) never makes a version urgent, or a misconfigured one would take the room first."""
        return self.reachable and (self.shortfall > 0 or self.slack < 0)

    def describe(self) -> str:
        shown = ("overloaded" if self.predicted_s is not None and math.isinf(self.predicted_s)
                 else "not predicted yet" if self.predicted_s is None else f"predicted {self.predicted_s * 1e3:.1f} ms")
        attained = "no request counted" if self.attainment is None else f"attained {self.attainment:.2%}"
        return (f"objective {self.share:.4g} <= {self.objective_s * 1e3:g} ms, {attained}, {shown}"
                + ("" if self.reachable else ", unreachable (a lone request takes longer)"))


def standing_of(obs: ModelObservation, minimum: int) -> ObjectiveStanding | None:
    """Where a version with a latency objective stands (None: it has none). Its spare never takes it below
    `minimum` nor below one instance (to zero only when idle: gpud.scaling.rules)."""
    if obs.objective_seconds is None:
        return None
    objective_s, n, share = obs.objective_seconds, obs.ready_instances, obs.objective_share
    line, largest = obs.batch_line, obs.max_batch_size
    rate = obs.planned_arrival_rate_per_second()  # as the hint plans
    predicted = None if line is None or n <= 0 else predicted_latency_s(rate, n, line, largest, share)
    held = obs.attainment is None or obs.attainment >= obs.objective_share
    floor = max(1, minimum)
    spare, spare_predicted = 0, None
    if held and n > floor:
        if rate <= 0:
            spare = n - floor  # no request in the window: any instance above its floor is spare
        elif line is not None and obs.attainment is not None:
            need = instances_for_objective(SCALE_DOWN_LOAD_MARGIN * rate, line, largest, objective_s, n, share)
            if need is not None and need < n:
                spare = n - max(need, floor)
        if spare:
            spare_predicted = None if line is None else predicted_latency_s(rate, n - spare, line, largest, share)
    floor_s = lone_request_s(obs)
    reachable = floor_s is None or floor_s < objective_s
    return ObjectiveStanding(objective_s, obs.objective_share, obs.attainment, predicted, n, spare, spare_predicted,
                             reachable)


def room_order(growing: Sequence[Key], standings: Mapping[Key, ObjectiveStanding]) -> list[Key]:
    """`growing`, most urgent first (see the module docstring); a stable sort: equals keep the given order."""
    def urgency(key: Key) -> tuple[int, float, float]:
        s = standings.get(key)
        if s is None or not s.missing:
            return (2, 0.0, 0.0)
        return (0 if s.shortfall > 0 else 1, -s.shortfall, s.slack)
    return sorted(growing, key=urgency)


def spare_order(standings: Mapping[Key, ObjectiveStanding], *, exclude: Sequence[Key] = ()) -> list[Key]:
    """Versions with spare instances, the most margin first: the lowest predicted / objective with the spare gone
    (unknown predictions, a version with no requests, first)."""
    def margin(key: Key) -> tuple[float, Key]:
        s = standings[key]
        return (0.0 if s.spare_predicted_s is None else s.spare_predicted_s / s.objective_s, key)
    return sorted((k for k, s in standings.items() if s.spare_instances > 0 and k not in exclude), key=margin)
