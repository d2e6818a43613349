"""ModelMetrics' fast exposition (render_text) against prometheus_client's, and the metrics endpoint that serves it."""
from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpud.api.metrics_server import exposition, make_metrics_app, start_metrics_server
from gpud.telemetry.host_metrics import HostCollector
from gpud.telemetry.model_metrics import BATCH_SIZE_BUCKETS, LATENCY_BUCKETS_SECONDS, ModelMetrics
from tests.promtool_check import promtool_check
from tests.serving_fakes import FakeServing, instance
from tests.test_model_metrics_triton import FakeDevices

# Values on, just below and just above bucket bounds, below the first and past the last: `le` is inclusive.
EDGE_SECONDS = (0.0, 0.00005, 0.0001, 0.00010001, 0.00025, 0.001, 0.0099999, 0.01, 0.6, 10.0, 10.5, 3600.0)


def samples(text: str) -> dict[tuple[str, str, frozenset], float]:
    """{(family, sample name, labels): value} of an exposition; a sample twice fails."""
    out: dict[tuple[str, str, frozenset], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (fam.name, s.name, frozenset(s.labels.items()))
            assert key not in out, f"sample exported twice: {key}"
            out[key] = s.value
    return out


def family_types(text: str) -> dict[str, str]:
    return {fam.name: fam.type for fam in text_string_to_metric_families(text)}


def same_samples(a: str, b: str) -> None:
    sa, sb = samples(a), samples(b)
    assert sa.keys() == sb.keys()
    for key, value in sa.items():
        assert value == sb[key] or (math.isnan(value) and math.isnan(sb[key])), key
    assert family_types(a) == family_types(b)


def busy(serving: FakeServing) -> None:
    """Two models with every kind of observation, one odd model name."""
    for i, q in enumerate(EDGE_SECONDS):
        serving.batch("resnet", "1", rows=1 + i * 100, queue_s=(q,), request_s=(q + 0.005,), input_s=0.0001,
                      infer_s=0.004 + i * 0.001, output_s=0.0002)
    serving.failure("resnet", "1", 0.5)
    serving.request('we"ird\\model\nname', "2", request_s=0.003)
    serving.batch("bert", "3", rows=8)
    serving.version("resnet", "1", pending=2, instances=(instance(0, "gpu0", 3 * 2**30, load_seconds=2.5),))
    serving.version("bert", "3", pending=0, instances=(
        instance(0, "gpu1/mig1.0", 2**30, load_seconds=4.0), instance(1, "gpu1/mig1.0", 2**30, load_seconds=4.0,
                                                                       ready=False)))


@pytest.fixture(params=[False, True], ids=["gpud-names", "triton-names"])
def metrics(request):
    registry, serving = CollectorRegistry(), FakeServing()
    m = ModelMetrics(serving, registry, triton_names=request.param, devices=FakeDevices())
    busy(serving)
    return registry, m, serving


class TestRenderTextMatchesCollector:
    def test_same_samples_and_same_bytes(self, metrics):
        registry, m, _ = metrics
        fast, reference = m.render_text(), generate_latest(registry).decode()
        same_samples(fast, reference)
        assert fast == reference  # also byte for byte: the same sorted labels and float formatting

    def test_large_counts_use_go_float_format(self, metrics):
        # floatToGoString switches to exponents at 7 integer digits: 1234567 -> 1.234567e+06
        registry, m, serving = metrics
        st = serving.stats("resnet", "1")
        st.histograms.queue[3] += 1_234_567
        st.inference_count += 10**7
        st.success.count += 999_999
        fast = m.render_text()
        assert 'gpud_model_inferences_total{model="resnet",version="1"} 1.0' in fast
        assert "e+06\n" in fast and "e+07\n" in fast
        assert fast == generate_latest(registry).decode()

    def test_empty(self):
        registry = CollectorRegistry()
        m = ModelMetrics(FakeServing(), registry, triton_names=True)
        assert m.render_text() == generate_latest(registry).decode()
        assert "gpud_model_request_duration_seconds histogram" in m.render_text()  # HELP/TYPE with no samples

    def test_removed_model_leaves_both(self, metrics):
        registry, m, serving = metrics
        serving.remove("resnet", "1")  # unloaded
        fast = m.render_text()
        assert 'model="resnet"' not in fast and 'model="bert"' in fast
        assert fast == generate_latest(registry).decode()
        serving.request("resnet", "1", 0.001, 0.001, 0.001, 0.001, 0.004)  # reloaded: a new record, from zero
        assert registry.get_sample_value("gpud_model_queue_duration_seconds_count",
                                         {"model": "resnet", "version": "1"}) == 1


class TestObservationsMatchPrometheusClient:
    """The arrays bucket values exactly as a prometheus_client Histogram with the same buckets does."""

    @pytest.mark.parametrize("name, kwarg", [
        ("gpud_model_queue_duration_seconds", "queue_s"),
        ("gpud_model_compute_input_duration_seconds", "input_s"),
        ("gpud_model_compute_infer_duration_seconds", "infer_s"),
        ("gpud_model_compute_output_duration_seconds", "output_s"),
        ("gpud_model_request_duration_seconds", "request_s"),
    ])
    def test_latency_histograms(self, name, kwarg):
        registry, reference, serving = CollectorRegistry(), CollectorRegistry(), FakeServing()
        ModelMetrics(serving, registry)
        h = Histogram(name, "reference", ("model", "version"), buckets=LATENCY_BUCKETS_SECONDS, registry=reference)
        for v in EDGE_SECONDS:
            serving.request("a", "1", **{kwarg: v})
            h.labels("a", "1").observe(v)
        ours = {k: v for k, v in samples(generate_latest(registry).decode()).items() if k[0] == name}
        theirs = {k: v for k, v in samples(generate_latest(reference).decode()).items()
                  if k[0] == name and not k[1].endswith("_created")}
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            # the record sums whole nanoseconds, the reference floats: the same sum to within rounding
            assert ours[key] == (pytest.approx(value) if key[1].endswith("_sum") else value), key

    def test_batch_size_histogram(self):
        registry, reference, serving = CollectorRegistry(), CollectorRegistry(), FakeServing()
        m = ModelMetrics(serving, registry)
        h = Histogram("gpud_model_batch_size", "reference", ("model", "version"), buckets=BATCH_SIZE_BUCKETS,
                      registry=reference)
        for rows in (1, 2, 3, 4, 5, 1023, 1024, 1025, 4096):
            serving.batch("a", "1", rows=rows)
            h.labels("a", "1").observe(rows)
        ours = {k: v for k, v in samples(m.render_text()).items() if k[0] == "gpud_model_batch_size"}
        theirs = {k: v for k, v in samples(generate_latest(reference).decode()).items()
                  if k[0] == "gpud_model_batch_size" and not k[1].endswith("_created")}
        assert ours == theirs

    def test_no_created_series(self, metrics):
        _, m, _ = metrics
        assert "_created" not in m.render_text()


def test_promtool_accepts_fast_text():
    serving = FakeServing()
    m = ModelMetrics(serving)
    busy(serving)
    promtool_check(m.render_text())


class TestEndpoint:
    def node_registry(self) -> CollectorRegistry:
        registry = CollectorRegistry()
        HostCollector(lambda: {}, registry=registry)
        return registry

    def test_exposition_exports_each_family_once(self):
        registry = self.node_registry()
        serving = FakeServing()
        m = ModelMetrics(serving, triton_names=True, devices=FakeDevices())
        busy(serving)
        text = exposition(registry, (m,)).decode()
        names = [fam.name for fam in text_string_to_metric_families(text)]
        assert len(names) == len(set(names))
        assert "gpud_model_request_duration_seconds" in names and any(n.startswith("gpud_host_") for n in names)
        assert text.endswith(m.render_text())  # the registry's part (host readings change), then the model part
        promtool_check(exposition(registry, (ModelMetrics(FakeServing()),)))

    def test_registered_source_refused(self):
        registry = self.node_registry()
        m = ModelMetrics(FakeServing(), registry)
        with pytest.raises(ValueError, match="registered in the served registry.*exported twice"):
            make_metrics_app(registry, (m,))

    def test_http_scrape(self):
        registry = self.node_registry()
        serving = FakeServing()
        m = ModelMetrics(serving)
        serving.request("a", "1", 0.001, 0.001, 0.001, 0.001, 0.004)

        async def scrape() -> tuple[int, str]:
            runner, port = await start_metrics_server(registry, "127.0.0.1", 0, text_sources=(m,))
            try:
                async with aiohttp.ClientSession() as session:
                    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
                        return r.status, await r.text()
            finally:
                await runner.cleanup()

        status, text = asyncio.run(scrape())
        assert status == 200
        s = samples(text)
        assert s[("gpud_model_requests", "gpud_model_requests_total",
                  frozenset({"model": "a", "version": "1", "outcome": "success"}.items()))] == 1
