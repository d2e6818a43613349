"""Typed model configuration: what the executor needs to know to run and batch a model.

These are plain values. `gpud.repository` builds them from Triton's `config.pbtxt` (or from the ONNX file when
there is none); the front ends (`gpud.api`) turn them back into Triton's JSON/protobuf shapes for the /config
endpoints.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gpud.executor.sequence_config import SequenceBatching

# KServe v2 datatype -> (Triton TYPE_ enum name, numpy dtype or None for BYTES)
_DATATYPES: dict[str, tuple[str, object]] = {
    "BOOL": ("TYPE_BOOL", np.bool_),
    "UINT8": ("TYPE_UINT8", np.uint8),
    "UINT16": ("TYPE_UINT16", np.uint16),
    "UINT32": ("TYPE_UINT32", np.uint32),
    "UINT64": ("TYPE_UINT64", np.uint64),
    "INT8": ("TYPE_INT8", np.int8),
    "INT16": ("TYPE_INT16", np.int16),
    "INT32": ("TYPE_INT32", np.int32),
    "INT64": ("TYPE_INT64", np.int64),
    "FP16": ("TYPE_FP16", np.float16),
    "FP32": ("TYPE_FP32", np.float32),
    "FP64": ("TYPE_FP64", np.float64),
    "BYTES": ("TYPE_STRING", np.object_),
}
KSERVE_DATATYPES = frozenset(_DATATYPES)
_TRITON_TO_KSERVE = {triton: kserve for kserve, (triton, _) in _DATATYPES.items()}


def numpy_dtype(datatype: str) -> np.dtype:
    """numpy dtype for a KServe datatype ("FP32" -> float32). BYTES maps to object."""
    try:
        return np.dtype(_DATATYPES[datatype][1])
    except KeyError:
        raise ValueError(f"unknown datatype {datatype!r}; expected one of {sorted(KSERVE_DATATYPES)}") from None


def triton_type(datatype: str) -> str:
    """Triton config enum name for a KServe datatype ("FP32" -> "TYPE_FP32")."""
    try:
        return _DATATYPES[datatype][0]
    except KeyError:
        raise ValueError(f"unknown datatype {datatype!r}") from None


def kserve_datatype(triton_type_name: str) -> str:
    """KServe datatype for a Triton config enum name ("TYPE_FP32" -> "FP32")."""
    try:
        return _TRITON_TO_KSERVE[triton_type_name]
    except KeyError:
        raise ValueError(f"unknown data_type {triton_type_name!r}; expected one of {sorted(_TRITON_TO_KSERVE)}") from None


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output. `dims` exclude the batch dimension when the model batches; -1 = variable."""

    name: str
    datatype: str  # KServe name: "FP32", "INT64", "BYTES", ...
    dims: tuple[int, ...]
    optional: bool = False
    # Triton's reshape: the shape the model takes or gives (without the batch dimension) where it differs from
    # `dims`, which is what clients send and get (gpud.executor.reshape). None: the model's shape is `dims`.
    reshape: tuple[int, ...] | None = None

    @property
    def model_dims(self) -> tuple[int, ...]:
        """The shape on the model's side (without the batch dimension)."""
        return self.dims if self.reshape is None else self.reshape


@dataclass(frozen=True)
class QueuePolicy:
    """Triton's ModelQueuePolicy. max_queue_size 0 = unbounded; default_timeout_us 0 = no timeout."""

    max_queue_size: int = 0
    default_timeout_us: int = 0
    timeout_action: str = "REJECT"  # or "DELAY"
    allow_timeout_override: bool = False


@dataclass(frozen=True)
class DynamicBatching:
    """Triton's ModelDynamicBatching (the fields gpud honours)."""

    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    preserve_ordering: bool = False
    priority_levels: int = 0  # 0 = one level; else levels 1..priority_levels, 1 the highest
    default_priority_level: int = 0
    default_queue_policy: QueuePolicy = QueuePolicy()
    priority_queue_policy: dict[int, QueuePolicy] = field(default_factory=dict)

    def queue_policy(self, level: int) -> QueuePolicy:
        return self.priority_queue_policy.get(level, self.default_queue_policy)


@dataclass(frozen=True)
class InstanceGroup:
    """Triton's ModelInstanceGroup. kind: KIND_AUTO, KIND_GPU or KIND_CPU."""

    count: int = 1
    kind: str = "KIND_AUTO"
    gpus: tuple[int, ...] = ()
    name: str = ""


ENSEMBLE_PLATFORM = "ensemble"


@dataclass(frozen=True)
class EnsembleStep:
    """One step of Triton's ModelEnsembling: a served model, and which ensemble tensors feed its inputs and take its
    outputs (input_map / output_map: the model's tensor name -> the ensemble's)."""

    model_name: str
    model_version: int = -1  # -1: the newest version served
    input_map: tuple[tuple[str, str], ...] = ()  # (model input, ensemble tensor), in the config's order
    output_map: tuple[tuple[str, str], ...] = ()  # (model output, ensemble tensor)


@dataclass(frozen=True)
class EnsembleScheduling:
    """Triton's ensemble_scheduling: the steps of a pipeline whose data flow the ensemble scheduler follows."""

    steps: tuple[EnsembleStep, ...]
    max_inflight_requests: int = 0  # per step, across all of the ensemble's requests; 0 = no limit


@dataclass(frozen=True)
class ModelConfig:
    """A model's configuration, Triton's ModelConfig reduced to what gpud uses (plus pass-through parameters)."""

    name: str
    platform: str = "onnxruntime_onnx"
    backend: str = "onnxruntime"
    max_batch_size: int = 0  # 0 = the model does not batch: tensors carry their full shape
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    instance_groups: tuple[InstanceGroup, ...] = (InstanceGroup(),)
    dynamic_batching: DynamicBatching | None = None
    sequence_batching: SequenceBatching | None = None  # gpud.executor.sequence_config; set: a stateful (sequence) model
    # Triton's optimization.execution_accelerators.gpu_execution_accelerator names, e.g. ("tensorrt",)
    gpu_execution_accelerators: tuple[str, ...] = ()
    parameters: dict[str, str] = field(default_factory=dict)
    default_model_filename: str = "model.onnx"
    ensemble: EnsembleScheduling | None = None  # platform "ensemble": no model file, no instances; its steps run

    @property
    def batches(self) -> bool:
        return self.max_batch_size > 0

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)
