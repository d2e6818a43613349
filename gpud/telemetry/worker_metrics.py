"""Supervision of gpud's device workers, read at scrape time: is each worker up, and how often was it lost.

The source is a callable returning the executor pool's `worker_info()` rows ({"device", "alive", "failures":
{cause: count}}), so this module needs nothing from the executor. A worker is lost when its process dies
("died") or when gpud kills it because a batch went unanswered for --worker-hang-secs ("hung"); either way gpud
restarts it and the requests it held fail with an error that says which.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

log = logging.getLogger(__name__)

CAUSES = ("died", "hung")


class WorkerCollector(Collector):
    def __init__(self, worker_info: Callable[[], list[dict[str, Any]]], registry: CollectorRegistry | None = None):
        self._worker_info = worker_info
        if registry is not None:
            registry.register(self)

    def describe(self) -> Iterable[Metric]:
        return self._families()

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, CounterMetricFamily]:
        return (
            GaugeMetricFamily("gpud_worker_up", "1 while gpud's worker process for the device is running and "
                              "serving, 0 while it is being restarted.", labels=("device",)),
            CounterMetricFamily("gpud_worker_restarts", "Times gpud lost the device's worker and restarted it, by "
                                "cause: died (the process ended) or hung (a batch unanswered for "
                                "--worker-hang-secs, so gpud killed it).", labels=("device", "cause")),
        )

    def collect(self) -> Iterable[Metric]:
        up, restarts = fams = self._families()
        try:
            rows = self._worker_info()
        except Exception:  # noqa: BLE001 - a failing source must not take the other metrics down
            log.exception("reading the workers' state failed")
            return fams
        for row in rows:
            try:
                device = str(row["device"])
                failures = row.get("failures") or {}
                counts = [float(failures.get(cause) or 0) for cause in CAUSES]
            except (KeyError, TypeError, ValueError, AttributeError):  # one bad row must not fail the scrape
                log.warning("skipping a malformed worker row: %r", row)
                continue
            up.add_metric([device], 1.0 if row.get("alive") else 0.0)
            for cause, count in zip(CAUSES, counts):
                restarts.add_metric([device, cause], count)
        return fams
