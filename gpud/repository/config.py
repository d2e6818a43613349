"""A model's config.pbtxt, read the way Triton reads it, as the executor's typed `ModelConfig`.

`config.pbtxt` is parsed with protobuf's text_format against Triton's model_config.proto, so a Triton repository
means the same thing here; the result is checked and turned into `gpud.executor.model_config.ModelConfig` plus the
`VersionPolicy` (which versions are served). Filling in what the model file says (inputs, outputs, batching) is
`gpud.repository.completion`'s job; `validate_model_config` then checks the complete configuration. Every problem is
a `ModelConfigError` that names the file at fault.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from google.protobuf import text_format

from gpud.executor.model_config import (VARIABLE_DIM, DynamicBatching, InstanceGroup, ModelConfig, QueuePolicy,
                                        TensorSpec)
from gpud.executor.datatypes import kserve_datatype
from gpud.executor.reshape import check_reshape
from gpud.repository.errors import ModelConfigError
from gpud.repository.options import read_options
from gpud.repository.sequence_config import sequence_batching_from_proto, validate_sequence_batching
from gpud.proto import model_config_pb2 as pb

DEFAULT_MODEL_FILENAME = "model.onnx"

ONNX_PLATFORM = "onnxruntime_onnx"
ONNX_BACKEND = "onnxruntime"
INSTANCE_KINDS = ("KIND_AUTO", "KIND_GPU", "KIND_CPU")  # KIND_MODEL needs a backend that places itself


# --------------------------------------------------------------------------------------------------------------------
# Version policy


@dataclass(frozen=True)
class VersionPolicy:
    """Triton's ModelVersionPolicy: which version directories are served.

    latest: the `num_versions` highest versions (Triton's default, with 1); all: every version;
    specific: the listed versions that exist (missing ones are skipped, as Triton does after logging them).
    """

    kind: str = "latest"  # "latest" | "all" | "specific"
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    def select(self, available: Iterable[int]) -> tuple[int, ...]:
        """The versions this policy serves out of `available`, ascending."""
        present = sorted(set(available))
        if self.kind == "all":
            return tuple(present)
        if self.kind == "specific":
            return tuple(v for v in present if v in self.versions)
        return tuple(present[-self.num_versions :]) if self.num_versions > 0 else ()

    def __str__(self) -> str:
        """The policy as config.pbtxt writes it, for messages."""
        if self.kind == "all":
            return "all { }"
        if self.kind == "specific":
            return f"specific {{ versions: {list(self.versions)} }}"
        return f"latest {{ num_versions: {self.num_versions} }}"


# --------------------------------------------------------------------------------------------------------------------
# config.pbtxt -> protobuf

_PARSE_LOCATION = re.compile(r"^\d+:\d+\s*:\s*(?:'[^\n]*?':\s*)?")
_UNKNOWN_FIELD = re.compile(r'Message type "([\w.]+)" has no field named "(\w+)"')


def parse_config_text(text: str, path: str | os.PathLike[str]) -> pb.ModelConfig:
    """Parse config.pbtxt text with Triton's exact text-format semantics. `path` is only used in errors."""
    message = pb.ModelConfig()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as e:
        problem = _PARSE_LOCATION.sub("", str(e)).rstrip(".")
        unknown = _UNKNOWN_FIELD.search(problem)
        if unknown:
            problem = f"unknown field '{unknown.group(2)}' in {unknown.group(1)}"
        raise ModelConfigError(path, problem, line=e.GetLine() or None) from None
    return message


def read_config_pbtxt(path: str | os.PathLike[str]) -> pb.ModelConfig:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ModelConfigError(path, f"not UTF-8 text: {e}") from None
    except OSError as e:
        raise ModelConfigError(path, f"cannot read: {e.strerror or e}") from None
    return parse_config_text(text, path)


# --------------------------------------------------------------------------------------------------------------------
# protobuf -> typed config (the checks that need only the config itself)


def _tensor_spec(io: pb.ModelInput | pb.ModelOutput, what: str, path: str) -> TensorSpec:
    if not io.name:
        raise ModelConfigError(path, f"{what} without a name")
    label = f"{what} '{io.name}'"
    if io.data_type == pb.TYPE_INVALID:
        raise ModelConfigError(path, f"{label} must specify data_type")
    type_name = pb.DataType.Name(io.data_type)
    try:
        datatype = kserve_datatype(type_name)
    except ValueError:
        raise ModelConfigError(path, f"{label}: data_type {type_name} is not supported by gpud") from None
    if io.is_shape_tensor:
        raise ModelConfigError(path, f"{label}: is_shape_tensor is only meaningful for TensorRT plans")
    if isinstance(io, pb.ModelInput) and io.allow_ragged_batch:
        raise ModelConfigError(path, f"{label}: allow_ragged_batch is not supported by gpud")
    if not io.dims:
        raise ModelConfigError(path, f"{label} must specify dims")
    for d in io.dims:
        if d < 1 and d != VARIABLE_DIM:
            raise ModelConfigError(
                path, f"{label}: dims {list(io.dims)}: each dimension must be >= 1, or -1 for a variable size"
            )
    reshape = None
    if io.HasField("reshape"):
        reshape = tuple(int(d) for d in io.reshape.shape)
        problem = check_reshape(io.dims, reshape)
        if problem:
            raise ModelConfigError(path, f"{label}: {problem}")
    optional = bool(io.optional) if isinstance(io, pb.ModelInput) else False
    return TensorSpec(name=io.name, datatype=datatype, dims=tuple(int(d) for d in io.dims), optional=optional,
                      reshape=reshape)


def tensor_specs(ios: Iterable[pb.ModelInput | pb.ModelOutput], what: str, path: str) -> tuple[TensorSpec, ...]:
    specs = tuple(_tensor_spec(io, what, path) for io in ios)
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ModelConfigError(path, f"{what} '{s.name}' is listed twice")
        seen.add(s.name)
    return specs


def _queue_policy(p: pb.ModelQueuePolicy) -> QueuePolicy:
    return QueuePolicy(
        max_queue_size=p.max_queue_size,
        default_timeout_us=p.default_timeout_microseconds,
        timeout_action=pb.ModelQueuePolicy.TimeoutAction.Name(p.timeout_action),
        allow_timeout_override=p.allow_timeout_override,
    )


def _dynamic_batching(db: pb.ModelDynamicBatching) -> DynamicBatching:
    return DynamicBatching(
        preferred_batch_sizes=tuple(db.preferred_batch_size),
        max_queue_delay_us=db.max_queue_delay_microseconds,
        preserve_ordering=db.preserve_ordering,
        priority_levels=db.priority_levels,
        default_priority_level=db.default_priority_level,
        default_queue_policy=_queue_policy(db.default_queue_policy),
        priority_queue_policy={int(level): _queue_policy(p) for level, p in db.priority_queue_policy.items()},
    )


def _instance_groups(groups: Iterable[pb.ModelInstanceGroup], model_name: str, path: str) -> tuple[InstanceGroup, ...]:
    out = []
    for i, g in enumerate(groups):
        kind = pb.ModelInstanceGroup.Kind.Name(g.kind)
        label = f"instance_group {g.name or i}"
        if kind not in INSTANCE_KINDS:
            raise ModelConfigError(path, f"{label}: kind {kind} is not supported; use one of {list(INSTANCE_KINDS)}")
        # Triton normalizes an unset (0) count to 1; only a negative count is an error.
        if g.count < 0:
            raise ModelConfigError(path, f"{label}: count {g.count} must be >= 1")
        if any(gpu < 0 for gpu in g.gpus):
            raise ModelConfigError(path, f"{label}: gpus {list(g.gpus)} must be device indices >= 0")
        if kind == "KIND_CPU" and g.gpus:
            raise ModelConfigError(path, f"{label}: KIND_CPU cannot list gpus {list(g.gpus)}")
        out.append(
            InstanceGroup(
                count=max(g.count, 1),
                kind=kind,
                gpus=tuple(g.gpus),
                name=g.name or f"{model_name}_{i}",  # Triton's name for an unnamed group
            )
        )
    # No instance_group: Triton adds one group named after the model, one instance, kind chosen at load time.
    return tuple(out) or (InstanceGroup(count=1, kind="KIND_AUTO", name=model_name),)


def version_policy_of(vp: pb.ModelVersionPolicy, path: str) -> VersionPolicy:
    choice = vp.WhichOneof("policy_choice")
    if choice == "all":
        return VersionPolicy(kind="all")
    if choice == "specific":
        versions = tuple(int(v) for v in vp.specific.versions)
        if not versions:
            raise ModelConfigError(path, "version_policy specific must list at least one version")
        if any(v < 0 for v in versions):
            raise ModelConfigError(path, f"version_policy specific versions {list(versions)} must be >= 0")
        return VersionPolicy(kind="specific", versions=versions)
    if choice == "latest":
        if vp.latest.num_versions < 1:
            raise ModelConfigError(path, "version_policy latest requires num_versions >= 1")
        return VersionPolicy(kind="latest", num_versions=vp.latest.num_versions)
    return VersionPolicy()


def config_from_proto(message: pb.ModelConfig, model_name: str, path: str) -> tuple[ModelConfig, VersionPolicy]:
    """Turn a parsed config.pbtxt into the executor's ModelConfig and the version policy (before auto-complete).

    `model_name` is the model directory's name; `path` the config file, named in errors.
    """
    if message.name and message.name != model_name:
        raise ModelConfigError(path, f"name '{message.name}' does not match the model directory '{model_name}'")
    platform, backend = message.platform, message.backend
    if platform and platform != ONNX_PLATFORM:
        raise ModelConfigError(path, f"platform '{platform}' is not supported; gpud serves '{ONNX_PLATFORM}' models")
    if backend and backend != ONNX_BACKEND:
        raise ModelConfigError(path, f"backend '{backend}' is not supported; gpud serves '{ONNX_BACKEND}' models")
    if message.max_batch_size < 0:
        raise ModelConfigError(path, f"max_batch_size {message.max_batch_size} must be >= 0")
    scheduling = message.WhichOneof("scheduling_choice")
    if scheduling == "ensemble_scheduling":
        raise ModelConfigError(path, f"{scheduling} is not supported by gpud")
    sequence_batching = None
    if scheduling == "sequence_batching":
        sequence_batching = sequence_batching_from_proto(message.sequence_batching, model_name,
                                                         os.path.dirname(path), path)
    if message.batch_input or message.batch_output:
        raise ModelConfigError(path, "batch_input / batch_output are not supported by gpud")
    if message.model_transaction_policy.decoupled:
        raise ModelConfigError(path, "decoupled models are not supported by gpud")
    accelerators = tuple(a.name for a in message.optimization.execution_accelerators.gpu_execution_accelerator)
    if any(not a for a in accelerators):
        raise ModelConfigError(path, "gpu_execution_accelerator without a name")
    instance_groups = _instance_groups(message.instance_group, model_name, path)
    parameters = {k: v.string_value for k, v in message.parameters.items()}
    config = ModelConfig(
        name=model_name,
        platform=ONNX_PLATFORM,
        backend=ONNX_BACKEND,
        max_batch_size=message.max_batch_size,
        inputs=tensor_specs(message.input, "input", path),
        outputs=tensor_specs(message.output, "output", path),
        instance_groups=instance_groups,
        dynamic_batching=_dynamic_batching(message.dynamic_batching) if scheduling == "dynamic_batching" else None,
        sequence_batching=sequence_batching,
        gpu_execution_accelerators=accelerators,
        parameters=parameters,
        options=read_options(parameters, instance_groups, path),
        default_model_filename=message.default_model_filename or DEFAULT_MODEL_FILENAME,
    )
    return config, version_policy_of(message.version_policy, path)


def validate_model_config(config: ModelConfig, path: str) -> None:
    """The checks Triton's ValidateModelConfig makes on a complete configuration. Raises ModelConfigError."""
    if not config.inputs:
        raise ModelConfigError(path, "the model has no inputs")
    if not config.outputs:
        raise ModelConfigError(path, "the model has no outputs")
    if config.sequence_batching is not None:
        validate_sequence_batching(config, path)
    if config.batches:
        for spec in config.inputs:
            if spec.optional:
                # As Triton's onnxruntime backend: an absent optional input cannot be batched with present ones.
                raise ModelConfigError(path, f"optional input '{spec.name}' is not supported when max_batch_size > 0")
    db = config.dynamic_batching
    if db is None:
        return
    for size in db.preferred_batch_sizes:
        if size <= 0:
            raise ModelConfigError(path, f"dynamic_batching preferred_batch_size {size} must be positive")
        if size > config.max_batch_size:
            raise ModelConfigError(
                path,
                f"dynamic_batching preferred_batch_size {size} must be <= max_batch_size {config.max_batch_size}",
            )
    if db.priority_levels == 0:
        if db.default_priority_level != 0 or db.priority_queue_policy:
            raise ModelConfigError(
                path, "dynamic_batching default_priority_level / priority_queue_policy need priority_levels > 0"
            )
        return
    if not 1 <= db.default_priority_level <= db.priority_levels:
        raise ModelConfigError(
            path,
            f"dynamic_batching default_priority_level {db.default_priority_level} must be in "
            f"[1, priority_levels={db.priority_levels}]",
        )
    for level in db.priority_queue_policy:
        if not 1 <= level <= db.priority_levels:
            raise ModelConfigError(
                path, f"dynamic_batching priority_queue_policy level {level} must be in [1, {db.priority_levels}]"
            )
