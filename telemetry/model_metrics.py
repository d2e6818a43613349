"""Per-model metrics the executor feeds directly (counters and histograms), plus gauges read at scrape time.

The executor calls `observe_request` once per finished request and `observe_batch` once per executed batch.
The labelled children are cached per (model, version) so a call costs a dict lookup and a few observes.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

# 100 us .. 10 s, roughly 1-2.5-5 per decade: fine where inference latencies live, coarse beyond.
LATENCY_BUCKETS_SECONDS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
BATCH_SIZE_BUCKETS = tuple(float(2**i) for i in range(11))  # 1, 2, 4, ..., 1024

PendingSource = Callable[[], dict[tuple[str, str], int]]
InstancesSource = Callable[[], dict[tuple[str, str, str], int]]


@dataclass(frozen=True)
class _Children:
    success: Counter
    failure: Counter
    queue: Histogram
    compute_input: Histogram
    compute_infer: Histogram
    compute_output: Histogram
    request: Histogram
    batch_size: Histogram
    executions: Counter


class _GaugeSources(Collector):
    """Pending requests and instance counts: owned by the executor, read when Prometheus scrapes."""

    def __init__(self) -> None:
        self.pending: PendingSource | None = None
        self.instances: InstancesSource | None = None

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def _families(self) -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("gpud_model_pending_requests", "Requests queued for the model, not yet executing.",
                              labels=("model", "version")),
            GaugeMetricFamily("gpud_model_instances", "Model instances loaded, per device.",
                              labels=("model", "version", "device")),
        ]

    def collect(self) -> Iterable[Metric]:
        pending_fam, instances_fam = self._families()
        if self.pending is not None:
            for (model, version), n in sorted(self.pending().items()):
                pending_fam.add_metric([model, str(version)], float(n))
        if self.instances is not None:
            for (model, version, device), n in sorted(self.instances().items()):
                instances_fam.add_metric([model, str(version), device], float(n))
        return [pending_fam, instances_fam]


class ModelMetrics:
    def __init__(self, registry: CollectorRegistry):
        labels = ("model", "version")
        self._requests = Counter("gpud_model_requests", "Inference requests finished, by outcome.",
                                 labels + ("outcome",), registry=registry)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS_SECONDS, registry=registry)

        self._queue = hist("gpud_model_queue_duration_seconds", "Time a successful request waited in the queue.")
        self._compute_input = hist("gpud_model_compute_input_duration_seconds",
                                   "Time to prepare a successful request's inputs (copy to the device).")
        self._compute_infer = hist("gpud_model_compute_infer_duration_seconds",
                                   "Time a successful request spent in model execution.")
        self._compute_output = hist("gpud_model_compute_output_duration_seconds",
                                    "Time to extract a successful request's outputs.")
        self._request = hist("gpud_model_request_duration_seconds",
                             "End-to-end time of a successful request inside gpud, queue included.")
        self._batch_size = Histogram("gpud_model_batch_size", "Requests per executed batch.", labels,
                                     buckets=BATCH_SIZE_BUCKETS, registry=registry)
        self._executions = Counter("gpud_model_executions", "Batches executed (model executions).", labels,
                                   registry=registry)
        self._sources = _GaugeSources()
        registry.register(self._sources)
        self._children: dict[tuple[str, str], _Children] = {}
        self._lock = threading.Lock()

    def _for(self, model: str, version: str) -> _Children:
        key = (model, version)
        children = self._children.get(key)
        if children is None:
            with self._lock:
                children = self._children.get(key)
                if children is None:
                    children = _Children(
                        success=self._requests.labels(model, version, "success"),
                        failure=self._requests.labels(model, version, "failure"),
                        queue=self._queue.labels(model, version),
                        compute_input=self._compute_input.labels(model, version),
                        compute_infer=self._compute_infer.labels(model, version),
                        compute_output=self._compute_output.labels(model, version),
                        request=self._request.labels(model, version),
                        batch_size=self._batch_size.labels(model, version),
                        executions=self._executions.labels(model, version),
                    )
                    self._children[key] = children
        return children

    def observe_request(self, model: str, version: str | int, success: bool,
                        queue_seconds: float | None = None, compute_input_seconds: float | None = None,
                        compute_infer_seconds: float | None = None, compute_output_seconds: float | None = None,
                        request_seconds: float | None = None) -> None:
        """Count one finished request. Durations are recorded for successful requests only (as Triton does):
        a failure's timings would mix rejected-at-once with timed-out-in-queue and mislead the latency panels."""
        c = self._for(model, str(version))
        if not success:
            c.failure.inc()
            return
        c.success.inc()
        if queue_seconds is not None:
            c.queue.observe(queue_seconds)
        if compute_input_seconds is not None:
            c.compute_input.observe(compute_input_seconds)
        if compute_infer_seconds is not None:
            c.compute_infer.observe(compute_infer_seconds)
        if compute_output_seconds is not None:
            c.compute_output.observe(compute_output_seconds)
        if request_seconds is not None:
            c.request.observe(request_seconds)

    def observe_batch(self, model: str, version: str | int, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size} for model {model!r} version {version!r}")
        c = self._for(model, str(version))
        c.batch_size.observe(batch_size)
        c.executions.inc()

    def set_sources(self, pending: PendingSource | None = None, instances: InstancesSource | None = None) -> None:
        """Callables returning {(model, version): n} and {(model, version, device): n}, called at each scrape."""
        self._sources.pending = pending
        self._sources.instances = instances

    def remove_model(self, model: str, version: str | int) -> None:
        """Drop the model's series (an unloaded model must not linger as a flat line). Idempotent."""
        version = str(version)
        with self._lock:
            self._children.pop((model, version), None)
        for outcome in ("success", "failure"):
            _remove(self._requests, model, version, outcome)
        for metric in (self._queue, self._compute_input, self._compute_infer, self._compute_output, self._request,
                       self._batch_size, self._executions):
            _remove(metric, model, version)


def _remove(metric: Counter | Histogram, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass  # never observed: nothing to remove
