"""Per-model metrics the executor feeds directly (counters and histograms), plus gauges read at scrape time.

The executor calls `observe_request` once per finished request and `observe_batch` once per executed batch.
The labelled children are cached per (model, version) so a call costs a dict lookup and a few observes.

Per-instance gauges (memory footprint, load time, readiness) are read from the core at scrape time
(`set_sources(instance_info=...)`). With `triton_names=True` the same observations are also exported under
Triton's names (`nv_inference_*` cumulative counters in microseconds, `nv_gpu_*` per physical GPU labelled
`gpu_uuid`), so dashboards built for Triton keep working against gpud (docs/model-metrics.md).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

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
class InstanceInfo:
    """One loaded model instance, as the scrape-time gauges see it."""

    model: str
    version: str
    instance: str  # the instance's index within its model version, as a string label
    device: str
    memory_bytes: int  # measured at load (device memory delta on a GPU, RSS delta on the CPU); estimate if unmeasured
    load_seconds: float  # load + warm-up run
    ready: bool


InstanceInfoSource = Callable[[], Iterable[InstanceInfo]]


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
    inferences: Counter
    triton: "_TritonTotals"


@dataclass
class _TritonTotals:
    """Triton's cumulative per-model counters, kept as plain numbers and exported at scrape time (durations in us,
    successful requests only, as Triton records them)."""

    success: int = 0
    failure: int = 0
    inference_count: int = 0  # rows
    exec_count: int = 0  # batches
    request_us: float = 0.0
    queue_us: float = 0.0
    compute_input_us: float = 0.0
    compute_infer_us: float = 0.0
    compute_output_us: float = 0.0


INSTANCE_LABELS = ("model", "version", "instance", "device")


class _GaugeSources(Collector):
    """Pending requests, instance counts and per-instance facts: owned by the executor, read when Prometheus
    scrapes."""

    def __init__(self) -> None:
        self.pending: PendingSource | None = None
        self.instances: InstancesSource | None = None
        self.instance_info: InstanceInfoSource | None = None

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def _families(self) -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("gpud_model_pending_requests", "Requests queued for the model, not yet executing.",
                              labels=("model", "version")),
            GaugeMetricFamily("gpud_model_instances", "Model instances loaded, per device.",
                              labels=("model", "version", "device")),
            GaugeMetricFamily("gpud_model_instance_memory_bytes", "Measured memory footprint of one model instance "
                              "(device memory on a GPU, resident memory on the CPU), bytes.", labels=INSTANCE_LABELS),
            GaugeMetricFamily("gpud_model_instance_load_duration_seconds", "Time the instance took to load, warm-up "
                              "run included, seconds.", labels=INSTANCE_LABELS),
            GaugeMetricFamily("gpud_model_instance_ready", "1 while the instance serves, 0 while it is not ready "
                              "(e.g. its worker is restarting).", labels=INSTANCE_LABELS),
        ]

    def collect(self) -> Iterable[Metric]:
        families = self._families()
        pending_fam, instances_fam, memory_fam, load_fam, ready_fam = families
        if self.pending is not None:
            for (model, version), n in sorted(self.pending().items()):
                pending_fam.add_metric([model, str(version)], float(n))
        if self.instances is not None:
            for (model, version, device), n in sorted(self.instances().items()):
                instances_fam.add_metric([model, str(version), device], float(n))
        if self.instance_info is not None:
            for i in self.instance_info():
                labels = [i.model, str(i.version), str(i.instance), i.device]
                memory_fam.add_metric(labels, float(i.memory_bytes))
                load_fam.add_metric(labels, float(i.load_seconds))
                ready_fam.add_metric(labels, 1.0 if i.ready else 0.0)
        return families


# Triton's per-model counters: (name, help, _TritonTotals attribute). Help texts follow Triton's.
_TRITON_COUNTERS = (
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes", "success"),
    ("nv_inference_request_failure", "Number of failed inference requests, all batch sizes", "failure"),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)", "inference_count"),
    ("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)",
     "exec_count"),
    ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds (includes cached "
     "requests)", "request_us"),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds (includes cached "
     "requests)", "queue_us"),
    ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds (does not include "
     "cached requests)", "compute_input_us"),
    ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds (does not "
     "include cached requests)", "compute_infer_us"),
    ("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in microseconds (does "
     "not include cached requests)", "compute_output_us"),
)
# Triton's GPU gauges: (name, help, DeviceReading attribute).
_TRITON_GPU = (
    ("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", "utilization_ratio"),
    ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", "memory_used_bytes"),
    ("nv_gpu_power_usage", "GPU power usage in watts", "power_w"),
    ("nv_gpu_power_limit", "GPU power management limit in watts", "power_limit_w"),
    ("nv_energy_consumption", "GPU energy consumption in joules since the Triton Server started", "energy_joules"),
)


def _untyped(name: str, doc: str) -> Metric:
    # Triton declares these counters without the `_total` suffix. prometheus_client's text exposition appends
    # `_total` to the name of every counter-typed family, which would rename the series Triton dashboards query;
    # an untyped family keeps the exact names and values (rate() and increase() work on it all the same).
    return Metric(name, doc, "unknown")


class _TritonCollector(Collector):
    def __init__(self, metrics: "ModelMetrics", devices: Any = None):
        self._metrics = metrics
        self.devices = devices  # a telemetry.devices.DeviceBackend, for nv_gpu_*; None: no GPU series

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def _families(self) -> list[Metric]:
        fams = [_untyped(name, doc) for name, doc, _ in _TRITON_COUNTERS]
        fams.append(GaugeMetricFamily("nv_inference_pending_request_count", "Instantaneous number of pending "
                                      "requests awaiting execution per-model.", labels=("model", "version")))
        fams.append(GaugeMetricFamily("nv_gpu_memory_total_bytes", "GPU total memory, in bytes",
                                      labels=("gpu_uuid",)))
        fams += [GaugeMetricFamily(name, doc, labels=("gpu_uuid",)) for name, doc, _ in _TRITON_GPU]
        return fams

    def collect(self) -> Iterable[Metric]:
        fams = self._families()
        counter_fams = fams[:len(_TRITON_COUNTERS)]
        pending_fam, total_fam = fams[len(_TRITON_COUNTERS):len(_TRITON_COUNTERS) + 2]
        gpu_fams = fams[len(_TRITON_COUNTERS) + 2:]
        with self._metrics._lock:
            children = sorted(self._metrics._children.items())
        for (model, version), c in children:
            labels = {"model": model, "version": version}
            for fam, (name, _, attr) in zip(counter_fams, _TRITON_COUNTERS):
                fam.add_sample(name, labels, float(getattr(c.triton, attr)))
        pending = self._metrics._sources.pending
        if pending is not None:
            for (model, version), n in sorted(pending().items()):
                pending_fam.add_metric([model, str(version)], float(n))
        if self.devices is not None:
            self._collect_gpus(total_fam, gpu_fams)
        return fams

    def _collect_gpus(self, total_fam: GaugeMetricFamily, gpu_fams: list[GaugeMetricFamily]) -> None:
        # Triton (through DCGM) reports physical GPUs only; a MIG instance's use shows on its parent.
        for d in self.devices.devices():
            if d.kind != "gpu":
                continue
            try:
                reading = self.devices.sample(d.id)
            except Exception:  # noqa: BLE001 - the device collector logs sampling failures; here: no sample
                continue
            total_fam.add_metric([d.uuid], float(d.memory_total_bytes))
            for fam, (_, _, attr) in zip(gpu_fams, _TRITON_GPU):
                value = getattr(reading, attr, None)
                if value is not None:
                    fam.add_metric([d.uuid], float(value))


class ModelMetrics:
    def __init__(self, registry: CollectorRegistry, *, triton_names: bool = False, devices: Any = None):
        """`triton_names`: also export Triton's `nv_inference_*` and (given `devices`, a DeviceBackend) `nv_gpu_*`."""
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
        self._inferences = Counter("gpud_model_inferences", "Inferences performed: batch rows executed (a request of "
                                   "8 rows counts 8).", labels, registry=registry)
        self._sources = _GaugeSources()
        registry.register(self._sources)
        self.triton_names = triton_names
        self._triton: _TritonCollector | None = None
        if triton_names:
            self._triton = _TritonCollector(self, devices)
            registry.register(self._triton)
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
                        inferences=self._inferences.labels(model, version),
                        triton=_TritonTotals(),
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
        t = c.triton
        if not success:
            c.failure.inc()
            t.failure += 1
            return
        c.success.inc()
        t.success += 1
        if queue_seconds is not None:
            c.queue.observe(queue_seconds)
            t.queue_us += queue_seconds * 1e6
        if compute_input_seconds is not None:
            c.compute_input.observe(compute_input_seconds)
            t.compute_input_us += compute_input_seconds * 1e6
        if compute_infer_seconds is not None:
            c.compute_infer.observe(compute_infer_seconds)
            t.compute_infer_us += compute_infer_seconds * 1e6
        if compute_output_seconds is not None:
            c.compute_output.observe(compute_output_seconds)
            t.compute_output_us += compute_output_seconds * 1e6
        if request_seconds is not None:
            c.request.observe(request_seconds)
            t.request_us += request_seconds * 1e6

    def observe_batch(self, model: str, version: str | int, batch_size: int) -> None:
        """One executed batch of `batch_size` rows (the executor passes rows: Triton's batch size)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size} for model {model!r} version {version!r}")
        c = self._for(model, str(version))
        c.batch_size.observe(batch_size)
        c.executions.inc()
        c.inferences.inc(batch_size)
        c.triton.exec_count += 1
        c.triton.inference_count += batch_size

    def set_sources(self, pending: PendingSource | None = None, instances: InstancesSource | None = None,
                    instance_info: InstanceInfoSource | None = None) -> None:
        """Callables returning {(model, version): n}, {(model, version, device): n} and [InstanceInfo], called at
        each scrape. A source not given is left as it was (the core sets the first two, the daemon the third)."""
        if pending is not None:
            self._sources.pending = pending
        if instances is not None:
            self._sources.instances = instances
        if instance_info is not None:
            self._sources.instance_info = instance_info

    def set_devices(self, devices: Any) -> None:
        """The DeviceBackend the Triton-named `nv_gpu_*` gauges read (no-op without `triton_names`)."""
        if self._triton is not None:
            self._triton.devices = devices

    def remove_model(self, model: str, version: str | int) -> None:
        """Drop the model's series (an unloaded model must not linger as a flat line). Idempotent."""
        version = str(version)
        with self._lock:
            self._children.pop((model, version), None)
        for outcome in ("success", "failure"):
            _remove(self._requests, model, version, outcome)
        for metric in (self._queue, self._compute_input, self._compute_infer, self._compute_output, self._request,
                       self._batch_size, self._executions, self._inferences):
            _remove(metric, model, version)


def _remove(metric: Counter | Histogram, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass  # never observed: nothing to remove
