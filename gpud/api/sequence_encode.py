"""A model's sequence_batching as the config endpoints write it: Triton's JSON (HTTP) and model_config.proto's
ModelSequenceBatching (gRPC), the same document (tests/test_api_encoders.py). perf_analyzer and tritonclient read it
to know the model is a sequence model."""
from __future__ import annotations

from typing import Any, cast

from gpud.executor.datatypes import triton_type
from gpud.executor.sequence_config import CORRID, OLDEST, ControlInput, SequenceBatching, StateSpec
from gpud.proto import model_config_pb2 as mc

_FALSE_TRUE_FIELD = {"INT32": "int32_false_true", "FP32": "fp32_false_true", "BOOL": "bool_false_true"}


def _cast(datatype: str, value: float) -> Any:
    return {"INT32": int, "FP32": float, "BOOL": bool}[datatype](value)


def _control_json(c: ControlInput) -> dict[str, Any]:
    control: dict[str, Any] = {"kind": c.kind}
    if c.kind == CORRID:
        control["data_type"] = triton_type(c.datatype)
    else:
        control[_FALSE_TRUE_FIELD[c.datatype]] = [_cast(c.datatype, c.false_value), _cast(c.datatype, c.true_value)]
    return {"name": c.name, "control": [control]}


def _state_json(s: StateSpec) -> dict[str, Any]:
    d: dict[str, Any] = {"input_name": s.input_name, "output_name": s.output_name,
                         "data_type": triton_type(s.datatype), "dims": list(s.dims),
                         "use_same_buffer_for_input_output": s.use_same_buffer_for_input_output,
                         "use_growable_memory": s.use_growable_memory}
    if s.initial is not None:
        init: dict[str, Any] = {"data_type": triton_type(s.datatype), "dims": list(s.initial_dims),
                                "name": s.initial_name}
        if s.initial_data_file:
            init["data_file"] = s.initial_data_file
        else:
            init["zero_data"] = True
        d["initial_state"] = [init]
    return d


def sequence_batching_json(sb: SequenceBatching) -> dict[str, Any]:
    d: dict[str, Any] = {
        "max_sequence_idle_microseconds": sb.max_sequence_idle_us,
        "control_input": [_control_json(c) for c in sb.controls],
        "state": [_state_json(s) for s in sb.states],
    }
    if sb.strategy == OLDEST:
        d["oldest"] = {"max_candidate_sequences": sb.max_candidate_sequences,
                       "preferred_batch_size": list(sb.preferred_batch_sizes),
                       "max_queue_delay_microseconds": sb.max_queue_delay_us,
                       "preserve_ordering": sb.preserve_ordering}
    else:
        d["direct"] = {"max_queue_delay_microseconds": sb.max_queue_delay_us,
                       "minimum_slot_utilization": sb.minimum_slot_utilization}
    return d


def sequence_batching_message(sb: SequenceBatching, message: mc.ModelSequenceBatching) -> None:
    """Fill `message` (a ModelConfig's sequence_batching) from `sb`."""
    message.SetInParent()
    message.max_sequence_idle_microseconds = sb.max_sequence_idle_us
    for c in sb.controls:
        control = message.control_input.add(name=c.name).control.add(
            kind=mc.ModelSequenceBatching.Control.Kind.Value(c.kind))
        if c.kind == CORRID:
            # cast: protoc's .pyi types an enum field as its enum class, while types-protobuf types Value() as int
            control.data_type = cast(mc.DataType, mc.DataType.Value(triton_type(c.datatype)))
        else:
            getattr(control, _FALSE_TRUE_FIELD[c.datatype]).extend(
                [_cast(c.datatype, c.false_value), _cast(c.datatype, c.true_value)])
    for s in sb.states:
        state = message.state.add(input_name=s.input_name, output_name=s.output_name,
                                  data_type=mc.DataType.Value(triton_type(s.datatype)), dims=s.dims,
                                  use_same_buffer_for_input_output=s.use_same_buffer_for_input_output,
                                  use_growable_memory=s.use_growable_memory)
        if s.initial is not None:
            init = state.initial_state.add(data_type=mc.DataType.Value(triton_type(s.datatype)),
                                           dims=s.initial_dims, name=s.initial_name)
            if s.initial_data_file:
                init.data_file = s.initial_data_file
            else:
                init.zero_data = True
    if sb.strategy == OLDEST:
        message.oldest.SetInParent()
        message.oldest.max_candidate_sequences = sb.max_candidate_sequences
        message.oldest.preferred_batch_size.extend(sb.preferred_batch_sizes)
        message.oldest.max_queue_delay_microseconds = sb.max_queue_delay_us
        message.oldest.preserve_ordering = sb.preserve_ordering
    else:
        message.direct.SetInParent()
        message.direct.max_queue_delay_microseconds = sb.max_queue_delay_us
        message.direct.minimum_slot_utilization = sb.minimum_slot_utilization
