"""Ensembles end to end: the real daemon (subprocess, simulated node, CPU execution) against the official
tritonclient over HTTP and gRPC, checked against onnxruntime running each step's model by hand; parallel steps, a
failing step, statistics of the ensemble and its composing models, metadata, config and the repository index, a
config that does not fit its steps, readiness and unload_dependents, and perf_analyzer (when installed)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from gpud.examples import CLASSES, PIXELS
from tests.daemon_harness import start_daemon, wait_for
from tests.ensemble_models import ByHand, ensemble_config, save_model, step, write_ensemble_repository

pytestmark = pytest.mark.slow
PERF_ANALYZER = os.environ.get("GPUD_PERF_ANALYZER") or shutil.which("perf_analyzer")
STEPS = ("preprocess", "classifier", "postprocess")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = write_ensemble_repository(tmp_path_factory.mktemp("repo"))
    # An ensemble whose step does not fit the model that serves it: classifier's logits are FP32, not INT64.
    save_model(repo, "misfit", None, ensemble_config(
        "misfit", [("IMAGE", "TYPE_UINT8", [PIXELS])], [("L", "TYPE_INT64", [CLASSES])],
        [step("preprocess", {"raw": "IMAGE"}, {"features": "f"}), step("classifier", {"features": "f"},
                                                                        {"logits": "L"})]))
    # An ensemble config that is wrong on its own: a tensor produced twice.
    save_model(repo, "twice", None, ensemble_config(
        "twice", [("IMAGE", "TYPE_UINT8", [PIXELS])], [("F", "TYPE_FP32", [PIXELS])],
        [step("preprocess", {"raw": "IMAGE"}, {"features": "F"}), step("preprocess", {"raw": "IMAGE"},
                                                                        {"features": "F"})]))
    return repo


@pytest.fixture(scope="module")
def daemon(repo, tmp_path_factory):
    d = start_daemon(repo, tmp_path_factory.mktemp("run"))
    yield d
    assert d.stop() == 0, d.log()


def client(daemon, protocol):
    if protocol == "http":
        return httpclient, httpclient.InferenceServerClient(daemon.http_url)
    return grpcclient, grpcclient.InferenceServerClient(daemon.grpc_url)


def infer(daemon, protocol, model: str, arrays: dict[str, np.ndarray], outputs: list[str] | None = None):
    mod, c = client(daemon, protocol)
    inputs = []
    for name, array in arrays.items():
        t = mod.InferInput(name, list(array.shape), {np.uint8: "UINT8", np.int64: "INT64"}[array.dtype.type])
        t.set_data_from_numpy(array)
        inputs.append(t)
    wanted = None if outputs is None else [mod.InferRequestedOutput(o) for o in outputs]
    return c.infer(model, inputs, outputs=wanted)


def stats(daemon, model: str) -> dict:
    return daemon.get_json(f"/v2/models/{model}/stats")["model_stats"][0]


def images(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (rows, PIXELS), dtype=np.uint8)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_pipeline_matches_onnxruntime_running_its_steps_by_hand(daemon, repo, protocol):
    image = images(3, 1)
    result = infer(daemon, protocol, "pipeline", {"IMAGE": image})
    expected = ByHand(repo).pipeline(image)
    np.testing.assert_allclose(result.as_numpy("PROBABILITIES"), expected["PROBABILITIES"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("LABEL"), expected["LABEL"])
    only = infer(daemon, protocol, "pipeline", {"IMAGE": image}, outputs=["LABEL"])
    np.testing.assert_array_equal(only.as_numpy("LABEL"), expected["LABEL"])
    assert only.as_numpy("PROBABILITIES") is None


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_parallel_steps_reading_the_same_tensor_and_their_join(daemon, repo, protocol):
    image = images(2, 2)
    result = infer(daemon, protocol, "fanout", {"IMAGE": image})
    expected = ByHand(repo).fanout(image)
    for name in ("SUM", "LOGITS_A"):
        np.testing.assert_allclose(result.as_numpy(name), expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_failing_step_fails_the_request_and_names_the_step(daemon, repo, protocol):
    ids = np.array([[3], [7]], dtype=np.int64)
    np.testing.assert_allclose(infer(daemon, protocol, "lookup", {"IDS": ids}).as_numpy("LOGITS"),
                               ByHand(repo).lookup(ids)["LOGITS"], rtol=1e-5, atol=1e-6)
    before = stats(daemon, "classifier")["inference_stats"]["success"]["count"]
    with pytest.raises(InferenceServerException) as e:
        infer(daemon, protocol, "lookup", {"IDS": np.array([[99]], dtype=np.int64)})  # the table has 10 rows
    message = e.value.message()
    assert message.startswith("in ensemble 'lookup', step 0 (model 'embed'): model 'embed' failed:"), message
    assert "indices" in message  # onnxruntime's own words
    assert stats(daemon, "classifier")["inference_stats"]["success"]["count"] == before  # the next step never ran
    # a step that refuses its input at once: the ensemble takes any number of ids per row, embed only one
    with pytest.raises(InferenceServerException) as e:
        infer(daemon, protocol, "lookup", {"IDS": np.array([[1, 2]], dtype=np.int64)})
    assert e.value.message() == ("in ensemble 'lookup', step 0 (model 'embed'): unexpected shape for input 'ids' for "
                                 "model 'embed'. Expected [-1,1], got [1,2]")


def test_concurrent_ensemble_requests_batch_in_each_step(daemon, repo):
    steps_before = {m: stats(daemon, m) for m in STEPS}
    ens_before = stats(daemon, "pipeline")
    by_hand = ByHand(repo)
    n = 64

    def one(k: int) -> None:
        image = images(1, 100 + k)
        got = infer(daemon, "http", "pipeline", {"IMAGE": image})
        np.testing.assert_array_equal(got.as_numpy("LABEL"), by_hand.pipeline(image)["LABEL"])

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(n)))
    ens = stats(daemon, "pipeline")
    assert ens["inference_stats"]["success"]["count"] - ens_before["inference_stats"]["success"]["count"] == n
    assert ens["execution_count"] - ens_before["execution_count"] == n  # one per request, as Triton counts
    batched = 0
    for m in STEPS:
        s, b = stats(daemon, m), steps_before[m]
        assert s["inference_count"] - b["inference_count"] == n  # every request went through every step
        batched += (s["inference_count"] - b["inference_count"]) - (s["execution_count"] - b["execution_count"])
    assert batched > 0  # 16 clients at once: some step ran requests of different clients in one batch


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_statistics_of_the_ensemble_and_its_composing_models(daemon, protocol):
    image = images(2, 3)
    mod, c = client(daemon, protocol)
    before = {m: stats(daemon, m) for m in ("pipeline",) + STEPS}
    infer(daemon, protocol, "pipeline", {"IMAGE": image})
    got = c.get_inference_statistics("pipeline")
    if protocol == "grpc":
        got = json_format.MessageToDict(got, preserving_proto_field_name=True)
    (ens,) = got["model_stats"]
    assert (ens["name"], ens["version"]) == ("pipeline", "1")
    assert int(ens["inference_count"]) - before["pipeline"]["inference_count"] == 2  # rows
    assert int(ens["execution_count"]) - before["pipeline"]["execution_count"] == 1
    after = {m: stats(daemon, m) for m in STEPS}
    for m in STEPS:
        assert after[m]["inference_count"] - before[m]["inference_count"] == 2
    # the ensemble's compute is its steps' (Triton's ensemble scheduler sums them the same way)
    infer_ns = int(ens["inference_stats"]["compute_infer"]["ns"]) - \
        before["pipeline"]["inference_stats"]["compute_infer"]["ns"]
    steps_ns = sum(after[m]["inference_stats"]["compute_infer"]["ns"]
                   - before[m]["inference_stats"]["compute_infer"]["ns"] for m in STEPS)
    assert infer_ns == steps_ns
    everything = {s["name"] for s in daemon.get_json("/v2/models/stats")["model_stats"]}
    assert {"pipeline", "fanout", "lookup", *STEPS} <= everything


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_metadata_config_readiness_and_the_index_of_an_ensemble(daemon, protocol):
    mod, c = client(daemon, protocol)
    meta, config, index = c.get_model_metadata("pipeline"), c.get_model_config("pipeline"), \
        c.get_model_repository_index()
    if protocol == "grpc":
        meta = json_format.MessageToDict(meta, preserving_proto_field_name=True)
        config = json_format.MessageToDict(config.config, preserving_proto_field_name=True)
        index = json_format.MessageToDict(index, preserving_proto_field_name=True)["models"]
    config = config.get("config", config)
    assert meta["platform"] == "ensemble" and [i["name"] for i in meta["inputs"]] == ["IMAGE"]
    assert [int(d) for d in meta["inputs"][0]["shape"]] == [-1, PIXELS]
    assert config["platform"] == "ensemble" and not config.get("instance_group")
    steps = config["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == list(STEPS)
    assert int(steps[0]["model_version"]) == -1 and steps[0]["input_map"] == {"raw": "IMAGE"}
    assert c.is_model_ready("pipeline")
    rows = {r["name"]: r for r in index}
    assert rows["pipeline"]["state"] == "READY"
    assert rows["misfit"]["state"] == "UNAVAILABLE" and "ensemble tensor 'L': inconsistent data type" in \
        rows["misfit"]["reason"]
    assert not c.is_model_ready("misfit")
    assert rows["twice"]["state"] == "UNAVAILABLE"
    assert "ensemble tensor 'F' is produced twice" in rows["twice"]["reason"]
    with pytest.raises(InferenceServerException, match="is not at ready state: in ensemble 'misfit'"):
        infer(daemon, protocol, "misfit", {"IMAGE": images(1, 4)})


def test_inspect_and_metrics_show_the_ensemble(daemon):
    doc = daemon.inspect()
    pipeline = next(m for m in doc["models"] if m["name"] == "pipeline")
    assert [s["model"] for s in pipeline["pipeline"]] == list(STEPS) and pipeline["instances"] == []
    out = subprocess.run([sys.executable, "-m", "gpud.cli.main", "inspect", "--url", daemon.http_url],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "PIPELINES" in out.stdout and "step 2  postprocess:1" in out.stdout
    metrics = urllib.request.urlopen(daemon.metrics_url, timeout=30).read().decode()
    assert 'gpud_model_requests_total{model="pipeline",outcome="success",version="1"}' in metrics


@pytest.mark.skipif(not PERF_ANALYZER, reason="perf_analyzer not installed (set GPUD_PERF_ANALYZER)")
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_the_ensemble_and_its_composing_models(daemon, protocol):
    url = daemon.http_url if protocol == "http" else daemon.grpc_url
    out = subprocess.run([PERF_ANALYZER, "-m", "pipeline", "-i", protocol, "-u", url, "--concurrency-range", "2",
                          "--measurement-mode", "count_windows", "--measurement-request-count", "200",
                          "--stability-percentage", "1000"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Composing models:" in out.stdout, out.stdout
    for m in STEPS:
        assert f"{m}, version: 1" in out.stdout


# --------------------------------------------------------------------------------------------------------------------
# Explicit mode: loading an ensemble loads its steps; readiness follows them; unload_dependents


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_load_readiness_and_unload_dependents_through_tritonclient(tmp_path, protocol):
    repo = write_ensemble_repository(tmp_path / "repo")
    d = start_daemon(repo, tmp_path, "--model-control-mode", "explicit", "--load-model", "classifier")
    try:
        mod, c = client(d, protocol)
        metadata = c.get_server_metadata()
        extensions = metadata["extensions"] if protocol == "http" else metadata.extensions
        assert "model_repository(unload_dependents)" in extensions  # Triton's name for what this test uses
        c.load_model("pipeline")  # its steps that are not loaded load with it
        assert c.is_model_ready("pipeline") and all(c.is_model_ready(m) for m in STEPS)
        image = images(1, 5)
        np.testing.assert_array_equal(infer(d, protocol, "pipeline", {"IMAGE": image}).as_numpy("LABEL"),
                                      ByHand(repo).pipeline(image)["LABEL"])
        c.unload_model("postprocess")  # a step goes: the ensemble is not ready, and says which step
        wait_for(lambda: not c.is_model_ready("pipeline"), 30, "the ensemble to read not ready")
        with pytest.raises(InferenceServerException, match="step 2 \\(model 'postprocess'\\)"):
            infer(d, protocol, "pipeline", {"IMAGE": image})
        c.load_model("postprocess")
        assert c.is_model_ready("pipeline")
        c.unload_model("pipeline", unload_dependents=True)
        # preprocess was loaded only for it: it goes; classifier (--load-model) and postprocess (loaded by its
        # own request) stay
        rows = c.get_model_repository_index()
        if protocol == "grpc":
            rows = json_format.MessageToDict(rows)["models"]
        index = {r["name"]: r for r in rows}
        ready = {n for n, r in index.items() if r.get("state") == "READY"}
        assert ready == {"classifier", "postprocess"}, index
    finally:
        assert d.stop() == 0, d.log()
