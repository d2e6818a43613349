"""The model repository in Triton's layout, read the way Triton reads it.

    <repo>/<model>/config.pbtxt            optional: Triton's ModelConfig in protobuf text format
    <repo>/<model>/<version>/model.onnx    one directory per version (or config.default_model_filename)

`config.pbtxt` is parsed with protobuf's text_format against Triton's model_config.proto, so a Triton repository
means the same thing here. The configuration is then completed from the ONNX file as Triton's onnxruntime backend
does (inputs, outputs, max_batch_size, an empty dynamic_batching), validated, and turned into the executor's typed
`ModelConfig`. Every problem is a `ModelConfigError` that names the file at fault; a bad model never stops the
others from loading (`ModelRepository.scan`).
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import onnx
from google.protobuf import text_format
from google.protobuf.message import DecodeError

from executor.model_config import (
    DynamicBatching,
    InstanceGroup,
    ModelConfig,
    QueuePolicy,
    TensorSpec,
    kserve_datatype,
    triton_type,
)
from gpud.proto import model_config_pb2 as pb

CONFIG_FILENAME = "config.pbtxt"
DEFAULT_MODEL_FILENAME = "model.onnx"
# Triton's --backend-config=onnxruntime,default-max-batch-size (4 unless set): what an auto-completed model that
# can batch gets as max_batch_size.
DEFAULT_MAX_BATCH_SIZE = 4
WILDCARD_DIM = -1

ONNX_PLATFORM = "onnxruntime_onnx"
ONNX_BACKEND = "onnxruntime"
INSTANCE_KINDS = ("KIND_AUTO", "KIND_GPU", "KIND_CPU")  # KIND_MODEL needs a backend that places itself

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


class ModelConfigError(ValueError):
    """A model that cannot be served as configured. The message starts with the file at fault.

    `path` is that file (config.pbtxt, the ONNX file, or the model/version directory), `line` the 1-based line in
    config.pbtxt when the parser knows it, `problem` the message without the location.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str, *, line: int | None = None):
        self.path = os.fspath(path)
        self.problem = problem
        self.line = line
        where = f"{self.path}: line {line}" if line is not None else self.path
        super().__init__(f"{where}: {problem}")


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
# Scanning


def list_model_dirs(repo_path: str | os.PathLike[str]) -> list[str]:
    """Names of the model directories in a repository, sorted. Hidden directories (.git, ...) are not models."""
    with os.scandir(repo_path) as it:
        return sorted(e.name for e in it if e.is_dir() and not e.name.startswith("."))


def available_versions(model_dir: str | os.PathLike[str]) -> tuple[int, ...]:
    """Version numbers present under a model directory, ascending.

    As Triton: a version is a subdirectory whose name is a non-negative integer; names with a leading zero ("01")
    and non-numeric names are ignored.
    """
    versions = []
    with os.scandir(model_dir) as it:
        for e in it:
            if e.is_dir() and e.name.isdigit() and (e.name == "0" or not e.name.startswith("0")):
                versions.append(int(e.name))
    return tuple(sorted(versions))


def resolve_model_file(version_dir: str, filename: str) -> str:
    """The ONNX file of a version. Triton also accepts `model.onnx` as a directory (ONNX with external data)."""
    path = os.path.join(version_dir, filename)
    if os.path.isdir(path):
        inner = os.path.join(path, DEFAULT_MODEL_FILENAME)
        return inner if os.path.isfile(inner) else path
    return path


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
    if io.HasField("reshape"):
        # The executor feeds tensors with the shape the client sent; a reshape would need support there.
        raise ModelConfigError(path, f"{label}: reshape is not supported by gpud")
    if io.is_shape_tensor:
        raise ModelConfigError(path, f"{label}: is_shape_tensor is only meaningful for TensorRT plans")
    if isinstance(io, pb.ModelInput) and io.allow_ragged_batch:
        raise ModelConfigError(path, f"{label}: allow_ragged_batch is not supported by gpud")
    if not io.dims:
        raise ModelConfigError(path, f"{label} must specify dims")
    for d in io.dims:
        if d < 1 and d != WILDCARD_DIM:
            raise ModelConfigError(
                path, f"{label}: dims {list(io.dims)}: each dimension must be >= 1, or -1 for a variable size"
            )
    optional = bool(io.optional) if isinstance(io, pb.ModelInput) else False
    return TensorSpec(name=io.name, datatype=datatype, dims=tuple(int(d) for d in io.dims), optional=optional)


def _tensor_specs(ios: Iterable[pb.ModelInput | pb.ModelOutput], what: str, path: str) -> tuple[TensorSpec, ...]:
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


def _version_policy(vp: pb.ModelVersionPolicy, path: str) -> VersionPolicy:
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
    if scheduling in ("sequence_batching", "ensemble_scheduling"):
        raise ModelConfigError(path, f"{scheduling} is not supported by gpud")
    if message.batch_input or message.batch_output:
        raise ModelConfigError(path, "batch_input / batch_output are not supported by gpud")
    if message.model_transaction_policy.decoupled:
        raise ModelConfigError(path, "decoupled models are not supported by gpud")
    accelerators = tuple(a.name for a in message.optimization.execution_accelerators.gpu_execution_accelerator)
    if any(not a for a in accelerators):
        raise ModelConfigError(path, "gpu_execution_accelerator without a name")
    config = ModelConfig(
        name=model_name,
        platform=ONNX_PLATFORM,
        backend=ONNX_BACKEND,
        max_batch_size=message.max_batch_size,
        inputs=_tensor_specs(message.input, "input", path),
        outputs=_tensor_specs(message.output, "output", path),
        instance_groups=_instance_groups(message.instance_group, model_name, path),
        dynamic_batching=_dynamic_batching(message.dynamic_batching) if scheduling == "dynamic_batching" else None,
        gpu_execution_accelerators=accelerators,
        parameters={k: v.string_value for k, v in message.parameters.items()},
        default_model_filename=message.default_model_filename or DEFAULT_MODEL_FILENAME,
    )
    return config, _version_policy(message.version_policy, path)


def validate_model_config(config: ModelConfig, path: str) -> None:
    """The checks Triton's ValidateModelConfig makes on a complete configuration. Raises ModelConfigError."""
    if not config.inputs:
        raise ModelConfigError(path, "the model has no inputs")
    if not config.outputs:
        raise ModelConfigError(path, "the model has no outputs")
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


# --------------------------------------------------------------------------------------------------------------------
# ONNX signature and auto-complete


@dataclass(frozen=True)
class OnnxTensor:
    """An ONNX graph input or output as onnxruntime reports it: symbolic or unknown dimensions are -1."""

    name: str
    datatype: str  # KServe
    shape: tuple[int, ...]

    @property
    def batch_capable(self) -> bool:
        return len(self.shape) > 0 and self.shape[0] == WILDCARD_DIM


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
    shape = tuple(d.dim_value if d.HasField("dim_value") else WILDCARD_DIM for d in tt.shape.dim)
    return OnnxTensor(name=vi.name, datatype=datatype, shape=shape)


def onnx_signature(model: onnx.ModelProto, path: str | os.PathLike[str]) -> OnnxSignature:
    """Inputs and outputs of an ONNX model. Initializers listed as graph inputs are weights, not inputs."""
    path = os.fspath(path)
    weights = {t.name for t in model.graph.initializer} | {t.values.name for t in model.graph.sparse_initializer}
    inputs = tuple(_onnx_tensor(vi, "input", path) for vi in model.graph.input if vi.name not in weights)
    outputs = tuple(_onnx_tensor(vi, "output", path) for vi in model.graph.output)
    return OnnxSignature(inputs=inputs, outputs=outputs)


def _from_onnx(t: OnnxTensor, batches: bool) -> TensorSpec:
    # A batching model's dims leave out the batch dimension, as Triton's auto-complete writes them.
    return TensorSpec(name=t.name, datatype=t.datatype, dims=t.shape[1:] if batches else t.shape)


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
    if len(t.shape) == 0:
        # A scalar tensor of a model that does not batch: Triton wants dims of all 1s for it.
        if any(d != 1 for d in spec.dims):
            raise ModelConfigError(config_path, f"{label}: {model_path} has a scalar; dims must be [1]")
        return
    compatible = len(shape) == len(spec.dims) and all(
        m == WILDCARD_DIM or c == WILDCARD_DIM or m == c for m, c in zip(shape, spec.dims)
    )
    if not compatible:
        batch_note = " (without the batch dimension)" if max_batch_size > 0 else ""
        raise ModelConfigError(
            config_path,
            f"{label}: dims {list(spec.dims)} do not match {list(shape)}{batch_note} in {model_path}",
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
    if not (config.inputs and config.outputs):
        if signature.can_batch:
            if config.max_batch_size == 0:
                config = replace(config, max_batch_size=max(default_max_batch_size, 0))
            if config.max_batch_size > 1 and config.dynamic_batching is None:
                config = replace(config, dynamic_batching=DynamicBatching())
        elif config.max_batch_size != 0:
            fixed = next(t for t in signature.inputs + signature.outputs if not t.batch_capable)
            raise ModelConfigError(
                config_path,
                f"max_batch_size {config.max_batch_size} > 0 but {model_path} cannot batch: tensor '{fixed.name}' "
                f"has shape {list(fixed.shape)}, not a variable first dimension",
            )
        if not config.inputs:
            config = replace(config, inputs=tuple(_from_onnx(t, config.batches) for t in signature.inputs))
        if not config.outputs:
            config = replace(config, outputs=tuple(_from_onnx(t, config.batches) for t in signature.outputs))

    input_names = [t.name for t in signature.inputs]
    for spec in config.inputs:
        _check_against_onnx(
            spec, signature.input(spec.name), "input", input_names, config.max_batch_size, config_path, model_path
        )
    missing = [n for n in input_names if config.input(n) is None]
    if missing:
        raise ModelConfigError(config_path, f"inputs {missing} of {model_path} are not in the config's inputs")
    output_names = [t.name for t in signature.outputs]
    for spec in config.outputs:  # a subset of the outputs is fine: Triton computes only those
        _check_against_onnx(
            spec, signature.output(spec.name), "output", output_names, config.max_batch_size, config_path, model_path
        )
    return config


# --------------------------------------------------------------------------------------------------------------------
# Loading one model


@dataclass(frozen=True)
class ModelEntry:
    """A model that can be served: its complete config and the file of each version the policy selects."""

    name: str
    path: str  # the model directory
    versions: tuple[int, ...]  # ascending
    model_paths: dict[int, str]  # version -> ONNX file
    config: ModelConfig
    version_policy: VersionPolicy = VersionPolicy()
    config_path: str | None = None  # None: no config.pbtxt, everything came from the ONNX file

    @property
    def latest_version(self) -> int:
        return self.versions[-1]

    def model_path(self, version: int | None = None) -> str:
        """The ONNX file of `version` (None = the latest served). KeyError for a version that is not served."""
        return self.model_paths[self.latest_version if version is None else version]


@dataclass(frozen=True)
class ModelLoadError:
    """A model directory that could not be loaded, and why (for the repository index and logs)."""

    name: str
    path: str
    reason: str  # the ModelConfigError message: starts with the file at fault
    error: ModelConfigError | None = field(default=None, compare=False, repr=False)


def load_model(
    model_dir: str | os.PathLike[str], *, default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
) -> ModelEntry:
    """Read one model directory: config.pbtxt (optional), version directories, auto-complete from the ONNX file.

    The config is completed from the newest served version's ONNX file; every served version's file must exist.
    """
    model_dir = os.fspath(model_dir)
    name = os.path.basename(os.path.normpath(model_dir))
    if not os.path.isdir(model_dir):
        raise ModelConfigError(model_dir, "model directory not found")
    config_path = os.path.join(model_dir, CONFIG_FILENAME)
    has_config = os.path.isfile(config_path)
    message = read_config_pbtxt(config_path) if has_config else pb.ModelConfig()
    # Problems without a config file are the model directory's: there is no file to blame but the ONNX one.
    blame = config_path if has_config else model_dir
    config, policy = config_from_proto(message, name, blame)

    present = available_versions(model_dir)
    if not present:
        raise ModelConfigError(model_dir, f"no version directory (expected e.g. 1/{config.default_model_filename})")
    versions = policy.select(present)
    if not versions:
        raise ModelConfigError(
            blame, f"version_policy {{ {policy} }} selects none of the versions present {list(present)}"
        )
    model_paths = {}
    for v in versions:
        version_dir = os.path.join(model_dir, str(v))
        path = resolve_model_file(version_dir, config.default_model_filename)
        if not os.path.isfile(path):
            raise ModelConfigError(version_dir, f"no model file '{config.default_model_filename}'")
        model_paths[v] = path

    newest = model_paths[versions[-1]]
    signature = onnx_signature(load_onnx(newest), newest)
    config = complete_config(
        config, signature, default_max_batch_size=default_max_batch_size, config_path=blame, model_path=newest
    )
    validate_model_config(config, blame)
    return ModelEntry(
        name=name,
        path=model_dir,
        versions=versions,
        model_paths=model_paths,
        config=config,
        version_policy=policy,
        config_path=config_path if has_config else None,
    )


def load_model_config(
    model_dir: str | os.PathLike[str], *, default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
) -> ModelConfig:
    """The complete, validated config of one model directory (see `load_model`)."""
    return load_model(model_dir, default_max_batch_size=default_max_batch_size).config


class ModelRepository:
    """A Triton-layout model repository on disk. Reads it on every `scan()`; holds no other state."""

    def __init__(self, path: str | os.PathLike[str], *, default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE):
        self.path = os.fspath(path)
        self.default_max_batch_size = default_max_batch_size

    def model_names(self) -> list[str]:
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"model repository {self.path} is not a directory")
        return list_model_dirs(self.path)

    def load(self, name: str) -> ModelEntry:
        """One model by name. Raises ModelConfigError (also for a name that is not in the repository)."""
        if not name or os.sep in name or name.startswith("."):
            raise ModelConfigError(os.path.join(self.path, name), "not a model name")
        return load_model(os.path.join(self.path, name), default_max_batch_size=self.default_max_batch_size)

    def scan(self) -> dict[str, ModelEntry | ModelLoadError]:
        """Every model directory, loaded or with the reason it could not be. One bad model never stops the rest."""
        result: dict[str, ModelEntry | ModelLoadError] = {}
        for name in self.model_names():
            model_dir = os.path.join(self.path, name)
            try:
                result[name] = self.load(name)
            except ModelConfigError as e:
                result[name] = ModelLoadError(name=name, path=model_dir, reason=str(e), error=e)
            except OSError as e:  # a directory that vanished or cannot be read while scanning
                err = ModelConfigError(e.filename or model_dir, f"cannot read: {e.strerror or e}")
                result[name] = ModelLoadError(name=name, path=model_dir, reason=str(err), error=err)
        return result


# --------------------------------------------------------------------------------------------------------------------
# Memory estimate


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
