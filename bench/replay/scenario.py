"""One replay scenario: which trace services become which models, their kinds, footprints, load times and request
rates over the model's time. Everything is derived from the trace, the measured kinds and a seed, so two runs with
the same arguments replay the same requests."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .control import ModelSpec
from .des import Kind, SimModel, poisson_arrivals
from .kinds import SPECS, load_kinds
from .alibaba import ServiceCurve, curves, read_lifetimes, select_dynamic

GIB = 2**30
NODE_FILE = Path(__file__).resolve().parents[2] / "config" / "nodes" / "hgx-a100-8gpu-mig.yaml"


@dataclass(frozen=True)
class Scenario:
    specs: dict[str, ModelSpec]
    kinds: dict[str, Kind]
    services: dict[str, str]  # model -> trace service (app_name)
    peak_rate_per_s: dict[str, float]
    rates_per_s: dict[str, np.ndarray]  # model -> rate in each second of model time
    duration_s: float
    measure_from_s: float  # the warm-up before it is not measured
    slo_queue_s: float
    target_utilization: float
    seconds_per_trace_step: float
    trace_step_s: float
    node_file: Path = NODE_FILE
    seed: int = 0
    objectives_ms: dict[str, float] = field(default_factory=dict)  # model -> its latency objective (queue + compute)

    def kind_of(self, model: str) -> Kind:
        return self.kinds[self.specs[model].kind]

    def throughput_per_s(self, model: str) -> float:
        """Requests one instance serves per second on a whole GPU, at full batches."""
        spec = self.specs[model]
        return spec.max_batch_size / self.kind_of(model).seconds(spec.max_batch_size)

    def mean_rate_per_s(self, model: str) -> float:
        r = self.rates_per_s[model][int(self.measure_from_s):]
        return float(r.mean())

    def models(self, seed_offset: int = 0) -> list[SimModel]:
        """The serving model's versions with their arrivals (the same for every policy of a run)."""
        rng = np.random.default_rng(self.seed + 1000 + seed_offset)
        return [SimModel(name, "1", self.kind_of(name), spec.max_batch_size,
                         poisson_arrivals(self.rates_per_s[name], 1.0, rng),
                         objective_s=self.objectives_ms[name] / 1e3 if name in self.objectives_ms else None)
                for name, spec in sorted(self.specs.items())]


# Each kind's latency objective (99% of requests within it, queue + compute): heterogeneous, as a node's models are.
OBJECTIVES_MS = {"ranker": 50.0, "encoder": 150.0, "vision": 400.0}


def build(data_dir: str | Path, *, models: int = 12, start_day: float = 18.0, days: float = 10.0,
          trace_step_s: float = 3600.0, seconds_per_trace_step: float = 30.0, warmup_s: float = 120.0,
          slo_queue_s: float = 0.2, target_utilization: float = 0.8, peak_instances: tuple[int, ...] = (1, 2, 3),
          load_base_s: float = 2.0, load_s_per_gib: float = 0.5, seed: int = 0) -> Scenario:
    """`models` services of the trace window (the most dynamic, trace.select_dynamic) become models. Model i gets
    kind i mod 3, a footprint from its kind's list, a peak that needs `peak_instances` instances (chosen at
    random) at the target utilization, and a load time of load_base_s + load_s_per_gib x footprint. One trace step
    (`trace_step_s`, an hour by default) lasts `seconds_per_trace_step` of model time; the live count is linear
    between steps. The warm-up repeats the first step."""
    rng = np.random.default_rng(seed)
    kinds = load_kinds()
    steps = int(days * 86400 / trace_step_s)
    chosen: list[ServiceCurve] = select_dynamic(curves(read_lifetimes(data_dir), start_day * 86400, trace_step_s,
                                                       steps), models)
    if len(chosen) < models:
        raise ValueError(f"the window has only {len(chosen)} dynamic services, {models} asked for")
    duration_s = warmup_s + steps * seconds_per_trace_step
    t = np.arange(int(math.ceil(duration_s)), dtype=float)
    step_of_t = np.clip((t - warmup_s) / seconds_per_trace_step, 0, steps - 1)
    specs, services, peaks, rates = {}, {}, {}, {}
    for i, curve in enumerate(chosen):
        kind = SPECS[i % len(SPECS)]
        name = f"m{i:02d}-{kind.name}"
        memory_gib = kind.memory_gib[int(rng.integers(len(kind.memory_gib)))]
        # It plans for the share of a GPU one instance uses at the target utilization (des rule 3's cap x target).
        spec = ModelSpec(name, kind.name, int(memory_gib * GIB), load_base_s + load_s_per_gib * memory_gib,
                         compute_fraction=round(kind.share * target_utilization, 3))
        specs[name] = spec
        services[name] = curve.app
        thr = spec.max_batch_size / kinds[kind.name].seconds(spec.max_batch_size)
        n_peak = int(rng.choice(peak_instances))
        peaks[name] = 0.95 * n_peak * thr * target_utilization  # just within n_peak instances at the target
        shape = np.interp(step_of_t, np.arange(steps), curve.shape())
        rates[name] = peaks[name] * shape
    objectives = {name: OBJECTIVES_MS[spec.kind] for name, spec in specs.items()}
    return Scenario(specs, kinds, services, peaks, rates, duration_s, warmup_s, slo_queue_s, target_utilization,
                    seconds_per_trace_step, trace_step_s, seed=seed, objectives_ms=objectives)
