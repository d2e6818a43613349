"""Triton's reshape (gpud/executor/reshape.py): the config's checks, the shapes on both sides, and models served with it
(auto-completed scalars per batch item, fixed and variable reshapes, a step of an ensemble), by the worker processes
and in process."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import gpud
from gpud.executor.model_config import TensorSpec
from gpud.executor.reshape import check_reshape, client_shape, model_shape, resolve
from gpud.executor.types import InferenceError
from gpud.api.http_encode import model_config_json
from tests.daemon_harness import ROOT, save

NODE = str(ROOT / "config/nodes/dgx-a100-2gpu-mig.yaml")


# --- pure ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dims, reshape, problem", [
    ((1,), (), ""),
    ((2, 3), (6,), ""),
    ((-1, 1), (-1,), ""),
    ((4, -1, 2), (8, -1), ""),
    ((4,), (5,), "has 5 elements"),
    ((-1,), (2, 2), "as many variable dimensions"),
    ((4,), (0, 4), "must be >= 1, or -1"),
])
def test_check_reshape(dims, reshape, problem):
    got = check_reshape(dims, reshape)
    assert (problem in got) if problem else got == ""


def test_variable_dimensions_correspond_in_order():
    assert resolve((8, -1), (4, -1, 2), (4, 7, 2)) == (8, 7)
    assert resolve((-1, 3, -1), (-1, -1), (5, 9)) == (5, 3, 9)
    spec = TensorSpec("x", "FP32", (-1, 1), reshape=(-1,))
    assert model_shape((3, 5, 1), spec, batches=True) == (3, 5)
    assert client_shape((3, 5), spec, batches=True) == (3, 5, 1)
    fixed = TensorSpec("x", "FP32", (2, 3), reshape=(6,))
    assert model_shape((2, 3), fixed, batches=False) == (6,)
    assert client_shape((4, 6), fixed, batches=True) == (4, 2, 3)


# --- served ----------------------------------------------------------------------------------------------------
def _model(in_shape: list, out_shape: list, op: str = "scale") -> onnx.ModelProto:
    """x -> y = 2x (same shape), or "flat": y = x + 2."""
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    node = helper.make_node("Mul", ["x", "two"], ["y"]) if op == "scale" else helper.make_node("Add", ["x", "two"],
                                                                                                 ["y"])
    graph = helper.make_graph([node], "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], [two])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


FLAT_CONFIG = """
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2, 3 ] reshape { shape: [ 6 ] } } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 3, 2 ] reshape { shape: [ 6 ] } } ]
"""
VARIABLE_CONFIG = """
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 1 ] reshape { shape: [ -1 ] } } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ -1, 1 ] reshape { shape: [ -1 ] } } ]
"""
PIPE_CONFIG = """
platform: "ensemble"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "scalar" model_version: -1 input_map { key: "x" value: "IN" } output_map { key: "y" value: "M" } },
  { model_name: "scalar" model_version: -1 input_map { key: "x" value: "M" } output_map { key: "y" value: "OUT" } }
] }
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    save(_model(["N"], ["N"]), repo, "scalar")  # no config: auto-complete gives dims [1], reshape []
    save(_model(["N", 6], ["N", 6], op="flat"), repo, "flat", FLAT_CONFIG)
    save(_model(["N", "K"], ["N", "K"]), repo, "variable", VARIABLE_CONFIG)
    (repo / "pipe" / "1").mkdir(parents=True)
    (repo / "pipe" / "config.pbtxt").write_text(PIPE_CONFIG)
    return repo


@pytest.fixture(scope="module", params=[False, True], ids=["worker-processes", "models-in-process"])
def server(repo, request):
    with gpud.Server(repo, node=NODE, placement_control="off", models_in_process=request.param) as s:
        yield s


def test_a_scalar_per_item_takes_batch_by_one_as_triton_has_it(server):
    config = model_config_json(server.model_config("scalar"))
    assert config["input"][0]["dims"] == [1] and config["input"][0]["reshape"] == {"shape": []}
    assert [t.shape for t in server.model_metadata("scalar").inputs] == [(-1, 1)]
    x = np.arange(3, dtype=np.float32).reshape(3, 1)
    for _ in range(2):  # the first call finds the model idle (a caller's own run in process); then with a timeout
        y = server.infer("scalar", {"x": x})["y"]
        assert y.shape == (3, 1) and np.array_equal(y, 2 * x)
        y = server.infer("scalar", {"x": x}, timeout=60)["y"]
        assert np.array_equal(y, 2 * x)
    with pytest.raises(InferenceError, match=r"Expected \[-1,1\], got \[3\]"):
        server.infer("scalar", {"x": np.zeros(3, np.float32)})


def test_fixed_reshapes_on_both_sides(server):
    x = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
    y = server.infer("flat", {"x": x})["y"]
    assert y.shape == (4, 3, 2)
    np.testing.assert_array_equal(y, (x.reshape(4, 6) + 2).reshape(4, 3, 2))


def test_variable_dimensions_pass_through(server):
    for k in (1, 5):
        x = np.random.default_rng(k).standard_normal((2, k, 1)).astype(np.float32)
        y = server.infer("variable", {"x": x}, timeout=60)["y"]
        assert y.shape == (2, k, 1)
        np.testing.assert_allclose(y, 2 * x)


def test_an_ensembles_steps_reshape_their_own_tensors(server):
    x = np.array([[1.0], [2.0]], np.float32)
    np.testing.assert_array_equal(server.infer("pipe", {"IN": x})["OUT"], 4 * x)


def test_threads_batch_through_a_reshape(server):
    from concurrent.futures import ThreadPoolExecutor

    xs = [np.full((1, 1), i, np.float32) for i in range(32)]  # auto-completed: max_batch_size 4
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda x: server.infer("scalar", {"x": x})["y"], xs))
    assert all(np.array_equal(y, 2 * x) for x, y in zip(xs, got))


def test_an_ensembles_own_tensors_cannot_reshape(tmp_path):
    from gpud.repository.errors import ModelConfigError
    from gpud.repository.layout import load_model_config

    d = tmp_path / "pipe"
    (d / "1").mkdir(parents=True)
    (d / "config.pbtxt").write_text(PIPE_CONFIG.replace('dims: [ 1 ] } ]\noutput', 'dims: [ 1 ] reshape { shape: [ ] } } ]'
                                                                                   '\noutput'))
    with pytest.raises(ModelConfigError, match="reshape on an ensemble's tensors is not supported"):
        load_model_config(d)


@pytest.mark.parametrize("model", ["flat", "scalar", "variable"])
def test_the_config_endpoints_say_the_reshape_and_read_back_the_same(repo, model):
    from google.protobuf import json_format

    from gpud.api.grpc_encode import model_config_message
    from gpud.core_api import ServedModelConfig
    from gpud.proto import model_config_pb2
    from gpud.repository.config import config_from_proto
    from gpud.repository.layout import load_model

    entry = load_model(repo / model)
    served = ServedModelConfig(entry.config, entry.version_policy)
    d = model_config_json(served)
    assert d["input"][0]["reshape"] == {"shape": list(entry.config.inputs[0].reshape)}
    again, _ = config_from_proto(json_format.ParseDict(d, model_config_pb2.ModelConfig()), model, "<json>")
    assert (again.inputs, again.outputs) == (entry.config.inputs, entry.config.outputs)
    message = model_config_message(served)
    assert message.input[0].HasField("reshape")
    assert list(message.input[0].reshape.shape) == list(entry.config.inputs[0].reshape)
