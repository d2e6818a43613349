"""Stateful ONNX models built by the tests, with their config.pbtxt, for the sequence batcher's tests.

- `controls_model`: echoes the control tensors the sequence batcher fills in (START, END, READY, CORRID) and
  OUTPUT = INPUT * READY, so a test sees exactly what Triton would have delivered to each batch row.
- `accumulator_model`: Triton's implicit-state accumulator (qa/common/gen_qa_implicit_models.py): the state is the
  running sum of a sequence's INPUTs, restarted at START; OUTPUT is the new sum, and CORRID_OUT echoes the CORRID.
"""
from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from tests.daemon_harness import save

_ONNX_TYPES = {"INT32": TensorProto.INT32, "FP32": TensorProto.FLOAT, "BOOL": TensorProto.BOOL,
               "UINT64": TensorProto.UINT64, "INT64": TensorProto.INT64, "BYTES": TensorProto.STRING}
_TRITON_TYPES = {"INT32": "TYPE_INT32", "FP32": "TYPE_FP32", "BOOL": "TYPE_BOOL", "UINT64": "TYPE_UINT64",
                 "INT64": "TYPE_INT64", "BYTES": "TYPE_STRING"}
_FALSE_TRUE = {"INT32": "int32_false_true", "FP32": "fp32_false_true", "BOOL": "bool_false_true"}


def _vi(name: str, datatype: str, batches: bool) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, _ONNX_TYPES[datatype], ["N", 1] if batches else [1])


def _model(nodes, inputs, outputs) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "sequence", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="gpud-tests")
    model.ir_version = 8
    return model


def controls_model(start="INT32", end="BOOL", ready="FP32", corrid="UINT64", batches=True) -> onnx.ModelProto:
    """INPUT INT32 and the four controls in; OUTPUT = INPUT * (READY != 0) and the controls echoed out."""
    nodes = [
        helper.make_node("Cast", ["READY"], ["ready_i"], to=TensorProto.INT32),
        helper.make_node("Mul", ["INPUT", "ready_i"], ["OUTPUT"]),
    ]
    for name in ("START", "END", "READY", "CORRID"):
        nodes.append(helper.make_node("Identity", [name], [f"{name}_OUT"]))
    types = {"START": start, "END": end, "READY": ready, "CORRID": corrid}
    return _model(nodes, [_vi("INPUT", "INT32", batches)] + [_vi(n, t, batches) for n, t in types.items()],
                  [_vi("OUTPUT", "INT32", batches)] + [_vi(f"{n}_OUT", t, batches) for n, t in types.items()])


def accumulator_model(corrid="UINT64", batches=True, reset_on_start=True) -> onnx.ModelProto:
    """state' = (START ? 0 : state) + INPUT * READY; OUTPUT = state'; CORRID_OUT = CORRID. Without
    `reset_on_start` the sum starts from the state gpud gives the first request (its initial_state)."""
    zero = helper.make_tensor("zero", TensorProto.INT32, [], [0])
    nodes = [
        helper.make_node("Constant", [], ["zero"], value=zero),
        helper.make_node("Cast", ["START"], ["start_b"], to=TensorProto.BOOL),
        helper.make_node("Where", ["start_b", "zero", "INPUT_STATE"], ["base"]) if reset_on_start else
        helper.make_node("Identity", ["INPUT_STATE"], ["base"]),
        helper.make_node("Mul", ["INPUT", "READY"], ["add"]),
        helper.make_node("Add", ["base", "add"], ["OUTPUT_STATE"]),
        helper.make_node("Identity", ["OUTPUT_STATE"], ["OUTPUT"]),
        helper.make_node("Identity", ["CORRID"], ["CORRID_OUT"]),
    ]
    inputs = [_vi("INPUT", "INT32", batches), _vi("START", "INT32", batches), _vi("READY", "INT32", batches),
              _vi("CORRID", corrid, batches), _vi("INPUT_STATE", "INT32", batches)]
    outputs = [_vi("OUTPUT", "INT32", batches), _vi("OUTPUT_STATE", "INT32", batches),
               _vi("CORRID_OUT", corrid, batches)]
    return _model(nodes, inputs, outputs)


def _control(name: str, kind: str, datatype: str, false_true=None) -> str:
    if kind == "CONTROL_SEQUENCE_CORRID":
        return f'{{ name: "{name}" control [ {{ kind: {kind} data_type: {_TRITON_TYPES[datatype]} }} ] }}'
    values = ", ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in false_true)
    return f'{{ name: "{name}" control [ {{ kind: {kind} {_FALSE_TRUE[datatype]}: [ {values} ] }} ] }}'


def controls_config(*, max_batch_size=4, strategy="direct { }", instances=1, idle_us=0,
                    start=("INT32", (10, 11)), end=("BOOL", (False, True)), ready=("FP32", (0.0, 1.0)),
                    corrid="UINT64") -> str:
    controls = [_control("START", "CONTROL_SEQUENCE_START", start[0], start[1]),
                _control("END", "CONTROL_SEQUENCE_END", end[0], end[1]),
                _control("READY", "CONTROL_SEQUENCE_READY", ready[0], ready[1]),
                _control("CORRID", "CONTROL_SEQUENCE_CORRID", corrid)]
    outs = "".join(f'{{ name: "{n}_OUT" data_type: {_TRITON_TYPES[t]} dims: [ 1 ] }},'
                   for n, t in (("START", start[0]), ("END", end[0]), ("READY", ready[0]), ("CORRID", corrid)))
    return f"""
max_batch_size: {max_batch_size}
sequence_batching {{
  {f"max_sequence_idle_microseconds: {idle_us}" if idle_us else ""}
  {strategy}
  control_input [ {", ".join(controls)} ]
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }}, {outs.rstrip(",")} ]
instance_group [ {{ count: {instances}, kind: KIND_CPU }} ]
"""


def accumulator_config(*, max_batch_size=4, strategy="direct { }", instances=1, idle_us=0, corrid="UINT64",
                       initial_state="", output_state=False) -> str:
    controls = [_control("START", "CONTROL_SEQUENCE_START", "INT32", (0, 1)),
                _control("READY", "CONTROL_SEQUENCE_READY", "INT32", (0, 1)),
                _control("CORRID", "CONTROL_SEQUENCE_CORRID", corrid)]
    state_out = ', { name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ] }' if output_state else ""
    return f"""
max_batch_size: {max_batch_size}
sequence_batching {{
  {f"max_sequence_idle_microseconds: {idle_us}" if idle_us else ""}
  {strategy}
  control_input [ {", ".join(controls)} ]
  state [ {{ input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ]
            {initial_state} }} ]
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }},
         {{ name: "CORRID_OUT" data_type: {_TRITON_TYPES[corrid]} dims: [ 1 ] }}{state_out} ]
instance_group [ {{ count: {instances}, kind: KIND_CPU }} ]
"""


def write_sequence_repository(repo: Path) -> None:
    """The models the end-to-end tests drive: direct and oldest accumulators (integer and string ids), the controls
    echo, and a short-idle accumulator for the idle release."""
    save(accumulator_model(), repo, "acc_direct", accumulator_config(instances=2))
    save(accumulator_model("BYTES"), repo, "acc_oldest",
         accumulator_config(corrid="BYTES", strategy="oldest { max_candidate_sequences: 8 "
                                                     "max_queue_delay_microseconds: 1000 }"))
    save(controls_model(), repo, "controls", controls_config())
    save(accumulator_model(), repo, "acc_idle", accumulator_config(idle_us=200_000))


def growing_model() -> onnx.ModelProto:
    """A model that does not batch, with a state that grows: state' = concat(state, INPUT) ([-1] INT32), OUTPUT =
    the sum of state' ([1]). READY and START inputs as controls (the model ignores START: gpud's initial state, one
    zero since the state's dim is variable, starts each sequence)."""
    nodes = [
        helper.make_node("Concat", ["INPUT_STATE", "INPUT"], ["OUTPUT_STATE"], axis=0),
        helper.make_node("ReduceSum", ["OUTPUT_STATE"], ["OUTPUT"], keepdims=1),
        helper.make_node("Identity", ["START"], ["START_OUT"]),
    ]
    inputs = [helper.make_tensor_value_info("INPUT", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("START", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("INPUT_STATE", TensorProto.INT32, ["S"])]
    outputs = [helper.make_tensor_value_info("OUTPUT", TensorProto.INT32, [1]),
               helper.make_tensor_value_info("OUTPUT_STATE", TensorProto.INT32, ["S2"]),
               helper.make_tensor_value_info("START_OUT", TensorProto.INT32, [1])]
    return _model(nodes, inputs, outputs)


GROWING_CONFIG = """
max_batch_size: 0
sequence_batching {
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]
  state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ -1 ] } ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ -1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""
