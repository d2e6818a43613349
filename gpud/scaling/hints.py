"""Autoscaling hints as pure functions: (policy, state, observation, now) -> (decision, new state).

Nothing here reads a clock, a device or the executor: `gpud.scaling.sampler` samples those and calls in. The rule is
Kubernetes' HorizontalPodAutoscaler's, applied to model instances instead of pods:

    desired = ceil(current * current_metric / target)       (skipped while |metric / target - 1| <= tolerance)

for two metrics, whichever asks for more (HPA takes the largest proposal of several metrics):
  - load:  utilization = arrival rate / (current * per-instance capacity), target `target_utilization_ratio`.
           current * utilization / target = arrival / (capacity * target): the instances the load needs. The capacity
           is what one instance completes per second with full batches, from the measured batch times
           (`batch_capacity_per_second`), not per second of busy time at the batch sizes seen: a batching instance
           is busy whenever requests keep coming, so busy time says nothing of how much more it could take, and
           spreading a load over more instances makes its batches smaller and its "throughput" lower, which would
           keep any number of instances looking needed.
  - queue: mean queue time against `target_queue_seconds`; only ever a reason to add instances (a short queue says
           nothing about how many instances could go; the load metric decides that), and at most twice the current
           count (HPA's default scale-up policy: +100%): a backlog still draining after capacity has arrived would
           otherwise ask for as many instances as its seconds of wait.
Then the version's bounds (gpud.scaling.bounds: its gpud_min_instances / gpud_max_instances, else the node's
defaults; the same bounds the controller applies) and HPA's stabilization windows: a scale-up happens only to the
*lowest* recommendation of the last `scale_up_stabilization_seconds`, a scale-down only to the *highest* recommendation
of the last `scale_down_stabilization_seconds` (so a burst or a lull shorter than the window changes nothing). Unlike
HPA, a fresh state has no evidence yet: until a window is covered by recommendations, the current count stands in for
the missing part of it, so a daemon that just started does not scale on its first sample. A version with a latency
objective skips the scale-up window for the instances a rise beyond the counts' noise needs
(`rising_rate_lower_bound`): the rise is the evidence the window waits for.

Headroom is the other pure function: how many more instances of each model fit on each device, from the device's
free memory and the model's measured footprint.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpud.executor.objective import DEFAULT_SHARE
from gpud.scaling.bounds import InstanceBounds
from gpud.scaling.tail import BatchLine, instances_for_objective, predicted_latency_s


@dataclass(frozen=True)
class HintPolicy:
    target_queue_seconds: float = 0.010  # mean time a request may wait in the queue before more instances help
    target_utilization_ratio: float = 0.8  # share of an instance's measured throughput to plan for (room for bursts)
    tolerance: float = 0.1  # HPA's default: metric/target within 1 +- 0.1 changes nothing
    scale_up_stabilization_seconds: float = 30.0  # a need for more must last this long before it is hinted
    scale_down_stabilization_seconds: float = 300.0  # HPA's default: a lull must last 5 minutes before scaling down

    def __post_init__(self) -> None:
        if self.target_queue_seconds <= 0:
            raise ValueError(f"target_queue_seconds must be > 0, got {self.target_queue_seconds}")
        if not 0 < self.target_utilization_ratio <= 1:
            raise ValueError(f"target_utilization_ratio must be in (0, 1], got {self.target_utilization_ratio}")
        if self.tolerance < 0:
            raise ValueError(f"tolerance must be >= 0, got {self.tolerance}")
        if self.scale_up_stabilization_seconds < 0 or self.scale_down_stabilization_seconds < 0:
            raise ValueError("stabilization windows must be >= 0 seconds, got "
                             f"up={self.scale_up_stabilization_seconds} down={self.scale_down_stabilization_seconds}")


@dataclass(frozen=True)
class ModelObservation:
    """What one model version did over the last sampling window."""

    ready_instances: int
    arrival_rate_per_second: float  # requests arriving per second: finished (successfully or not) + queue growth
    # Requests one instance completes per second with full batches (batch_capacity_per_second); None: not measured.
    throughput_per_instance_per_second: float | None
    queue_seconds: float | None  # mean queue time of the requests that finished in the window; None: none finished
    # The version's latency objective (gpud.executor.objective), when it has one: then it, not the queue target,
    # decides (objective_recommendation).
    objective_seconds: float | None = None
    objective_share: float = DEFAULT_SHARE
    attainment: float | None = None  # requests within it / counted, over the window; None: none counted
    batch_line: BatchLine | None = None  # the window's batch time by size, for predictions
    max_batch_size: int = 0
    # The arrival rate over the last sampling interval alone: a version with an objective plans for the larger of the
    # two, so a step up in load is seen within one interval rather than a rate window (None: not known).
    recent_arrival_rate_per_second: float | None = None
    # How fast the arrival rate rose (the recent rate against the window's; 0 when it did not), and how long one more
    # instance takes to load: a version with an objective plans for the rate expected once an added one serves.
    arrival_rise_per_second2: float = 0.0
    lead_s: float = 0.0
    # A rise beyond the counts' noise (rising_rate_lower_bound): the rate the load will at least reach once an
    # instance asked for now serves and the next one could be asked for. None: no such rise (or too few samples).
    # Evidence enough to add instances at once, with no scale-up window.
    rising_rate_per_second: float | None = None

    def planned_arrival_rate_per_second(self) -> float:
        """The rate a version with an objective plans for: the larger of the window's and the last interval's, plus
        the rise expected over the lead time (a ramp is met when the instance it needs is ready, not after)."""
        recent = self.recent_arrival_rate_per_second
        if recent is None:
            return self.arrival_rate_per_second
        planned = max(self.arrival_rate_per_second, recent + self.arrival_rise_per_second2 * self.lead_s)
        return planned if self.rising_rate_per_second is None else max(planned, self.rising_rate_per_second)


@dataclass(frozen=True)
class HintState:
    """Recommendations (time_s, instances) still inside the longer stabilization window, oldest first."""

    recommendations: tuple[tuple[float, int], ...] = ()
    since_s: float | None = None  # time of the first observation: before since_s + window there is no evidence


@dataclass(frozen=True)
class HintDecision:
    desired_instances: int  # after tolerance, bounds and stabilization: the hint
    recommended_instances: int  # before stabilization (bounded)
    current_instances: int
    load_instances: int | None  # the load metric's proposal; None when it could not be computed
    queue_instances: int | None  # the queue metric's proposal; None when the queue is within target
    utilization_ratio: float | None  # arrival / (current * throughput)
    reason: str  # a short phrase a person can read in `gpudctl inspect`


def _ceil(x: float) -> int:
    # 0.1 * 30 is 3.0000000000000004 in floating point; the instance count it stands for is 3, not 4.
    return math.ceil(round(x, 9))


def recommend(policy: HintPolicy, obs: ModelObservation,
              bounds: InstanceBounds) -> tuple[int, int | None, int | None, float | None, str]:
    """The instantaneous recommendation (within `bounds`, not stabilized) and the proposals it came from."""
    if obs.objective_seconds is not None:
        return objective_recommendation(obs, bounds)
    current = obs.ready_instances
    load = util = None
    in_tolerance = False
    if obs.arrival_rate_per_second <= 0:
        load, util = 0, 0.0  # no requests: no instance is needed for load, whatever the throughput
    elif obs.throughput_per_instance_per_second and obs.throughput_per_instance_per_second > 0:
        needed = obs.arrival_rate_per_second / obs.throughput_per_instance_per_second  # instances fully busy
        if current > 0:
            util = needed / current
            ratio = util / policy.target_utilization_ratio
            in_tolerance = abs(ratio - 1) <= policy.tolerance
            load = current if in_tolerance else _ceil(current * ratio)
        else:
            load = _ceil(needed / policy.target_utilization_ratio)
    queue = None
    if obs.queue_seconds is not None and current > 0:
        ratio = obs.queue_seconds / policy.target_queue_seconds
        if ratio > 1 + policy.tolerance:
            queue = min(_ceil(current * ratio), 2 * current)
    proposals = [p for p in (load, queue) if p is not None]
    if not proposals:
        raw, reason = current, "no measurement yet: holding"
    else:
        raw = max(proposals)
        if queue is not None and obs.queue_seconds is not None and queue >= (load or 0):
            reason = f"queue {obs.queue_seconds * 1e3:.1f} ms over target {policy.target_queue_seconds * 1e3:.1f} ms"
        else:
            reason = f"load {obs.arrival_rate_per_second:.1f} req/s"
            if util is not None:
                reason += f", {util:.0%} of measured throughput"
            if in_tolerance:
                reason += " (within tolerance)"
    bounded = bounds.clamp(raw)
    if bounded != raw:
        reason += f"; bounded to {bounds.describe()}"
    return bounded, load, queue, util, reason


# --- latency objectives ------------------------------------------------------------------------------------------
# Fewer instances only when they would still meet the objective at this many times the rate planned for (and the
# objective held over the window): room for the load's variation on top of the predicted quantile, itself on the
# safe side (gpud.scaling.tail). The replay: 1.1 against 1.25 held every model's attainment with fewer moves.
SCALE_DOWN_LOAD_MARGIN = 1.1
# An objective below a lone request's latency (unreachable): instances are sized for this many times that latency (a
# batch in progress to wait for and its own, with a quarter to spare), not one more per missed window.
UNREACHABLE_AIM = 2.5


# How many standard deviations of the counts' noise the rise between the two spans must clear (a one-sided chance of
# 0.13% on a steady load, whatever the horizon), and how many the extrapolated rate is taken below its estimate.
RISE_SIGNIFICANCE_Z = 3.0
RISE_CONFIDENCE_Z = 2.0


def lone_request_s(obs: ModelObservation) -> float | None:
    """A lone request's latency at the objective's share (the model's own, with no queueing): an objective below it
    is met by no instance count (unreachable). None: no batch times yet."""
    if obs.batch_line is None:
        return None
    return predicted_latency_s(0.0, 1, obs.batch_line, obs.max_batch_size, obs.objective_share)


def _step_limit(current: int, bounds: InstanceBounds) -> int:
    limit = max(2 * max(current, 1), current + 1)  # as the queue metric: at most doubling per step
    if bounds.maximum is not None:
        limit = min(limit, max(bounds.maximum, 1))
    return limit


def rising_instances(obs: ModelObservation, bounds: InstanceBounds) -> int | None:
    """The instances a version with an objective needs for its rise beyond noise alone
    (ModelObservation.rising_rate_per_second): added at once, with no scale-up window, because the rise is the
    evidence the window waits for. None: no such rise, no batch times, or an objective no count meets."""
    rising, line, floor_s = obs.rising_rate_per_second, obs.batch_line, lone_request_s(obs)
    if obs.objective_seconds is None or rising is None or line is None or floor_s is None \
            or floor_s >= obs.objective_seconds:
        return None
    limit = _step_limit(obs.ready_instances, bounds)
    need = instances_for_objective(rising, line, obs.max_batch_size, obs.objective_seconds, limit, obs.objective_share)
    return bounds.clamp(limit if need is None else need)


def objective_recommendation(obs: ModelObservation,
                             bounds: InstanceBounds) -> tuple[int, int | None, int | None, float | None, str]:
    """What a version with a latency objective needs: the fewest instances whose predicted latency quantile (the
    objective's share, gpud.scaling.tail) meets it at the rate planned for (ModelObservation.
    planned_arrival_rate_per_second); at least one more while the window's attainment is below its share (the
    prediction is then wrong about something); fewer only when the objective held and the fewer would still meet it
    at SCALE_DOWN_LOAD_MARGIN x that rate. The node-wide queue target plays no part."""
    current = obs.ready_instances
    assert obs.objective_seconds is not None
    objective_s, share = obs.objective_seconds, obs.objective_share
    spec = f"objective {share:.4g} <= {objective_s * 1e3:g} ms"
    rate = obs.planned_arrival_rate_per_second()
    missed = obs.attainment is not None and obs.attainment < share
    attained = "" if obs.attainment is None else f", attained {obs.attainment:.2%}"
    limit = _step_limit(current, bounds)
    if rate <= 0:
        raw, reason = (current, f"{spec}: missed{attained}, no arrivals to predict: holding") if missed else \
            (0, f"{spec}: no requests")
    elif obs.batch_line is None:
        raw = min(current + 1, limit) if missed else current
        reason = f"{spec}{attained}: " + ("missed, adding one" if missed else "no batch times yet: holding")
    else:
        line, largest = obs.batch_line, obs.max_batch_size
        # A lone request's latency is the model's own: an objective below it is not met by any count. Instances can
        # still take away the load's queueing: aim at a latency they can give, and do not add one per missed window
        # (that would fill the node for nothing).
        floor_s = lone_request_s(obs)
        assert floor_s is not None  # (this branch has batch times)
        unreachable = floor_s >= objective_s
        aim_s = UNREACHABLE_AIM * floor_s if unreachable else objective_s
        need = instances_for_objective(rate, line, largest, aim_s, limit, share)
        raw = limit if need is None else need
        if missed and not unreachable:
            raw = max(raw, min(current + 1, limit))
        if raw < current:
            if (missed and not unreachable) or obs.attainment is None:
                raw = current  # fewer only on evidence that the objective holds
            else:  # as many as meet it with the load's margin (an unreachable one's aim has its margin already)
                margin = 1.0 if unreachable else SCALE_DOWN_LOAD_MARGIN
                kept = instances_for_objective(margin * rate, line, largest, aim_s, current, share)
                raw = current if kept is None else max(raw, kept)
        predicted = predicted_latency_s(rate, max(raw, 1), line, largest, share)
        shown = "overloaded" if math.isinf(predicted) else f"{predicted * 1e3:.1f} ms"
        reason = f"{spec}: predicted {shown} at {raw} instance(s){attained}" + (" (missed)" if missed else "")
        if unreachable:
            reason += (f"; unreachable: a lone request takes {floor_s * 1e3:.1f} ms, so instances are sized for "
                       f"{aim_s * 1e3:.1f} ms")
        if rate > 1.05 * obs.arrival_rate_per_second:
            reason += f"; planned for {rate:.1f} req/s, rising (window {obs.arrival_rate_per_second:.1f})"
    bounded = bounds.clamp(raw)
    if bounded != raw:
        reason += f"; bounded to {bounds.describe()}"
    return bounded, raw, None, None, reason


def desired_instances(policy: HintPolicy, state: HintState, obs: ModelObservation, now_s: float,
                      bounds: InstanceBounds) -> tuple[HintDecision, HintState]:
    """One step of the policy for a version with these bounds. Pure: the same arguments always give the same
    decision and state."""
    current = obs.ready_instances
    rec, load, queue, util, reason = recommend(policy, obs, bounds)
    since = state.since_s if state.since_s is not None else now_s
    keep_s = max(policy.scale_up_stabilization_seconds, policy.scale_down_stabilization_seconds)
    history = tuple((t, r) for t, r in state.recommendations if now_s - t <= keep_s) + ((now_s, rec),)

    def window(seconds: float) -> list[int]:
        recs = [r for t, r in history if now_s - t <= seconds]
        if now_s - since < seconds:
            recs.append(current)  # the part of the window before the first observation: no reason to change
        return recs

    up = min(window(policy.scale_up_stabilization_seconds))
    down = max(window(policy.scale_down_stabilization_seconds))
    desired = current
    if desired < up:
        desired = up
    if desired > down:
        desired = down
    rising = rising_instances(obs, bounds)
    if rising is not None and rising > desired:
        desired = rising
        reason += f"; rising beyond noise to {obs.rising_rate_per_second:.1f} req/s: added at once"
    if desired != rec:
        reason += (f"; scale-up stabilized ({policy.scale_up_stabilization_seconds:.0f} s window)" if rec > desired
                   else f"; scale-down stabilized ({policy.scale_down_stabilization_seconds:.0f} s window)")
    decision = HintDecision(desired, rec, current, load, queue, util, reason)
    return decision, HintState(history, since)


# --- observations from counters ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelCounters:
    """Cumulative counters of one model version at one instant (gpud.executor.stats, read by gpud.scaling.sampler)."""

    time_s: float
    requests: int  # finished, success + failure
    successes: int
    queue_ns: int  # summed over successful requests
    batch_compute_ns: int  # summed over executions: input + infer + output time of each batch
    ready_instances: int
    # per batch size: (rows, executions, compute ns summed over them); empty: not known (busy time alone is used)
    batches: tuple[tuple[int, int, int], ...] = ()
    max_batch_size: int = 0  # the model's; 0: it does not batch (one request per execution)
    objective_seconds: float | None = None  # its latency objective, if it has one
    objective_share: float = DEFAULT_SHARE
    within_objective: int = 0
    over_objective: int = 0
    pending: int = 0  # queued or running at that instant
    load_s: float = 0.0  # how long its instances took to load (the longest of the ready ones); 0: not known


# A batch size this many times the largest seen in the window is as far as the batch-time line is trusted: on a GPU a
# batch's time is flat while the device is underused, so a line through small batches overstates large ones. As the
# load grows (or instances go) larger batches are seen and the reach grows with them.
EXTRAPOLATION_LIMIT = 1.5


def _measured_sizes(batches: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, float]]:
    """(rows, executions, mean seconds) of each size measured, from (rows, executions, compute ns)."""
    return [(rows, n, ns / n / 1e9) for rows, n, ns in batches if n > 0 and ns > 0 and rows > 0]


def _fitted_line(sizes: Sequence[tuple[int, int, float]]) -> BatchLine:
    """The least-squares line through two or more measured sizes, each weighted by its executions."""
    weight = sum(n for _, n, _ in sizes)
    mean_b = sum(n * b for b, n, _ in sizes) / weight
    mean_t = sum(n * t for _, n, t in sizes) / weight
    var_b = sum(n * (b - mean_b) ** 2 for b, n, _ in sizes) / weight
    slope = max(0.0, sum(n * (b - mean_b) * (t - mean_t) for b, n, t in sizes) / weight / var_b)
    return BatchLine(mean_t - slope * mean_b, slope)


def batch_line(batches: Sequence[tuple[int, int, int]]) -> BatchLine | None:
    """The least-squares line of mean batch time over batch size (each size weighted by its executions); one size
    alone: a line through the origin (no gain from batching assumed: a load that has only made batches of one row
    says nothing of what larger ones cost, and taking them as free would predict one instance meets any rate).
    `batches`: (rows, executions, compute ns) per size. None: nothing measured."""
    sizes = _measured_sizes(batches)
    if not sizes:
        return None
    if len(sizes) < 2:
        rows, _, t = sizes[0]
        return BatchLine(0.0, t / rows)
    return _fitted_line(sizes)


def batch_capacity_per_second(batches: Sequence[tuple[int, int, int]], max_batch_size: int) -> float | None:
    """Requests one instance completes per second when the load fills its batches: `size / t(size)` at the largest
    batch the model takes (at most EXTRAPOLATION_LIMIT x the largest seen), where t is the least-squares line of the
    measured mean batch time over batch size (each size weighted by its executions), and never less than the best
    throughput a measured size showed. `batches`: (rows, executions, compute ns) per size. None: nothing measured."""
    sizes = _measured_sizes(batches)
    if not sizes:
        return None
    shown = max(rows / t for rows, _, t in sizes)
    if len(sizes) < 2:
        return shown
    full = min(max(1, max_batch_size), EXTRAPOLATION_LIMIT * max(b for b, _, _ in sizes))
    t_full = _fitted_line(sizes).seconds(full)
    return max(shown, full / t_full) if t_full > 0 else shown


def arrivals_per_second(older: ModelCounters, newer: ModelCounters) -> float:
    """Requests that arrived per second over [older, newer]: those finished, and the growth of those queued or
    running (under overload the finished ones alone would show the capacity, not the load)."""
    arrived = newer.requests - older.requests + newer.pending - older.pending
    return max(0.0, arrived / (newer.time_s - older.time_s))


def rising_rate_lower_bound(early: tuple[ModelCounters, ModelCounters], late: tuple[ModelCounters, ModelCounters],
                            horizon_s: float, z: float = RISE_CONFIDENCE_Z) -> float | None:
    """The arrival rate `horizon_s` after the `late` span ends, on the line through the two spans' rates, less `z`
    standard deviations of that extrapolation (the arrivals counted in a span are Poisson: their variance is their
    count, taken as at least one, so an empty span is not certainty). None when the late span's rate is not above
    the early one's by RISE_SIGNIFICANCE_Z standard deviations of their difference (the longer the horizon, the more
    a chance difference would be multiplied: the rise itself must be beyond the noise), or when even the bound is
    not above the late span's rate. Pure."""
    (a, b), (c, d) = early, late
    early_s, late_s = b.time_s - a.time_s, d.time_s - c.time_s
    if early_s <= 0 or late_s <= 0 or c.time_s < b.time_s:
        return None
    n_early = max(0, b.requests - a.requests + b.pending - a.pending)
    n_late = max(0, d.requests - c.requests + d.pending - c.pending)
    r_early, r_late = n_early / early_s, n_late / late_s
    var_early, var_late = max(n_early, 1) / early_s ** 2, max(n_late, 1) / late_s ** 2
    if r_late - r_early <= RISE_SIGNIFICANCE_Z * math.sqrt(var_early + var_late):
        return None
    k = (horizon_s + late_s / 2) / ((c.time_s + d.time_s) / 2 - (a.time_s + b.time_s) / 2)
    forecast = r_late + (r_late - r_early) * k
    sd = math.sqrt((1 + k) ** 2 * var_late + k ** 2 * var_early)
    low = forecast - z * sd
    return low if low > r_late else None


def observe(older: ModelCounters, newer: ModelCounters,
            last_throughput_per_second: float | None = None,
            previous: ModelCounters | None = None,
            early: tuple[ModelCounters, ModelCounters] | None = None) -> ModelObservation:
    """Rates over [older, newer] (and, given the `previous` sample, the arrival rate over [previous, newer] too).
    Throughput is one instance's capacity with full batches, from the window's batch times by size
    (batch_capacity_per_second); without them, requests completed per second an instance was busy. A window with no
    execution keeps the last measured throughput."""
    dt = newer.time_s - older.time_s
    if dt <= 0:
        raise ValueError(f"observation window must be positive, got {older.time_s} -> {newer.time_s}")
    done = newer.successes - older.successes
    busy_s = (newer.batch_compute_ns - older.batch_compute_ns) / 1e9
    before = {rows: (n, ns) for rows, n, ns in older.batches}
    window = [(rows, n - before.get(rows, (0, 0))[0], ns - before.get(rows, (0, 0))[1])
              for rows, n, ns in newer.batches]
    throughput = batch_capacity_per_second(window, newer.max_batch_size) if newer.batches else None
    if throughput is None:
        throughput = done / busy_s if done > 0 and busy_s > 0 else last_throughput_per_second
    queue_s = (newer.queue_ns - older.queue_ns) / done / 1e9 if done > 0 else None
    within, over = newer.within_objective - older.within_objective, newer.over_objective - older.over_objective
    arrival = arrivals_per_second(older, newer)
    recent, rise = None, 0.0
    if previous is not None and older.time_s <= previous.time_s < newer.time_s:
        recent = arrivals_per_second(previous, newer)
        # Each rate stands for the middle of its span: the rise is the slope between the two (a rise only).
        apart_s = (previous.time_s - older.time_s) / 2
        if apart_s > 0:
            rise = max(0.0, (recent - arrival) / apart_s)
    rising = None
    if previous is not None and early is not None and newer.objective_seconds is not None:
        # until an instance asked for now serves (its load), and the next could be asked for (one interval)
        rising = rising_rate_lower_bound(early, (previous, newer), newer.load_s + newer.time_s - previous.time_s)
    return ModelObservation(ready_instances=newer.ready_instances,
                            arrival_rate_per_second=arrival,
                            throughput_per_instance_per_second=throughput, queue_seconds=queue_s,
                            objective_seconds=newer.objective_seconds, objective_share=newer.objective_share,
                            attainment=within / (within + over) if within + over > 0 else None,
                            batch_line=batch_line(window) if newer.batches else None,
                            max_batch_size=newer.max_batch_size,
                            recent_arrival_rate_per_second=recent, arrival_rise_per_second2=rise,
                            lead_s=newer.load_s, rising_rate_per_second=rising)


# --- headroom ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceFree:
    device_id: str
    kind: str  # "gpu" | "mig" | "cpu"
    free_bytes: int  # after gpud's reserve and what is loaded or being loaded


@dataclass(frozen=True)
class ModelFootprint:
    model: str
    footprint_bytes: int  # measured per instance (estimate until one is loaded)
    kinds: tuple[str, ...]  # device kinds its instance groups may use


def node_headroom(devices: Iterable[DeviceFree], models: Iterable[ModelFootprint]) -> dict[str, dict[str, int]]:
    """{model: {device: instances that still fit}} for every device the model may use. Each model's figures are
    alternatives (the same free memory counted for every model), not additive."""
    devices = list(devices)
    out: dict[str, dict[str, int]] = {}
    for m in models:
        if m.footprint_bytes <= 0:
            raise ValueError(f"model {m.model!r}: footprint must be > 0 bytes, got {m.footprint_bytes}")
        out[m.model] = {d.device_id: max(0, d.free_bytes) // m.footprint_bytes for d in devices if d.kind in m.kinds}
    return out


def total_headroom(headroom: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    return {model: sum(per_device.values()) for model, per_device in headroom.items()}
