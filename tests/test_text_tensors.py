"""Text (BYTES) tensors come back byte for byte on every front end: HTTP JSON and binary, gRPC, the in-process API
(models in worker processes and in the application's process). Empty strings, NUL bytes, multi-byte UTF-8, strings of
different lengths in one batch. Bytes that are not UTF-8 (which onnxruntime's string tensors cannot hold) are refused
with a 400 / INVALID_ARGUMENT naming the input, never altered, never a 500. Hypothesis round-trips arbitrary strings
through an identity model."""
from __future__ import annotations


import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

import gpud
from gpud.executor.types import InferenceError
from tests.daemon_harness import save, start_daemon
from tests.ensemble_models import ensemble_config, save_model, step

pytestmark = pytest.mark.slow
NODE = "config/nodes/dgx-a100-2gpu-mig.yaml"
CONFIG = """max_batch_size: 8
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "ECHO" data_type: TYPE_STRING dims: [ -1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 500 }
"""
SPECIAL = [b"", b"he\x00llo", "h\u00e9llo".encode(), "\u65e5\u672c\U0001f600".encode(), b"\x00", b"a" * 300]
TEXTS = st.lists(st.text(alphabet=st.characters(codec="utf-8"), max_size=24).map(str.encode) | st.sampled_from(SPECIAL),
                 min_size=1, max_size=6)
SLOW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def identity_model() -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Identity", ["TEXT"], ["ECHO"])], "echo",
                              [helper.make_tensor_value_info("TEXT", TensorProto.STRING, ["batch", "n"])],
                              [helper.make_tensor_value_info("ECHO", TensorProto.STRING, ["batch", "n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def as_array(items: list[bytes]) -> np.ndarray:
    arr = np.empty((1, len(items)), dtype=object)
    arr[0, :] = items
    return arr


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    save(identity_model(), repo, "echo", CONFIG)
    # An ensemble of two echo steps: text crosses a step boundary (the first step's output is the second's input)
    save_model(repo, "echo_twice", None, ensemble_config(
        "echo_twice", [("TEXT", "TYPE_STRING", [-1])], [("ECHO", "TYPE_STRING", [-1])],
        [step("echo", {"TEXT": "TEXT"}, {"ECHO": "mid"}), step("echo", {"TEXT": "mid"}, {"ECHO": "ECHO"})],
        max_batch_size=8))
    return repo


@pytest.fixture(scope="module")
def daemon(repo, tmp_path_factory):
    d = start_daemon(repo, tmp_path_factory.mktemp("run"))
    yield d
    assert d.stop() == 0, d.log()


def http_json(daemon, texts: list[str]) -> tuple[int, dict]:
    return daemon.post_json("/v2/models/echo/infer", {"inputs": [{"name": "TEXT", "shape": [1, len(texts)],
                                                                   "datatype": "BYTES", "data": texts}]}, 30)


class TestOverTheWire:
    @SLOW
    @given(items=TEXTS)
    def test_http_binary(self, daemon, items):
        client = httpclient.InferenceServerClient(daemon.http_url)
        inp = httpclient.InferInput("TEXT", [1, len(items)], "BYTES")
        inp.set_data_from_numpy(as_array(items), binary_data=True)
        out = client.infer("echo", [inp], outputs=[httpclient.InferRequestedOutput("ECHO", binary_data=True)])
        assert list(out.as_numpy("ECHO")[0]) == items

    @SLOW
    @given(items=TEXTS)
    def test_grpc(self, daemon, items):
        client = grpcclient.InferenceServerClient(daemon.grpc_url)
        inp = grpcclient.InferInput("TEXT", [1, len(items)], "BYTES")
        inp.set_data_from_numpy(as_array(items))
        out = client.infer("echo", [inp])
        assert list(out.as_numpy("ECHO")[0]) == items

    @SLOW
    @given(texts=st.lists(st.text(alphabet=st.characters(codec="utf-8"), max_size=24), min_size=1, max_size=6))
    def test_http_json(self, daemon, texts):
        status, doc = http_json(daemon, texts)
        assert status == 200, doc
        assert doc["outputs"][0]["data"] == texts  # JSON carries text: any character, NUL included

    @SLOW
    @given(items=st.lists(st.binary(max_size=12), min_size=1, max_size=4))
    def test_bytes_that_are_not_utf8_are_refused_naming_the_input(self, daemon, items):
        client = httpclient.InferenceServerClient(daemon.http_url)
        inp = httpclient.InferInput("TEXT", [1, len(items)], "BYTES")
        inp.set_data_from_numpy(as_array(items), binary_data=True)
        try:
            text = [i.decode("utf-8") for i in items]
        except UnicodeDecodeError:
            text = None
        if text is not None:
            assert list(client.infer("echo", [inp]).as_numpy("ECHO")[0]) == items
            return
        with pytest.raises(InferenceServerException) as info:
            client.infer("echo", [inp])
        assert info.value.status() == "400" and "input 'TEXT' element" in info.value.message()
        assert "is not UTF-8 text" in info.value.message()

    @SLOW
    @given(items=TEXTS)
    def test_through_an_ensembles_steps(self, daemon, items):
        client = grpcclient.InferenceServerClient(daemon.grpc_url)
        inp = grpcclient.InferInput("TEXT", [1, len(items)], "BYTES")
        inp.set_data_from_numpy(as_array(items))
        assert list(client.infer("echo_twice", [inp]).as_numpy("ECHO")[0]) == items

    def test_a_batch_of_empty_strings_and_a_batch_of_mixed_lengths(self, daemon):
        client = grpcclient.InferenceServerClient(daemon.grpc_url)
        for items in ([b""] * 5, [b"x" * n for n in (0, 1, 7, 64, 3)]):
            inp = grpcclient.InferInput("TEXT", [1, len(items)], "BYTES")
            inp.set_data_from_numpy(as_array(items))
            assert list(client.infer("echo", [inp]).as_numpy("ECHO")[0]) == items

    def test_grpc_refuses_non_utf8_with_invalid_argument(self, daemon):
        client = grpcclient.InferenceServerClient(daemon.grpc_url)
        inp = grpcclient.InferInput("TEXT", [1, 2], "BYTES")
        inp.set_data_from_numpy(as_array([b"ok", b"\xff\xfe"]))
        with pytest.raises(InferenceServerException) as info:
            client.infer("echo", [inp])
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "input 'TEXT' element 1 is not UTF-8 text" in info.value.message()


@pytest.fixture(scope="module", params=[False, True], ids=["workers", "in-process"])
def server(repo, request):
    with gpud.Server(repo, node=NODE, models_in_process=request.param) as s:
        yield s


class TestInProcess:
    @SLOW
    @given(items=TEXTS)
    def test_round_trip(self, server, items):
        out = server.infer("echo", {"TEXT": as_array(items)})
        assert list(out["ECHO"][0]) == items

    def test_not_utf8_is_refused(self, server):
        with pytest.raises(InferenceError, match="input 'TEXT' element 0 is not UTF-8 text"):
            server.infer("echo", {"TEXT": as_array([b"\xc3("])})


# --- text through a sequence model's state (the state carries bytes from one request of a sequence to the next) -------
def last_text_model() -> onnx.ModelProto:
    """PREV = the state (the sequence's previous TEXT; "" at its start); the new state = TEXT."""
    vi = lambda name, t: helper.make_tensor_value_info(name, t, ["N", 1])  # noqa: E731
    graph = helper.make_graph([helper.make_node("Identity", ["INPUT_STATE"], ["PREV"]),
                               helper.make_node("Identity", ["TEXT"], ["OUTPUT_STATE"])], "last_text",
                              [vi("TEXT", TensorProto.STRING), vi("INPUT_STATE", TensorProto.STRING),
                               vi("START", TensorProto.INT32)],
                              [vi("PREV", TensorProto.STRING), vi("OUTPUT_STATE", TensorProto.STRING)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


LAST_TEXT_CONFIG = """max_batch_size: 4
sequence_batching {
  direct { }
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]
  state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_STRING dims: [ 1 ] } ]
}
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "PREV" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""


@pytest.mark.parametrize("in_process", [False, True], ids=["workers", "in-process"])
def test_text_through_a_sequence_models_state(tmp_path, in_process):
    save(last_text_model(), tmp_path, "last_text", LAST_TEXT_CONFIG)
    texts = [b"he\x00llo", "h\u00e9llo".encode(), b"", "\U0001f600".encode() * 40]
    with gpud.Server(tmp_path, node=NODE, models_in_process=in_process) as server:
        got = []
        for i, text in enumerate(texts):
            arr = np.empty((1, 1), dtype=object)
            arr[0, 0] = text
            out = server.infer("last_text", {"TEXT": arr}, parameters={"sequence_id": 42, "sequence_start": i == 0,
                                                                       "sequence_end": i == len(texts) - 1})
            got.append(out["PREV"][0, 0])
    assert got == [b""] + texts[:-1]  # each request sees the one before it, byte for byte
