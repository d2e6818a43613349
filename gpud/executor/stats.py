"""The one record of a model version's requests, batches and latencies, kept by its scheduler.

Written once per finished batch (and once per failed request) by `gpud.executor.scheduler`, from the event loop; read,
never written, by everything that reports: Triton's statistics extension (what perf_analyzer reads), the Prometheus
collectors in `gpud.telemetry.model_metrics` (at scrape time, histograms included) and the autoscaling hints. One record
means one count of each event: the statistics endpoint and /metrics cannot disagree.

Request-level durations count once per request and only for successful requests (as Triton does); the batch's
compute phases count once per request too (every request of a batch shares them), and once per execution in
`batches`, keyed by batch size (rows). The histograms hold non-cumulative bucket counts (one per upper bound, +Inf
last); their sums are the matching `Duration.ns` (and `inference_count` for the batch size).
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

# 100 us .. 10 s, roughly 1-2.5-5 per decade: fine where inference latencies live, coarse beyond. The dashboard's
# p50/p99 panels interpolate within buckets, so a coarser 1-10-100 grid would make a 4 ms p99 read anywhere in 1-10.
LATENCY_BUCKETS_SECONDS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
LATENCY_BUCKETS_NS = tuple(round(b * 1e9) for b in LATENCY_BUCKETS_SECONDS)  # `le` is inclusive: v <= bound
BATCH_SIZE_BUCKETS = tuple(float(2**i) for i in range(11))  # 1, 2, 4, ..., 1024 rows


def _buckets(bounds: Sequence[float]) -> list[int]:
    return [0] * (len(bounds) + 1)


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns


@dataclass
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class LatencyHistograms:
    """Bucket counts per phase of a successful request (LATENCY_BUCKETS_NS, +Inf last) and of batch sizes."""

    queue: list[int] = field(default_factory=lambda: _buckets(LATENCY_BUCKETS_NS))
    compute_input: list[int] = field(default_factory=lambda: _buckets(LATENCY_BUCKETS_NS))
    compute_infer: list[int] = field(default_factory=lambda: _buckets(LATENCY_BUCKETS_NS))
    compute_output: list[int] = field(default_factory=lambda: _buckets(LATENCY_BUCKETS_NS))
    request: list[int] = field(default_factory=lambda: _buckets(LATENCY_BUCKETS_NS))
    batch_size: list[int] = field(default_factory=lambda: _buckets(BATCH_SIZE_BUCKETS))


@dataclass
class ModelStats:
    """Cumulative counters and histograms of one model version (a reload starts a new record)."""

    success: Duration = field(default_factory=Duration)  # ns: end-to-end time inside gpud
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0  # rows inferred (Triton counts batch rows)
    execution_count: int = 0  # batches executed
    last_inference_ms: int = 0  # wall clock (ms since the epoch) of the last batch
    cold_starts: int = 0  # loads from zero instances because a request came (scale to zero, load on demand)
    cold_start_seconds: float = 0.0  # their total time, from the first waiting request to an instance serving
    evictions: int = 0  # instances unloaded (idle, or spare by its objective) to make room for another model's load
    batches: dict[int, BatchStats] = field(default_factory=dict)
    histograms: LatencyHistograms = field(default_factory=LatencyHistograms)
    # The latency objective (gpud.executor.objective), when the version has one: its bound (0: none) and share,
    # and the requests within it and over it (a failed request counts over: it did not meet it).
    objective_ns: int = 0
    objective_share: float = 0.0
    within_objective: int = 0
    over_objective: int = 0

    def record_batch(self, rows: int, queue_ns: Sequence[int], request_ns: Sequence[int], input_ns: int,
                     infer_ns: int, output_ns: int, wall_ms: int) -> None:
        """One executed batch of `rows` rows whose requests all succeeded: per request its queue and end-to-end
        time; the batch's compute phases, which every request in it shares."""
        n = len(queue_ns)
        if rows < 1 or n < 1:
            raise ValueError(f"a batch has at least one request and one row, got {n} requests, {rows} rows")
        self.execution_count += 1
        self.inference_count += rows
        self.last_inference_ms = wall_ms
        b = self.batches.get(rows)
        if b is None:
            b = self.batches[rows] = BatchStats()
        b.compute_input.add(input_ns)
        b.compute_infer.add(infer_ns)
        b.compute_output.add(output_ns)
        h = self.histograms
        h.batch_size[bisect_left(BATCH_SIZE_BUCKETS, rows)] += 1
        bounds = LATENCY_BUCKETS_NS
        for d, buckets, values in ((self.queue, h.queue, queue_ns), (self.success, h.request, request_ns)):
            total = 0
            for v in values:
                buckets[bisect_left(bounds, v)] += 1
                total += v
            d.add(total, n)
        if self.objective_ns:
            within = sum(1 for v in request_ns if v <= self.objective_ns)
            self.within_objective += within
            self.over_objective += n - within
        for d, buckets, v in ((self.compute_input, h.compute_input, input_ns),
                              (self.compute_infer, h.compute_infer, infer_ns),
                              (self.compute_output, h.compute_output, output_ns)):
            d.add(v * n, n)
            buckets[bisect_left(bounds, v)] += n

    def record_cold_start(self, seconds: float) -> None:
        self.cold_starts += 1
        self.cold_start_seconds += seconds

    def record_failure(self, request_ns: int) -> None:
        """One failed request, `request_ns` after it arrived. Failures add no latencies (as in Triton): a failure's
        timings would mix rejected-at-once with timed-out-in-queue and mislead the latency panels."""
        self.fail.add(request_ns)
        if self.objective_ns:
            self.over_objective += 1
