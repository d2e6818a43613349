"""A model's `sequence_batching` (config.pbtxt), read and checked the way Triton reads it, as the executor's typed
`gpud.executor.sequence_config.SequenceBatching`; and the check of its control and state tensors against the ONNX file.

Triton's checks are model_config_utils.cc's (GetBooleanSequenceControlProperties, GetTypedSequenceControlProperties,
ValidateModelConfig), sequence_batch_scheduler.cc's (GenerateInitialStateData) and the onnxruntime backend's
(control tensors of dims [1] and the model's datatype). Every problem is a ModelConfigError naming the file.
"""
from __future__ import annotations

import math
import os

from gpud.executor.model_config import VARIABLE_DIM, ModelConfig
from gpud.executor.datatypes import kserve_datatype, numpy_dtype
from gpud.executor.sequence_config import (CORRID, CORRID_DATATYPES, DEFAULT_MAX_SEQUENCE_IDLE_US, DIRECT,
                                      OLDEST, ControlInput, SequenceBatching, StateSpec)
from gpud.proto import model_config_pb2 as pb
from gpud.repository.errors import ModelConfigError

INITIAL_STATE_FOLDER = "initial_state"  # Triton's kInitialStateFolder: <model>/initial_state/<data_file>
_KINDS = pb.ModelSequenceBatching.Control.Kind


def _control(ci: pb.ModelSequenceBatching.ControlInput, model: str, path: str) -> ControlInput:
    if not ci.name:
        raise ModelConfigError(path, f"sequence batching control tensor must have a name for {model}")
    if len(ci.control) != 1:
        raise ModelConfigError(path, f"sequence batching control tensor '{ci.name}' lists {len(ci.control)} "
                                     "controls; each control tensor carries exactly one")
    c = ci.control[0]
    kind = _KINDS.Name(c.kind)
    given = [f for f in ("int32_false_true", "fp32_false_true", "bool_false_true") if len(getattr(c, f))]
    if kind == CORRID:
        if given:
            raise ModelConfigError(path, "sequence batching must not specify either 'int32_false_true', "
                                         f"'fp32_false_true' or 'bool_false_true' for {kind} for {model}")
        type_name = pb.DataType.Name(c.data_type)
        datatype = kserve_datatype(type_name) if type_name != "TYPE_INVALID" else ""
        if datatype not in CORRID_DATATYPES:
            raise ModelConfigError(path, f"unexpected data type for control {kind} for {model}. Allowed data types "
                                         "are TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING")
        return ControlInput(ci.name, kind, datatype)
    if not given:
        raise ModelConfigError(path, "sequence batching must specify either 'int32_false_true', 'fp32_false_true' "
                                     f"or 'bool_false_true' for {kind} for {model}")
    if len(given) > 1:
        raise ModelConfigError(path, "sequence batching specifies more than one from 'int32_false_true', "
                                     f"'fp32_false_true' and 'bool_false_true' for {kind} for {model}")
    field = given[0]
    values = list(getattr(c, field))
    if len(values) != 2:
        raise ModelConfigError(path, f"sequence batching control '{field}' must have exactly 2 entries for {kind} "
                                     f"for {model}")
    datatype = {"int32_false_true": "INT32", "fp32_false_true": "FP32", "bool_false_true": "BOOL"}[field]
    return ControlInput(ci.name, kind, datatype, values[0], values[1])


def _controls(sb: pb.ModelSequenceBatching, model: str, path: str) -> tuple[ControlInput, ...]:
    controls = tuple(_control(ci, model, path) for ci in sb.control_input)
    names: set[str] = set()
    kinds: set[str] = set()
    for c in controls:
        if c.name in names:
            raise ModelConfigError(path, f"sequence batching control tensor '{c.name}' is specified for multiple "
                                         f"control kinds for {model}")
        if c.kind in kinds:
            raise ModelConfigError(path, f"sequence batching specifies multiple {c.kind} tensors for {model}")
        names.add(c.name)
        kinds.add(c.kind)
    return controls


def _initial_data(init: pb.ModelSequenceBatching.InitialState, state: pb.ModelSequenceBatching.State,
                  datatype: str, model_dir: str, path: str) -> tuple[bytes, tuple[int, ...]]:
    label = f"state input '{state.input_name}'"
    if init.data_type != state.data_type:
        raise ModelConfigError(path, f"The data type used for 'initial_state' field of state '{state.input_name}' "
                                     "does not match the state data type.")
    if not init.name:
        raise ModelConfigError(path, f"Field 'name' must be set when using initial_state for {label}.")
    if len(init.dims) != len(state.dims):
        raise ModelConfigError(path, f"Number of dimensions in 'initial_state' doesn't match the size of 'state' "
                                     f"dimensions for {label}. {len(init.dims)} != {len(state.dims)}")
    for i_dim, s_dim in zip(init.dims, state.dims):
        if i_dim == VARIABLE_DIM or i_dim < 0:
            raise ModelConfigError(path, f"'initial_state' field for {label} contains variable dimensions.")
        if s_dim != VARIABLE_DIM and i_dim != s_dim:
            raise ModelConfigError(path, f"'initial_state' dim for {label} doesn't match 'state' dim description. "
                                         f"{i_dim} != {s_dim}")
    dims = tuple(int(d) for d in init.dims)
    count = math.prod(dims)
    choice = init.WhichOneof("state_data")
    if choice == "zero_data":
        if datatype == "BYTES":
            return b"\0\0\0\0" * count, dims  # empty strings
        return bytes(count * numpy_dtype(datatype).itemsize), dims
    if choice == "data_file":
        file = os.path.join(model_dir, INITIAL_STATE_FOLDER, init.data_file)
        try:
            with open(file, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ModelConfigError(file, f"initial_state data_file for {label}: cannot read: {e.strerror or e}") \
                from None
        if datatype == "BYTES":
            from gpud.executor.bytes_tensor import decode_bytes_elements

            try:
                decode_bytes_elements(data, count)
            except ValueError as e:
                raise ModelConfigError(file, f"initial_state for {label}: {e}") from None
            return data, dims
        need = count * numpy_dtype(datatype).itemsize
        if len(data) < need:
            raise ModelConfigError(file, f"initial_state setting expects {need} bytes, but the data provided from "
                                         f"{init.data_file} only has {len(data)} bytes.")
        return data[:need], dims
    raise ModelConfigError(path, f"initial_state setting expects state '{state.input_name}' to have state_data set")


def _states(sb: pb.ModelSequenceBatching, model_dir: str, path: str) -> tuple[StateSpec, ...]:
    states = []
    inputs: set[str] = set()
    outputs: set[str] = set()
    for s in sb.state:
        if not s.input_name or not s.output_name:
            raise ModelConfigError(path, "sequence batching state must name its input_name and output_name")
        label = f"state input '{s.input_name}'"
        if s.input_name in inputs:
            raise ModelConfigError(path, f"sequence batching state input_name '{s.input_name}' is listed twice")
        if s.output_name in outputs:
            raise ModelConfigError(path, f"sequence batching state output_name '{s.output_name}' is listed twice")
        inputs.add(s.input_name)
        outputs.add(s.output_name)
        type_name = pb.DataType.Name(s.data_type)
        if type_name == "TYPE_INVALID":
            raise ModelConfigError(path, f"{label} must specify data_type")
        try:
            datatype = kserve_datatype(type_name)
        except ValueError:
            raise ModelConfigError(path, f"{label}: data_type {type_name} is not supported by gpud") from None
        if not s.dims:
            raise ModelConfigError(path, f"{label} must specify dims")
        if any(d < 1 and d != VARIABLE_DIM for d in s.dims):
            raise ModelConfigError(path, f"{label}: dims {list(s.dims)}: each dimension must be >= 1, or -1")
        if len(s.initial_state) > 1:
            raise ModelConfigError(path, f"initial_state field for {label} must contain exactly one or zero element. "
                                         f"Found '{len(s.initial_state)}' elements.")
        initial: bytes | None = None
        initial_dims: tuple[int, ...] = ()
        if s.initial_state:
            initial, initial_dims = _initial_data(s.initial_state[0], s, datatype, model_dir, path)
        # use_same_buffer_for_input_output and use_growable_memory are memory layouts of Triton's own; gpud keeps a
        # sequence's state as its own arrays either way, so both are accepted and change nothing.
        init = s.initial_state[0] if s.initial_state else None
        states.append(StateSpec(s.input_name, s.output_name, datatype, tuple(int(d) for d in s.dims), initial,
                                initial_dims, init.name if init else "", init.data_file if init else "",
                                s.use_same_buffer_for_input_output, s.use_growable_memory))
    return tuple(states)


def sequence_batching_from_proto(sb: pb.ModelSequenceBatching, model: str, model_dir: str,
                                 path: str) -> SequenceBatching:
    """The typed sequence_batching of a config.pbtxt (before auto-complete: the batch-size checks are
    `validate_sequence_batching`'s). `model_dir` holds initial_state/ files."""
    if sb.iterative_sequence:
        raise ModelConfigError(path, "sequence_batching iterative_sequence is not supported by gpud")
    controls = _controls(sb, model, path)
    states = _states(sb, model_dir, path)
    idle_us = sb.max_sequence_idle_microseconds or DEFAULT_MAX_SEQUENCE_IDLE_US
    if sb.WhichOneof("strategy_choice") == OLDEST:
        o = sb.oldest
        if o.max_candidate_sequences < 0:
            raise ModelConfigError(path, f"sequence batching oldest max_candidate_sequences "
                                         f"{o.max_candidate_sequences} must be >= 0")
        return SequenceBatching(OLDEST, idle_us, controls, states, max_queue_delay_us=o.max_queue_delay_microseconds,
                                max_candidate_sequences=o.max_candidate_sequences,
                                preferred_batch_sizes=tuple(o.preferred_batch_size),
                                preserve_ordering=o.preserve_ordering)
    d = sb.direct
    if not 0.0 <= d.minimum_slot_utilization <= 1.0:
        raise ModelConfigError(path, "sequence batching minimum slot utilization must be in range (0.0, 1.0] for "
                                     f"{model}")
    return SequenceBatching(DIRECT, idle_us, controls, states, max_queue_delay_us=d.max_queue_delay_microseconds,
                            minimum_slot_utilization=d.minimum_slot_utilization)


def sequence_tensor_names(config: ModelConfig) -> tuple[frozenset[str], frozenset[str]]:
    """The model inputs gpud fills in (control and state inputs), and the state outputs that clients do not see
    (those the config's outputs do not list)."""
    sb = config.sequence_batching
    if sb is None:
        return frozenset(), frozenset()
    inputs = {c.name for c in sb.controls} | {s.input_name for s in sb.states}
    outputs = {s.output_name for s in sb.states if config.output(s.output_name) is None}
    return frozenset(inputs), frozenset(outputs)


def validate_sequence_batching(config: ModelConfig, path: str) -> None:
    """The checks that need the complete configuration (max_batch_size may come from the ONNX file)."""
    sb = config.sequence_batching
    if sb is None:
        return
    model = config.name
    for spec in config.inputs:
        if spec.name in {c.name for c in sb.controls}:
            raise ModelConfigError(path, f"input '{spec.name}' is a sequence batching control tensor: the sequence "
                                         "batcher fills it in, clients do not send it; remove it from input")
        if any(s.input_name == spec.name for s in sb.states):
            raise ModelConfigError(path, f"input '{spec.name}' is a sequence batching state input: the sequence "
                                         "batcher fills it in, clients do not send it; remove it from input")
    if config.batches:
        for s in sb.states:
            if any(d == VARIABLE_DIM for d in s.dims):
                # Triton's states may grow; gpud stacks the states of a batch's sequences into one tensor.
                raise ModelConfigError(path, f"sequence batching state '{s.input_name}' has variable dims "
                                             f"{list(s.dims)} and max_batch_size {config.max_batch_size} > 0: gpud "
                                             "batches the states of several sequences, which needs them of one "
                                             "shape; give the state fixed dims, or set max_batch_size 0")
    for size in sb.preferred_batch_sizes:
        if size <= 0:
            raise ModelConfigError(path, f"sequence batching preferred batch size must be positive for {model}")
        if size > config.max_batch_size:
            raise ModelConfigError(path, f"sequence batching preferred batch size must be <= max batch size for "
                                         f"{model}")


def _check_batch_dim(name: str, shape: tuple[int, ...], lead: int, config: ModelConfig, config_path: str,
                     model_path: str) -> None:
    if lead and (not shape or shape[0] != VARIABLE_DIM):
        raise ModelConfigError(config_path, f"max_batch_size {config.max_batch_size} > 0 but the first dimension of "
                                            f"'{name}' {list(shape)} in {model_path} is not a variable batch dimension")


def check_sequence_tensors(config: ModelConfig, onnx_inputs: dict[str, tuple[str, tuple[int, ...]]],
                           onnx_outputs: dict[str, tuple[str, tuple[int, ...]]], config_path: str,
                           model_path: str) -> None:
    """Control inputs, state inputs and state outputs against the ONNX graph's (name -> (datatype, shape)): each
    present, control tensors of dims [1] and their configured datatype, state tensors of the state's datatype and
    a compatible shape (the onnxruntime backend's checks, made when the repository is read)."""
    sb = config.sequence_batching
    if sb is None:
        return
    lead = 1 if config.batches else 0
    for c in sb.controls:
        found = onnx_inputs.get(c.name)
        if found is None:
            raise ModelConfigError(config_path, f"configuration specified sequence control '{c.name}', but model "
                                                f"{model_path} does not provide that input")
        datatype, shape = found
        _check_batch_dim(c.name, shape, lead, config, config_path, model_path)
        if list(shape[lead:]) != [1]:
            raise ModelConfigError(config_path, f"sequence control '{c.name}' in model {model_path} has dims "
                                                f"{list(shape[lead:])} but dims [1] is expected")
        if datatype != c.datatype:
            raise ModelConfigError(config_path, f"sequence control '{c.name}', the model expects data-type "
                                                f"{datatype} but the model configuration specifies data-type "
                                                f"{c.datatype}")
    for s in sb.states:
        for name, table, what in ((s.input_name, onnx_inputs, "input"), (s.output_name, onnx_outputs, "output")):
            found = table.get(name)
            if found is None:
                raise ModelConfigError(config_path, f"state {what} '{name}' is not an {what} of {model_path}")
            datatype, shape = found
            _check_batch_dim(name, shape, lead, config, config_path, model_path)
            if datatype != s.datatype:
                raise ModelConfigError(config_path, f"state {what} '{name}': the model expects data-type {datatype} "
                                                    f"but the state specifies data-type {s.datatype}")
            dims = shape[lead:]
            if len(dims) != len(s.dims) or any(m != VARIABLE_DIM and c != VARIABLE_DIM and m != c
                                               for m, c in zip(dims, s.dims)):
                raise ModelConfigError(config_path, f"state {what} '{name}': dims {list(s.dims)} do not match "
                                                    f"{list(dims)} in {model_path}")
