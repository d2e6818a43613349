"""Triton's classification extension (`classification: k` on a requested output: the top k as "value:index:label"
BYTES) and the reported config kept faithful to config.pbtxt (an input's format, an output's label_filename and
every other field gpud does not change), over HTTP and gRPC."""
from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from gpud.examples import write_example_repository
from gpud.executor.classification import class_count, classify
from gpud.executor.model_config import ModelConfig, TensorSpec
from gpud.executor.types import InferenceError, InferTensor, RequestedOutput
from tests.daemon_harness import start_daemon

LABELS = [f"class-{i}" for i in range(8)]  # 10 logits, 8 labels: indices 8 and 9 have none
CNN_CONFIG = """
max_batch_size: 8
input [ { name: "input" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, 32, 32 ] } ]
output [ { name: "logits" data_type: TYPE_FP32 dims: [ 10 ] label_filename: "labels.txt" } ]
model_warmup [ { name: "zeros" batch_size: 1
                 inputs { key: "input" value: { data_type: TYPE_FP32 dims: [ 3, 32, 32 ] zero_data: true } } } ]
"""


class TestClassify:
    def test_top_k_of_each_row_highest_first_with_labels(self):
        data = np.array([[0.1, 0.7, 0.2], [0.5, 0.25, 0.25]], np.float32)
        out = classify(InferTensor("y", "FP32", data.shape, data), 2, ["a", "b"], batches=True)
        assert out.datatype == "BYTES" and out.shape == (2, 2)
        # ties keep index order; index 2 has no label; float values written as C++ std::to_string does
        assert out.data.tolist() == [[b"0.700000:1:b", b"0.200000:2"], [b"0.500000:0:a", b"0.250000:1:b"]]

    def test_k_is_capped_and_integers_are_written_whole(self):
        data = np.array([3, 9, 1], np.int32)
        out = classify(InferTensor("y", "INT32", data.shape, data), 5, [], batches=False)
        assert out.shape == (3,) and out.data.tolist() == [b"9:1", b"3:0", b"1:2"]

    @pytest.mark.parametrize("value, message", [
        (-1, "expected an integer >= 0, got -1"), ("3", "expected an integer >= 0, got '3'"),
        (True, "expected an integer >= 0, got True"),
    ])
    def test_a_bad_count_is_refused(self, value, message):
        config = ModelConfig("m", outputs=(TensorSpec("y", "FP32", (4,)),))
        with pytest.raises(InferenceError, match=message):
            class_count(RequestedOutput("y", {"classification": value}), config)

    def test_an_output_that_cannot_be_classified_is_refused(self):
        config = ModelConfig("m", outputs=(TensorSpec("s", "BYTES", (1,)),))
        with pytest.raises(InferenceError, match="class result not available for output 's' due to unsupported "
                                                 "type 'BYTES'"):
            class_count(RequestedOutput("s", {"classification": 2}), config)
        assert class_count(RequestedOutput("s", {}), config) == 0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_example_repository(repo, ["cnn"])
    (repo / "cnn" / "config.pbtxt").write_text(CNN_CONFIG)
    (repo / "cnn" / "labels.txt").write_text("\n".join(LABELS) + "\n")
    d = start_daemon(repo, tmp_path_factory.mktemp("run"))
    yield d
    assert d.stop() == 0, d.log()


def _image(rows: int) -> np.ndarray:
    return np.random.default_rng(7).standard_normal((rows, 3, 32, 32)).astype(np.float32)


def _expected(logits: np.ndarray, k: int) -> list[list[bytes]]:
    out = []
    for row in logits:
        order = np.argsort(-row.astype(np.float64), kind="stable")[:k]
        out.append([f"{row[i]:f}:{i}".encode() + (f":{LABELS[i]}".encode() if i < len(LABELS) else b"")
                    for i in order])
    return out


@pytest.mark.slow
class TestOverTheWire:
    def test_http_and_grpc_answer_the_top_k_with_labels(self, daemon):
        x = _image(2)
        http = httpclient.InferenceServerClient(daemon.http_url)
        inp = httpclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        logits = http.infer("cnn", [inp]).as_numpy("logits")
        for binary in (True, False):
            out = http.infer("cnn", [inp], outputs=[httpclient.InferRequestedOutput("logits", binary_data=binary,
                                                                                    class_count=3)])
            got = [[v.encode() if isinstance(v, str) else v for v in row] for row in out.as_numpy("logits").tolist()]
            assert got == _expected(logits, 3)  # JSON answers text, which tritonclient hands back as str
        grpc = grpcclient.InferenceServerClient(daemon.grpc_url)
        ginp = grpcclient.InferInput("input", list(x.shape), "FP32")
        ginp.set_data_from_numpy(x)
        out = grpc.infer("cnn", [ginp], outputs=[grpcclient.InferRequestedOutput("logits", class_count=12)])
        assert out.as_numpy("logits").shape == (2, 10)  # k capped at the 10 classes
        assert out.as_numpy("logits").tolist() == _expected(logits, 10)

    def test_the_reported_config_keeps_what_config_pbtxt_says(self, daemon):
        with urllib.request.urlopen(f"http://{daemon.http_url}/v2/models/cnn/config", timeout=30) as r:
            config = json.load(r)
        assert config["input"][0]["format"] == "FORMAT_NCHW"
        assert config["output"][0]["label_filename"] == "labels.txt"
        assert config["model_warmup"][0]["name"] == "zeros"
        grpc_config = grpcclient.InferenceServerClient(daemon.grpc_url).get_model_config("cnn").config
        assert grpcclient.model_config_pb2.ModelInput.Format.Name(grpc_config.input[0].format) == "FORMAT_NCHW"
        assert grpc_config.output[0].label_filename == "labels.txt"
        assert grpc_config.model_warmup[0].name == "zeros"

    def test_a_bytes_output_or_a_bad_count_is_a_400(self, daemon):
        http = httpclient.InferenceServerClient(daemon.http_url)
        inp = httpclient.InferInput("input", [1, 3, 32, 32], "FP32")
        inp.set_data_from_numpy(_image(1))
        with pytest.raises(InferenceServerException) as info:
            http.infer("cnn", [inp], outputs=[httpclient.InferRequestedOutput("logits", class_count=-2)])
        assert info.value.status() == "400" and "classification" in info.value.message()
