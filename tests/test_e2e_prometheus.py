"""Acceptance: the real daemon scraped by a real Prometheus with gpud's rules loaded, under inference load.

Every panel query of config/grafana/gpud.json must return data, and every metric name the dashboard and the rules
use must be one gpud exports (or a recording rule of the rules file, or Prometheus' own `up`). A quiet alert is
fine; a query of a metric that does not exist is not. Skips cleanly without `prometheus` / `promtool`.
"""
from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest
import yaml

from gpud.examples import write_example_repository
from tests.daemon_harness import start_daemon, wait_for
from tests.promql import DASHBOARD, RULES, dashboard_queries, metric_names, rule_exprs

pytestmark = pytest.mark.slow

DEADLINE_S = 45.0  # for all panel queries together to have data, once load runs
PROMETHEUS_SERIES = {"up"}


def test_metric_names_parser():
    expr = ('histogram_quantile(0.99, sum by (le, model) (rate(gpud_model_queue_duration_seconds_bucket'
            '{model=~"a|b"}[1m]))) / on (instance) group_left gpud:x:sum or vector(0) > bool 1e-9')
    assert metric_names(expr) == {"gpud_model_queue_duration_seconds_bucket", "gpud:x:sum"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout_s: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def tools():
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if prometheus is None or promtool is None:
        pytest.skip("prometheus / promtool not on PATH (Debian package 'prometheus' provides them)")
    return prometheus, promtool


def test_promtool_checks_the_rules(tools):
    proc = subprocess.run([tools[1], "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_unit_tests_of_the_objective_rules_and_burn_rate_alerts(tools):
    """config/prometheus/gpud-rules.test.yml: a version burning its budget 20x pages (fast: 1 h and 5 min windows),
    warns (6 h and 30 min) and opens a ticket (3 d and 6 h); one meeting its objective does not; a 10-minute spike
    that the hour has not confirmed does not page."""
    tests_file = RULES.parent / "gpud-rules.test.yml"
    proc = subprocess.run([tools[1], "test", "rules", tests_file.name], cwd=RULES.parent, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_model():
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "model", "device"} <= set(variables)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_every_panel_and_variable_queries_the_datasource_variable():
    """The data source is a dashboard variable (a fleet's dashboards pick their Prometheus at view time), never an
    import-time input that pins every panel to one data source when imported."""
    dash = json.loads(DASHBOARD.read_text())
    assert "__inputs" not in dash and "DS_PROMETHEUS" not in DASHBOARD.read_text()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    uses = {"type": "prometheus", "uid": "${datasource}"}
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == uses, v["name"]

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))  # a collapsed row holds its panels
    checked = 0
    for p in panels(dash["panels"]):
        if p["type"] == "row":
            continue
        assert p["datasource"] == uses, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t.get("datasource", uses) == uses, (p["title"], t)
        checked += 1
    assert checked >= 20


def test_every_query_selects_the_gpud_daemons_chosen():
    """A fleet's dashboard: every series a panel or variable reads is filtered by the `instance` variable (the gpud
    daemons shown), except the recording rules that sum over the whole fleet."""
    dash = json.loads(DASHBOARD.read_text())
    fleet_sums = {"gpud:model_desired_instances:sum", "gpud:model_instances_current:sum"}
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["instance"]["query"]["query"] == "label_values(gpud_device_healthy, instance)"
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for name, v in variables.items() if v["type"] == "query" and name != "instance"]
    selectors = [(m.group(1), m.group(2)) for e in exprs
                 for m in re.finditer(r"\b(gpud[_:][A-Za-z0-9_:]*)(\{[^}]*\})?", e)]
    assert len(selectors) > 40
    for name, labels in selectors:
        if name in fleet_sums:
            assert not labels or "instance" not in labels, name
        else:
            assert labels and labels.startswith('{instance=~"$instance"'), (name, labels)


class _Load(threading.Thread):
    """Inference requests to every example model until stopped: the panels are queried while load runs."""

    def __init__(self, http_url: str):
        super().__init__(daemon=True)
        self.http_url = http_url
        self.stop_event = threading.Event()
        self.sent = 0
        self.errors: list[str] = []

    def run(self) -> None:
        import tritonclient.http as httpclient

        rng = np.random.default_rng(0)
        client = httpclient.InferenceServerClient(self.http_url, concurrency=4)
        feeds = {
            "mlp": {"input": rng.standard_normal((2, 256)).astype(np.float32)},
            "cnn": {"input": rng.standard_normal((1, 3, 32, 32)).astype(np.float32)},
            "two_input": {"ids": rng.integers(-5, 5, (2, 4)).astype(np.int64),
                          "scale": rng.random((2, 4)).astype(np.float32)},
        }
        inputs = {}
        for model, arrays in feeds.items():
            ins = []
            for name, arr in arrays.items():
                i = httpclient.InferInput(name, list(arr.shape), "FP32" if arr.dtype == np.float32 else "INT64")
                i.set_data_from_numpy(arr)
                ins.append(i)
            inputs[model] = ins
        while not self.stop_event.is_set():
            pending = [client.async_infer(model, ins) for model, ins in inputs.items() for _ in range(4)]
            for p in pending:
                try:
                    p.get_result()
                    self.sent += 1
                except Exception as exc:  # noqa: BLE001 - reported by the test, not raised in the thread
                    self.errors.append(str(exc))
        client.close()


def test_every_panel_and_rule_against_real_prometheus(tools, tmp_path):
    prometheus, _ = tools
    repo = tmp_path / "repo"
    write_example_repository(repo)
    daemon = start_daemon(repo, tmp_path, "--triton-metrics", "--hints-interval-seconds", "1",
                          "--hints-rate-window-seconds", "3", "--latency-objective-ms", "1000")  # objective panels
    prom = None
    load = _Load(daemon.http_url)
    try:
        port = _free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "gpud",
                                "static_configs": [{"targets": [f"127.0.0.1:{daemon.ports['metrics']}"]}]}],
        }))
        prom_log = (tmp_path / "prometheus.log").open("w")
        prom = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=prom_log, stderr=subprocess.STDOUT)
        api = f"http://127.0.0.1:{port}/api/v1"

        def query(expr: str) -> list:
            return _get(f"{api}/query?" + urllib.parse.urlencode({"query": expr}))["data"]["result"]

        def scraped() -> bool:
            try:
                return any(r["value"][1] == "1" for r in query('up{job="gpud"}'))
            except OSError:
                return False

        wait_for(scraped, 30, "Prometheus to scrape gpud")
        load.start()

        # What gpud exports: every family's HELP line (families with no sample yet, e.g. XID counters, included).
        with urllib.request.urlopen(daemon.metrics_url, timeout=10) as r:
            exposition = r.read().decode()
        exported = set(re.findall(r"^# HELP (\S+)", exposition, re.M))
        for family in list(exported):  # histograms and counters expose their samples under suffixed names
            exported |= {family + s for s in ("_bucket", "_sum", "_count", "_total", "_created")}
        rules, recorded = rule_exprs()
        known = exported | set(recorded) | PROMETHEUS_SERIES
        queries = dashboard_queries()
        for title, expr in queries:
            missing = metric_names(expr) - known
            assert not missing, f"panel {title!r} queries metrics gpud does not export: {sorted(missing)}"
        for expr in rules:
            missing = metric_names(expr) - known
            assert not missing, f"rule {expr!r} uses metrics gpud does not export: {sorted(missing)}"

        # Every panel query returns data while load runs (bounded; polled, not slept), on the simulated node too:
        # its boards draw power and warm up with the load (gpud.telemetry.power_model).
        required = queries
        empty: dict[str, str] = {}

        def all_have_data() -> bool:
            empty.clear()
            for title, expr in required:
                if not query(expr):
                    empty[title] = expr
            return not empty

        deadline = time.monotonic() + DEADLINE_S
        while not all_have_data():
            assert not load.errors, load.errors[:3]
            if time.monotonic() > deadline:
                raise AssertionError(f"panels without data after {DEADLINE_S:.0f} s of load "
                                     f"({load.sent} requests): {json.dumps(empty, indent=1)}")
            time.sleep(0.5)

        # The rules are loaded and evaluate without error (quiet alerts are fine).
        def rules_evaluated() -> bool:  # health: "unknown" before the first evaluation, "ok" or "err" after
            rules = [r for g in _get(f"{api}/rules")["data"]["groups"] for r in g["rules"]]
            errors = {r["name"]: r.get("lastError") for r in rules if r["health"] == "err"}
            assert not errors, errors
            return len(rules) == len(rule_exprs()[0]) and all(r["health"] == "ok" for r in rules)

        wait_for(rules_evaluated, 15, "every rule to evaluate with health ok")
        for title in ("gpud:model_desired_instances:sum", "gpud:model_queue_seconds:mean1m"):
            assert query(title), f"recording rule {title} has no data"
        assert not load.errors, load.errors[:3]
        # The Triton-compatible names are there too (--triton-metrics), once requests have been served.
        with urllib.request.urlopen(daemon.metrics_url, timeout=10) as r:
            exposition = r.read().decode()
        for name in ("nv_inference_request_success", "nv_inference_count", "nv_inference_exec_count",
                     "nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us",
                     "nv_inference_pending_request_count", "nv_gpu_memory_total_bytes"):
            assert re.search(rf"^{name}\{{", exposition, re.M), f"{name} not exported"
        hints = daemon.inspect()["hints"]
        assert {m["name"] for m in hints["models"]} >= {"mlp", "cnn", "two_input"}
    finally:
        load.stop_event.set()
        if load.is_alive():
            load.join(30)
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(20)
            except subprocess.TimeoutExpired:
                prom.kill()
        assert daemon.stop() == 0, daemon.log()
