"""The five placement policies of the replay, each run on the same scenario (the same requests, node and models):

(a) triton   Triton's default: every model on every device (each GPU and MIG instance loads every model that still
             fits, in name order), static. Models that fit nowhere are not served.
(b) peak     static, each model sized for its peak rate (the hints' load rule), packed by gpud's planner.
(c) average  static, each model sized for its mean rate, packed by gpud's planner.
(d) scratch  gpud's hints and controller targets, but each interval the node is planned from scratch and every step
             to that plan taken (make-before-break, no cap on steps).
(e) gpud     gpud's placement controller as the daemon runs it: incremental re-plans that keep moves few, at most
             max_steps_per_interval steps, scale to zero and load on demand with eviction.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from gpud.executor.model_config import InstanceGroup
from gpud.scaling.rules import ScalingPolicy
from gpud.placing.inputs import VersionDemand, build_inputs, planning_devices
from gpud.placement import PlannerConfig, plan
from gpud.scaling.hints import HintPolicy
from gpud.telemetry.simulated import SimulatedBackend

from .control import ControlPlane, ControlSettings, instances_needed, scratch_dir
from .des import Serving, SimDevice, memory_hours, slo_attainment
from .scenario import Scenario

POLICIES = ("triton", "peak", "average", "scratch", "gpud", "objectives", "objectives-unranked")
SAMPLE_S = 10.0


@dataclass
class Result:
    policy: str
    slo_attainment: float
    requests: int
    failed: int
    mean_queue_ms: float
    memory_gib_hours: float
    loads: int  # instance loads after the start (the start-up placement is free for every policy)
    unloads: int
    cold_starts: int = 0
    evictions: int = 0
    flaps: int = 0
    steps: dict[str, int] = field(default_factory=dict)  # the controller's applied steps by action
    unplaced: list[str] = field(default_factory=list)  # instances a static policy could not place
    seconds: float = 0.0  # wall time of the simulation
    series: dict[str, list[float]] = field(default_factory=dict)  # every SAMPLE_S: t, memory GiB, instances, SLO
    # per model: the share of its requests within its own latency objective (queue + compute), every policy
    objective_attainment: dict[str, float] = field(default_factory=dict)

    @property
    def moves(self) -> int:
        """Instance loads + unloads: the placement work done while serving."""
        return self.loads + self.unloads


def settings_for(scenario: Scenario, *, incremental: bool, interval_s: float = 5.0, scale_up_s: float = 5.0,
                 scale_down_s: float = 120.0, idle_unload_s: float = 300.0, max_steps: int = 4,
                 hints_interval_s: float = 2.5, rate_window_s: float = 15.0,
                 queue_target_share: float = 0.5) -> ControlSettings:
    """The controller's settings in model time. The replay compresses an hour of the trace into 30 s, so the
    windows that follow demand (interval, rate and scale-up windows) are shorter than the daemon's defaults; the
    scale-down window is 120 s and the idle time the daemon's 300 s; load times are not compressed (harder for the
    controller, not easier). The hints aim at a mean queue of `queue_target_share` x the SLO's bound."""
    hints = HintPolicy(target_queue_seconds=scenario.slo_queue_s * queue_target_share,
                       target_utilization_ratio=scenario.target_utilization,
                       scale_up_stabilization_seconds=scale_up_s, scale_down_stabilization_seconds=scale_down_s)
    control = ScalingPolicy(interval_seconds=interval_s, max_steps_per_interval=max_steps,
                            scale_down_cooldown_seconds=scale_down_s, idle_unload_seconds=idle_unload_s)
    return ControlSettings(hints, control, hints_interval_s, rate_window_s, incremental=incremental)


def _devices(backend: SimulatedBackend) -> list[SimDevice]:
    return [SimDevice(d.id, d.compute_fraction, d.kind != "cpu") for d in backend.leaf_devices()]


def _serving(scenario: Scenario, backend: SimulatedBackend) -> Serving:
    return Serving(_devices(backend), scenario.models(), slo_queue_s=scenario.slo_queue_s,
                   measure_from_s=scenario.measure_from_s)


def _sampler(serving: Serving, series: dict[str, list[float]]) -> None:
    last = [0, 0]

    def sample() -> None:
        models = serving.models.values()
        # of the requests that arrived in the window (measured ones), those that were taken within the SLO
        within = sum(m.within_slo for m in models)
        total = sum(max(0, m.arrived(serving.now_s) - int(np.searchsorted(m.arrivals_s, serving.measure_from_s)))
                    for m in models)
        series.setdefault("t", []).append(serving.now_s)
        series.setdefault("memory_gib", []).append(serving.memory_bytes / 2**30)
        series.setdefault("instances", []).append(sum(len(m.instances) for m in models))
        series.setdefault("slo", []).append((within - last[0]) / (total - last[1]) if total > last[1] else math.nan)
        last[:] = [within, total]
        serving.at(serving.now_s + SAMPLE_S, sample)

    serving.at(0.0, sample)


def _result(policy: str, serving: Serving, started: float, series: dict, **kw) -> Result:
    models = list(serving.models.values())
    served = sum(m.served for m in models)
    return Result(policy, slo_attainment(models), served + sum(m.failed for m in models), sum(m.failed for m in models),
                  1e3 * sum(m.queue_s_total for m in models) / served if served else math.nan,
                  memory_hours(serving.memory_byte_seconds), seconds=time.perf_counter() - started, series=series,
                  objective_attainment={m.name: m.objective_attainment for m in models if m.objective_s is not None},
                  **kw)


# --- static policies ------------------------------------------------------------------------------------------
def every_model_everywhere(scenario: Scenario, backend: SimulatedBackend,
                           reserve_bytes: int = 512 * 2**20) -> tuple[list[tuple[str, str]], list[str]]:
    """(a): (model, device) for every leaf device and every model that still fits on it, in name order."""
    out, unplaced = [], []
    for d in backend.leaf_devices():
        if d.kind == "cpu":
            continue
        free = d.memory_total_bytes - reserve_bytes
        for name, spec in sorted(scenario.specs.items()):
            if spec.memory_bytes <= free:
                out.append((name, d.id))
                free -= spec.memory_bytes
    for name in scenario.specs:
        if not any(m == name for m, _ in out):
            unplaced.append(f"{name}: fits on no device beside the models before it")
    return out, unplaced


def planned(scenario: Scenario, backend: SimulatedBackend, counts: dict[str, int],
            reserve_bytes: int = 512 * 2**20) -> tuple[list[tuple[str, str]], list[str]]:
    """(b), (c): `counts` instances per model, packed by gpud's planner (through gpud's own translation)."""
    devices = planning_devices(backend.leaf_devices(), device_reserve_bytes=reserve_bytes)
    versions = [VersionDemand(name, "1", (InstanceGroup(count=counts[name], kind="KIND_GPU"),), spec.memory_bytes,
                              spec.compute_fraction) for name, spec in sorted(scenario.specs.items())]
    inputs = build_inputs(devices, versions)
    result = plan(inputs.devices, inputs.demands, config=PlannerConfig(time_limit_seconds=2.0))
    placed = [(inputs.groups[a.model].model, a.device) for a in result.placements]
    return placed, [f"{u.model} instance {u.instance}: {u.reason}" for u in result.unplaced]


def run_static(policy: str, scenario: Scenario, placement: list[tuple[str, str]], unplaced: list[str]) -> Result:
    started = time.perf_counter()
    backend = SimulatedBackend.from_file(scenario.node_file)
    serving = _serving(scenario, backend)
    series: dict[str, list[float]] = {}
    _sampler(serving, series)
    for k, (name, device) in enumerate(placement):
        serving.ready(serving.add_instance(f"{name}#{k}", serving.models[(name, "1")], device,
                                           scenario.specs[name].memory_bytes))
    serving.finish(scenario.duration_s)
    return _result(policy, serving, started, series, loads=0, unloads=0, unplaced=unplaced)


# --- controlled policies --------------------------------------------------------------------------------------
def run_controlled(policy: str, scenario: Scenario, settings: ControlSettings, workdir: Path | None = None,
                   objectives: bool = False) -> Result:
    """(d), (e); `objectives`: each model's config carries its latency objective (gpud_latency_objective_ms), which
    then drives its instance count instead of the queue target."""
    started = time.perf_counter()
    backend = SimulatedBackend.from_file(scenario.node_file)
    serving = _serving(scenario, backend)
    series: dict[str, list[float]] = {}
    _sampler(serving, series)
    specs = {name: replace(spec, objective_ms=scenario.objectives_ms.get(name)) if objectives else spec
             for name, spec in scenario.specs.items()}
    plane = ControlPlane(serving, backend, specs, settings, workdir or scratch_dir())
    try:
        plane.start()
        serving.finish(scenario.duration_s)
        steps: dict[str, int] = {}
        for (action, _reason, applied), n in plane.controller.actions.items():
            if applied == "true":
                steps[action] = steps.get(action, 0) + n
        return _result(policy, serving, started, series, loads=plane.pool.loads, unloads=plane.pool.unloads,
                       cold_starts=plane.cold_starts(), evictions=plane.evictions(),
                       flaps=plane.flaps(settings.control.scale_down_cooldown_seconds), steps=steps)
    finally:
        plane.close()


def run_policy(policy: str, scenario: Scenario, **controller: float) -> Result:
    """`controller`: settings_for's keywords, for (d) and (e)."""
    backend = SimulatedBackend.from_file(scenario.node_file)
    if policy == "triton":
        return run_static(policy, scenario, *every_model_everywhere(scenario, backend))
    if policy in ("peak", "average"):
        counts = {}
        for name in scenario.specs:
            rate = (max(scenario.rates_per_s[name]) if policy == "peak" else scenario.mean_rate_per_s(name))
            counts[name] = instances_needed(rate, scenario.throughput_per_s(name), scenario.target_utilization)
        return run_static(policy, scenario, *planned(scenario, backend, counts))
    if policy in ("scratch", "gpud"):
        return run_controlled(policy, scenario, settings_for(scenario, incremental=policy == "gpud", **controller))
    if policy in ("objectives", "objectives-unranked"):  # unranked: without the priority under scarcity
        settings = replace(settings_for(scenario, incremental=True, **controller), ranked=policy == "objectives")
        return run_controlled(policy, scenario, settings, objectives=True)
    raise ValueError(f"unknown policy {policy!r} (policies: {', '.join(POLICIES)})")
