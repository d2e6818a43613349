"""A sequence model's config.pbtxt read as Triton reads it (gpud.repository.sequence_config): the typed values, Triton's
errors for a bad sequence_batching (each naming the file), the control and state tensors checked against the ONNX
file, auto-complete leaving them to gpud, and the config endpoints writing it back (HTTP JSON == gRPC message)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from gpud.executor.sequence_config import (CORRID, DIRECT, END, OLDEST, READY, START, ControlInput, SequenceBatching,
    StateSpec, control_value, initial_state)
from gpud.executor.model_config import execution_config
from gpud.api import grpc_encode, http_encode
from gpud.core_api import ServedModelConfig
from gpud.repository.errors import ModelConfigError
from gpud.repository.layout import load_model
from tests.daemon_harness import save
from tests.sequence_models import accumulator_config, accumulator_model, controls_config, controls_model
from tests.test_api_encoders import _same


def load(tmp_path, model, config, name="m"):
    save(model, tmp_path, name, config)
    return load_model(tmp_path / name).config


class TestParsed:
    def test_direct_with_controls_of_every_type(self, tmp_path):
        cfg = load(tmp_path, controls_model(), controls_config(max_batch_size=4, idle_us=5_000_000))
        sb = cfg.sequence_batching
        assert sb.strategy == DIRECT and sb.max_sequence_idle_us == 5_000_000
        assert sb.controls == (ControlInput("START", START, "INT32", 10, 11), ControlInput("END", END, "BOOL", False,
                                                                                           True),
                               ControlInput("READY", READY, "FP32", 0.0, 1.0), ControlInput("CORRID", CORRID, "UINT64"))
        assert [s.name for s in cfg.inputs] == ["INPUT"]  # the controls are gpud's to fill in, not the client's
        assert cfg.dynamic_batching is None

    def test_oldest_and_state(self, tmp_path):
        cfg = load(tmp_path, accumulator_model("BYTES"), accumulator_config(
            corrid="BYTES", strategy="oldest { max_candidate_sequences: 16 preferred_batch_size: [ 2, 4 ] "
                                     "max_queue_delay_microseconds: 300 }"))
        sb = cfg.sequence_batching
        assert (sb.strategy, sb.max_candidate_sequences, sb.preferred_batch_sizes, sb.max_queue_delay_us) == \
            (OLDEST, 16, (2, 4), 300)
        assert sb.max_sequence_idle_us == 1_000_000  # Triton's default when unset
        assert sb.states == (StateSpec("INPUT_STATE", "OUTPUT_STATE", "INT32", (1,)),)
        assert sb.slots_per_instance(cfg.max_batch_size) == 16
        run = execution_config(cfg)  # what the worker loads the model with
        assert [i.name for i in run.inputs] == ["INPUT", "START", "READY", "CORRID", "INPUT_STATE"]
        assert [o.name for o in run.outputs] == ["OUTPUT", "CORRID_OUT", "OUTPUT_STATE"]

    def test_initial_state_zero_and_from_a_file(self, tmp_path):
        cfg = load(tmp_path, accumulator_model(), accumulator_config(
            initial_state='initial_state: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "z" }'))
        assert initial_state(cfg.sequence_batching.states[0], batches=True).tolist() == [[0]]
        (tmp_path / "f" / "initial_state").mkdir(parents=True)
        (tmp_path / "f" / "initial_state" / "v").write_bytes(np.array([7, 8], "<i4").tobytes())
        cfg = load(tmp_path, accumulator_model(), accumulator_config(
            initial_state='initial_state: { data_type: TYPE_INT32 dims: [ 1 ] data_file: "v" name: "f" }'), "f")
        state = cfg.sequence_batching.states[0]
        assert initial_state(state, batches=True).tolist() == [[7]]  # the first dims' worth of the file
        assert (state.initial_name, state.initial_data_file) == ("f", "v")

    def test_auto_complete_leaves_control_and_state_tensors_out(self, tmp_path):
        config = accumulator_config()
        config = config[:config.index("\ninput [")]  # no input, no output: completed from the ONNX file
        cfg = load(tmp_path, accumulator_model(), config)
        assert [i.name for i in cfg.inputs] == ["INPUT"]
        assert [o.name for o in cfg.outputs] == ["OUTPUT", "CORRID_OUT"]
        assert cfg.dynamic_batching is None  # a sequence model gets no dynamic batching


class TestControlValues:
    @pytest.mark.parametrize("control, value, want, dtype", [
        (ControlInput("S", START, "INT32", -1, 5), True, [[5]], np.int32),
        (ControlInput("S", START, "FP32", 0.5, 2.5), False, [[0.5]], np.float32),
        (ControlInput("S", READY, "BOOL", False, True), True, [[True]], np.bool_),
        (ControlInput("C", CORRID, "UINT64"), 2**64 - 1, [[2**64 - 1]], np.uint64),
        (ControlInput("C", CORRID, "INT32"), 2**32 + 5, [[5]], np.int32),  # the low bytes, as Triton copies them
        (ControlInput("C", CORRID, "BYTES"), "abc", [[b"abc"]], object),
    ])
    def test_values(self, control, value, want, dtype):
        got = control_value(control, value, batches=True)
        assert got.dtype == np.dtype(dtype) and got.tolist() == want
        assert control_value(control, value, batches=False).shape == (1,)


BASE = accumulator_config()  # START, READY, CORRID (uint64) and the state INPUT_STATE -> OUTPUT_STATE, direct
STATE_TYPE = 'output_name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ]'


def _variant(*replacements: tuple[str, str]) -> str:
    config = BASE
    for old, new in replacements:
        assert old in config, old
        config = config.replace(old, new)
    return config


def _sb(extra: str) -> str:
    """BASE with `extra` added inside sequence_batching."""
    return _variant(("sequence_batching {", "sequence_batching { " + extra))


def _initial(initial_state: str) -> str:
    return _variant((STATE_TYPE, STATE_TYPE + " " + initial_state))


class TestTritonErrors:
    @pytest.mark.parametrize("config, problem", [
        (_sb('control_input [ { control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] } ]'),
         "sequence batching control tensor must have a name for m"),
        (_sb('control_input [ { name: "END" control [ { kind: CONTROL_SEQUENCE_END } ] } ]'),
         "sequence batching must specify either 'int32_false_true', 'fp32_false_true' or 'bool_false_true' for "
         "CONTROL_SEQUENCE_END for m"),
        (_sb('control_input [ { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] '
             'fp32_false_true: [ 0, 1 ] } ] } ]'), "specifies more than one from"),
        (_sb('control_input [ { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 1 ] } ] } ]'),
         "sequence batching control 'int32_false_true' must have exactly 2 entries for CONTROL_SEQUENCE_END"),
        (_variant(("data_type: TYPE_UINT64 }", "data_type: TYPE_FP32 }")),
         "unexpected data type for control CONTROL_SEQUENCE_CORRID for m"),
        (_variant(("data_type: TYPE_UINT64 }", "int32_false_true: [ 0, 1 ] }")),
         "must not specify either 'int32_false_true'"),
        (_sb('control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] '
             '} ]'), "control tensor 'START' is specified for multiple control kinds"),
        (_sb('control_input [ { name: "S2" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] '
             '} ]'), "specifies multiple CONTROL_SEQUENCE_START tensors for m"),
        (_sb('control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] }, '
             '{ kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] } ]'),
         "each control tensor carries exactly one"),
        (_variant(("direct { }", "direct { minimum_slot_utilization: 1.5 }")),
         "minimum slot utilization must be in range"),
        (_variant(("direct { }", "oldest { preferred_batch_size: [ 8 ] }")),
         "sequence batching preferred batch size must be <= max batch size"),
        (_variant(("direct { }", "oldest { preferred_batch_size: [ 0 ] }")),
         "sequence batching preferred batch size must be positive"),
        (_sb("iterative_sequence: true"), "iterative_sequence is not supported by gpud"),
        (_sb('state [ { input_name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]'),
         "must name its input_name and output_name"),
        (_sb('state [ { input_name: "INPUT_STATE" output_name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]'),
         "state input_name 'INPUT_STATE' is listed twice"),
        (_initial('initial_state: { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true name: "i" }'),
         "'initial_state' field of state 'INPUT_STATE' does not match the state data type"),
        (_initial('initial_state: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true }'),
         "Field 'name' must be set when using initial_state"),
        (_initial('initial_state: { data_type: TYPE_INT32 dims: [ 1, 1 ] zero_data: true name: "i" }'),
         "Number of dimensions in 'initial_state' doesn't match"),
        (_initial('initial_state: { data_type: TYPE_INT32 dims: [ 2 ] zero_data: true name: "i" }'),
         "'initial_state' dim for state input 'INPUT_STATE' doesn't match 'state' dim description. 2 != 1"),
        (_initial('initial_state: { data_type: TYPE_INT32 dims: [ 1 ] name: "i" }'), "to have state_data set"),
        (_initial('initial_state: [ { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "i" }, '
                  '{ data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "j" } ]'),
         "must contain exactly one or zero element. Found '2' elements."),
        (_variant((STATE_TYPE, STATE_TYPE.replace("[ 1 ]", "[ -1 ]"))),
         "has variable dims [-1] and max_batch_size 4 > 0"),
        (_variant(('input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]',
                   'input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }, '
                   '{ name: "START" data_type: TYPE_INT32 dims: [ 1 ] } ]')),
         "input 'START' is a sequence batching control tensor"),
    ])
    def test_config_errors(self, tmp_path, config, problem):
        with pytest.raises(ModelConfigError) as e:
            load(tmp_path, accumulator_model(), config)
        assert problem in e.value.problem
        assert e.value.path.endswith("config.pbtxt")

    def test_a_missing_initial_state_file_is_named(self, tmp_path):
        with pytest.raises(ModelConfigError) as e:
            load(tmp_path, accumulator_model(),
                 _initial('initial_state: { data_type: TYPE_INT32 dims: [ 1 ] data_file: "nope" name: "i" }'))
        assert e.value.path.endswith("initial_state/nope") and "cannot read" in e.value.problem

    def test_a_short_initial_state_file(self, tmp_path):
        (tmp_path / "m" / "initial_state").mkdir(parents=True)
        (tmp_path / "m" / "initial_state" / "short").write_bytes(b"\0\0")
        with pytest.raises(ModelConfigError) as e:
            load(tmp_path, accumulator_model(),
                 _initial('initial_state: { data_type: TYPE_INT32 dims: [ 1 ] data_file: "short" name: "i" }'))
        assert "initial_state setting expects 4 bytes, but the data provided from short only has 2 bytes" in \
            e.value.problem


def _unbatched_start() -> onnx.ModelProto:
    model = controls_model()
    model.graph.input[1].type.tensor_type.shape.dim[0].dim_value = 1  # START [1, 1]: no batch dimension
    return model


class TestAgainstTheOnnxFile:
    @pytest.mark.parametrize("model, config, problem", [
        (accumulator_model(), _variant(('name: "START"', 'name: "GO"')),
         "configuration specified sequence control 'GO', but model"),
        (controls_model(start="FP32"), controls_config(), "sequence control 'START', the model expects data-type FP32 "
                                                          "but the model configuration specifies data-type INT32"),
        (_unbatched_start(), controls_config(), "the first dimension of 'START' [1, 1]"),
        (accumulator_model(), _variant(('input_name: "INPUT_STATE"', 'input_name: "S_IN"')),
         "state input 'S_IN' is not an input of"),
        (accumulator_model(), _variant((STATE_TYPE, STATE_TYPE.replace("INT32", "FP32"))),
         "state input 'INPUT_STATE': the model expects data-type INT32 but the state specifies data-type FP32"),
        (accumulator_model(), _variant((STATE_TYPE, STATE_TYPE.replace("[ 1 ]", "[ 3 ]"))),
         "state input 'INPUT_STATE': dims [3] do not match [1]"),
    ])
    def test_onnx_errors(self, tmp_path, model, config, problem):
        with pytest.raises(ModelConfigError) as e:
            load(tmp_path, model, config)
        assert problem in e.value.problem

    def test_model_inputs_the_config_does_not_account_for(self, tmp_path):
        ready = '{ name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }, '
        with pytest.raises(ModelConfigError) as e:  # READY is an input of the model, and no control names it
            load(tmp_path, accumulator_model(), _variant((ready, "")))
        assert "inputs ['READY']" in e.value.problem and "are not in the config's inputs" in e.value.problem


SEQUENCE_CONFIGS = {
    "direct, every control type": SequenceBatching(
        DIRECT, 5_000_000, (ControlInput("S", START, "INT32", 10, 11), ControlInput("E", END, "BOOL", False, True),
                            ControlInput("R", READY, "FP32", 0.0, 1.0), ControlInput("C", CORRID, "BYTES")),
        max_queue_delay_us=100, minimum_slot_utilization=0.5),
    "oldest, states": SequenceBatching(
        OLDEST, 1_000_000, (ControlInput("C", CORRID, "UINT64"),),
        (StateSpec("a", "b", "INT32", (4,), b"\0" * 16, (4,), "zeros"),
         StateSpec("c", "d", "FP32", (2,), b"\0" * 8, (2,), "file", "init.bin", True, True),
         StateSpec("e", "f", "BYTES", (1,))),
        max_queue_delay_us=10, max_candidate_sequences=64, preferred_batch_sizes=(2, 4), preserve_ordering=True),
}


@pytest.mark.parametrize("sb", SEQUENCE_CONFIGS.values(), ids=SEQUENCE_CONFIGS.keys())
def test_config_endpoints_agree(sb, tmp_path):
    from gpud.executor.model_config import ModelConfig, TensorSpec

    served = ServedModelConfig(ModelConfig(name="s", max_batch_size=4, inputs=(TensorSpec("x", "INT32", (1,)),),
                                           outputs=(TensorSpec("y", "INT32", (1,)),), sequence_batching=sb))
    _same(http_encode.model_config_json(served), grpc_encode.model_config_message(served))


def test_config_endpoint_round_trips_the_repository(tmp_path):
    """What the endpoint writes, read back as config.pbtxt, is the same model."""
    from google.protobuf import text_format

    cfg = load(tmp_path, controls_model(), controls_config(max_batch_size=4, idle_us=3_000_000))
    message = grpc_encode.model_config_message(ServedModelConfig(cfg))
    again = load(tmp_path, controls_model(), text_format.MessageToString(message).replace('name: "m"', 'name: "n"'),
                 name="n")
    assert again.sequence_batching == cfg.sequence_batching
