"""The two benchmark models, written into a Triton-layout repository with the same batching settings for everyone.

- `mlp`: gpud.examples.make_mlp(): FP32 "input" [-1, 256] -> "output" [-1, 16], 256 -> 1024 -> 1024 -> 16.
  Tiny: the serving stack, not the engine, is what is measured.
- `heavy`: same signature, compute-bound (about 1 ms of CPU per row on a 2-core machine, nearly flat from batch 8
  to 64): input [b, 256] -> MatMul [256, 16*256] -> Reshape [b*16, 256] -> HEAVY_LAYERS x (MatMul 256x256 + Add +
  Relu) -> Reshape [b, 4096] -> MatMul [4096, 16] -> "output" [b, 16]. Per row: 2*256*4096 + L*2*16*256*256 +
  2*4096*16 = 2.1M + L*2.1M + 0.13M FLOPs (L = 44: 94 MFLOP). Weights are 11 MiB and the activations 16 KiB a row,
  so per-row cost barely depends on the batch size (wider, shallower variants got slower per row at batch 64).
"""
from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from gpud.examples import IR_VERSION, OPSET_VERSION, make_mlp

MAX_BATCH_SIZE = 64
DELAY_US = 3000
HEAVY_LAYERS = 44
HEAVY_TOKENS = 16
HEAVY_WIDTH = 256

CONFIG_PBTXT = """\
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: {max_batch}
input [ {{ name: "input" data_type: TYPE_FP32 dims: [ 256 ] }} ]
output [ {{ name: "output" data_type: TYPE_FP32 dims: [ 16 ] }} ]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}
{parameters}"""


def make_heavy(layers: int = HEAVY_LAYERS, seed: int = 7) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    t, w = HEAVY_TOKENS, HEAVY_WIDTH

    def weight(name: str, shape: tuple[int, int]) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * np.sqrt(2.0 / shape[0])).astype(np.float32), name)

    inits = [
        weight("w_in", (256, t * w)),
        numpy_helper.from_array(np.array([-1, w], dtype=np.int64), "tok_shape"),
        numpy_helper.from_array(np.array([-1, t * w], dtype=np.int64), "row_shape"),
        weight("w_out", (t * w, 16)),
    ]
    nodes = [
        helper.make_node("MatMul", ["input", "w_in"], ["proj"]),
        helper.make_node("Reshape", ["proj", "tok_shape"], ["h0"]),
    ]
    for i in range(layers):
        inits += [weight(f"w{i}", (w, w)), numpy_helper.from_array(np.full(w, 0.01, np.float32), f"b{i}")]
        nodes += [
            helper.make_node("MatMul", [f"h{i}", f"w{i}"], [f"m{i}"]),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
            helper.make_node("Relu", [f"a{i}"], [f"h{i + 1}"]),
        ]
    nodes += [
        helper.make_node("Reshape", [f"h{layers}", "row_shape"], ["rows"]),
        helper.make_node("MatMul", ["rows", "w_out"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes, "heavy",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 256])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 16])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET_VERSION)],
                              producer_name="bench.serving.heavy")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


BUILDERS = {"mlp": make_mlp, "heavy": make_heavy}


def write_repository(root: str, intra_op_threads: int = 0, instances: int = 1) -> dict[str, str]:
    """Write <root>/<name>/1/model.onnx + config.pbtxt for both models; returns name -> model.onnx path."""
    params = ""
    if intra_op_threads > 0:
        params = ('parameters { key: "intra_op_thread_count" value: { string_value: "%d" } }\n' % intra_op_threads)
    paths = {}
    for name, build in BUILDERS.items():
        vdir = os.path.join(root, name, "1")
        os.makedirs(vdir, exist_ok=True)
        path = os.path.join(vdir, "model.onnx")
        onnx.save(build(), path)
        with open(os.path.join(root, name, "config.pbtxt"), "w") as f:
            f.write(CONFIG_PBTXT.format(name=name, max_batch=MAX_BATCH_SIZE, delay_us=DELAY_US, parameters=params,
                                        instances=instances))
        paths[name] = path
    return paths
