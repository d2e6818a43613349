"""Autoscaling hints in the daemon: samples the core on a fixed tick, turns counter deltas into observations, runs the
pure policies of gpud.scaling.hints, and exports the result (a Prometheus Collector, and `inspect()["hints"]`).

Why a periodic tick and not sampling at scrape time: the policy's stabilization windows and the rate window are
seconds of the injected clock, and the observations are deltas between samples. Riding on scrapes would make them
depend on who scrapes: two Prometheus servers would halve every delta's window, a node nobody scrapes would freeze
its hints (and `gpudctl inspect` would show stale ones), and a scrape would pay for the computation. A fixed tick
makes a hint a function of load and time only; a scrape just reads the latest decision.

The hints are advice: nothing here changes a placement (the controller that acts on them is gpud.scaling.rules's job).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from gpud.executor.objective import DEFAULT_SHARE
from gpud.executor.stats import ModelStats
from gpud.scaling.bounds import InstanceBounds
from gpud.scaling.hints import (DeviceFree, HintDecision, HintPolicy, HintState, ModelCounters, ModelFootprint,
                             ModelObservation, desired_instances, node_headroom, observe)
from gpud.scaling.priority import ObjectiveStanding, standing_of
from gpud.telemetry.serving import ServingSnapshot, SnapshotSource

log = logging.getLogger("gpud.autoscale")  # the name operators filter on (before gpud.scaling)

# A footprint measured as a resident-memory delta can come out as 0 for a tiny model on the CPU; headroom divides by
# it. 1 MiB is below any real model and keeps the figure finite.
MIN_FOOTPRINT_BYTES = 2**20

Key = tuple[str, str]  # (model, version)
FreeDevicesSource = Callable[[], list[DeviceFree]]


@dataclass
class _Track:
    """One model version's recent counters and policy state."""

    # A reload starts a new statistics record whose counters start at 0: the history must restart. The record itself,
    # not its id(): a freed record's id can be reused by the next one.
    record: ModelStats
    samples: deque  # ModelCounters, oldest first, spanning at most the rate window
    state: HintState
    throughput: float | None = None  # last measured, kept through idle windows
    observation: ModelObservation | None = None
    decision: HintDecision | None = None
    minimum_instances: int = 0


def read_counters(snapshot: ServingSnapshot,
                  now_s: float) -> dict[Key, tuple[ModelStats, ModelCounters, InstanceBounds]]:
    """The cumulative counters of every served model version, keyed (model, version), with the record they are
    read from (gpud.executor.stats) and the version's bounds (the controller's: gpud.scaling.bounds)."""
    out = {}
    for v in snapshot.versions():
        if v.is_ensemble:
            continue  # no instances to scale: its steps' models are scaled by their own load
        st = v.stats
        per_size = tuple((rows, b.compute_infer.count,
                          b.compute_input.ns + b.compute_infer.ns + b.compute_output.ns)
                         for rows, b in sorted(st.batches.items()))
        out[(v.model, v.version)] = (st, ModelCounters(
            time_s=now_s, requests=st.success.count + st.fail.count, successes=st.success.count,
            queue_ns=st.queue.ns, batch_compute_ns=sum(ns for _, _, ns in per_size),
            ready_instances=v.ready_instances, batches=per_size, max_batch_size=v.max_batch_size,
            objective_seconds=st.objective_ns / 1e9 if st.objective_ns else None,
            objective_share=st.objective_share or DEFAULT_SHARE, within_objective=st.within_objective,
            over_objective=st.over_objective, pending=v.pending_requests,
            load_s=v.load_seconds or 0.0),
            InstanceBounds(v.min_instances, v.max_instances))
    return out


def model_footprints(snapshot: ServingSnapshot) -> list[ModelFootprint]:
    """Per model: the largest measured instance footprint over its versions (the conservative figure for "one more"),
    and the device kinds its instance groups may use. Models with no loaded instance have no measurement: skipped."""
    out = []
    for m in snapshot.models:
        sizes: list[int] = []
        kinds: set[str] = set()
        for v in m.versions:
            kinds.update(v.device_kinds)
            # A measured 0 (a resident-memory delta on the CPU) says nothing: the estimate stands in.
            sizes += [i.memory_bytes or i.estimate_bytes for i in v.instances]
        if sizes and kinds:
            out.append(ModelFootprint(m.name, max(MIN_FOOTPRINT_BYTES, max(sizes)), tuple(sorted(kinds))))
    return out


_KEPT_FOR_RISE = 4  # samples: the last interval and the one two before it


class HintsSampler(Collector):
    """Ticks every `interval_s` of `clock`; exports gpud_model_desired_instances and friends at scrape time.
    `snapshot` is the serving core's (gpud.telemetry.serving); `free_devices` the free memory per leaf device as
    placement sees it."""

    def __init__(self, snapshot: SnapshotSource, free_devices: FreeDevicesSource, policy: HintPolicy, *,
                 clock: Callable[[], float] = time.monotonic, interval_s: float = 5.0, rate_window_s: float = 30.0,
                 registry: CollectorRegistry | None = None):
        if interval_s <= 0:
            raise ValueError(f"hints interval must be > 0 seconds, got {interval_s}")
        if rate_window_s < interval_s:
            raise ValueError(f"hints rate window ({rate_window_s} s) must be at least one interval ({interval_s} s)")
        self.snapshot = snapshot
        self.free_devices = free_devices
        self.policy = policy
        self.clock = clock
        self.interval_s = interval_s
        self.rate_window_s = rate_window_s
        self._tracks: dict[Key, _Track] = {}
        self.headroom: dict[str, dict[str, int]] = {}
        self.after_tick: Callable[[], object] | None = None  # run after each sample (the controller's early tick)
        if registry is not None:
            registry.register(self)

    # --- sampling --------------------------------------------------------------------------------------------
    def tick(self) -> None:
        """One sample of every model version, and one policy step for those with a full delta."""
        now = self.clock()
        snapshot = self.snapshot()
        current = read_counters(snapshot, now)
        for key in list(self._tracks):
            if key not in current:
                del self._tracks[key]  # unloaded: its series go with it
        for key, (record, counters, bounds) in current.items():
            track = self._tracks.get(key)
            if track is None or track.record is not record:
                self._tracks[key] = _Track(record, deque([counters]), HintState())
                continue
            samples = track.samples
            samples.append(counters)
            # The newest sample at least rate_window_s old is the base of the delta (one sample per tick); four at
            # least are kept, for the span two intervals before the last one, which a rise is seen against
            # (hints.rising_rate_lower_bound) even where the window is shorter.
            while len(samples) > _KEPT_FOR_RISE and now - samples[1].time_s >= self.rate_window_s:
                samples.popleft()
            base = samples[0]
            for s in samples:
                if now - s.time_s < self.rate_window_s:
                    break
                base = s
            if counters.time_s <= base.time_s:
                continue  # a clock that did not move: no rate to compute
            early = (samples[-4], samples[-3]) if len(samples) >= _KEPT_FOR_RISE else None
            track.observation = observe(base, counters, track.throughput, samples[-2], early)
            track.throughput = track.observation.throughput_per_instance_per_second
            track.decision, track.state = desired_instances(self.policy, track.state, track.observation, now,
                                                            bounds)
            track.minimum_instances = bounds.minimum
        try:
            self.headroom = node_headroom(self.free_devices(), model_footprints(snapshot))
        except Exception:  # noqa: BLE001 - a device read failing must not stop the hints of the models
            log.exception("computing node headroom failed")

    async def run(self) -> None:
        """Tick forever (cancel to stop). A failing tick is logged and the next one runs: hints are advisory."""
        while True:
            try:
                self.tick()
                if self.after_tick is not None:
                    self.after_tick()
            except Exception:  # noqa: BLE001
                log.exception("autoscaling hints: sampling failed")
            await asyncio.sleep(self.interval_s)

    # --- views -----------------------------------------------------------------------------------------------
    def decisions(self) -> dict[Key, HintDecision]:
        return {k: t.decision for k, t in self._tracks.items() if t.decision is not None}

    def standings(self) -> dict[Key, ObjectiveStanding]:
        """Where each version with a latency objective stands over the last window (gpud.scaling.priority)."""
        out = {}
        for k, t in self._tracks.items():
            standing = None if t.observation is None else standing_of(t.observation, t.minimum_instances)
            if standing is not None:
                out[k] = standing
        return out

    def inspect(self) -> dict[str, Any]:
        models = []
        for (name, version), t in sorted(self._tracks.items()):
            o, d = t.observation, t.decision
            models.append({
                "name": name, "version": version,
                "current_instances": d.current_instances if d else t.samples[-1].ready_instances,
                "desired_instances": d.desired_instances if d else None,
                "recommended_instances": d.recommended_instances if d else None,
                "arrival_rate_per_second": o.arrival_rate_per_second if o else None,
                # what a version with a latency objective plans for (the last interval's rate and its rise too)
                "planned_arrival_rate_per_second": o.planned_arrival_rate_per_second()
                if o and o.objective_seconds is not None else None,
                "throughput_per_instance_per_second": o.throughput_per_instance_per_second if o else None,
                "queue_seconds": o.queue_seconds if o else None,
                "utilization_ratio": d.utilization_ratio if d else None,
                "reason": d.reason if d else "collecting a first window",
            })
        return {"interval_seconds": self.interval_s, "rate_window_seconds": self.rate_window_s,
                "policy": asdict(self.policy), "models": models,
                "headroom": {m: dict(sorted(per.items())) for m, per in sorted(self.headroom.items())}}

    # --- Collector -------------------------------------------------------------------------------------------
    def describe(self) -> Iterable[Metric]:
        return self._families()

    def _families(self) -> list[GaugeMetricFamily]:
        mv = ("model", "version")
        return [
            GaugeMetricFamily("gpud_model_desired_instances", "Autoscaling hint: instances the model version needs "
                              "for its load and queue-time target (HPA rule, stabilized), within its "
                              "bounds.", labels=mv),
            GaugeMetricFamily("gpud_model_instances_current", "Ready instances of the model version when the hint "
                              "was computed.", labels=mv),
            GaugeMetricFamily("gpud_model_instance_throughput_requests_per_second", "Requests one instance completes "
                              "per second with full batches, from its measured batch times.", labels=mv),
            GaugeMetricFamily("gpud_node_headroom_instances", "How many more instances of the model fit on the "
                              "device by free memory and measured footprint (per model: alternatives, not a sum).",
                              labels=("model", "device")),
        ]

    def collect(self) -> Iterable[Metric]:
        desired_fam, current_fam, throughput_fam, headroom_fam = fams = self._families()
        for (model, version), t in sorted(self._tracks.items()):
            if t.decision is not None:
                desired_fam.add_metric([model, version], float(t.decision.desired_instances))
                current_fam.add_metric([model, version], float(t.decision.current_instances))
            if t.throughput is not None:
                throughput_fam.add_metric([model, version], float(t.throughput))
        for model, per_device in sorted(self.headroom.items()):
            for device, n in sorted(per_device.items()):
                headroom_fam.add_metric([model, device], float(n))
        return fams
