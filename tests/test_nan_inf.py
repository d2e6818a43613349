"""NaN and the infinities through every front end, as Triton's qa/L0_nan_inf checks them: an answer written as JSON
is JSON Python reads (NaN, Infinity, -Infinity, as Triton writes them), and every client gets the exact values back.
JSON inputs may hold them too (Triton reads them)."""
from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper

from tests.daemon_harness import save, start_daemon

EXPECTED = np.array([-np.inf, np.nan, 0.0, np.inf], np.float32)  # log of 0, -1, 1, and -log 0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    t = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [4])  # noqa: E731
    # y = log(x) * s: log 0 = -inf, log -1 = nan, log 1 = 0; the last element's sign flipped gives +inf
    sign = helper.make_tensor("s", TensorProto.FLOAT, [4], [1.0, 1.0, 1.0, -1.0])
    graph = helper.make_graph([helper.make_node("Log", ["x"], ["l"]), helper.make_node("Mul", ["l", "s"], ["y"])],
                              "nan_inf", [t("x")], [t("y")], initializer=[sign])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    repo = tmp_path_factory.mktemp("models")
    save(model, repo, "nan_inf", 'max_batch_size: 0\n'
         'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
         'output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]\n')
    d = start_daemon(repo, tmp_path_factory.mktemp("run"), node=None)
    yield d
    d.stop()


X = [0.0, -1.0, 1.0, 0.0]


def test_a_json_answer_is_json_python_reads_with_the_exact_values(daemon):
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [4], "data": X}]}).encode()
    req = urllib.request.Request(f"http://{daemon.http_url}/v2/models/nan_inf/infer", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read()
    assert b"-Infinity" in text and b"NaN" in text and b"null" not in text, text
    out = np.array(json.loads(text)["outputs"][0]["data"], np.float32)
    np.testing.assert_array_equal(out, EXPECTED)


@pytest.mark.parametrize("binary", [False, True])
def test_http_clients_get_the_exact_values_in_json_or_binary(daemon, binary):
    client = httpclient.InferenceServerClient(daemon.http_url)
    x = httpclient.InferInput("x", [4], "FP32")
    x.set_data_from_numpy(np.array(X, np.float32), binary_data=binary)
    result = client.infer("nan_inf", [x], outputs=[httpclient.InferRequestedOutput("y", binary_data=binary)])
    np.testing.assert_array_equal(result.as_numpy("y"), EXPECTED)


def test_grpc_clients_get_the_exact_values(daemon):
    client = grpcclient.InferenceServerClient(daemon.grpc_url)
    x = grpcclient.InferInput("x", [4], "FP32")
    x.set_data_from_numpy(np.array(X, np.float32))
    np.testing.assert_array_equal(client.infer("nan_inf", [x]).as_numpy("y"), EXPECTED)


def test_json_inputs_may_hold_them(daemon):
    # x = [inf, nan, 1, 1]: log inf = inf, log nan = nan
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [4],
                                   "data": [float("inf"), float("nan"), 1.0, 1.0]}]}).encode()
    req = urllib.request.Request(f"http://{daemon.http_url}/v2/models/nan_inf/infer", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        out = np.array(json.loads(r.read())["outputs"][0]["data"], np.float32)
    np.testing.assert_array_equal(out, np.array([np.inf, np.nan, 0.0, -0.0], np.float32))
