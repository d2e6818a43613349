"""Per-model Prometheus metrics, read at scrape time from the serving snapshot (`gpud.telemetry.serving`): request and
batch counters, latency and batch-size histograms from each version's statistics record (`gpud.executor.stats`, the
one record the scheduler writes), and gauges of pending requests and loaded instances.

Why not prometheus_client's Counter and Histogram: a node serving 100 models exports ~11 000 model samples (5
latency histograms of 16 buckets and a batch-size histogram per model version), and prometheus_client's text
exposition writes them at ~10 us each on a slow core, ~130 ms a scrape against a 50 ms target
(docs/benchmarks.md, "Telemetry scrape cost"). So the record keeps plain arrays (non-cumulative bucket counts,
+Inf last; the sums are its nanosecond totals) and the exposition text of these families is rendered here with the
label prefix of every sample line cached per (model, version) (`render_text`): a scrape costs roughly one pass of
string concatenation and one join; the bytes are the ones `generate_latest` writes for the same families
(tests/test_metrics_exposition.py compares the two). A version that leaves the snapshot (unloaded) leaves the
exposition with it, and its cached prefixes are dropped.

Threading: the scheduler writes the records from the daemon's event loop and the metrics endpoint renders from the
same loop, so nothing is locked. A scrape from another thread (a test calling `generate_latest`) can at worst see
one batch half recorded (a bucket counted, its sum not yet).

`ModelMetrics` is also an ordinary prometheus_client collector: `ModelMetrics(source, registry)` registers it, and
`generate_latest(registry)` / `registry.get_sample_value` see every family it exports (`collect()` builds them at
scrape time). The daemon instead creates it with `registry=None` and serves `render_text()` next to
`generate_latest(registry)` of the other collectors (gpud/api/metrics_server.py), which exports each family once.

What is exported differs from a Counter/Histogram-based exporter in one respect: no `*_created` series. In the text
format Prometheus stores them as ordinary gauges (one per counter and histogram child, ~1 000 series for 100 models);
no dashboard panel, rule or alert of gpud's reads them, and `rate()`/`increase()` handle counter resets without them.

With `triton_names=True` the same records are also exported under Triton's names (`nv_inference_*` cumulative
counters in microseconds, `nv_gpu_*` per physical GPU labelled `gpu_uuid`), so dashboards built for Triton keep
working against gpud (docs/model-metrics.md).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import accumulate
from operator import add

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from gpud.executor.stats import BATCH_SIZE_BUCKETS, LATENCY_BUCKETS_SECONDS, ModelStats
from gpud.telemetry.devices import DeviceBackend
from gpud.telemetry.serving import ServingSnapshot, SnapshotSource, VersionView

__all__ = ["BATCH_SIZE_BUCKETS", "LATENCY_BUCKETS_SECONDS", "ModelMetrics"]

MODEL_LABELS = ("model", "version")
# Not "instance": Prometheus sets that label on every scraped series (the target), and renames ours to
# exported_instance.
INSTANCE_LABELS = ("model", "version", "model_instance", "device")

_REQUESTS = ("gpud_model_requests", "Inference requests finished, by outcome.")
# The histograms, in this order: (name, help, upper bounds without +Inf, the record's buckets, the record's sum).
_HISTOGRAMS: tuple[tuple[str, str, tuple[float, ...], Callable[[ModelStats], list[int]],
                         Callable[[ModelStats], float]], ...] = (
    ("gpud_model_queue_duration_seconds", "Time a successful request waited in the queue.", LATENCY_BUCKETS_SECONDS,
     lambda st: st.histograms.queue, lambda st: st.queue.ns / 1e9),
    ("gpud_model_compute_input_duration_seconds", "Time to prepare a successful request's inputs (copy to the "
     "device).", LATENCY_BUCKETS_SECONDS, lambda st: st.histograms.compute_input, lambda st: st.compute_input.ns / 1e9),
    ("gpud_model_compute_infer_duration_seconds", "Time a successful request spent in model execution.",
     LATENCY_BUCKETS_SECONDS, lambda st: st.histograms.compute_infer, lambda st: st.compute_infer.ns / 1e9),
    ("gpud_model_compute_output_duration_seconds", "Time to extract a successful request's outputs.",
     LATENCY_BUCKETS_SECONDS, lambda st: st.histograms.compute_output, lambda st: st.compute_output.ns / 1e9),
    ("gpud_model_request_duration_seconds", "End-to-end time of a successful request inside gpud, queue included.",
     LATENCY_BUCKETS_SECONDS, lambda st: st.histograms.request, lambda st: st.success.ns / 1e9),
    ("gpud_model_batch_size", "Requests per executed batch.", BATCH_SIZE_BUCKETS,
     lambda st: st.histograms.batch_size, lambda st: float(st.inference_count)),
)
# Plain counters: (name without _total, help, the record's value).
_COUNTERS: tuple[tuple[str, str, Callable[[ModelStats], int | float]], ...] = (
    ("gpud_model_executions", "Batches executed (model executions).", lambda st: st.execution_count),
    ("gpud_model_inferences", "Inferences performed: batch rows executed (a request of 8 rows counts 8).",
     lambda st: st.inference_count),
    ("gpud_model_cold_starts", "Loads of the version from zero instances because a request came (scale to zero, "
     "load on demand).", lambda st: st.cold_starts),
    ("gpud_model_cold_start_seconds", "Time of those cold starts, from the request that triggered one to an "
     "instance serving, seconds.", lambda st: st.cold_start_seconds),
    ("gpud_model_evictions", "Instances of the version unloaded to make room for another model's load: idle ones "
     "(least recently used first), or spare ones while its latency objective holds with margin.",
     lambda st: st.evictions),
    ("gpud_model_requests_within_objective", "Requests answered within the version's latency objective (queue + "
     "compute inside gpud); 0 for versions without one.", lambda st: st.within_objective),
    ("gpud_model_requests_over_objective", "Requests answered over the version's latency objective, or failed; "
     "0 for versions without one.", lambda st: st.over_objective),
)
# `le` label values, as prometheus_client writes them (0.00025, 1.0, +Inf).
_LES = tuple(tuple(floatToGoString(b) for b in bounds) + ("+Inf",) for _, _, bounds, _, _ in _HISTOGRAMS)

# Triton's per-model counters: (name, help, the record's value). Help texts follow Triton's. Durations are of
# successful requests only, as Triton records them, in microseconds.
_TRITON_COUNTERS: tuple[tuple[str, str, Callable[[ModelStats], float]], ...] = (
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes",
     lambda st: st.success.count),
    ("nv_inference_request_failure", "Number of failed inference requests, all batch sizes", lambda st: st.fail.count),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)",
     lambda st: st.inference_count),
    ("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)",
     lambda st: st.execution_count),
    ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds (includes cached "
     "requests)", lambda st: st.success.ns / 1e3),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds (includes cached "
     "requests)", lambda st: st.queue.ns / 1e3),
    ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds (does not include "
     "cached requests)", lambda st: st.compute_input.ns / 1e3),
    ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds (does not "
     "include cached requests)", lambda st: st.compute_infer.ns / 1e3),
    ("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in microseconds (does "
     "not include cached requests)", lambda st: st.compute_output.ns / 1e3),
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


def _number_text(x: int | float) -> str:
    return _count_text(x) if isinstance(x, int) else _value_text(x)


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


# --- per-(model, version) sample-line prefixes ------------------------------------------------------------------------
class _Labels:
    """The cached label text of one model version's sample lines."""

    __slots__ = ("model", "version", "labels", "outcome_labels", "prefixes")

    def __init__(self, model: str, version: str):
        self.model, self.version = model, version
        # Label pairs in sorted name order, as generate_latest writes them: le < model < outcome < version.
        lv = f'model="{_escape_label(model)}",version="{_escape_label(version)}"'
        self.labels = "{" + lv + "} "
        self.outcome_labels = tuple(f'{{model="{_escape_label(model)}",outcome="{outcome}",'
                                    f'version="{_escape_label(version)}"}} ' for outcome in ("success", "failure"))
        # Per histogram: the prefixes of its bucket lines and its _count line, then its _sum line's.
        self.prefixes = tuple(
            (tuple(f'{name}_bucket{{le="{le}",{lv}}} ' for le in les) + (f"{name}_count{{{lv}}} ",),
             f"{name}_sum{{{lv}}} ")
            for (name, *_), les in zip(_HISTOGRAMS, _LES))


def _gauge_families() -> list[GaugeMetricFamily]:
    return [
        GaugeMetricFamily("gpud_model_pending_requests", "Requests queued for the model, not yet executing.",
                          labels=MODEL_LABELS),
        GaugeMetricFamily("gpud_model_instances", "Model instances loaded, per device.",
                          labels=("model", "version", "device")),
        GaugeMetricFamily("gpud_model_instance_memory_bytes", "Measured memory footprint of one model instance "
                          "(device memory on a GPU, resident memory on the CPU), bytes.", labels=INSTANCE_LABELS),
        GaugeMetricFamily("gpud_model_instance_load_duration_seconds", "Time the instance took to load, warm-up "
                          "run included, seconds.", labels=INSTANCE_LABELS),
        GaugeMetricFamily("gpud_model_instance_ready", "1 while the instance serves, 0 while it is not ready "
                          "(e.g. its worker is restarting).", labels=INSTANCE_LABELS),
        GaugeMetricFamily("gpud_model_sequences", "Live sequences of a sequence model: holding a slot of an "
                          "instance (where=slot), or waiting for one (where=backlog).",
                          labels=("model", "version", "where")),
        GaugeMetricFamily("gpud_model_latency_objective_seconds", "The version's latency objective: the bound on a "
                          "request's latency inside gpud (queue + compute), seconds. Only versions with one.",
                          labels=MODEL_LABELS),
        GaugeMetricFamily("gpud_model_latency_objective_share", "The share of requests the version's latency "
                          "objective covers (0.99: 99% within the bound); its error budget is 1 - share.",
                          labels=MODEL_LABELS),
    ]


def _collect_gauges(versions: list[VersionView]) -> list[GaugeMetricFamily]:
    families = _gauge_families()
    pending_fam, instances_fam, memory_fam, load_fam, ready_fam, sequences_fam, objective_fam, share_fam = families
    for v in versions:
        pending_fam.add_metric([v.model, v.version], float(v.pending_requests))
        if v.stats.objective_ns:
            objective_fam.add_metric([v.model, v.version], v.stats.objective_ns / 1e9)
            share_fam.add_metric([v.model, v.version], v.stats.objective_share)
        if v.sequences_in_slots is not None:
            sequences_fam.add_metric([v.model, v.version, "slot"], float(v.sequences_in_slots))
            sequences_fam.add_metric([v.model, v.version, "backlog"], float(v.sequences_in_backlog))
        per_device: dict[str, int] = {}
        for i in v.instances:
            if i.ready:
                per_device[i.device_id] = per_device.get(i.device_id, 0) + 1
        for device, n in sorted(per_device.items()):
            instances_fam.add_metric([v.model, v.version, device], float(n))
    for v in versions:
        for i in v.instances:
            labels = [v.model, v.version, str(i.index), i.device_id]
            memory_fam.add_metric(labels, float(i.footprint_bytes))
            load_fam.add_metric(labels, float(i.load_seconds))
            ready_fam.add_metric(labels, 1.0 if i.ready else 0.0)
    return families


def _untyped(name: str, doc: str) -> Metric:
    # Triton declares these counters without the `_total` suffix. prometheus_client's text exposition appends
    # `_total` to the name of every counter-typed family, which would rename the series Triton dashboards query;
    # an untyped family keeps the exact names and values (rate() and increase() work on it all the same).
    return Metric(name, doc, "unknown")


class _Triton:
    """Triton's names for the same records (`nv_inference_*`) and `nv_gpu_*` per physical GPU."""

    def __init__(self, devices: DeviceBackend | None):
        self.devices = devices  # for nv_gpu_*; None: no GPU series

    @staticmethod
    def gauge_families() -> list[GaugeMetricFamily]:
        fams = [GaugeMetricFamily("nv_inference_pending_request_count", "Instantaneous number of pending "
                                  "requests awaiting execution per-model.", labels=MODEL_LABELS),
                GaugeMetricFamily("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", labels=("gpu_uuid",))]
        fams += [GaugeMetricFamily(name, doc, labels=("gpu_uuid",)) for name, doc, _ in _TRITON_GPU]
        return fams

    @staticmethod
    def counter_families(versions: list[VersionView]) -> list[Metric]:
        fams = []
        for name, doc, value in _TRITON_COUNTERS:
            fam = _untyped(name, doc)
            for v in versions:
                fam.add_sample(name, {"model": v.model, "version": v.version}, float(value(v.stats)))
            fams.append(fam)
        return fams

    @staticmethod
    def counters_text(versions: list[VersionView], labels: list[_Labels]) -> list[str]:
        out = []
        for name, doc, value in _TRITON_COUNTERS:
            out.append(_header(name, doc, "untyped"))
            out += [f"{name}{lb.labels}{_value_text(float(value(v.stats)))}" for v, lb in zip(versions, labels)]
        return out

    def collect_gauges(self, versions: list[VersionView]) -> list[GaugeMetricFamily]:
        fams = self.gauge_families()
        pending_fam, total_fam, gpu_fams = fams[0], fams[1], fams[2:]
        for v in versions:
            pending_fam.add_metric([v.model, v.version], float(v.pending_requests))
        if self.devices is not None:
            self._collect_gpus(self.devices, total_fam, gpu_fams)
        return fams

    @staticmethod
    def _collect_gpus(devices: DeviceBackend, total_fam: GaugeMetricFamily,
                      gpu_fams: list[GaugeMetricFamily]) -> None:
        # Triton (through DCGM) reports physical GPUs only; a MIG instance's use shows on its parent.
        for d in devices.devices():
            if d.kind != "gpu":
                continue
            try:
                reading = devices.sample(d.id)
            except Exception:  # noqa: BLE001 - the device collector logs sampling failures; here: no sample
                continue
            total_fam.add_metric([d.uuid], float(d.memory_total_bytes))
            for fam, (_, _, attr) in zip(gpu_fams, _TRITON_GPU):
                value = getattr(reading, attr, None)
                if value is not None:
                    fam.add_metric([d.uuid], float(value))


class ModelMetrics(Collector):
    def __init__(self, source: SnapshotSource, registry: CollectorRegistry | None = None, *,
                 triton_names: bool = False, devices: DeviceBackend | None = None):
        """`source`: the serving snapshot, called at every scrape. `registry`: where to register as a collector;
        None for none (the daemon serves `render_text()` itself). `triton_names`: also export Triton's
        `nv_inference_*` and (given `devices`) `nv_gpu_*`."""
        self.source = source
        self._labels: dict[tuple[str, str], _Labels] = {}  # (model, version) -> cached line prefixes
        self.triton_names = triton_names
        self._triton = _Triton(devices) if triton_names else None
        self.registry = registry
        if registry is not None:
            registry.register(self)

    def _read(self) -> tuple[list[VersionView], list[_Labels]]:
        """The snapshot's versions sorted by (model, version), with their cached prefixes; versions that left the
        snapshot lose theirs."""
        snapshot: ServingSnapshot = self.source()
        versions = sorted(snapshot.versions(), key=lambda v: (v.model, v.version))
        cache, labels = self._labels, []
        fresh: dict[tuple[str, str], _Labels] = {}
        for v in versions:
            key = (v.model, v.version)
            lb = cache.get(key) or _Labels(*key)
            fresh[key] = lb
            labels.append(lb)
        self._labels = fresh
        return versions, labels

    # --- exposition ------------------------------------------------------------------------------------------------
    def describe(self) -> Iterable[Metric]:
        """The families, without samples: what the registry checks for name clashes (nothing is read)."""
        fams: list[Metric] = [CounterMetricFamily(*_REQUESTS, labels=MODEL_LABELS + ("outcome",))]
        fams += [HistogramMetricFamily(name, doc, labels=MODEL_LABELS) for name, doc, *_ in _HISTOGRAMS]
        fams += [CounterMetricFamily(name, doc, labels=MODEL_LABELS) for name, doc, _ in _COUNTERS]
        fams += _gauge_families()
        if self._triton is not None:
            fams += [_untyped(name, doc) for name, doc, _ in _TRITON_COUNTERS]
            fams += _Triton.gauge_families()
        return fams

    def collect(self) -> Iterable[Metric]:
        """The families as prometheus_client objects (for `generate_latest(registry)` and `get_sample_value`)."""
        versions, _ = self._read()
        requests = CounterMetricFamily(*_REQUESTS, labels=MODEL_LABELS + ("outcome",))
        for v in versions:
            requests.add_metric([v.model, v.version, "success"], v.stats.success.count)
            requests.add_metric([v.model, v.version, "failure"], v.stats.fail.count)
        fams: list[Metric] = [requests]
        for (name, doc, _, buckets, total), les in zip(_HISTOGRAMS, _LES):
            fam = HistogramMetricFamily(name, doc, labels=MODEL_LABELS)
            for v in versions:
                fam.add_metric([v.model, v.version], list(zip(les, accumulate(buckets(v.stats)))), total(v.stats))
            fams.append(fam)
        for name, doc, value in _COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=MODEL_LABELS)
            for v in versions:
                counter.add_metric([v.model, v.version], value(v.stats))
            fams.append(counter)
        fams += _collect_gauges(versions)
        if self._triton is not None:
            fams += self._triton.counter_families(versions)
            fams += self._triton.collect_gauges(versions)
        return fams

    def render_text(self) -> str:
        """The same families in the Prometheus text format, written from the records with the cached line prefixes:
        byte for byte what `generate_latest` writes for `collect()`, ~20x faster (docs/benchmarks.md)."""
        versions, labels = self._read()
        out = [_header("gpud_model_requests_total", _REQUESTS[1], "counter")]
        for v, lb in zip(versions, labels):
            success, failure = lb.outcome_labels
            out += (f"gpud_model_requests_total{success}{_count_text(v.stats.success.count)}",
                    f"gpud_model_requests_total{failure}{_count_text(v.stats.fail.count)}")
        for k, (name, doc, _, buckets, total) in enumerate(_HISTOGRAMS):
            out.append(_header(name, doc, "histogram"))
            for v, lb in zip(versions, labels):
                counts = list(accumulate(buckets(v.stats)))
                counts.append(counts[-1])  # _count: the +Inf bucket
                lines, sum_prefix = lb.prefixes[k]
                # Counts are cumulative, so the last is the largest: below 10**6 all print as `%d.0` (C, no frame).
                out += map(add, lines, map(_SMALL_COUNT.__mod__ if counts[-1] < 1000000 else _count_text, counts))
                out += (sum_prefix, _value_text(total(v.stats)))
        for name, doc, value in _COUNTERS:
            out.append(_header(name + "_total", doc, "counter"))
            out += [f"{name}_total{lb.labels}{_number_text(value(v.stats))}" for v, lb in zip(versions, labels)]
        out += map(_family_text, _collect_gauges(versions))
        if self._triton is not None:
            out += self._triton.counters_text(versions, labels)
            out += map(_family_text, self._triton.collect_gauges(versions))
        return "".join(out)
