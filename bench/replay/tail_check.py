"""Two checks behind the objective-driven replay (issue 26), both on the replay's own serving model (des.py):

1. The tail prediction (gpud.scaling.tail.predicted_latency_s) against the 99th percentile the model serves: each
   kind, 1-4 instances each on a GPU of its own, steady Poisson arrivals at 2-90% of the full-batch capacity.
2. The least memory any controller could meet the objectives with: every second of the trace sized to the fewest
   instances whose measured 99th percentile (from 1, interpolated over the loads) is within the objective, with no
   load time, no reaction delay and no margin; once with one instance kept while a model is idle (a cold start
   misses any of these objectives), once with none (a controller that knew when each ramp from zero comes).

    cd bench && python -m replay.tail_check --data ../../shared/data
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from gpud.scaling.hints import batch_line
from gpud.scaling.tail import BatchLine, predicted_latency_s

from .des import Kind, Serving, SimDevice, SimModel, poisson_arrivals
from .kinds import load_kinds
from .scenario import OBJECTIVES_MS, build

LOADS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9)
INSTANCES = (1, 2, 3, 4)
MAX_BATCH = 4


class _Keeping:
    """A model's statistics record that also keeps every request's latency (a stand-in around it: the compiled
    ModelStats's methods cannot be replaced)."""

    def __init__(self, stats, latencies: list[int]):
        self._stats = stats
        self._latencies = latencies

    def record_batch(self, rows, queue_ns, request_ns, *rest):
        self._latencies.extend(request_ns)
        return self._stats.record_batch(rows, queue_ns, request_ns, *rest)

    def __getattr__(self, name: str):
        return getattr(self._stats, name)


def served_quantile_s(kind: Kind, rate_per_s: float, instances: int, *, seconds: float = 200.0,
                      share: float = 0.99, seed: int = 1) -> float:
    """The `share` quantile of request latency (queue + compute) the serving model gives at a steady rate."""
    model = SimModel("m", "1", kind, MAX_BATCH, poisson_arrivals([rate_per_s] * int(seconds), 1.0,
                                                                 np.random.default_rng(seed)))
    latencies: list[int] = []
    model.stats = _Keeping(model.stats, latencies)  # type: ignore[assignment]
    serving = Serving([SimDevice(f"gpu{i}", 1.0, True) for i in range(instances)], [model], slo_queue_s=1.0)
    for i in range(instances):
        serving.ready(serving.add_instance(f"i{i}", model, f"gpu{i}", 1))
    serving.finish(seconds + 5)
    return float(np.quantile(np.asarray(latencies) / 1e9, share))


def line_of(kind: Kind) -> BatchLine:
    line = batch_line([(rows, 1, round(kind.seconds(rows) * 1e9)) for rows in range(1, MAX_BATCH + 1)])
    assert line is not None
    return line


def most_rate_within(points: list[tuple[float, float]], objective_s: float) -> float:
    """The highest rate whose served quantile is within the objective, linear between measured (rate, quantile)."""
    best = 0.0
    for (r0, q0), (r1, q1) in zip(points, points[1:]):
        if q0 > objective_s:
            break
        if q1 > objective_s:
            return r0 + (r1 - r0) * (objective_s - q0) / (q1 - q0)
        best = r1
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[3] / "shared" / "data"))
    args = p.parse_args(argv)
    kinds = load_kinds()
    within: dict[tuple[str, int], float] = {}
    ratios: list[float] = []
    print("kind     inst  " + " ".join(f"{load:>11.0%}" for load in LOADS))
    print("         (99th percentile served / predicted, ms)")
    for name, kind in kinds.items():
        line, capacity = line_of(kind), MAX_BATCH / kind.seconds(MAX_BATCH)
        for n in INSTANCES:
            cells, points = [], []
            for load in LOADS:
                rate = load * n * capacity
                served, predicted = served_quantile_s(kind, rate, n), predicted_latency_s(rate, n, line, MAX_BATCH)
                points.append((rate, served))
                ratios.append(predicted / served)
                cells.append(f"{served * 1e3:5.0f}/{predicted * 1e3:<5.0f}")
            within[(name, n)] = most_rate_within(points, OBJECTIVES_MS[name] / 1e3)
            print(f"{name:<8} {n:>4}  " + " ".join(cells))
    print(f"predicted / served: {min(ratios):.2f}-{max(ratios):.2f}x, median {float(np.median(ratios)):.2f}x "
          f"over {len(ratios)} points")
    print("most req/s within the objective (served): " +
          ", ".join(f"{k} x{n}: {r:.0f}" for (k, n), r in within.items()))
    scenario = build(args.data)
    hours_per_sample = 1 / 3600
    for kept in (1, 0):
        total = 0.0
        for name, spec in scenario.specs.items():
            for rate in scenario.rates_per_s[name][int(scenario.measure_from_s):]:
                n = 1
                while n < INSTANCES[-1] and rate > within[(spec.kind, n)]:
                    n += 1
                total += (n if rate > 0 else kept) * spec.memory_bytes / 2**30 * hours_per_sample
        print(f"least memory meeting every objective, {kept} instance(s) kept while idle: {total:.1f} GiB-h")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
