"""Loading a model with Triton's overrides (issue 23, item 3): a model configuration in the load request replaces
config.pbtxt for that load, and `file:<version>/<name>` parameters replace the model directory, over HTTP (base64),
gRPC (bytes) and `gpudctl load --config/--file`; the files live in a directory of gpud's own until the model is
loaded again without them or unloaded; bad overrides are refused with the parameter named, and the serving model
is untouched."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.request

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from gpud.examples import make_two_input, write_example_repository
from gpud.repository.overrides import LoadOverride, OverrideStore, check_file_path
from tests.daemon_harness import ROOT, start_daemon

pytestmark = pytest.mark.slow
# two_input with its config.pbtxt says max_batch_size 8; the override says 2 and names its inputs as the model does
OVERRIDE = {"max_batch_size": 2,
            "input": [{"name": "ids", "data_type": "TYPE_INT64", "dims": [4]},
                      {"name": "scale", "data_type": "TYPE_FP32", "dims": [4]}],
            "output": [{"name": "out", "data_type": "TYPE_FP32", "dims": [4]}]}


class TestParsing:
    @pytest.mark.parametrize("path", ["model.onnx", "1/../x", "/1/model.onnx", "1//m", "a/model.onnx", "1/."])
    def test_a_file_outside_a_version_directory_is_refused(self, path):
        with pytest.raises(ValueError, match="expected 'file:<version>/<file name>'"):
            check_file_path(path)

    def test_files_need_a_config(self):
        with pytest.raises(ValueError, match="'config' parameter must be provided with 'file:' parameters"):
            LoadOverride(None, {"1/model.onnx": b""})

    def test_the_store_removes_what_no_longer_serves(self, tmp_path):
        store = OverrideStore(str(tmp_path / "o"))
        first = store.write("m", {"1/model.onnx": b"a"})
        store.serving("m", first)
        second = store.write("m", {"1/model.onnx": b"b"})
        store.serving("m", second)
        assert not os.path.exists(first) and open(os.path.join(second, "1", "model.onnx"), "rb").read() == b"b"
        store.serving("m", None)
        assert not os.path.exists(second)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_example_repository(repo, ["mlp", "two_input"])
    d = start_daemon(repo, tmp_path_factory.mktemp("run"), "--model-control-mode", "explicit", "--load-model", "*")
    yield d
    assert d.stop() == 0, d.log()


def load(daemon, name: str, parameters: dict) -> tuple[int, dict]:
    return daemon.post_json(f"/v2/repository/models/{name}/load", {"parameters": parameters})


def config_of(daemon, name: str) -> dict:
    with urllib.request.urlopen(f"http://{daemon.http_url}/v2/models/{name}/config", timeout=30) as r:
        return json.load(r)


def infer_two_input(daemon, name: str) -> np.ndarray:
    client = httpclient.InferenceServerClient(daemon.http_url)
    ids, scale = httpclient.InferInput("ids", [1, 4], "INT64"), httpclient.InferInput("scale", [1, 4], "FP32")
    ids.set_data_from_numpy(np.arange(4, dtype=np.int64).reshape(1, 4))
    scale.set_data_from_numpy(np.ones((1, 4), np.float32))
    return client.infer(name, [ids, scale]).as_numpy("out")


def test_a_config_override_replaces_config_pbtxt_for_the_load(daemon):
    assert config_of(daemon, "two_input")["max_batch_size"] == 8
    assert load(daemon, "two_input", {"config": json.dumps(OVERRIDE)}) == (200, {})
    assert config_of(daemon, "two_input")["max_batch_size"] == 2
    # loaded again without it: the repository's config.pbtxt again
    assert load(daemon, "two_input", {}) == (200, {})
    assert config_of(daemon, "two_input")["max_batch_size"] == 8


def test_files_make_up_the_model_directory_over_http_and_grpc(daemon):
    model = make_two_input().SerializeToString()
    expected = infer_two_input(daemon, "two_input")
    # a model the repository does not have, from the request's files alone
    status, answer = load(daemon, "uploaded", {"config": json.dumps(OVERRIDE),
                                              "file:1/model.onnx": base64.b64encode(model).decode()})
    assert status == 200, answer
    np.testing.assert_allclose(infer_two_input(daemon, "uploaded"), expected)
    grpc = grpcclient.InferenceServerClient(daemon.grpc_url)
    grpc.load_model("uploaded_grpc", config=json.dumps(OVERRIDE), files={"file:1/model.onnx": model})
    np.testing.assert_allclose(infer_two_input(daemon, "uploaded_grpc"), expected)
    for name in ("uploaded", "uploaded_grpc"):
        grpc.unload_model(name)


def test_a_load_over_http_takes_files_past_the_control_routes_1_mib(daemon):
    # a model's files are megabytes: Triton's HTTP load takes them (base64 in the JSON body); other control routes
    # keep their 1 MiB bound
    model = make_two_input().SerializeToString()
    weights = np.random.default_rng(0).bytes(3 * 2**20)  # as a model's external data beside it
    client = httpclient.InferenceServerClient(daemon.http_url)
    client.load_model("uploaded_big", config=json.dumps(OVERRIDE),
                      files={"file:1/model.onnx": model, "file:1/weights.bin": weights})
    np.testing.assert_allclose(infer_two_input(daemon, "uploaded_big"), infer_two_input(daemon, "two_input"))
    client.unload_model("uploaded_big")
    status, answer = daemon.post_json("/v2/repository/index", {"ready": True, "pad": "x" * 2**21})
    assert status == 413 and "exceeds the limit of 1048576 bytes" in answer["error"]


@pytest.mark.parametrize("parameters, message", [
    ({"file:1/model.onnx": "AAAA"}, "'config' parameter must be provided with 'file:' parameters"),
    ({"config": "{}", "file:../x": "AAAA"}, "expected 'file:<version>/<file name>'"),
    ({"config": "{}", "file:1/model.onnx": "not base64!"}, "'file:1/model.onnx' is not base64"),
    ({"config": 7}, "'config' must be a string"),
    ({"config": "{not json"}, "not a model configuration"),
    ({"config": json.dumps({"name": "other"})}, "name 'other' does not match the model 'mlp'"),
    ({"config": json.dumps({"max_batch_size": 2, "nonsense": 1})}, "not a model configuration"),
])
def test_a_bad_override_is_refused_and_the_model_serves_on(daemon, parameters, message):
    status, answer = load(daemon, "mlp", parameters)
    assert status == 400 and message in answer["error"], answer
    assert config_of(daemon, "mlp")["max_batch_size"] == 64  # untouched


def test_gpudctl_load_with_a_config_file(daemon, tmp_path):
    config = tmp_path / "two_input.pbtxt"
    config.write_text('max_batch_size: 2\ninput [ { name: "ids" data_type: TYPE_INT64 dims: [ 4 ] },\n'
                      '{ name: "scale" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
                      'output [ { name: "out" data_type: TYPE_FP32 dims: [ 4 ] } ]\n')
    model = tmp_path / "m.onnx"
    onnx.save(make_two_input(), model)
    out = subprocess.run([sys.executable, "-m", "gpud.cli.main", "load", "from_gpudctl", "--url",
                          f"http://{daemon.http_url}", "--config", str(config), "--file", f"1/model.onnx={model}"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert config_of(daemon, "from_gpudctl")["max_batch_size"] == 2
