"""ModelMetrics: request/batch families read from the statistics records, scrape-time gauges, series removal."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpud.executor.stats import ModelStats
from gpud.telemetry.model_metrics import BATCH_SIZE_BUCKETS, LATENCY_BUCKETS_SECONDS, ModelMetrics
from tests.promtool_check import promtool_check
from tests.serving_fakes import FakeServing, instance


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


@pytest.fixture
def setup():
    registry, serving = CollectorRegistry(), FakeServing()
    return registry, serving, ModelMetrics(serving, registry)


def test_requests_by_outcome_and_latency_histograms(setup):
    registry, serving, _ = setup
    serving.request("resnet", "1", queue_s=0.0002, input_s=0.0001, infer_s=0.004, output_s=0.0003, request_s=0.0046)
    serving.request("resnet", "1", queue_s=0.02, input_s=0.0001, infer_s=0.004, output_s=0.0003, request_s=0.0245)
    serving.failure("resnet", "1")
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
    registry, serving, _ = setup
    for size in (1, 3, 8, 8):
        serving.batch("bert", "2", rows=size)
    lv = dict(model="bert", version="2")
    assert value(registry, "gpud_model_executions_total", **lv) == 4
    assert value(registry, "gpud_model_batch_size_sum", **lv) == 20  # 1 + 3 + 8 + 8
    assert value(registry, "gpud_model_batch_size_bucket", le="4.0", **lv) == 2
    with pytest.raises(ValueError, match="at least one request and one row"):
        ModelStats().record_batch(0, [0], [0], 0, 0, 0, 0)
    with pytest.raises(ValueError, match="at least one request and one row"):
        ModelStats().record_batch(1, [], [], 0, 0, 0, 0)


def test_gauges_read_at_scrape_time(setup):
    registry, serving, _ = setup
    v = serving.version("resnet", "1", pending=3,
                        instances=(instance(0, "gpu0", 1), instance(1, "gpu0", 1), instance(2, "gpu1/mig1.0", 1)))
    assert value(registry, "gpud_model_pending_requests", model="resnet", version="1") == 3
    assert value(registry, "gpud_model_instances", model="resnet", version="1", device="gpu1/mig1.0") == 1
    assert value(registry, "gpud_model_instances", model="resnet", version="1", device="gpu0") == 2
    v.pending = 0
    v.instances = v.instances[2:]
    assert value(registry, "gpud_model_pending_requests", model="resnet", version="1") == 0
    assert value(registry, "gpud_model_instances", model="resnet", version="1", device="gpu0") is None


def test_unloaded_model_leaves(setup):
    registry, serving, m = setup
    serving.request("a", "1", 0.001, 0.001, 0.001, 0.001, 0.004)
    serving.failure("a", "1")
    serving.request("b", "1", 0.001, 0.001, 0.001, 0.001, 0.004)
    serving.remove("a", "1")  # unloaded: its version left the snapshot
    text = generate_latest(registry).decode()
    assert 'model="a"' not in text and 'model="b"' in text
    assert ("a", "1") not in m._labels  # its cached line prefixes went too
    serving.request("a", "1", 0.001, 0.001, 0.001, 0.001, 0.004)  # comes back cleanly if reloaded (a new record)
    assert value(registry, "gpud_model_requests_total", model="a", version="1", outcome="success") == 1


def test_line_prefixes_cached_between_scrapes(setup):
    _, serving, m = setup
    serving.batch("a", "1")
    m.render_text()
    first = m._labels[("a", "1")]
    serving.batch("a", "1")
    m.render_text()
    assert m._labels[("a", "1")] is first


def test_promtool_accepts_exposition(setup):
    registry, serving, _ = setup
    serving.batch("a", "1", rows=4, queue_s=(0.001,), request_s=(0.004,), input_s=0.001, infer_s=0.001,
                  output_s=0.001)
    serving.version("a", "1", pending=1, instances=(instance(0, "cpu", 2**20),))
    promtool_check(generate_latest(registry))


def test_one_batch_record_equals_one_request_per_batch():
    # The scheduler records a batch's requests at once; every request's latencies land as if recorded alone.
    queue_ns = [200_000, 20_000_000, 0, 250_000]
    request_ns = [4_600_000, 24_500_000, 1_000_000, 10_000_000_000]
    one, batch = FakeServing(), FakeServing()
    for q, r in zip(queue_ns, request_ns):
        one.request("resnet", "1", q / 1e9, 100_000 / 1e9, 4_000_000 / 1e9, 250_000 / 1e9, r / 1e9)
    batch.stats("resnet", "1").record_batch(4, queue_ns, request_ns, 100_000, 4_000_000, 250_000, 0)

    def samples(serving):
        registry = CollectorRegistry()
        ModelMetrics(serving, registry)
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in registry.collect()
                for s in family.samples if not s.name.startswith(("gpud_model_batch_size", "gpud_model_executions"))}

    a, b = samples(one), samples(batch)
    assert a.keys() == b.keys()
    for key in a:
        assert b[key] == pytest.approx(a[key]), key
