"""End to end: the real daemon (subprocess, simulated node, CPU execution) against the official tritonclient."""
from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from gpud.examples import write_example_repository
from tests.promtool_check import promtool_check
from tests.daemon_harness import (ROOT, SLOW_CONFIG, example_inputs, onnxruntime_reference, save, slow_model,
                                  start_daemon)

pytestmark = pytest.mark.slow
MAX_REQUEST_BYTES = 4 * 2**20


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_example_repository(repo)  # mlp (config.pbtxt), cnn (no config), two_input (INT64 + FP32, config)
    # Two broken models next to the good ones: they must not stop the others.
    shutil.copytree(repo / "mlp", repo / "bad_config")
    (repo / "bad_config" / "config.pbtxt").write_text("max_batchsize: 8\n")
    (repo / "corrupt" / "1").mkdir(parents=True)
    (repo / "corrupt" / "1" / "model.onnx").write_bytes(b"this is not an onnx file")
    # A model whose batch takes tens of milliseconds: concurrent requests really overlap on it.
    save(slow_model(width=512, layers=300), repo, "slow", SLOW_CONFIG)
    return repo


@pytest.fixture(scope="module")
def daemon(repo, tmp_path_factory):
    d = start_daemon(repo, tmp_path_factory.mktemp("run"), "--max-request-bytes", str(MAX_REQUEST_BYTES),
                     "--model-control-mode", "explicit", "--load-model", "*")
    yield d
    assert d.stop() == 0, d.log()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("model", ["mlp", "cnn", "two_input"])
def test_tritonclient_infer_matches_onnxruntime(daemon, repo, protocol, binary, model):
    if protocol == "grpc" and not binary:
        pytest.skip("gRPC tensors are always binary (raw_input_contents)")
    mod = httpclient if protocol == "http" else grpcclient
    client = mod.InferenceServerClient(daemon.http_url if protocol == "http" else daemon.grpc_url)
    assert client.is_server_ready() and client.is_model_ready(model)
    meta = client.get_model_metadata(model)
    config = client.get_model_config(model)
    if protocol == "grpc":
        meta = json.loads(__import__("google.protobuf.json_format", fromlist=["x"]).MessageToJson(meta))
        config = {"config": {"max_batch_size": config.config.max_batch_size}}
    config = config.get("config", config)
    assert config["max_batch_size"] > 0
    arrays = example_inputs(model, 3, np.random.default_rng(7))
    inputs = []
    for m in meta["inputs"]:
        arr = arrays[m["name"]]
        inp = mod.InferInput(m["name"], list(arr.shape), m["datatype"])
        if protocol == "http":
            inp.set_data_from_numpy(arr, binary_data=binary)
        else:
            inp.set_data_from_numpy(arr)
        inputs.append(inp)
    outputs = [mod.InferRequestedOutput(o["name"], binary_data=binary) if protocol == "http"
               else mod.InferRequestedOutput(o["name"]) for o in meta["outputs"]]
    result = client.infer(model, inputs, outputs=outputs)
    expected = onnxruntime_reference(repo, model, arrays)
    for name, want in expected.items():
        np.testing.assert_allclose(result.as_numpy(name), want, rtol=1e-5, atol=1e-5)


def test_concurrent_requests_are_batched(daemon, repo):
    # 24 clients on their own connections send at the same moment (a barrier). The model computes for milliseconds,
    # so while the first batch runs the others queue, and the batcher must put them together. (tritonclient's
    # gevent-based async_infer sends one request after another, which would not test batching.)
    before = httpclient.InferenceServerClient(daemon.http_url).get_inference_statistics("slow")["model_stats"][0]
    rng = np.random.default_rng(1)
    rows = [rng.standard_normal((1, 512)).astype(np.float32) for _ in range(24)]
    barrier = threading.Barrier(len(rows))

    def one(x: np.ndarray) -> np.ndarray:
        client = httpclient.InferenceServerClient(daemon.http_url, network_timeout=60)
        inp = httpclient.InferInput("x", [1, 512], "FP32")
        inp.set_data_from_numpy(x)
        assert client.is_server_live()  # connect first, so the barrier releases 24 ready senders
        barrier.wait(timeout=60)
        return client.infer("slow", [inp]).as_numpy("y")

    with ThreadPoolExecutor(len(rows)) as pool:
        got = np.concatenate(list(pool.map(one, rows)))
    want = onnxruntime_reference(repo, "slow", {"x": np.concatenate(rows)})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    after = httpclient.InferenceServerClient(daemon.http_url).get_inference_statistics("slow")["model_stats"][0]
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 24
    assert executions < inferences, f"{executions} executions for {inferences} inferences: nothing was batched"


def _post(daemon, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    host, port = daemon.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def _json_infer(shape, datatype="FP32", count=None, name="input"):
    n = int(np.prod(shape)) if count is None else count
    return json.dumps({"inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": [0] * n}]}).encode()


BAD_HTTP = {
    "wrong shape": ("/v2/models/mlp/infer", _json_infer([1, 255]), {}, 400),
    "wrong dtype": ("/v2/models/mlp/infer", _json_infer([1, 256], "INT32"), {}, 400),
    "unknown input": ("/v2/models/mlp/infer", _json_infer([1, 256], name="nope"), {}, 400),
    "element count": ("/v2/models/mlp/infer", _json_infer([1, 256], count=3), {}, 400),
    "unknown model": ("/v2/models/nope/infer", _json_infer([1, 256]), {}, 404),
    "malformed json": ("/v2/models/mlp/infer", b'{"inputs": [', {}, 400),
    "truncated binary": (
        "/v2/models/mlp/infer",
        json.dumps({"inputs": [{"name": "input", "shape": [1, 256], "datatype": "FP32",
                                "parameters": {"binary_data_size": 1024}}]}).encode() + b"\0" * 100,
        "binary", 400),
    "oversized body": ("/v2/models/mlp/infer", b"{" + b" " * (MAX_REQUEST_BYTES + 10) + b"}", {}, 413),
}


@pytest.mark.parametrize("case", list(BAD_HTTP))
def test_bad_http_requests_get_4xx_and_change_nothing(daemon, case):
    path, body, headers, status = BAD_HTTP[case]
    if headers == "binary":
        header_len = body.index(b"}]}") + 3
        headers = {"Inference-Header-Content-Length": str(header_len)}
    got, payload = _post(daemon, path, body, headers)
    assert got == status, payload
    assert isinstance(payload.get("error"), str) and payload["error"]
    assert httpclient.InferenceServerClient(daemon.http_url).is_server_ready()
    assert httpclient.InferenceServerClient(daemon.http_url).is_model_ready("mlp")


def test_bad_grpc_requests_get_status_codes(daemon):
    client = grpcclient.InferenceServerClient(daemon.grpc_url)
    inp = grpcclient.InferInput("input", [1, 255], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 255), np.float32))
    with pytest.raises(InferenceServerException) as e:
        client.infer("mlp", [inp])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "shape" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        client.infer("nope", [inp])
    assert e.value.status() == "StatusCode.NOT_FOUND"
    assert client.is_server_ready()


def test_repository_index_reports_broken_models_and_others_serve(daemon):
    client = httpclient.InferenceServerClient(daemon.http_url)
    index = {m["name"]: m for m in client.get_model_repository_index()}
    for good in ("mlp", "cnn", "two_input"):
        assert index[good]["state"] == "READY"
    assert index["bad_config"]["state"] == "UNAVAILABLE"
    assert "bad_config/config.pbtxt" in index["bad_config"]["reason"]
    assert "max_batchsize" in index["bad_config"]["reason"]
    assert index["corrupt"]["state"] == "UNAVAILABLE"
    assert "corrupt/1/model.onnx" in index["corrupt"]["reason"]
    with pytest.raises(InferenceServerException):
        inp = httpclient.InferInput("input", [1, 256], "FP32")
        inp.set_data_from_numpy(np.zeros((1, 256), np.float32))
        client.infer("corrupt", [inp])
    assert client.is_server_ready()


def test_http_and_grpc_describe_the_server_alike(daemon):
    # Both front ends encode the core's same typed answers: Triton's HTTP JSON, read as protobuf JSON with Triton's
    # own protos (tritonclient's), is the gRPC answer.
    from google.protobuf import json_format
    from tritonclient.grpc import model_config_pb2, service_pb2

    http = httpclient.InferenceServerClient(daemon.http_url)
    grpc = grpcclient.InferenceServerClient(daemon.grpc_url)
    inp = httpclient.InferInput("input", [2, 256], "FP32")
    inp.set_data_from_numpy(np.ones((2, 256), np.float32))
    http.infer("mlp", [inp])  # statistics with a batch in them
    assert json_format.ParseDict(http.get_server_metadata(), service_pb2.ServerMetadataResponse()) == \
        grpc.get_server_metadata()
    for model in ("mlp", "cnn", "two_input"):
        assert json_format.ParseDict(http.get_model_metadata(model), service_pb2.ModelMetadataResponse()) == \
            grpc.get_model_metadata(model)
        assert json_format.ParseDict(http.get_model_config(model), model_config_pb2.ModelConfig()) == \
            grpc.get_model_config(model).config
    assert json_format.ParseDict(http.get_inference_statistics(), service_pb2.ModelStatisticsResponse()) == \
        grpc.get_inference_statistics()
    assert json_format.ParseDict({"models": http.get_model_repository_index()},
                                 service_pb2.RepositoryIndexResponse()) == grpc.get_model_repository_index()


def test_unload_and_load_through_the_repository_api(daemon):
    client = httpclient.InferenceServerClient(daemon.http_url)
    client.unload_model("cnn")
    assert not client.is_model_ready("cnn")
    client.load_model("cnn")
    assert client.is_model_ready("cnn")


def test_metrics_expose_model_latency_and_device_memory(daemon):
    import urllib.request

    client = httpclient.InferenceServerClient(daemon.http_url)
    inp = httpclient.InferInput("input", [2, 256], "FP32")
    inp.set_data_from_numpy(np.ones((2, 256), np.float32))
    client.infer("mlp", [inp])
    text = urllib.request.urlopen(daemon.metrics_url, timeout=30).read().decode()
    for needle in ('gpud_model_queue_duration_seconds_bucket{', 'gpud_model_compute_infer_duration_seconds_count{',
                   'gpud_model_requests_total{', 'gpud_model_batch_size_bucket{', 'gpud_device_memory_used_bytes{',
                   'gpud_device_memory_total_bytes{', 'gpud_model_instances{', 'gpud_model_pending_requests{'):
        assert needle in text, needle
    mlp_device = next(m for m in daemon.inspect()["models"] if m["name"] == "mlp")["instances"][0]["device"]
    used = [line for line in text.splitlines()
            if line.startswith("gpud_device_memory_used_bytes{") and f'device="{mlp_device}"' in line]
    assert used and float(used[0].rsplit(" ", 1)[1]) > 0, f"{mlp_device} holds mlp: its memory used must show it"
    promtool_check(text)


def test_gpudctl_inspect_shows_tree_instances_and_latency(daemon):
    out = subprocess.run([sys.executable, "-m", "gpud.cli", "inspect", "--url", daemon.http_url],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "gpu1/mig1.0" in out.stdout and "└─" in out.stdout and "MIG 3g.40gb" in out.stdout
    assert "mlp:1#0" in out.stdout and "queue ms" in out.stdout
    assert "corrupt" in out.stdout and "reason:" in out.stdout
    raw = subprocess.run([sys.executable, "-m", "gpud.cli", "inspect", "--url", daemon.http_url, "--json"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    data = json.loads(raw.stdout)
    assert data["server"] == daemon.get_json("/v2")  # the server metadata, as GET /v2 answers it
    assert {d["id"] for d in data["devices"]} >= {"gpu0", "gpu1", "gpu1/mig1.0", "cpu"}
    mlp = next(m for m in data["models"] if m["name"] == "mlp")
    assert mlp["instances"][0]["memory_bytes"] > 0


def test_gpudctl_inspect_unreachable_is_a_clear_error():
    out = subprocess.run([sys.executable, "-m", "gpud.cli", "inspect", "--url", "127.0.0.1:9"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 1 and "cannot reach gpud" in out.stderr
