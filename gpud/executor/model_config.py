"""Typed model configuration: what the executor needs to know to run and batch a model.

These are plain values. `gpud.repository` builds them from Triton's `config.pbtxt` (or from the ONNX file when
there is none); the front ends (`gpud.api`) turn them back into Triton's JSON/protobuf shapes for the /config
endpoints.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from gpud.executor.sequence_config import SequenceBatching

VARIABLE_DIM = -1  # a dimension of any size (Triton's -1 in dims)

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


BatchingMode = Literal["adaptive", "triton"]
BATCHING_MODES: tuple[BatchingMode, ...] = ("adaptive", "triton")


# The config.pbtxt parameters ModelOptions reads (gpud.repository.options parses them; messages name them)
MIN_INSTANCES = "gpud_min_instances"
MAX_INSTANCES = "gpud_max_instances"
COMPUTE_FRACTION = "gpud_compute_fraction"
BATCHING = "gpud_batching"
CUDA_TF32 = "gpud_cuda_tf32"
LATENCY_OBJECTIVE_MS = "gpud_latency_objective_ms"
LATENCY_OBJECTIVE_SHARE = "gpud_latency_objective_share"
LATENCY_OBJECTIVE_SHED = "gpud_latency_objective_shed"
INTRA_OP_THREADS = "intra_op_thread_count"  # Triton's onnxruntime backend parameter


@dataclass(frozen=True)
class ModelOptions:
    """gpud's own config.pbtxt parameters (`gpud_*`) and the Triton parameters gpud interprets, parsed and checked
    once, when the configuration is read (gpud.repository.options): the rest of gpud reads these, never the
    strings in `ModelConfig.parameters`."""

    min_instances: int | None = None  # gpud_min_instances; None: the node's default, else the instance_group count
    max_instances: int | None = None  # gpud_max_instances; None: the node's default, else as many as fit
    compute_fraction: float = 0.0  # gpud_compute_fraction: a device's compute one instance uses; 0: not limited
    batching: BatchingMode = "adaptive"  # gpud_batching: "triton" is Triton's exact dynamic batcher
    cuda_tf32: bool = False  # gpud_cuda_tf32: FP32 MatMul and Conv may round to TF32 on the CUDA EP
    intra_op_threads: int | None = None  # intra_op_thread_count (Triton's onnxruntime backend); None: gpud's default
    # The latency objective (gpud.executor.objective): the share of requests whose server-side latency (queue +
    # compute) must stay within the milliseconds. None: the node's default (--latency-objective-ms / -share).
    latency_objective_ms: float | None = None
    latency_objective_share: float | None = None
    latency_objective_shed: bool = False  # answer UNAVAILABLE at once a request queued past the objective


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
    parameters: dict[str, str] = field(default_factory=dict)  # as config.pbtxt has them (the /config endpoints)
    options: ModelOptions = ModelOptions()  # what gpud reads of `parameters`, typed and checked
    default_model_filename: str = "model.onnx"
    ensemble: EnsembleScheduling | None = None  # platform "ensemble": no model file, no instances; its steps run

    @property
    def batches(self) -> bool:
        return self.max_batch_size > 0

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)


def execution_config(config: ModelConfig) -> ModelConfig:
    """The configuration the model runs with: a sequence model's control and state inputs added to its inputs and
    its state outputs to its outputs (where the client's config does not list them). Other models: unchanged."""
    sb = config.sequence_batching
    if sb is None:
        return config
    inputs = list(config.inputs)
    for c in sb.controls:
        inputs.append(TensorSpec(c.name, c.datatype, (1,)))
    outputs = list(config.outputs)
    for s in sb.states:
        inputs.append(TensorSpec(s.input_name, s.datatype, s.dims))
        if config.output(s.output_name) is None:
            outputs.append(TensorSpec(s.output_name, s.datatype, s.dims))
    return replace(config, inputs=tuple(inputs), outputs=tuple(outputs))
