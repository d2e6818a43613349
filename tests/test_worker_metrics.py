"""gpud_worker_up and gpud_worker_restarts_total from the executor pool's worker_info() rows."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpud.executor.pool import ExecutorPool
from gpud.telemetry.worker_metrics import WorkerCollector
from tests.promtool_check import promtool_check


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_up_and_restarts_by_cause():
    rows = [{"device": "gpu1/mig1.0", "pid": None, "alive": False, "restarts": 3, "failures": {"died": 1, "hung": 2}},
            {"device": "cpu", "pid": 42, "alive": True, "restarts": 0, "failures": {"died": 0, "hung": 0}}]
    registry = CollectorRegistry()
    WorkerCollector(lambda: rows, registry=registry)
    got = _samples(registry)
    assert got[("gpud_worker_up", (("device", "cpu"),))] == 1.0
    assert got[("gpud_worker_up", (("device", "gpu1/mig1.0"),))] == 0.0
    assert got[("gpud_worker_restarts_total", (("cause", "hung"), ("device", "gpu1/mig1.0")))] == 2.0
    assert got[("gpud_worker_restarts_total", (("cause", "died"), ("device", "gpu1/mig1.0")))] == 1.0
    assert got[("gpud_worker_restarts_total", (("cause", "died"), ("device", "cpu")))] == 0.0  # present from start


def test_the_pools_rows_feed_it_and_a_failing_source_leaves_no_series():
    registry = CollectorRegistry()
    WorkerCollector(ExecutorPool().worker_info, registry=registry)  # no worker started yet: no series
    assert not [k for k in _samples(registry) if k[0].startswith("gpud_worker")]

    def broken():
        raise RuntimeError("boom")
    registry = CollectorRegistry()
    WorkerCollector(broken, registry=registry)
    assert not [k for k in _samples(registry) if k[0].startswith("gpud_worker")]


def test_promtool_accepts_the_exposition():
    registry = CollectorRegistry()
    WorkerCollector(lambda: [{"device": "gpu0", "alive": True, "failures": {"hung": 1}}], registry=registry)
    promtool_check(generate_latest(registry))


def test_a_malformed_row_is_skipped_not_the_scrape():
    registry = CollectorRegistry()
    WorkerCollector(lambda: [{"alive": True}, {"device": "gpu0", "failures": {"hung": "x"}},
                             {"device": "cpu", "alive": True, "failures": {"died": None}}], registry=registry)
    got = _samples(registry)
    assert got[("gpud_worker_up", (("device", "cpu"),))] == 1.0
    assert not [k for k in got if ("device", "gpu0") in k[1]]
