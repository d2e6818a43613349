"""Per-model metrics the executor feeds directly (request and batch counters, latency and batch-size histograms),
plus gauges read at scrape time.

Why not prometheus_client's Counter and Histogram: a node serving 100 models exports ~11 000 model samples (5
latency histograms of 16 buckets and a batch-size histogram per model version), and prometheus_client's text
exposition writes them at ~10 us each on a slow core, ~130 ms a scrape against a 50 ms target
(docs/benchmarks.md, "Telemetry scrape cost"); each observe also takes a lock per histogram. So the observations live
in plain arrays, one `_Series` per (model, version): per histogram a list of non-cumulative bucket counts (+Inf last)
followed by the sum, plus four integer counters. The exposition text of these families is rendered here with the
label prefix of every sample line cached per series (`render_text`), so a scrape costs roughly one pass of string
concatenation and one join; the bytes are the ones `generate_latest` writes for the same families
(tests/test_metrics_exposition.py compares the two).

Threading: the executor calls `observe_request` (once per finished request) and `observe_batch` (once per executed
batch) from the daemon's event loop, and the metrics endpoint renders from the same loop, so nothing is locked. A
scrape from another thread (a test calling `generate_latest`) is still safe: it iterates a snapshot of the series
and can at worst see one observation half applied (a bucket counted, its sum not yet).

`ModelMetrics` is also an ordinary prometheus_client collector: `ModelMetrics(registry)` registers it, and
`generate_latest(registry)` / `registry.get_sample_value` see every family it exports (`collect()` builds them at
scrape time). The daemon instead creates it with `registry=None` and serves `render_text()` next to
`generate_latest(registry)` of the other collectors (gpud/metrics_server.py), which exports each family once.

What is exported differs from a Counter/Histogram-based exporter in one respect: no `*_created` series. In the text
format Prometheus stores them as ordinary gauges (one per counter and histogram child, ~1 000 series for 100 models);
no dashboard panel, rule or alert of gpud's reads them, and `rate()`/`increase()` handle counter resets without them.
The 16 latency buckets stay: the dashboard's p50/p99 panels interpolate within buckets, and a coarser 1-10-100 grid
would make a 4 ms p99 read anywhere between 1 and 10 ms.

Per-instance gauges (memory footprint, load time, readiness) are read from the core at scrape time
(`set_sources(instance_info=...)`). With `triton_names=True` the same observations are also exported under
Triton's names (`nv_inference_*` cumulative counters in microseconds, `nv_gpu_*` per physical GPU labelled
`gpu_uuid`), so dashboards built for Triton keep working against gpud (docs/model-metrics.md).
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import accumulate
from operator import add
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

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

MODEL_LABELS = ("model", "version")
INSTANCE_LABELS = ("model", "version", "instance", "device")

_REQUESTS = ("gpud_model_requests", "Inference requests finished, by outcome.")
# The histograms of a series, in the order of `_Series.hists`: (name, help, upper bounds without +Inf).
_HISTOGRAMS = (
    ("gpud_model_queue_duration_seconds", "Time a successful request waited in the queue.", LATENCY_BUCKETS_SECONDS),
    ("gpud_model_compute_input_duration_seconds", "Time to prepare a successful request's inputs (copy to the "
     "device).", LATENCY_BUCKETS_SECONDS),
    ("gpud_model_compute_infer_duration_seconds", "Time a successful request spent in model execution.",
     LATENCY_BUCKETS_SECONDS),
    ("gpud_model_compute_output_duration_seconds", "Time to extract a successful request's outputs.",
     LATENCY_BUCKETS_SECONDS),
    ("gpud_model_request_duration_seconds", "End-to-end time of a successful request inside gpud, queue included.",
     LATENCY_BUCKETS_SECONDS),
    ("gpud_model_batch_size", "Requests per executed batch.", BATCH_SIZE_BUCKETS),
)
# Plain counters of a series: (name without _total, help, _Series attribute).
_COUNTERS = (
    ("gpud_model_executions", "Batches executed (model executions).", "executions"),
    ("gpud_model_inferences", "Inferences performed: batch rows executed (a request of 8 rows counts 8).",
     "inferences"),
)
# `le` label values, as prometheus_client writes them (0.00025, 1.0, +Inf).
_LES = tuple(tuple(floatToGoString(b) for b in bounds) + ("+Inf",) for _, _, bounds in _HISTOGRAMS)

# Triton's per-model counters: (name, help, value of a _Series). Help texts follow Triton's. Durations are the
# histograms' sums (successful requests only, as Triton records them) in microseconds.
_TRITON_COUNTERS: tuple[tuple[str, str, Callable[["_Series"], float]], ...] = (
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes",
     lambda s: s.success),
    ("nv_inference_request_failure", "Number of failed inference requests, all batch sizes", lambda s: s.failure),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)",
     lambda s: s.inferences),
    ("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)",
     lambda s: s.executions),
    ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds (includes cached "
     "requests)", lambda s: s.request[-1] * 1e6),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds (includes cached "
     "requests)", lambda s: s.queue[-1] * 1e6),
    ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds (does not include "
     "cached requests)", lambda s: s.compute_input[-1] * 1e6),
    ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds (does not "
     "include cached requests)", lambda s: s.compute_infer[-1] * 1e6),
    ("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in microseconds (does "
     "not include cached requests)", lambda s: s.compute_output[-1] * 1e6),
)
# Triton's GPU gauges: (name, help, DeviceReading attribute).
_TRITON_GPU = (
    ("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", "utilization_ratio"),
    ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", "memory_used_bytes"),
    ("nv_gpu_power_usage", "GPU power usage in watts", "power_w"),
    ("nv_gpu_power_limit", "GPU power management limit in watts", "power_limit_w"),
    ("nv_energy_consumption", "GPU energy consumption in joules since the Triton Server started", "energy_joules"),
)


# --- the text format, as prometheus_client's generate_latest writes it -------------------------------------------
def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _header(name: str, doc: str, mtype: str) -> str:
    doc = doc.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {mtype}\n"


def _count_text(n: int) -> str:
    """An integer count as floatToGoString writes it (`3.0`; Go's exponent form from 7 digits on), newline included."""
    return f"{n}.0\n" if 0 <= n < 1000000 else floatToGoString(n) + "\n"


_SMALL_COUNT = "%d.0\n"  # _count_text of 0 <= n < 10**6


def _value_text(v: float) -> str:
    return floatToGoString(v) + "\n"


def _family_text(metric: Metric) -> str:
    """A gauge or untyped family built at scrape time (a few hundred samples at most), written sample by sample."""
    if metric.type not in ("gauge", "unknown"):
        raise ValueError(f"_family_text writes gauge and untyped families only, not {metric.type} ({metric.name})")
    out = [_header(metric.name, metric.documentation, "gauge" if metric.type == "gauge" else "untyped")]
    for s in metric.samples:
        labels = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(s.labels.items()))
        out.append(f"{s.name}{{{labels}}} " if labels else f"{s.name} ")
        out.append(_value_text(s.value))
    return "".join(out)


# --- per-(model, version) state -----------------------------------------------------------------------------------
class _Series:
    """One model version's observations and the cached prefixes of its sample lines.

    A histogram is one list: non-cumulative bucket counts (ints, one per upper bound, +Inf last), then the sum."""

    __slots__ = ("model", "version", "hists", "queue", "compute_input", "compute_infer", "compute_output", "request",
                 "batch_size", "success", "failure", "executions", "inferences", "labels", "outcome_labels", "prefixes")

    def __init__(self, model: str, version: str):
        self.model, self.version = model, version
        self.hists = tuple([0] * len(les) + [0.0] for les in _LES)
        (self.queue, self.compute_input, self.compute_infer, self.compute_output, self.request,
         self.batch_size) = self.hists
        self.success = self.failure = self.executions = self.inferences = 0
        # Label pairs in sorted name order, as generate_latest writes them: le < model < outcome < version.
        lv = f'model="{_escape_label(model)}",version="{_escape_label(version)}"'
        self.labels = "{" + lv + "} "
        self.outcome_labels = tuple(f'{{model="{_escape_label(model)}",outcome="{outcome}",'
                                    f'version="{_escape_label(version)}"}} ' for outcome in ("success", "failure"))
        # Per histogram: the prefixes of its bucket lines and its _count line, then its _sum line's.
        self.prefixes = tuple(
            (tuple(f'{name}_bucket{{le="{le}",{lv}}} ' for le in les) + (f"{name}_count{{{lv}}} ",),
             f"{name}_sum{{{lv}}} ")
            for (name, _, _), les in zip(_HISTOGRAMS, _LES))


class _GaugeSources:
    """Pending requests, instance counts and per-instance facts: owned by the executor, read when Prometheus
    scrapes."""

    def __init__(self) -> None:
        self.pending: PendingSource | None = None
        self.instances: InstancesSource | None = None
        self.instance_info: InstanceInfoSource | None = None

    @staticmethod
    def families() -> list[GaugeMetricFamily]:
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

    def collect(self) -> list[GaugeMetricFamily]:
        families = self.families()
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


def _untyped(name: str, doc: str) -> Metric:
    # Triton declares these counters without the `_total` suffix. prometheus_client's text exposition appends
    # `_total` to the name of every counter-typed family, which would rename the series Triton dashboards query;
    # an untyped family keeps the exact names and values (rate() and increase() work on it all the same).
    return Metric(name, doc, "unknown")


class _Triton:
    """Triton's names for the same observations (`nv_inference_*`) and `nv_gpu_*` per physical GPU."""

    def __init__(self, sources: _GaugeSources, devices: Any = None):
        self._sources = sources
        self.devices = devices  # a telemetry.devices.DeviceBackend, for nv_gpu_*; None: no GPU series

    @staticmethod
    def gauge_families() -> list[GaugeMetricFamily]:
        fams = [GaugeMetricFamily("nv_inference_pending_request_count", "Instantaneous number of pending "
                                  "requests awaiting execution per-model.", labels=("model", "version")),
                GaugeMetricFamily("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", labels=("gpu_uuid",))]
        fams += [GaugeMetricFamily(name, doc, labels=("gpu_uuid",)) for name, doc, _ in _TRITON_GPU]
        return fams

    def counter_families(self, series: list[_Series]) -> list[Metric]:
        fams = []
        for name, doc, value in _TRITON_COUNTERS:
            fam = _untyped(name, doc)
            for s in series:
                fam.add_sample(name, {"model": s.model, "version": s.version}, float(value(s)))
            fams.append(fam)
        return fams

    def counters_text(self, series: list[_Series]) -> list[str]:
        out = []
        for name, doc, value in _TRITON_COUNTERS:
            out.append(_header(name, doc, "untyped"))
            out += [f"{name}{s.labels}{_value_text(value(s))}" for s in series]
        return out

    def collect_gauges(self) -> list[GaugeMetricFamily]:
        fams = self.gauge_families()
        pending_fam, total_fam, gpu_fams = fams[0], fams[1], fams[2:]
        pending = self._sources.pending
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


class ModelMetrics(Collector):
    def __init__(self, registry: CollectorRegistry | None, *, triton_names: bool = False, devices: Any = None):
        """`registry`: where to register as a collector; None for none (the daemon serves `render_text()` itself).
        `triton_names`: also export Triton's `nv_inference_*` and (given `devices`, a DeviceBackend) `nv_gpu_*`."""
        self._series: dict[tuple[str, str], _Series] = {}  # (model, str(version)) -> series
        self._lookup: dict[tuple[str, Any], _Series] = {}  # (model, version as the caller passes it) -> series
        self._sources = _GaugeSources()
        self.triton_names = triton_names
        self._triton = _Triton(self._sources, devices) if triton_names else None
        self.registry = registry
        if registry is not None:
            registry.register(self)

    # --- the hot path: called by the executor from the event loop --------------------------------------------------
    def _for(self, model: str, version: str | int) -> _Series:
        s = self._lookup.get((model, version))
        if s is None:
            key = (model, str(version))
            s = self._series.get(key)
            if s is None:
                s = self._series[key] = _Series(*key)
            self._lookup[(model, version)] = s
        return s

    def observe_request(self, model: str, version: str | int, success: bool,
                        queue_seconds: float | None = None, compute_input_seconds: float | None = None,
                        compute_infer_seconds: float | None = None, compute_output_seconds: float | None = None,
                        request_seconds: float | None = None) -> None:
        """Count one finished request. Durations are recorded for successful requests only (as Triton does):
        a failure's timings would mix rejected-at-once with timed-out-in-queue and mislead the latency panels."""
        s = self._lookup.get((model, version)) or self._for(model, version)
        if not success:
            s.failure += 1
            return
        s.success += 1
        # bisect_left: the first bucket whose upper bound is >= the value (Prometheus' `le`); past the last, +Inf.
        if queue_seconds is not None:
            h = s.queue
            h[bisect_left(LATENCY_BUCKETS_SECONDS, queue_seconds)] += 1
            h[-1] += queue_seconds
        if compute_input_seconds is not None:
            h = s.compute_input
            h[bisect_left(LATENCY_BUCKETS_SECONDS, compute_input_seconds)] += 1
            h[-1] += compute_input_seconds
        if compute_infer_seconds is not None:
            h = s.compute_infer
            h[bisect_left(LATENCY_BUCKETS_SECONDS, compute_infer_seconds)] += 1
            h[-1] += compute_infer_seconds
        if compute_output_seconds is not None:
            h = s.compute_output
            h[bisect_left(LATENCY_BUCKETS_SECONDS, compute_output_seconds)] += 1
            h[-1] += compute_output_seconds
        if request_seconds is not None:
            h = s.request
            h[bisect_left(LATENCY_BUCKETS_SECONDS, request_seconds)] += 1
            h[-1] += request_seconds

    def observe_requests(self, model: str, version: str | int, queue_ns: list[int], compute_input_ns: int,
                         compute_infer_ns: int, compute_output_ns: int, request_ns: list[int]) -> None:
        """The successful requests of one batch at once (what observe_request does for each, in a fraction of the
        time): per-request queue and request times; the batch's compute times, which every request shares."""
        n = len(queue_ns)
        if not n:
            return
        s = self._lookup.get((model, version)) or self._for(model, version)
        s.success += n
        buckets = LATENCY_BUCKETS_SECONDS
        for h, values in ((s.queue, queue_ns), (s.request, request_ns)):
            total = 0
            for v in values:
                h[bisect_left(buckets, v / 1e9)] += 1
                total += v
            h[-1] += total / 1e9
        for h, v in ((s.compute_input, compute_input_ns), (s.compute_infer, compute_infer_ns),
                     (s.compute_output, compute_output_ns)):
            seconds = v / 1e9
            h[bisect_left(buckets, seconds)] += n
            h[-1] += seconds * n

    def observe_batch(self, model: str, version: str | int, batch_size: int) -> None:
        """One executed batch of `batch_size` rows (the executor passes rows: Triton's batch size)."""
        rows = int(batch_size)
        if rows < 1 or rows != batch_size:
            raise ValueError(f"batch_size must be a whole number of rows >= 1, got {batch_size} for model {model!r} "
                             f"version {version!r}")
        s = self._lookup.get((model, version)) or self._for(model, version)
        h = s.batch_size
        h[bisect_left(BATCH_SIZE_BUCKETS, rows)] += 1
        h[-1] += rows
        s.executions += 1
        s.inferences += rows

    # --- configuration and lifecycle ---------------------------------------------------------------------------------
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
        s = self._series.pop((model, str(version)), None)
        if s is not None:
            for key in [key for key, other in self._lookup.items() if other is s]:
                del self._lookup[key]

    # --- exposition ------------------------------------------------------------------------------------------------
    def _snapshot(self) -> list[_Series]:
        return [s for _, s in sorted(self._series.items())]

    def describe(self) -> Iterable[Metric]:
        """The families, without samples: what the registry checks for name clashes (nothing is read)."""
        fams: list[Metric] = [CounterMetricFamily(*_REQUESTS, labels=MODEL_LABELS + ("outcome",))]
        fams += [HistogramMetricFamily(name, doc, labels=MODEL_LABELS) for name, doc, _ in _HISTOGRAMS]
        fams += [CounterMetricFamily(name, doc, labels=MODEL_LABELS) for name, doc, _ in _COUNTERS]
        fams += _GaugeSources.families()
        if self._triton is not None:
            fams += [_untyped(name, doc) for name, doc, _ in _TRITON_COUNTERS] + _Triton.gauge_families()
        return fams

    def collect(self) -> Iterable[Metric]:
        """The families as prometheus_client objects (for `generate_latest(registry)` and `get_sample_value`)."""
        series = self._snapshot()
        requests = CounterMetricFamily(*_REQUESTS, labels=MODEL_LABELS + ("outcome",))
        for s in series:
            requests.add_metric([s.model, s.version, "success"], s.success)
            requests.add_metric([s.model, s.version, "failure"], s.failure)
        fams: list[Metric] = [requests]
        for k, ((name, doc, _), les) in enumerate(zip(_HISTOGRAMS, _LES)):
            fam = HistogramMetricFamily(name, doc, labels=MODEL_LABELS)
            for s in series:
                h = s.hists[k]
                fam.add_metric([s.model, s.version], list(zip(les, accumulate(h[:-1]))), h[-1])
            fams.append(fam)
        for name, doc, attr in _COUNTERS:
            fam = CounterMetricFamily(name, doc, labels=MODEL_LABELS)
            for s in series:
                fam.add_metric([s.model, s.version], getattr(s, attr))
            fams.append(fam)
        fams += self._sources.collect()
        if self._triton is not None:
            fams += self._triton.counter_families(series) + self._triton.collect_gauges()
        return fams

    def render_text(self) -> str:
        """The same families in the Prometheus text format, written from the arrays with the cached line prefixes:
        byte for byte what `generate_latest` writes for `collect()`, ~20x faster (docs/benchmarks.md)."""
        series = self._snapshot()
        out = [_header("gpud_model_requests_total", _REQUESTS[1], "counter")]
        for s in series:
            success, failure = s.outcome_labels
            out += (f"gpud_model_requests_total{success}{_count_text(s.success)}",
                    f"gpud_model_requests_total{failure}{_count_text(s.failure)}")
        for k, (name, doc, _) in enumerate(_HISTOGRAMS):
            out.append(_header(name, doc, "histogram"))
            for s in series:
                h = s.hists[k]
                counts = list(accumulate(h[:-1]))
                counts.append(counts[-1])  # _count: the +Inf bucket
                lines, sum_prefix = s.prefixes[k]
                # Counts are cumulative, so the last is the largest: below 10**6 all print as `%d.0` (C, no frame).
                out += map(add, lines, map(_SMALL_COUNT.__mod__ if counts[-1] < 1000000 else _count_text, counts))
                out += (sum_prefix, _value_text(h[-1]))
        for name, doc, attr in _COUNTERS:
            out.append(_header(name + "_total", doc, "counter"))
            out += [f"{name}_total{s.labels}{_count_text(getattr(s, attr))}" for s in series]
        out += map(_family_text, self._sources.collect())
        if self._triton is not None:
            out += self._triton.counters_text(series)
            out += map(_family_text, self._triton.collect_gauges())
        return "".join(out)
