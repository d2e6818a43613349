"""The Alibaba GPU-disaggregated DLRM trace (NSDI'25) as load: the live instance count of each inference service over
time becomes the request rate of one model.

Each row of `disaggregated_DLRM_trace.csv` is one instance of a service (`app_name`) with its creation and deletion
time in seconds from the trace start (empty: before the start / after the end). The live count of a service at time t
is the number of its instances created at or before t and not deleted by t. A service's rate at t is
`peak_rate * live(t) / max live over the window`: the trace gives the shape of demand, the replay its scale.
"""
from __future__ import annotations

import csv
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACE_FILE = "traces/alibaba-gpu-v2025/disaggregated_DLRM_trace.csv"


@dataclass(frozen=True)
class ServiceCurve:
    app: str
    live: tuple[int, ...]  # live instances at each step of the window

    @property
    def peak(self) -> int:
        return max(self.live)

    @property
    def mean(self) -> float:
        return sum(self.live) / len(self.live)

    def shape(self) -> np.ndarray:
        """live / peak at each step (0..1)."""
        return np.asarray(self.live, dtype=float) / max(1, self.peak)


def read_lifetimes(data_dir: str | Path) -> dict[str, list[tuple[float, float]]]:
    """Per service, (created_s, deleted_s) of each of its instances: -inf / +inf where the trace leaves it empty."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    with open(Path(data_dir) / TRACE_FILE, newline="") as f:
        for row in csv.DictReader(f):
            created = float(row["creation_time"]) if row["creation_time"] else float("-inf")
            deleted = float(row["deletion_time"]) if row["deletion_time"] else float("inf")
            out[row["app_name"]].append((created, deleted))
    return dict(out)


def live_counts(lifetimes: Sequence[tuple[float, float]], start_s: float, step_s: float, steps: int) -> tuple[int, ...]:
    """Instances alive at start_s + k * step_s, k = 0..steps-1 (alive at t: created <= t < deleted)."""
    created = np.sort(np.array([c for c, _ in lifetimes]))
    deleted = np.sort(np.array([d for _, d in lifetimes]))
    t = start_s + step_s * np.arange(steps)
    return tuple(int(x) for x in np.searchsorted(created, t, side="right") - np.searchsorted(deleted, t, side="right"))


def curves(lifetimes: dict[str, list[tuple[float, float]]], start_s: float, step_s: float,
           steps: int) -> list[ServiceCurve]:
    return [ServiceCurve(app, live_counts(spans, start_s, step_s, steps)) for app, spans in sorted(lifetimes.items())]


def select_dynamic(all_curves: Sequence[ServiceCurve], count: int, *, min_peak: int = 4,
                   min_peak_to_mean: float = 1.3) -> list[ServiceCurve]:
    """The `count` services whose demand moves the most in the window: peak at least `min_peak` instances and at
    least `min_peak_to_mean` times their mean, ranked by how much the live count changes step to step (total
    variation / peak). A controller has nothing to do for a flat service; the replay is about the ones that move."""
    def moves(c: ServiceCurve) -> float:
        return float(np.abs(np.diff(c.live)).sum()) / c.peak

    eligible = [c for c in all_curves if c.peak >= min_peak and c.peak >= min_peak_to_mean * c.mean]
    return sorted(eligible, key=lambda c: (-moves(c), c.app))[:count]
