"""ModelMetrics: request/batch instruments, scrape-time gauges, series removal."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from telemetry.model_metrics import BATCH_SIZE_BUCKETS, LATENCY_BUCKETS_SECONDS, ModelMetrics
from tests.promtool_check import promtool_check


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


@pytest.fixture
def setup():
    registry = CollectorRegistry()
    return registry, ModelMetrics(registry)


def test_requests_by_outcome_and_latency_histograms(setup):
    registry, m = setup
    m.observe_request("resnet", "1", True, queue_seconds=0.0002, compute_input_seconds=0.0001,
                      compute_infer_seconds=0.004, compute_output_seconds=0.0003, request_seconds=0.0046)
    m.observe_request("resnet", 1, True, queue_seconds=0.02, compute_input_seconds=0.0001,
                      compute_infer_seconds=0.004, compute_output_seconds=0.0003, request_seconds=0.0245)
    m.observe_request("resnet", "1", False)
    lv = dict(model="resnet", version="1")
    assert value(registry, "gpud_model_requests_total", outcome="success", **lv) == 2
    assert value(registry, "gpud_model_requests_total", outcome="failure", **lv) == 1
    assert value(registry, "gpud_model_queue_duration_seconds_count", **lv) == 2  # failures add no durations
    assert value(registry, "gpud_model_queue_duration_seconds_sum", **lv) == pytest.approx(0.0202)
    # 0.0002 <= 0.00025; 0.02 > 0.01 and <= 0.025
    assert value(registry, "gpud_model_queue_duration_seconds_bucket", le="0.00025", **lv) == 1
    assert value(registry, "gpud_model_queue_duration_seconds_bucket", le="0.025", **lv) == 2
    assert value(registry, "gpud_model_compute_infer_duration_seconds_count", **lv) == 2
    assert value(registry, "gpud_model_compute_input_duration_seconds_count", **lv) == 2
    assert value(registry, "gpud_model_compute_output_duration_seconds_count", **lv) == 2
    assert value(registry, "gpud_model_request_duration_seconds_count", **lv) == 2


def test_buckets():
    assert LATENCY_BUCKETS_SECONDS[0] == 0.0001 and LATENCY_BUCKETS_SECONDS[-1] == 10.0
    assert list(LATENCY_BUCKETS_SECONDS) == sorted(LATENCY_BUCKETS_SECONDS)
    assert BATCH_SIZE_BUCKETS == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def test_batches(setup):
    registry, m = setup
    for size in (1, 3, 8, 8):
        m.observe_batch("bert", "2", size)
    lv = dict(model="bert", version="2")
    assert value(registry, "gpud_model_executions_total", **lv) == 4
    assert value(registry, "gpud_model_batch_size_sum", **lv) == 20  # 1 + 3 + 8 + 8
    assert value(registry, "gpud_model_batch_size_bucket", le="4.0", **lv) == 2
    with pytest.raises(ValueError, match="batch_size must be a whole number of rows >= 1"):
        m.observe_batch("bert", "2", 0)


def test_gauges_read_at_scrape_time(setup):
    registry, m = setup
    pending = {("resnet", "1"): 3}
    instances = {("resnet", "1", "gpu0"): 2, ("resnet", "1", "gpu1/mig1.0"): 1}
    m.set_sources(pending=lambda: dict(pending), instances=lambda: dict(instances))
    assert value(registry, "gpud_model_pending_requests", model="resnet", version="1") == 3
    assert value(registry, "gpud_model_instances", model="resnet", version="1", device="gpu1/mig1.0") == 1
    pending[("resnet", "1")] = 0
    del instances[("resnet", "1", "gpu0")]
    assert value(registry, "gpud_model_pending_requests", model="resnet", version="1") == 0
    assert value(registry, "gpud_model_instances", model="resnet", version="1", device="gpu0") is None


def test_remove_model(setup):
    registry, m = setup
    m.observe_request("a", "1", True, 0.001, 0.001, 0.001, 0.001, 0.004)
    m.observe_request("a", "1", False)
    m.observe_batch("a", "1", 4)
    m.observe_request("b", "1", True, 0.001, 0.001, 0.001, 0.001, 0.004)
    m.remove_model("a", "1")
    text = generate_latest(registry).decode()
    assert 'model="a"' not in text and 'model="b"' in text
    m.remove_model("a", "1")  # idempotent
    m.remove_model("never", "1")
    m.observe_request("a", "1", True, 0.001, 0.001, 0.001, 0.001, 0.004)  # comes back cleanly if reloaded
    assert value(registry, "gpud_model_requests_total", model="a", version="1", outcome="success") == 1


def test_series_cached(setup):
    _, m = setup
    m.observe_batch("a", "1", 1)
    first = m._for("a", "1")
    m.observe_batch("a", "1", 1)
    assert m._for("a", "1") is first


def test_promtool_accepts_exposition(setup):
    registry, m = setup
    m.observe_request("a", "1", True, 0.001, 0.001, 0.001, 0.001, 0.004)
    m.observe_batch("a", "1", 4)
    m.set_sources(pending=lambda: {("a", "1"): 1}, instances=lambda: {("a", "1", "cpu"): 1})
    promtool_check(generate_latest(registry))


def test_observe_requests_equals_one_observe_request_per_request():
    # The scheduler records a batch's requests at once; the exposition must be what per-request calls give.
    queue_ns = [200_000, 20_000_000, 0, 250_000]
    request_ns = [4_600_000, 24_500_000, 1_000_000, 10_000_000_000]
    one, batch = CollectorRegistry(), CollectorRegistry()
    m1, m2 = ModelMetrics(one), ModelMetrics(batch)
    for q, r in zip(queue_ns, request_ns):
        m1.observe_request("resnet", "1", True, q / 1e9, 100_000 / 1e9, 4_000_000 / 1e9, 250_000 / 1e9, r / 1e9)
    m2.observe_requests("resnet", "1", queue_ns, 100_000, 4_000_000, 250_000, request_ns)
    m2.observe_requests("resnet", "1", [], 1, 1, 1, [])  # an empty batch changes nothing

    def samples(registry):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in registry.collect() for s in family.samples if not s.name.endswith("_created")}

    a, b = samples(one), samples(batch)
    assert a.keys() == b.keys()
    for key in a:
        assert b[key] == pytest.approx(a[key]), key
