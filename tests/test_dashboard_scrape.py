"""Every metric a Grafana panel uses has samples in a scrape of the daemon on the simulated default node (issue 17
item 4): a person trying gpud without a GPU sees every panel of config/grafana/gpud.json move, power, temperature
and XID included. No Prometheus needed: the panels' metric names (recording rules expanded to the metrics they
read) are checked against the exposition itself, so this runs wherever the suite runs.
"""
from __future__ import annotations

import re
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpud.examples import write_example_repository
from gpud.telemetry.simulated import DEFAULT_NODE_FILE
from tests.daemon_harness import start_daemon, wait_for
from tests.promql import dashboard_queries, metric_names, rule_exprs

pytestmark = pytest.mark.slow

# `A or vector(0)` (optionally `or on() vector(0)`) has data by construction: A's counters may have no sample yet
# (no placement action has happened). Their families must still be exported.
_FALLBACK = re.compile(r"\bor\s+(on\s*\(\s*\)\s*)?vector\(")


def _panel_names(expr: str, recorded: dict[str, str]) -> set[str]:
    """The exported metrics an expression reads, through recording rules (which may read other recording rules)."""
    names: set[str] = set()
    for name in metric_names(expr):
        names |= _panel_names(recorded[name], recorded) if name in recorded else {name}
    return names


def _scrape(url: str) -> tuple[set[str], set[str]]:
    """(families exported, sample names with at least one sample) of one scrape."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    families, sampled = set(), set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        families |= {family.name + s for s in suffixes}
        sampled |= {s.name for s in family.samples}
    return families, sampled


def test_every_panel_metric_has_samples_on_the_simulated_default_node(tmp_path):
    repo = tmp_path / "repo"
    write_example_repository(repo, ["mlp"])
    # the embedded default node, named explicitly so a machine with a GPU runs this on the same simulated node
    daemon = start_daemon(repo, tmp_path, "--hints-interval-seconds", "1", "--hints-rate-window-seconds", "3",
                          "--control-interval-seconds", "1", "--latency-objective-ms", "1000",  # objective panels
                          node=DEFAULT_NODE_FILE)
    try:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(daemon.http_url)
        x = httpclient.InferInput("input", [2, 256], "FP32")
        x.set_data_from_numpy(np.ones((2, 256), dtype=np.float32))
        for _ in range(4):
            client.infer("mlp", [x])
        client.close()
        _, recorded = rule_exprs()
        queries = [(title, expr, _panel_names(expr, recorded)) for title, expr in dashboard_queries()]
        missing: dict[str, list[str]] = {}

        def every_panel_has_data() -> bool:  # hints and the controller publish on their first interval
            families, sampled = _scrape(daemon.metrics_url)
            missing.clear()
            for title, expr, names in queries:
                need = families if _FALLBACK.search(expr) else sampled
                absent = sorted(names - need)
                if absent:
                    missing[title] = absent
            return not missing

        try:
            wait_for(every_panel_has_data, 30, "every panel's metrics in a scrape")
        except AssertionError:
            raise AssertionError(f"panels whose metrics have no samples: {missing}") from None
        families, sampled = _scrape(daemon.metrics_url)
        # the simulated boards: power and temperature move with the load, error counters read 0
        for name in ("gpud_device_power_watts", "gpud_device_temperature_celsius", "gpud_device_xid_errors_total",
                     "gpud_device_ecc_volatile_errors_total"):
            assert name in sampled, name
    finally:
        assert daemon.stop() == 0, daemon.log()
