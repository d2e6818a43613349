"""Triton's answers where clients match on them (issue 23, item 6), on the real daemon: duplicate requested outputs
refused, unloading a model that is not loaded succeeds, a JSON body decoded in a child process (1000 bytes and more
here) that the core then refuses is answered with the same status and message as on the loop, for every refusal
reason (before, the refusal raised inside the child's completion callback and the client never got an answer)."""
from __future__ import annotations

import http.client
import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from gpud.examples import write_example_repository
from tests.daemon_harness import start_daemon

pytestmark = pytest.mark.slow
OFFLOAD_BYTES = 1000


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_example_repository(repo, ["mlp", "two_input", "cnn"])
    d = start_daemon(repo, tmp_path_factory.mktemp("run"), "--model-control-mode", "explicit", "--load-model", "mlp",
                     "--load-model", "two_input", "--json-offload-bytes", str(OFFLOAD_BYTES))
    yield d
    assert d.stop() == 0, d.log()


def post(daemon, path: str, doc: dict | None = None) -> tuple[int, dict]:
    return daemon.post_json(path, doc, timeout_s=60)


def infer_doc(name: str = "input", datatype: str = "FP32", rows: int = 1, width: int = 256,
              values: list | None = None) -> dict:
    data = values if values is not None else [0.5] * (rows * width)
    return {"inputs": [{"name": name, "shape": [rows, width], "datatype": datatype, "data": data}]}


class TestRequestedOutputs:
    def test_a_duplicate_is_refused_over_http_and_grpc(self, daemon):
        doc = {**infer_doc(values=[0.0] * 256), "outputs": [{"name": "output"}, {"name": "output"}]}
        status, answer = post(daemon, "/v2/models/mlp/infer", doc)
        assert status == 400 and answer["error"] == "output 'output' already exists in request"
        client = grpcclient.InferenceServerClient(daemon.grpc_url)
        inp = grpcclient.InferInput("input", [1, 256], "FP32")
        inp.set_data_from_numpy(np.zeros((1, 256), np.float32))
        out = grpcclient.InferRequestedOutput("output")
        with pytest.raises(InferenceServerException) as info:
            client.infer("mlp", [inp], outputs=[out, out])
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "output 'output' already exists in request" in info.value.message()


class TestUnload:
    @pytest.mark.parametrize("name", ["cnn", "not_in_the_repository"])
    def test_unloading_a_model_that_is_not_loaded_succeeds(self, daemon, name):
        assert post(daemon, f"/v2/repository/models/{name}/unload") == (200, {})
        grpcclient.InferenceServerClient(daemon.grpc_url).unload_model(name)  # raises on an error
        httpclient.InferenceServerClient(daemon.http_url).unload_model(name)
        assert post(daemon, "/v2/models/mlp/infer", infer_doc(values=[0.0] * 256))[0] == 200  # others untouched


# (reason, the request's JSON, what a small request of the same mistake is): every refusal the core makes after a
# body was decoded. Each large body is padded past OFFLOAD_BYTES so it is decoded in a child process.
REFUSALS = {
    "shape": ("/v2/models/mlp/infer", lambda n: infer_doc(width=n)),
    "datatype": ("/v2/models/mlp/infer", lambda n: infer_doc(datatype="FP64", width=256, rows=n // 256 or 1)),
    "batch size": ("/v2/models/mlp/infer", lambda n: infer_doc(rows=65)),
    "unknown input": ("/v2/models/mlp/infer", lambda n: infer_doc(name="nope", width=256, rows=n // 256 or 1)),
    "unknown model": ("/v2/models/nope/infer", lambda n: infer_doc(width=n)),
}


@pytest.mark.parametrize("reason", sorted(REFUSALS))
def test_a_large_json_body_refused_by_the_core_is_answered_as_a_small_one_is(daemon, reason):
    path, make = REFUSALS[reason]
    large = make(300)
    assert len(json.dumps(large)) >= OFFLOAD_BYTES  # decoded in a child process
    status_large, answer_large = post(daemon, path, large)
    small = make(4) if reason != "batch size" else None
    assert status_large in (400, 404), answer_large
    assert answer_large.get("error")
    if small is not None and len(json.dumps(small)) < OFFLOAD_BYTES:
        status_small, answer_small = post(daemon, path, small)
        assert status_small == status_large  # the same answer whichever path decoded the body
    assert post(daemon, "/v2/models/mlp/infer", infer_doc(values=[0.0] * 256))[0] == 200  # the daemon serves on


class TestRawBinaryRequest:
    """Inference-Header-Content-Length: 0: the body is the model's one input, shaped from its config (Triton's raw
    binary request); the answer is JSON."""

    @staticmethod
    def raw(daemon, model: str, body: bytes) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(daemon.http_url, timeout=60)
        try:
            conn.request("POST", f"/v2/models/{model}/infer", body, {"Inference-Header-Content-Length": "0",
                                                                      "Content-Type": "application/octet-stream"})
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()

    def test_the_single_input_is_the_whole_body(self, daemon):
        x = np.linspace(-1, 1, 256, dtype=np.float32)
        status, answer = self.raw(daemon, "mlp", x.tobytes())
        assert status == 200, answer
        status_json, expected = post(daemon, "/v2/models/mlp/infer", infer_doc(values=x.tolist()))
        assert answer["outputs"][0]["shape"] == [1, 16]
        assert np.allclose(answer["outputs"][0]["data"], expected["outputs"][0]["data"], rtol=1e-6)

    def test_a_body_that_is_no_whole_input_is_refused(self, daemon):
        status, answer = self.raw(daemon, "mlp", b"\x00" * 1000)
        assert status == 400 and "raw input 'input' of model 'mlp' has 1000 bytes" in answer["error"]

    def test_a_model_of_several_inputs_is_refused_with_tritons_words(self, daemon):
        status, answer = self.raw(daemon, "two_input", b"\x00" * 32)
        assert status == 400
        assert answer["error"] == ("Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in "
                                   "'two_input' model configuration")
