"""Ensemble models (Triton's `platform: "ensemble"` with `ensemble_scheduling`), read and checked the way Triton
checks them. Pure: no registry, no I/O beyond what `gpud.repository.layout` hands in.

Two checks, as in Triton:
- `ensemble_config_from_proto` (when the repository is read; Triton's ValidateEnsembleSchedulingConfig): the
  config alone. Steps name a model and map at least one input and one output; no ensemble tensor is produced
  twice; every ensemble input is read by a step; every ensemble output is produced by a step; every tensor a step
  reads exists; every intermediate tensor is read; the steps form no cycle. No instance_group, optimization or
  model_warmup: an ensemble has no instances of its own (its steps' models have theirs).
- `check_against_steps` (once the steps' models are served; Triton's ValidateEnsembleConfig): each step maps only
  inputs and outputs its model has and every required input; no step model batches less than the ensemble; every
  ensemble tensor has one data type and one shape wherever it is read or written (a -1 matches any size; a tensor
  shared by a batching and a non-batching model compares with the batch dimension written out).
Every problem names the step (its index, as in the config, and its model) and the tensor.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpud.executor.model_config import (ENSEMBLE_PLATFORM, EnsembleScheduling, EnsembleStep, ModelConfig, TensorSpec)
from gpud.proto import model_config_pb2 as pb
from gpud.repository.config import VersionPolicy, tensor_specs, version_policy_of
from gpud.repository.errors import ModelConfigError
from gpud.repository.options import read_options


def is_ensemble(message: pb.ModelConfig) -> bool:
    """Whether a parsed config.pbtxt describes an ensemble (its platform, or ensemble_scheduling set)."""
    return message.platform == ENSEMBLE_PLATFORM or message.WhichOneof("scheduling_choice") == "ensemble_scheduling"


def step_label(index: int, model: str) -> str:
    return f"step {index} (model '{model}')"


def ensemble_config_from_proto(message: pb.ModelConfig, model_name: str,
                               path: str) -> tuple[ModelConfig, VersionPolicy]:
    """An ensemble's config.pbtxt as the executor's ModelConfig (platform "ensemble", no instance groups, its steps
    in `ensemble`) and its version policy. ModelConfigError names the file and the problem."""
    if message.name and message.name != model_name:
        raise ModelConfigError(path, f"name '{message.name}' does not match the model directory '{model_name}'")
    if message.platform != ENSEMBLE_PLATFORM:
        raise ModelConfigError(path, f"ensemble_scheduling cannot be set for model '{model_name}' whose platform is "
                                     f"not '{ENSEMBLE_PLATFORM}'")
    if message.WhichOneof("scheduling_choice") != "ensemble_scheduling":
        raise ModelConfigError(path, f"ensemble_scheduling must be set for ensemble '{model_name}' (platform "
                                     f"'{ENSEMBLE_PLATFORM}')")
    if message.backend:
        raise ModelConfigError(path, f"ensemble '{model_name}' must have platform '{ENSEMBLE_PLATFORM}' and no "
                                     f"backend (got backend '{message.backend}')")
    if message.instance_group:
        raise ModelConfigError(path, f"instance_group should not be specified for ensemble '{model_name}': its "
                                     "steps' models are placed and scaled with their own instance groups")
    if message.HasField("optimization"):
        raise ModelConfigError(path, f"optimization should not be specified for ensemble '{model_name}'")
    if message.model_warmup:
        raise ModelConfigError(path, f"model_warmup can not be specified for ensemble '{model_name}'")
    if message.batch_input or message.batch_output:
        raise ModelConfigError(path, "batch_input / batch_output are not supported by gpud")
    if message.model_transaction_policy.decoupled:
        raise ModelConfigError(path, "decoupled models are not supported by gpud")
    if message.max_batch_size < 0:
        raise ModelConfigError(path, f"max_batch_size {message.max_batch_size} must be >= 0")
    inputs = tensor_specs(message.input, "input", path)
    outputs = tensor_specs(message.output, "output", path)
    reshaped = [t.name for t in (*inputs, *outputs) if t.reshape is not None]
    if reshaped:
        raise ModelConfigError(path, f"ensemble '{model_name}', tensor '{reshaped[0]}': reshape on an ensemble's "
                                     "tensors is not supported by gpud (its steps' models may reshape)")
    # Triton completes no ensemble config from a model file (there is none): the config declares its tensors.
    if not inputs:
        raise ModelConfigError(path, f"ensemble '{model_name}' must declare its inputs")
    if not outputs:
        raise ModelConfigError(path, f"ensemble '{model_name}' must declare its outputs")
    steps = tuple(_step(i, s, model_name, path) for i, s in enumerate(message.ensemble_scheduling.step))
    if not steps:
        raise ModelConfigError(path, f"must specify 'step' for ensemble '{model_name}'")
    try:
        check_data_flow(model_name, inputs, outputs, steps)
    except ValueError as exc:
        raise ModelConfigError(path, str(exc)) from None
    parameters = {k: v.string_value for k, v in message.parameters.items()}
    config = ModelConfig(name=model_name, platform=ENSEMBLE_PLATFORM, backend="", max_batch_size=message.max_batch_size,
                         inputs=inputs, outputs=outputs, instance_groups=(), parameters=parameters,
                         options=read_options(parameters, (), path),
                         default_model_filename="",
                         ensemble=EnsembleScheduling(steps, message.ensemble_scheduling.max_inflight_requests))
    return config, version_policy_of(message.version_policy, path)


def _step(index: int, s: pb.ModelEnsembling.Step, ensemble: str, path: str) -> EnsembleStep:
    if not s.model_name:
        raise ModelConfigError(path, f"must specify 'model_name' in step {index} of ensemble '{ensemble}'")
    label = step_label(index, s.model_name)
    if s.model_name == ensemble:
        raise ModelConfigError(path, f"{label} of ensemble '{ensemble}' names the ensemble itself (a circular "
                                     "dependency)")
    if s.model_namespace:
        raise ModelConfigError(path, f"{label}: model_namespace is not supported by gpud (one repository, one "
                                     "namespace)")
    if s.model_version < -1:
        raise ModelConfigError(path, f"{label}: model_version {s.model_version} must be -1 (the newest version "
                                     "served) or a version number")
    if not s.input_map:
        raise ModelConfigError(path, f"must specify 'input_map' in {label} of ensemble '{ensemble}'")
    if not s.output_map:
        raise ModelConfigError(path, f"must specify 'output_map' in {label} of ensemble '{ensemble}'")
    for what, mapping in (("input_map", s.input_map), ("output_map", s.output_map)):
        for key, value in mapping.items():
            if not key or not value:
                raise ModelConfigError(path, f"{label}: {what} entry {key!r} -> {value!r} needs both a model "
                                             "tensor and an ensemble tensor name")
    # protobuf maps keep no order: sorted, so that the same config always means the same step
    return EnsembleStep(model_name=s.model_name, model_version=int(s.model_version),
                        input_map=tuple(sorted(s.input_map.items())), output_map=tuple(sorted(s.output_map.items())))


def check_data_flow(ensemble: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                    steps: Sequence[EnsembleStep]) -> None:
    """The ensemble's data flow, from its config alone. ValueError with the first problem found."""
    given = {t.name for t in inputs}
    producer: dict[str, int] = {}
    for i, s in enumerate(steps):
        for model_output, tensor in s.output_map:
            if tensor in producer:
                j = producer[tensor]
                raise ValueError(f"ensemble tensor '{tensor}' is produced twice: by "
                                 f"{step_label(j, steps[j].model_name)} and by {step_label(i, s.model_name)} "
                                 f"(its output '{model_output}'); a tensor can appear in an output map only once")
            if tensor in given:
                raise ValueError(f"ensemble tensor '{tensor}' is an ensemble input and also produced by "
                                 f"{step_label(i, s.model_name)} (its output '{model_output}')")
            producer[tensor] = i
    read: set[str] = set()
    for i, s in enumerate(steps):
        for model_input, tensor in s.input_map:
            if tensor not in given and tensor not in producer:
                raise ValueError(f"{step_label(i, s.model_name)} reads ensemble tensor '{tensor}' (for its input "
                                 f"'{model_input}'), which is not an ensemble input and no step produces")
            read.add(tensor)
    for t in inputs:
        if t.name not in read:
            raise ValueError(f"ensemble input '{t.name}' for ensemble '{ensemble}' is not used by any step")
    wanted = {t.name for t in outputs}
    for t in outputs:
        if t.name not in producer:
            raise ValueError(f"output '{t.name}' for ensemble '{ensemble}' is not written: no step's output_map "
                             f"produces it")
    for tensor, i in sorted(producer.items()):
        if tensor not in read and tensor not in wanted:
            raise ValueError(f"ensemble tensor '{tensor}' (produced by {step_label(i, steps[i].model_name)}) is "
                             f"unused in ensemble '{ensemble}': no step reads it and it is not an ensemble output")
    cycle = find_cycle(steps, producer)
    if cycle:
        path = " -> ".join(f"{step_label(i, steps[i].model_name)}" for i in cycle)
        raise ValueError(f"the steps of ensemble '{ensemble}' form a cycle: {path} -> "
                         f"{step_label(cycle[0], steps[cycle[0]].model_name)}; no step of it could ever run")


def find_cycle(steps: Sequence[EnsembleStep], producer: Mapping[str, int]) -> list[int]:
    """Step indices around one cycle of the data flow (step j reads what step i writes: i -> j), or []."""
    after: dict[int, list[int]] = {i: [] for i in range(len(steps))}
    for j, s in enumerate(steps):
        for _, tensor in s.input_map:
            i = producer.get(tensor)
            if i is not None and j not in after[i]:
                after[i].append(j)
    state = [0] * len(steps)  # 0 unseen, 1 on the path, 2 done
    path: list[int] = []

    def visit(i: int) -> list[int]:
        state[i] = 1
        path.append(i)
        for j in after[i]:
            if state[j] == 1:
                return path[path.index(j):]
            if state[j] == 0:
                found = visit(j)
                if found:
                    return found
        path.pop()
        state[i] = 2
        return []

    for i in range(len(steps)):
        if state[i] == 0:
            found = visit(i)
            if found:
                return found
    return []


# --------------------------------------------------------------------------------------------------------------------
# Against the steps' models


@dataclass(frozen=True)
class _Seen:
    """Where an ensemble tensor's data type and shape were first inferred from."""

    where: str
    datatype: str
    dims: tuple[int, ...]
    full_dims: tuple[int, ...]  # with the batch dimension (-1) when the model batches


def _seen(where: str, spec: TensorSpec, batching: bool) -> _Seen:
    return _Seen(where, spec.datatype, spec.dims, ((-1,) if batching else ()) + spec.dims)


def _dims_match(a: Sequence[int], b: Sequence[int]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b))


def _fmt(dims: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


def check_against_steps(ensemble: ModelConfig, step_configs: Sequence[ModelConfig]) -> None:
    """The ensemble against the configs of the models that serve its steps (one per step, in order). ValueError
    with the first problem, naming the step and the tensor."""
    assert ensemble.ensemble is not None
    name = ensemble.name
    tensors: dict[str, _Seen] = {}

    def meet(tensor: str, seen: _Seen) -> None:
        first = tensors.setdefault(tensor, seen)
        if first is seen:
            return
        if first.datatype != seen.datatype:
            raise ValueError(f"in ensemble '{name}', ensemble tensor '{tensor}': inconsistent data type: "
                             f"{first.datatype} from {first.where}, {seen.datatype} from {seen.where}")
        if not _dims_match(first.dims, seen.dims) and not _dims_match(first.full_dims, seen.full_dims):
            raise ValueError(f"in ensemble '{name}', ensemble tensor '{tensor}': inconsistent shape: "
                             f"{_fmt(first.full_dims)} from {first.where}, {_fmt(seen.full_dims)} from {seen.where}")

    for spec in ensemble.inputs:
        meet(spec.name, _seen(f"the ensemble's input '{spec.name}'", spec, ensemble.batches))
    for spec in ensemble.outputs:
        meet(spec.name, _seen(f"the ensemble's output '{spec.name}'", spec, ensemble.batches))
    for i, (step, config) in enumerate(zip(ensemble.ensemble.steps, step_configs)):
        label = step_label(i, step.model_name)
        if config.max_batch_size != 0 and config.max_batch_size < ensemble.max_batch_size:
            raise ValueError(f"ensemble '{name}' allows maximum batch size {ensemble.max_batch_size}, but {label} "
                             f"only allows {config.max_batch_size}")
        mapped = dict(step.input_map)
        for model_input in mapped:
            if config.input(model_input) is None:
                raise ValueError(f"in ensemble '{name}', {label}: input_map names input '{model_input}', which "
                                 f"the model does not have (its inputs: {[s.name for s in config.inputs]})")
        for spec in config.inputs:
            tensor = mapped.get(spec.name)
            if tensor is None:
                if spec.optional:
                    continue
                raise ValueError(f"in ensemble '{name}', {label}: input '{spec.name}' is not mapped to any ensemble "
                                 "tensor")
            meet(tensor, _seen(f"{label}'s input '{spec.name}'", spec, config.batches))
        for model_output, tensor in step.output_map:
            out_spec = config.output(model_output)
            if out_spec is None:
                raise ValueError(f"in ensemble '{name}', {label}: output_map names output '{model_output}', which "
                                 f"the model does not have (its outputs: {[s.name for s in config.outputs]})")
            meet(tensor, _seen(f"{label}'s output '{model_output}'", out_spec, config.batches))
