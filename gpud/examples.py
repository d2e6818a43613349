"""Example models in a Triton-layout repository, built with the `onnx` helper API (nothing downloaded).

The daemon can write them at start-up so a fresh install serves something, and tests build repositories from them.
Weights come from a seeded generator, so the same call writes byte-identical files.

- `mlp`: FP32 [-1, 256] -> 256->1024->1024->16 with Relu, with a config.pbtxt (max_batch_size 64, dynamic batching).
- `cnn`: FP32 [-1, 3, 32, 32] -> FP32 [-1, 10] logits, no config.pbtxt: it is auto-completed from the ONNX file.
- `two_input`: INT64 "ids" [-1, 4] and FP32 "scale" [-1, 4] -> FP32 "out" [-1, 4], with a config.pbtxt, where
  out = p + rowsum(p) and p = Cast(ids) * scale (rowsum broadcast over the 4 columns).
- the pipeline (`write_pipeline_example`): the ensemble `pipeline`, UINT8 "IMAGE" [-1, 16] -> FP32 "PROBABILITIES"
  [-1, 4] and INT64 "LABEL" [-1, 1], whose steps are `preprocess` (scale the pixels), `classifier` (an MLP) and
  `postprocess` (softmax and argmax).
"""
from __future__ import annotations

import os
from typing import Any
from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# ir_version 8 / opset 17 load in every onnxruntime that pyproject allows (>= 1.18) and in Triton's.
OPSET_VERSION = 17
IR_VERSION = 8
BATCH_DIM = "batch"  # symbolic first dimension: the model batches

MLP_CONFIG_PBTXT = """\
name: "mlp"
platform: "onnxruntime_onnx"
max_batch_size: 64
input [
  {
    name: "input"
    data_type: TYPE_FP32
    dims: [ 256 ]
  }
]
output [
  {
    name: "output"
    data_type: TYPE_FP32
    dims: [ 16 ]
  }
]
instance_group [
  {
    count: 1
    kind: KIND_AUTO
  }
]
dynamic_batching {
  preferred_batch_size: [ 16, 32, 64 ]
  max_queue_delay_microseconds: 3000
}
"""

TWO_INPUT_CONFIG_PBTXT = """\
name: "two_input"
backend: "onnxruntime"
max_batch_size: 8
input [
  {
    name: "ids"
    data_type: TYPE_INT64
    dims: [ 4 ]
  },
  {
    name: "scale"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
output [
  {
    name: "out"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
dynamic_batching {
  max_queue_delay_microseconds: 1000
}
"""


def _weight(rng: np.random.Generator, name: str, shape: tuple[int, ...], fan_in: int) -> TensorProto:
    # He-style scaling keeps activations in a sane range through the Relu layers, so outputs are finite and useful
    # for comparing results across backends.
    data = (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)
    return numpy_helper.from_array(data, name)


def _bias(rng: np.random.Generator, name: str, size: int) -> TensorProto:
    return numpy_helper.from_array((rng.standard_normal(size) * 0.01).astype(np.float32), name)


def _finish(graph: onnx.GraphProto, producer: str) -> onnx.ModelProto:
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET_VERSION)], producer_name=f"gpud.examples.{producer}"
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def _dense_layers(rng: np.random.Generator, widths: list[int], x: str,
                  out: str) -> tuple[list[onnx.NodeProto], list[TensorProto]]:
    """MatMul+Add layers of the given widths from input `x` to output `out`, Relu between them."""
    nodes: list[onnx.NodeProto] = []
    inits: list[TensorProto] = []
    for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
        inits += [_weight(rng, f"w{i}", (fan_in, fan_out), fan_in), _bias(rng, f"b{i}", fan_out)]
        last = i == len(widths) - 2
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"mm{i}"]))
        nodes.append(helper.make_node("Add", [f"mm{i}", f"b{i}"], [out if last else f"pre{i}"]))
        if not last:
            nodes.append(helper.make_node("Relu", [f"pre{i}"], [f"act{i}"]))
            x = f"act{i}"
    return nodes, inits


def make_mlp(seed: int = 0) -> onnx.ModelProto:
    """FP32 "input" [batch, 256] -> "output" [batch, 16]: three MatMul+Add layers, Relu after the first two."""
    nodes, inits = _dense_layers(np.random.default_rng(seed), [256, 1024, 1024, 16], "input", "output")
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [BATCH_DIM, 256])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [BATCH_DIM, 16])],
        initializer=inits,
    )
    return _finish(graph, "mlp")


def make_cnn(seed: int = 1) -> onnx.ModelProto:
    """FP32 "input" [batch, 3, 32, 32] -> "logits" [batch, 10]: two Conv+Relu+MaxPool stages and a Gemm."""
    rng = np.random.default_rng(seed)
    inits = [
        _weight(rng, "conv0_w", (8, 3, 3, 3), 3 * 3 * 3),
        _bias(rng, "conv0_b", 8),
        _weight(rng, "conv1_w", (16, 8, 3, 3), 8 * 3 * 3),
        _bias(rng, "conv1_b", 16),
        _weight(rng, "fc_w", (16 * 8 * 8, 10), 16 * 8 * 8),
        _bias(rng, "fc_b", 10),
    ]
    conv: dict[str, Any] = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    pool: dict[str, Any] = {"kernel_shape": [2, 2], "strides": [2, 2]}
    nodes = [
        helper.make_node("Conv", ["input", "conv0_w", "conv0_b"], ["c0"], **conv),  # [b, 8, 32, 32]
        helper.make_node("Relu", ["c0"], ["r0"]),
        helper.make_node("MaxPool", ["r0"], ["p0"], **pool),  # [b, 8, 16, 16]
        helper.make_node("Conv", ["p0", "conv1_w", "conv1_b"], ["c1"], **conv),  # [b, 16, 16, 16]
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], **pool),  # [b, 16, 8, 8]
        helper.make_node("Flatten", ["p1"], ["flat"], axis=1),  # [b, 1024]
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"]),  # [b, 10]
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [BATCH_DIM, 3, 32, 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [BATCH_DIM, 10])],
        initializer=inits,
    )
    return _finish(graph, "cnn")


def make_two_input() -> onnx.ModelProto:
    """INT64 "ids" [batch, 4], FP32 "scale" [batch, 4] -> FP32 "out" [batch, 4] = p + rowsum(p), p = ids * scale."""
    nodes = [
        helper.make_node("Cast", ["ids"], ["ids_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["ids_f", "scale"], ["p"]),
        helper.make_node("ReduceSum", ["p", "sum_axes"], ["rowsum"], keepdims=1),  # [b, 1]
        helper.make_node("Add", ["p", "rowsum"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "two_input",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, [BATCH_DIM, 4]),
            helper.make_tensor_value_info("scale", TensorProto.FLOAT, [BATCH_DIM, 4]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [BATCH_DIM, 4])],
        initializer=[numpy_helper.from_array(np.array([1], dtype=np.int64), "sum_axes")],
    )
    return _finish(graph, "two_input")


def two_input_reference(ids: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """What `two_input` computes, in numpy: for checking a served result."""
    p = ids.astype(np.float32) * scale.astype(np.float32)
    return p + p.sum(axis=1, keepdims=True)


# --- a pipeline: an ensemble of three models (what `./scripts/run` serves beside the models above) -------------------
PIXELS = 16  # the pipeline's "image": 16 UINT8 pixels
CLASSES = 4


def make_preprocess() -> onnx.ModelProto:
    """UINT8 "raw" [batch, 16] -> FP32 "features" [batch, 16] = raw * 2/255 - 1 (pixels scaled to [-1, 1])."""
    nodes = [
        helper.make_node("Cast", ["raw"], ["raw_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["raw_f", "scale"], ["scaled"]),
        helper.make_node("Sub", ["scaled", "one"], ["features"]),
    ]
    graph = helper.make_graph(
        nodes, "preprocess", [helper.make_tensor_value_info("raw", TensorProto.UINT8, [BATCH_DIM, PIXELS])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [BATCH_DIM, PIXELS])],
        initializer=[numpy_helper.from_array(np.array(2 / 255, dtype=np.float32), "scale"),
                     numpy_helper.from_array(np.array(1, dtype=np.float32), "one")])
    return _finish(graph, "preprocess")


def make_classifier(seed: int = 2, hidden: int = 64, layers: int = 1, classes: int = CLASSES) -> onnx.ModelProto:
    """FP32 "features" [batch, 16] -> FP32 "logits" [batch, 4]: `layers` MatMul+Add+Relu of width `hidden`, then
    one MatMul+Add (the benchmark makes it wider and deeper to make it the pipeline's slowest step)."""
    nodes, inits = _dense_layers(np.random.default_rng(seed), [PIXELS] + [hidden] * layers + [classes], "features",
                                 "logits")
    graph = helper.make_graph(
        nodes, "classifier", [helper.make_tensor_value_info("features", TensorProto.FLOAT, [BATCH_DIM, PIXELS])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [BATCH_DIM, classes])], initializer=inits)
    return _finish(graph, "classifier")


def make_postprocess() -> onnx.ModelProto:
    """FP32 "logits" [batch, 4] -> FP32 "probabilities" [batch, 4] (softmax), INT64 "label" [batch, 1] (argmax)."""
    nodes = [
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
        helper.make_node("ArgMax", ["logits"], ["label"], axis=1, keepdims=1),
    ]
    graph = helper.make_graph(
        nodes, "postprocess", [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [BATCH_DIM, CLASSES])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [BATCH_DIM, CLASSES]),
         helper.make_tensor_value_info("label", TensorProto.INT64, [BATCH_DIM, 1])])
    return _finish(graph, "postprocess")


def _step_config(name: str, inputs: list[tuple[str, str, int]], outputs: list[tuple[str, str, int]]) -> str:
    def tensors(specs: list[tuple[str, str, int]]) -> str:
        return ",\n".join(f'  {{ name: "{n}", data_type: {t}, dims: [ {d} ] }}' for n, t, d in specs)
    return (f'name: "{name}"\nbackend: "onnxruntime"\nmax_batch_size: 16\ninput [\n{tensors(inputs)}\n]\n'
            f'output [\n{tensors(outputs)}\n]\ndynamic_batching {{ }}\n')


PIPELINE_CONFIG_PBTXT = """\
# An ensemble: one request runs preprocess -> classifier -> postprocess inside gpud; the tensors between the
# steps never leave it. Each step's model batches, is placed and scaled on its own.
name: "pipeline"
platform: "ensemble"
max_batch_size: 16
input [ { name: "IMAGE", data_type: TYPE_UINT8, dims: [ 16 ] } ]
output [
  { name: "PROBABILITIES", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "LABEL", data_type: TYPE_INT64, dims: [ 1 ] }
]
ensemble_scheduling {
  step [
    {
      model_name: "preprocess"
      model_version: -1
      input_map { key: "raw" value: "IMAGE" }
      output_map { key: "features" value: "features" }
    },
    {
      model_name: "classifier"
      model_version: -1
      input_map { key: "features" value: "features" }
      output_map { key: "logits" value: "logits" }
    },
    {
      model_name: "postprocess"
      model_version: -1
      input_map { key: "logits" value: "logits" }
      output_map [
        { key: "probabilities" value: "PROBABILITIES" },
        { key: "label" value: "LABEL" }
      ]
    }
  ]
}
"""

# name -> (builder or None for an ensemble (no model file), config.pbtxt text)
PIPELINE_EXAMPLES: dict[str, tuple[Callable[[], onnx.ModelProto] | None, str]] = {
    "preprocess": (make_preprocess, _step_config("preprocess", [("raw", "TYPE_UINT8", PIXELS)],
                                                 [("features", "TYPE_FP32", PIXELS)])),
    "classifier": (make_classifier, _step_config("classifier", [("features", "TYPE_FP32", PIXELS)],
                                                 [("logits", "TYPE_FP32", CLASSES)])),
    "postprocess": (make_postprocess, _step_config("postprocess", [("logits", "TYPE_FP32", CLASSES)],
                                                   [("probabilities", "TYPE_FP32", CLASSES),
                                                    ("label", "TYPE_INT64", 1)])),
    "pipeline": (None, PIPELINE_CONFIG_PBTXT),
}


def write_pipeline_example(out_dir: str | os.PathLike[str]) -> list[str]:
    """Write the pipeline (`pipeline`, an ensemble of `preprocess`, `classifier` and `postprocess`) into a
    repository; the ensemble's version directory is empty, as Triton has it. Returns the written paths."""
    written: list[str] = []
    for name, (build, config_text) in PIPELINE_EXAMPLES.items():
        version_dir = os.path.join(os.fspath(out_dir), name, "1")
        os.makedirs(version_dir, exist_ok=True)
        if build is not None:
            model_path = os.path.join(version_dir, "model.onnx")
            onnx.save_model(build(), model_path)
            written.append(model_path)
        config_path = os.path.join(os.fspath(out_dir), name, "config.pbtxt")
        with open(config_path, "w", encoding="utf-8") as f:
            f.write(config_text)
        written.append(config_path)
    return written


# name -> (builder, config.pbtxt text or None for "auto-complete from the ONNX file")
EXAMPLES: dict[str, tuple[Callable[[], onnx.ModelProto], str | None]] = {
    "mlp": (make_mlp, MLP_CONFIG_PBTXT),
    "cnn": (make_cnn, None),
    "two_input": (make_two_input, TWO_INPUT_CONFIG_PBTXT),
}


def write_example_repository(out_dir: str | os.PathLike[str], names: list[str] | None = None) -> list[str]:
    """Write the example models as `<out_dir>/<name>/1/model.onnx` (+ config.pbtxt). Returns the written paths.

    Existing files are overwritten; the output is deterministic, so rewriting is harmless.
    """
    wanted = list(EXAMPLES) if names is None else names
    unknown = sorted(set(wanted) - set(EXAMPLES))
    if unknown:
        raise ValueError(f"unknown example model(s) {unknown}; known: {sorted(EXAMPLES)}")
    written: list[str] = []
    for name in wanted:
        build, config_text = EXAMPLES[name]
        version_dir = os.path.join(os.fspath(out_dir), name, "1")
        os.makedirs(version_dir, exist_ok=True)
        model_path = os.path.join(version_dir, "model.onnx")
        onnx.save_model(build(), model_path)
        written.append(model_path)
        config_path = os.path.join(os.fspath(out_dir), name, "config.pbtxt")
        if config_text is not None:
            with open(config_path, "w", encoding="utf-8") as f:
                f.write(config_text)
            written.append(config_path)
    return written


PIPELINE = "pipeline"  # the name that stands for the ensemble and its steps (PIPELINE_EXAMPLES)


def default_example_repository(environ: Mapping[str, str] = os.environ) -> str:
    """Where gpud writes the example models it serves when given no repository (what ./scripts/run serves):
    $XDG_CACHE_HOME/gpud/example-models, by default ~/.cache/gpud/example-models."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gpud", "example-models")


def write_served_examples(out_dir: str | os.PathLike[str], names: list[str] | None = None) -> list[str]:
    """Write what gpud serves when given no repository: every example model and the pipeline (its ensemble and
    steps). `names`: only these (of EXAMPLES, and PIPELINE for the ensemble with its steps). Returns the paths."""
    wanted = [*EXAMPLES, PIPELINE] if names is None else names
    models = [n for n in wanted if n != PIPELINE]
    written = write_example_repository(out_dir, models) if models else []
    if PIPELINE in wanted:
        written += write_pipeline_example(out_dir)
    return written
