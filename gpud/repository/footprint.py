"""How much memory one instance of a model needs, estimated from its ONNX file when it cannot be measured yet.

Placement needs a figure before the first instance loads; once an instance runs, its measured footprint replaces
the estimate.
"""
from __future__ import annotations

import math
import os

import onnx

from gpud.executor.model_config import ModelConfig
from gpud.repository.completion import load_onnx


def _itemsize(elem_type: int) -> int:
    if elem_type == onnx.TensorProto.STRING:
        return 8  # a pointer per element; the strings themselves are unknowable ahead of time
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize
    except (KeyError, TypeError, ValueError):
        return 4


def _tensor_proto_bytes(t: onnx.TensorProto) -> int:
    if t.data_type == onnx.TensorProto.STRING:
        return sum(len(s) for s in t.string_data)
    return math.prod(t.dims) * _itemsize(t.data_type)


def initializer_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the weights: initializers (inline or external, from their dims) and Constant node values."""
    total = sum(_tensor_proto_bytes(t) for t in model.graph.initializer)
    total += sum(_tensor_proto_bytes(s.values) + _tensor_proto_bytes(s.indices) for s in model.graph.sparse_initializer)
    for node in model.graph.node:
        if node.op_type == "Constant":
            total += sum(_tensor_proto_bytes(a.t) for a in node.attribute if a.type == onnx.AttributeProto.TENSOR)
    return total


def estimate_footprint_bytes(model_path: str | os.PathLike[str], config: ModelConfig) -> int:
    """Memory one instance of the model needs, estimated from the ONNX file when it cannot be measured.

        footprint_bytes = weight_bytes + Σ_tensors itemsize × Π dims

    weight_bytes: initializers and Constant values. The sum runs over every graph input, output and intermediate
    tensor after ONNX shape inference, with the batch dimension (the symbols of the inputs' first dimensions) set to
    max(1, max_batch_size) and any other unknown dimension set to 1. Counting every intermediate as live at once
    over-estimates (runtimes reuse buffers), which is the safe side for placement; unknown non-batch dimensions
    (e.g. sequence lengths) under-estimate. Top-level graph only (subgraphs of If/Loop are not counted).
    """
    path = os.fspath(model_path)
    model = load_onnx(path)
    weights = initializer_bytes(model)
    weight_names = {t.name for t in model.graph.initializer}
    batch = max(1, config.max_batch_size)
    batch_symbols = {
        vi.type.tensor_type.shape.dim[0].dim_param
        for vi in model.graph.input
        if vi.name not in weight_names and vi.type.tensor_type.shape.dim
    } - {""}
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - an estimate must not fail because inference cannot handle some op
        inferred = model
    graph = inferred.graph
    tensors: dict[str, onnx.ValueInfoProto] = {}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        if vi.name not in weight_names and vi.type.WhichOneof("value") == "tensor_type":
            tensors[vi.name] = vi
    activation_bytes = 0
    for vi in tensors.values():
        tt = vi.type.tensor_type
        elements = 1
        for i, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value"):
                elements *= d.dim_value
            elif d.dim_param in batch_symbols or (i == 0 and config.batches):
                elements *= batch
        activation_bytes += elements * _itemsize(tt.elem_type)
    return weights + activation_bytes
