"""Completing a model's configuration from its ONNX file, as Triton's onnxruntime backend does.

The ONNX graph's inputs and outputs (`onnx_signature`) fill in what config.pbtxt leaves out: inputs, outputs,
max_batch_size and an empty dynamic_batching (`complete_config`); the tensors the config does list are checked
against the graph. A file that is not ONNX is a `ModelConfigError` naming it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import onnx
from google.protobuf.message import DecodeError

from gpud.executor.model_config import VARIABLE_DIM, DynamicBatching, ModelConfig, TensorSpec
from gpud.executor.datatypes import triton_type

from gpud.repository.errors import ModelConfigError
from gpud.repository.sequence_config import check_sequence_tensors, sequence_tensor_names

# Triton's --backend-config=onnxruntime,default-max-batch-size (4 unless set): what an auto-completed model that
# can batch gets as max_batch_size.
DEFAULT_MAX_BATCH_SIZE = 4


# ONNX TensorProto element type -> KServe datatype. BFLOAT16 and the float8 types have no executor dtype.
_ONNX_TO_KSERVE: dict[int, str] = {
    onnx.TensorProto.BOOL: "BOOL",
    onnx.TensorProto.UINT8: "UINT8",
    onnx.TensorProto.UINT16: "UINT16",
    onnx.TensorProto.UINT32: "UINT32",
    onnx.TensorProto.UINT64: "UINT64",
    onnx.TensorProto.INT8: "INT8",
    onnx.TensorProto.INT16: "INT16",
    onnx.TensorProto.INT32: "INT32",
    onnx.TensorProto.INT64: "INT64",
    onnx.TensorProto.FLOAT16: "FP16",
    onnx.TensorProto.FLOAT: "FP32",
    onnx.TensorProto.DOUBLE: "FP64",
    onnx.TensorProto.STRING: "BYTES",
}


@dataclass(frozen=True)
class OnnxTensor:
    """An ONNX graph input or output as onnxruntime reports it: symbolic or unknown dimensions are -1."""

    name: str
    datatype: str  # KServe
    shape: tuple[int, ...]

    @property
    def batch_capable(self) -> bool:
        return len(self.shape) > 0 and self.shape[0] == VARIABLE_DIM


@dataclass(frozen=True)
class OnnxSignature:
    inputs: tuple[OnnxTensor, ...]
    outputs: tuple[OnnxTensor, ...]

    @property
    def can_batch(self) -> bool:
        """Triton's test: every input and output has a variable first dimension."""
        return all(t.batch_capable for t in self.inputs + self.outputs)

    def input(self, name: str) -> OnnxTensor | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> OnnxTensor | None:
        return next((t for t in self.outputs if t.name == name), None)


def load_onnx(model_path: str | os.PathLike[str]) -> onnx.ModelProto:
    """The ONNX graph without external weight files. A corrupt file is a ModelConfigError naming it."""
    if not os.path.isfile(model_path):
        raise ModelConfigError(model_path, "model file not found")
    if os.path.getsize(model_path) == 0:
        raise ModelConfigError(model_path, "not a valid ONNX file: the file is empty")
    try:
        model = onnx.load(os.fspath(model_path), load_external_data=False)
    except DecodeError as e:
        raise ModelConfigError(model_path, f"not a valid ONNX file: {e}") from None
    except Exception as e:  # noqa: BLE001 - arbitrary bytes must give a model error, never take the daemon down
        raise ModelConfigError(model_path, f"not a valid ONNX file: {type(e).__name__}: {e}") from None
    # Protobuf decodes many byte strings without complaint; a real model has an IR version and a graph with outputs.
    if model.ir_version <= 0 or not model.graph.output:
        raise ModelConfigError(model_path, "not a valid ONNX file: no IR version or no graph outputs")
    return model


def _onnx_tensor(vi: onnx.ValueInfoProto, what: str, path: str) -> OnnxTensor:
    if vi.type.WhichOneof("value") != "tensor_type":
        raise ModelConfigError(path, f"{what} '{vi.name}' is not a tensor; gpud serves tensor inputs and outputs")
    tt = vi.type.tensor_type
    datatype = _ONNX_TO_KSERVE.get(tt.elem_type)
    if datatype is None:
        type_name = onnx.TensorProto.DataType.Name(tt.elem_type)
        raise ModelConfigError(path, f"{what} '{vi.name}' has element type {type_name}, which gpud does not support")
    if not tt.HasField("shape"):
        raise ModelConfigError(path, f"{what} '{vi.name}' has no shape (not even a rank); gpud needs the rank")
    shape = tuple(d.dim_value if d.HasField("dim_value") else VARIABLE_DIM for d in tt.shape.dim)
    return OnnxTensor(name=vi.name, datatype=datatype, shape=shape)


def onnx_signature(model: onnx.ModelProto, path: str | os.PathLike[str]) -> OnnxSignature:
    """Inputs and outputs of an ONNX model. Initializers listed as graph inputs are weights, not inputs."""
    path = os.fspath(path)
    weights = {t.name for t in model.graph.initializer} | {t.values.name for t in model.graph.sparse_initializer}
    inputs = tuple(_onnx_tensor(vi, "input", path) for vi in model.graph.input if vi.name not in weights)
    outputs = tuple(_onnx_tensor(vi, "output", path) for vi in model.graph.output)
    return OnnxSignature(inputs=inputs, outputs=outputs)


def _from_onnx(t: OnnxTensor, batches: bool) -> TensorSpec:
    # A batching model's dims leave out the batch dimension, as Triton's auto-complete writes them; a scalar (per
    # batch item) becomes dims [1] with an empty reshape, as there too: clients send [batch, 1] (or [1]).
    dims = t.shape[1:] if batches else t.shape
    if not dims:
        return TensorSpec(name=t.name, datatype=t.datatype, dims=(1,), reshape=())
    return TensorSpec(name=t.name, datatype=t.datatype, dims=dims)


def _check_against_onnx(
    spec: TensorSpec, t: OnnxTensor | None, what: str, sig_names: list[str], max_batch_size: int,
    config_path: str, model_path: str,
) -> None:
    label = f"{what} '{spec.name}'"
    if t is None:
        raise ModelConfigError(config_path, f"{label} is not an {what} of {model_path} (it has {sig_names})")
    if spec.datatype != t.datatype:
        raise ModelConfigError(
            config_path,
            f"{label}: data_type {triton_type(spec.datatype)} does not match {triton_type(t.datatype)} "
            f"in {model_path}",
        )
    shape = t.shape
    if max_batch_size > 0:
        if not t.batch_capable:
            raise ModelConfigError(
                config_path,
                f"{label}: max_batch_size {max_batch_size} > 0 but the first dimension of {list(shape)} in "
                f"{model_path} is not a variable batch dimension",
            )
        shape = shape[1:]
    dims = spec.model_dims  # a reshape is what the model has
    if len(shape) == 0 and spec.reshape is None:
        # A scalar tensor of a model that does not batch, without a reshape: Triton wants dims of all 1s for it.
        if any(d != 1 for d in dims):
            raise ModelConfigError(config_path, f"{label}: {model_path} has a scalar; dims must be [1]")
        return
    compatible = len(shape) == len(dims) and all(
        m == VARIABLE_DIM or c == VARIABLE_DIM or m == c for m, c in zip(shape, dims)
    )
    if not compatible:
        batch_note = " (without the batch dimension)" if max_batch_size > 0 else ""
        what_dims = "dims" if spec.reshape is None else "reshape"
        raise ModelConfigError(
            config_path,
            f"{label}: {what_dims} {list(dims)} do not match {list(shape)}{batch_note} in {model_path}",
        )


def complete_config(
    config: ModelConfig, signature: OnnxSignature, *, default_max_batch_size: int, config_path: str, model_path: str
) -> ModelConfig:
    """Triton's onnxruntime auto-complete, then a check of the configured tensors against the ONNX file.

    When the config lists both inputs and outputs, Triton does not auto-complete at all. Otherwise: a model whose
    every input and output has a variable first dimension can batch; if max_batch_size is 0 it becomes
    `default_max_batch_size`, and a model with max_batch_size > 1 and no scheduler gets an empty dynamic_batching.
    Missing inputs/outputs are filled in from the ONNX file.
    """
    # A sequence model's control and state inputs (and unlisted state outputs) are gpud's to fill in and read:
    # they are never the client's, so auto-complete leaves them out (Triton's would list them).
    hidden_inputs, hidden_outputs = sequence_tensor_names(config)
    if not (config.inputs and config.outputs):
        if signature.can_batch:
            if config.max_batch_size == 0:
                config = replace(config, max_batch_size=max(default_max_batch_size, 0))
            if config.max_batch_size > 1 and config.dynamic_batching is None and config.sequence_batching is None:
                config = replace(config, dynamic_batching=DynamicBatching())
        elif config.max_batch_size != 0:
            fixed = next(t for t in signature.inputs + signature.outputs if not t.batch_capable)
            raise ModelConfigError(
                config_path,
                f"max_batch_size {config.max_batch_size} > 0 but {model_path} cannot batch: tensor '{fixed.name}' "
                f"has shape {list(fixed.shape)}, not a variable first dimension",
            )
        if not config.inputs:
            config = replace(config, inputs=tuple(_from_onnx(t, config.batches) for t in signature.inputs
                                                  if t.name not in hidden_inputs))
        if not config.outputs:
            config = replace(config, outputs=tuple(_from_onnx(t, config.batches) for t in signature.outputs
                                                   if t.name not in hidden_outputs))
            hidden_inputs, hidden_outputs = sequence_tensor_names(config)

    input_names = [t.name for t in signature.inputs]
    for spec in config.inputs:
        _check_against_onnx(
            spec, signature.input(spec.name), "input", input_names, config.max_batch_size, config_path, model_path
        )
    check_sequence_tensors(config, {t.name: (t.datatype, t.shape) for t in signature.inputs},
                           {t.name: (t.datatype, t.shape) for t in signature.outputs}, config_path, model_path)
    missing = [n for n in input_names if config.input(n) is None and n not in hidden_inputs]
    if missing:
        raise ModelConfigError(config_path, f"inputs {missing} of {model_path} are not in the config's inputs")
    output_names = [t.name for t in signature.outputs]
    for spec in config.outputs:  # a subset of the outputs is fine: Triton computes only those
        _check_against_onnx(
            spec, signature.output(spec.name), "output", output_names, config.max_batch_size, config_path, model_path
        )
    return config
