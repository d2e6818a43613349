"""Model repository: config.pbtxt parsing and validation, auto-complete from ONNX, version policies, and the
HTTP JSON of what it reads (gpud.api.http_encode)."""
from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from google.protobuf import json_format
from onnx import TensorProto, helper, numpy_helper

from gpud.executor.model_config import DynamicBatching, InstanceGroup, QueuePolicy, TensorSpec
from gpud.api.http_encode import model_config_json, model_metadata_json
from gpud.core_api import ModelMetadata, ServedModelConfig
from gpud.proto import model_config_pb2
from gpud.repository.config import VersionPolicy, config_from_proto, parse_config_text
from gpud.repository.errors import ModelConfigError
from gpud.repository.footprint import estimate_footprint_bytes
from gpud.repository.layout import (
    ModelEntry,
    ModelLoadError,
    ModelRepository,
    available_versions,
    load_model,
    load_model_config,
)

B = "batch"  # symbolic batch dimension


# ---------------------------------------------------------------------------------------------------------------------
# builders


def identity_model(*tensors: tuple[str, str, int, list]) -> onnx.ModelProto:
    """A model of Identity nodes: each (input_name, output_name, elem_type, shape) is one input copied to one output."""
    nodes = [helper.make_node("Identity", [i], [o]) for i, o, _, _ in tensors]
    graph = helper.make_graph(
        nodes,
        "identity",
        [helper.make_tensor_value_info(i, t, s) for i, _, t, s in tensors],
        [helper.make_tensor_value_info(o, t, s) for _, o, t, s in tensors],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


BATCHING = identity_model(("x", "y", TensorProto.FLOAT, [B, 4]))  # FP32 [-1, 4] -> [-1, 4]
FIXED = identity_model(("x", "y", TensorProto.FLOAT, [2, 4]))  # cannot batch: first dimension is 2
# INT64 "a" [-1, 3] -> "c"; FP32 "b" [-1, n] -> "d" (n symbolic)
TWO = identity_model(("a", "c", TensorProto.INT64, [B, 3]), ("b", "d", TensorProto.FLOAT, [B, "n"]))


def make_model_dir(
    repo: Path,
    name: str,
    config: str | None,
    model: onnx.ModelProto | bytes | None = BATCHING,
    versions: tuple[str, ...] = ("1",),
    filename: str = "model.onnx",
) -> Path:
    model_dir = repo / name
    model_dir.mkdir(parents=True)
    if config is not None:
        (model_dir / "config.pbtxt").write_text(config)
    for v in versions:
        (model_dir / v).mkdir()
        if model is None:
            continue
        path = model_dir / v / filename
        if isinstance(model, bytes):
            path.write_bytes(model)
        else:
            onnx.save_model(model, os.fspath(path))
    return model_dir


XY_CONFIG = """
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


# ---------------------------------------------------------------------------------------------------------------------
# good configurations


class TestGoodConfigs:
    @pytest.mark.parametrize(
        "config, model, default_mbs, expected",
        [
            pytest.param(
                XY_CONFIG, BATCHING, 4,
                dict(max_batch_size=8, dynamic_batching=None, inputs=(TensorSpec("x", "FP32", (4,)),)),
                id="full-config-no-autocomplete",
            ),
            pytest.param(
                None, BATCHING, 4,
                # no config: batch-capable -> default_max_batch_size 4, and 4 > 1 adds an empty dynamic_batching
                dict(max_batch_size=4, dynamic_batching=DynamicBatching(), outputs=(TensorSpec("y", "FP32", (4,)),)),
                id="no-config-autocomplete",
            ),
            pytest.param(
                'name: "m"\nmax_batch_size: 16\n', BATCHING, 4,
                dict(max_batch_size=16, dynamic_batching=DynamicBatching(), inputs=(TensorSpec("x", "FP32", (4,)),)),
                id="config-without-io",
            ),
            pytest.param(
                "max_batch_size: 1\n", BATCHING, 4,
                # Triton adds dynamic batching only for max_batch_size > 1
                dict(max_batch_size=1, dynamic_batching=None),
                id="mbs-1-no-dynamic-batching",
            ),
            pytest.param(
                None, BATCHING, 0,
                # default max batch size 0: the model is served without batching, dims keep the -1
                dict(max_batch_size=0, dynamic_batching=None, inputs=(TensorSpec("x", "FP32", (-1, 4)),)),
                id="default-mbs-0",
            ),
            pytest.param(
                None, FIXED, 4,
                dict(max_batch_size=0, dynamic_batching=None, inputs=(TensorSpec("x", "FP32", (2, 4)),)),
                id="fixed-first-dim-does-not-batch",
            ),
            pytest.param(
                'max_batch_size: 0\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]\n'
                'output [ { name: "y" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]\n',
                BATCHING, 4,
                # inputs and outputs both listed: Triton skips auto-complete, max_batch_size stays 0
                dict(max_batch_size=0, dynamic_batching=None),
                id="explicit-non-batching",
            ),
            pytest.param(
                'max_batch_size: 8\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]\n', BATCHING, 4,
                # a -1 in the config is compatible with any model dimension; outputs are auto-completed
                dict(max_batch_size=8, inputs=(TensorSpec("x", "FP32", (-1,)),),
                     outputs=(TensorSpec("y", "FP32", (4,)),), dynamic_batching=DynamicBatching()),
                id="wildcard-dims-and-output-autocomplete",
            ),
            pytest.param(
                'max_batch_size: 8\ninput [ { name: "a" data_type: TYPE_INT64 dims: [ 3 ] },'
                ' { name: "b" data_type: TYPE_FP32 dims: [ 5 ] } ]\n'
                'output [ { name: "d" data_type: TYPE_FP32 dims: [ -1 ] } ]\n',
                TWO, 4,
                # symbolic "n" in the model is -1: any configured size fits; a subset of the outputs is allowed
                dict(max_batch_size=8, outputs=(TensorSpec("d", "FP32", (-1,)),)),
                id="two-inputs-output-subset",
            ),
            pytest.param(
                XY_CONFIG
                + 'instance_group [ { kind: KIND_GPU gpus: [ 0, 1 ] }, { name: "cpu" count: 2 kind: KIND_CPU } ]\n',
                BATCHING, 4,
                # an unset count is 1 (Triton's normalization); an unnamed group is "<model>_<index>"
                dict(instance_groups=(
                    InstanceGroup(1, "KIND_GPU", (0, 1), "m_0"), InstanceGroup(2, "KIND_CPU", (), "cpu"),
                )),
                id="instance-groups",
            ),
            pytest.param(
                XY_CONFIG
                + """dynamic_batching {
                  preferred_batch_size: [ 2, 8 ]
                  max_queue_delay_microseconds: 500
                  preserve_ordering: true
                  priority_levels: 3
                  default_priority_level: 2
                  default_queue_policy { max_queue_size: 100 default_timeout_microseconds: 2000 }
                  priority_queue_policy { key: 1 value { timeout_action: DELAY allow_timeout_override: true } }
                }
                parameters { key: "intra_op_thread_count" value { string_value: "2" } }
                optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" } ] } }
                """,
                BATCHING, 4,
                dict(
                    dynamic_batching=DynamicBatching(
                        preferred_batch_sizes=(2, 8), max_queue_delay_us=500, preserve_ordering=True,
                        priority_levels=3, default_priority_level=2,
                        default_queue_policy=QueuePolicy(max_queue_size=100, default_timeout_us=2000),
                        priority_queue_policy={1: QueuePolicy(timeout_action="DELAY", allow_timeout_override=True)},
                    ),
                    parameters={"intra_op_thread_count": "2"},
                    gpu_execution_accelerators=("tensorrt",),
                ),
                id="dynamic-batching-priorities-parameters",
            ),
        ],
    )
    def test_load(self, tmp_path, config, model, default_mbs, expected):
        model_dir = make_model_dir(tmp_path, "m", config, model)
        cfg = load_model_config(model_dir, default_max_batch_size=default_mbs)
        assert cfg.name == "m"
        assert cfg.platform == "onnxruntime_onnx" and cfg.backend == "onnxruntime"
        for attr, value in expected.items():
            assert getattr(cfg, attr) == value, attr

    def test_no_config_default_instance_group_named_after_model(self, tmp_path):
        cfg = load_model_config(make_model_dir(tmp_path, "m", None))
        assert cfg.instance_groups == (InstanceGroup(count=1, kind="KIND_AUTO", name="m"),)

    def test_initializers_listed_as_graph_inputs_are_not_inputs(self, tmp_path):
        w = numpy_helper.from_array(np.ones((1, 4), np.float32), "w")
        graph = helper.make_graph(
            [helper.make_node("Add", ["x", "w"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, 4]),
             helper.make_tensor_value_info("w", TensorProto.FLOAT, [1, 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, 4])],
            initializer=[w],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        cfg = load_model_config(make_model_dir(tmp_path, "m", None, model))
        assert [t.name for t in cfg.inputs] == ["x"]
        assert cfg.max_batch_size == 4

    def test_default_model_filename(self, tmp_path):
        model_dir = make_model_dir(tmp_path, "m", 'default_model_filename: "net.onnx"\n', filename="net.onnx")
        entry = load_model(model_dir)
        assert entry.model_path().endswith(os.path.join("1", "net.onnx"))
        assert entry.config.default_model_filename == "net.onnx"


# ---------------------------------------------------------------------------------------------------------------------
# bad configurations: every error names the file at fault


CONFIG, ONNX_FILE, MODEL_DIR, VERSION_DIR = "config.pbtxt", "1/model.onnx", "", "1"


class TestBadConfigs:
    @pytest.mark.parametrize(
        "config, model, blamed, problem",
        [
            ('name: "m"\n\nmax_batchsize: 8\n', BATCHING, CONFIG, "line 3: unknown field 'max_batchsize'"),
            ("instance_group [ { kind: KIND_FOO } ]", BATCHING, CONFIG, 'line 1: '),
            ('max_batch_size: "x"', BATCHING, CONFIG, "line 1: Couldn't parse integer"),
            ('input [ { name: "x" dims: [ 1, 2 }', BATCHING, CONFIG, "line 1: "),
            ('name: "other"\n', BATCHING, CONFIG, "name 'other' does not match the model directory 'm'"),
            ("max_batch_size: -1\n", BATCHING, CONFIG, "max_batch_size -1 must be >= 0"),
            ('platform: "tensorrt_plan"\n', BATCHING, CONFIG, "platform 'tensorrt_plan' is not supported"),
            ('backend: "python"\n', BATCHING, CONFIG, "backend 'python' is not supported"),
            ("sequence_batching { iterative_sequence: true }\n", BATCHING, CONFIG,
             "iterative_sequence is not supported"),
            (XY_CONFIG + "dynamic_batching { preferred_batch_size: [ 4, 16 ] }", BATCHING, CONFIG,
             "preferred_batch_size 16 must be <= max_batch_size 8"),
            (XY_CONFIG + "dynamic_batching { preferred_batch_size: [ 0 ] }", BATCHING, CONFIG,
             "preferred_batch_size 0 must be positive"),
            ("max_batch_size: 2\ndynamic_batching { preferred_batch_size: [ 4 ] }", BATCHING, CONFIG,
             # checked after auto-complete, against the final max_batch_size
             "preferred_batch_size 4 must be <= max_batch_size 2"),
            (XY_CONFIG + "dynamic_batching { priority_levels: 2 default_priority_level: 3 }", BATCHING, CONFIG,
             "default_priority_level 3 must be in [1, priority_levels=2]"),
            (XY_CONFIG + "dynamic_batching { priority_levels: 2 }", BATCHING, CONFIG,
             "default_priority_level 0 must be in [1, priority_levels=2]"),
            (XY_CONFIG + "dynamic_batching { priority_levels: 2 default_priority_level: 1 "
             "priority_queue_policy { key: 5 value { } } }", BATCHING, CONFIG,
             "priority_queue_policy level 5 must be in [1, 2]"),
            (XY_CONFIG + "dynamic_batching { default_priority_level: 1 }", BATCHING, CONFIG,
             "need priority_levels > 0"),
            (XY_CONFIG + "instance_group [ { count: -2 } ]", BATCHING, CONFIG, "count -2 must be >= 1"),
            (XY_CONFIG + "instance_group [ { kind: KIND_MODEL } ]", BATCHING, CONFIG,
             "kind KIND_MODEL is not supported"),
            (XY_CONFIG + "instance_group [ { kind: KIND_CPU gpus: [ 0 ] } ]", BATCHING, CONFIG,
             "KIND_CPU cannot list gpus"),
            ('input [ { name: "x" dims: [ 4 ] } ]', BATCHING, CONFIG, "input 'x' must specify data_type"),
            ('input [ { name: "x" data_type: TYPE_BF16 dims: [ 4 ] } ]', BATCHING, CONFIG,
             "data_type TYPE_BF16 is not supported"),
            ('input [ { name: "x" data_type: TYPE_FP32 } ]', BATCHING, CONFIG, "input 'x' must specify dims"),
            ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 0 ] } ]', BATCHING, CONFIG,
             "each dimension must be >= 1, or -1"),
            ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] reshape { shape: [ 2, 2 ] } } ]', BATCHING,
             CONFIG, "input 'x': reshape [2, 2] do not match [4] (without the batch dimension)"),
            ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] reshape { shape: [ 5 ] } } ]', BATCHING,
             CONFIG, "input 'x': reshape [5] has 5 elements (its fixed dimensions), dims [4] 4"),
            ('input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] reshape { shape: [ 2, 2 ] } } ]', BATCHING,
             CONFIG, "reshape [2, 2] must have as many variable dimensions (-1) as dims [-1]"),
            ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] reshape { shape: [ 0, 4 ] } } ]', BATCHING,
             CONFIG, "reshape [0, 4]: each dimension must be >= 1, or -1"),
            ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]',
             BATCHING, CONFIG, "input 'x' is listed twice"),
            ("version_policy { latest { } }", BATCHING, CONFIG, "num_versions >= 1"),
            ("version_policy { specific { versions: [ 7 ] } }", BATCHING, CONFIG, "selects none of the versions"),
            # the config disagrees with the ONNX file
            (XY_CONFIG.replace('"x"', '"z"'), BATCHING, CONFIG, "input 'z' is not an input of"),
            (XY_CONFIG.replace("TYPE_FP32 dims: [ 4 ] } ]\noutput", "TYPE_INT32 dims: [ 4 ] } ]\noutput"), BATCHING,
             CONFIG, "input 'x': data_type TYPE_INT32 does not match TYPE_FP32"),
            (XY_CONFIG.replace("dims: [ 4 ] } ]\noutput", "dims: [ 5 ] } ]\noutput"), BATCHING, CONFIG,
             "input 'x': dims [5] do not match [4] (without the batch dimension)"),
            (XY_CONFIG.replace("dims: [ 4 ] } ]\noutput", "dims: [ 4, 1 ] } ]\noutput"), BATCHING, CONFIG,
             "dims [4, 1] do not match [4]"),
            (XY_CONFIG, FIXED, CONFIG, "first dimension of [2, 4]"),
            ("max_batch_size: 8\n", FIXED, CONFIG, "cannot batch: tensor 'x' has shape [2, 4]"),
            ('max_batch_size: 8\ninput [ { name: "a" data_type: TYPE_INT64 dims: [ 3 ] } ]\n', TWO, CONFIG,
             "inputs ['b'] of"),
            (XY_CONFIG.replace('output [ { name: "y"', 'output [ { name: "q"'), BATCHING, CONFIG,
             "output 'q' is not an output of"),
            # the ONNX file is at fault
            (None, b"", ONNX_FILE, "not a valid ONNX file: the file is empty"),
            (None, b"\x08\x07garbage that is not a protobuf \xff\xfe", ONNX_FILE, "not a valid ONNX file"),
            (None, BATCHING.SerializeToString()[:-7], ONNX_FILE, "not a valid ONNX file"),
            (None, identity_model(("x", "y", TensorProto.BFLOAT16, [B, 4])), ONNX_FILE,
             "element type BFLOAT16, which gpud does not support"),
            # the directory layout is at fault
            (None, None, VERSION_DIR, "no model file 'model.onnx'"),
        ],
    )
    def test_error_names_file(self, tmp_path, config, model, blamed, problem):
        model_dir = make_model_dir(tmp_path, "m", config, model)
        with pytest.raises(ModelConfigError) as info:
            load_model_config(model_dir)
        err = info.value
        expected_path = os.path.join(os.fspath(model_dir), blamed) if blamed else os.fspath(model_dir)
        assert err.path == expected_path
        assert str(err).startswith(expected_path + ": ")
        assert problem in str(err)
        assert isinstance(err, ValueError)

    def test_unknown_field_message_exact(self, tmp_path):
        model_dir = make_model_dir(tmp_path, "mlp", 'name: "mlp"\n\nmax_batchsize: 8\n')
        with pytest.raises(ModelConfigError) as info:
            load_model_config(model_dir)
        assert str(info.value) == (
            f"{model_dir}/config.pbtxt: line 3: unknown field 'max_batchsize' in inference.ModelConfig"
        )
        assert info.value.line == 3

    def test_no_version_directory(self, tmp_path):
        model_dir = make_model_dir(tmp_path, "m", None, versions=())
        with pytest.raises(ModelConfigError, match="no version directory") as info:
            load_model_config(model_dir)
        assert info.value.path == os.fspath(model_dir)

    def test_model_without_outputs_is_not_valid_onnx(self, tmp_path):
        model = identity_model(("x", "y", TensorProto.FLOAT, [B, 4]))
        del model.graph.output[:]
        model_dir = make_model_dir(tmp_path, "m", None, model)
        with pytest.raises(ModelConfigError, match="no graph outputs") as info:
            load_model_config(model_dir)
        assert info.value.path == os.path.join(os.fspath(model_dir), "1", "model.onnx")

    def test_without_config_file_the_model_dir_is_blamed(self, tmp_path):
        # nothing in the ONNX file is wrong, and there is no config.pbtxt: the problem is the directory's
        model_dir = make_model_dir(tmp_path, "m", None, versions=("1",))
        (model_dir / "1" / "model.onnx").unlink()
        with pytest.raises(ModelConfigError) as info:
            load_model_config(model_dir)
        assert info.value.path == os.path.join(os.fspath(model_dir), "1")


# ---------------------------------------------------------------------------------------------------------------------
# version policies


class TestVersionPolicy:
    @pytest.mark.parametrize(
        "policy, expected",
        [
            ("", (10,)),  # Triton's default: latest { num_versions: 1 }
            ("version_policy { latest { num_versions: 2 } }", (3, 10)),
            ("version_policy { latest { num_versions: 9 } }", (1, 2, 3, 10)),
            ("version_policy { all { } }", (1, 2, 3, 10)),
            ("version_policy { specific { versions: [ 2, 7 ] } }", (2,)),  # 7 is missing: skipped, as Triton does
            ("version_policy: { specific: { versions: [10, 1] } }", (1, 10)),
        ],
    )
    def test_selects(self, tmp_path, policy, expected):
        # "01" (leading zero), "abc" and "-1" are not version directories
        model_dir = make_model_dir(tmp_path, "m", policy, versions=("1", "2", "3", "10", "01", "abc", "-1"))
        entry = load_model(model_dir)
        assert entry.versions == expected
        assert entry.latest_version == expected[-1]
        assert set(entry.model_paths) == set(expected)
        assert all(os.path.isfile(p) for p in entry.model_paths.values())

    def test_available_versions_ignores_non_versions(self, tmp_path):
        model_dir = make_model_dir(tmp_path, "m", None, versions=("3", "0", "007", "x1", "12"))
        (model_dir / "5").write_text("a file, not a directory")
        assert available_versions(model_dir) == (0, 3, 12)

    def test_a_selected_version_without_file_fails_the_model(self, tmp_path):
        model_dir = make_model_dir(tmp_path, "m", "version_policy { all { } }", versions=("1", "2"))
        os.remove(model_dir / "2" / "model.onnx")
        with pytest.raises(ModelConfigError, match="no model file") as info:
            load_model(model_dir)
        assert info.value.path == os.path.join(os.fspath(model_dir), "2")

    def test_unselected_version_without_file_is_fine(self, tmp_path):
        model_dir = make_model_dir(tmp_path, "m", None, versions=("1", "2"))
        os.remove(model_dir / "1" / "model.onnx")
        assert load_model(model_dir).versions == (2,)

    @pytest.mark.parametrize(
        "policy, available, expected",
        [
            (VersionPolicy(), [3, 1, 2], (3,)),
            (VersionPolicy(kind="latest", num_versions=2), [3, 1, 2], (2, 3)),
            (VersionPolicy(kind="all"), [3, 1], (1, 3)),
            (VersionPolicy(kind="specific", versions=(1, 5)), [1, 2], (1,)),
            (VersionPolicy(), [], ()),
        ],
    )
    def test_select_pure(self, policy, available, expected):
        assert policy.select(available) == expected


# ---------------------------------------------------------------------------------------------------------------------
# repository scan


class TestScan:
    def test_bad_model_does_not_stop_the_others(self, tmp_path):
        make_model_dir(tmp_path, "good", XY_CONFIG)
        make_model_dir(tmp_path, "bad_config", "max_batchsize: 3\n")
        make_model_dir(tmp_path, "corrupt", None, b"not onnx")
        make_model_dir(tmp_path, "empty", None, versions=())
        (tmp_path / ".hidden").mkdir()
        (tmp_path / "README.md").write_text("not a model")
        result = ModelRepository(tmp_path).scan()
        assert sorted(result) == ["bad_config", "corrupt", "empty", "good"]
        assert isinstance(result["good"], ModelEntry)
        assert result["good"].config.max_batch_size == 8
        for name in ("bad_config", "corrupt", "empty"):
            err = result[name]
            assert isinstance(err, ModelLoadError)
            assert err.name == name
            assert err.reason.startswith(os.fspath(tmp_path / name))
        assert "unknown field 'max_batchsize'" in result["bad_config"].reason
        assert "not a valid ONNX file" in result["corrupt"].reason

    def test_load_unknown_model(self, tmp_path):
        with pytest.raises(ModelConfigError, match="model directory not found"):
            ModelRepository(tmp_path).load("nope")

    def test_missing_repository(self, tmp_path):
        with pytest.raises(FileNotFoundError):
            ModelRepository(tmp_path / "nope").scan()

    def test_default_max_batch_size_passed_through(self, tmp_path):
        make_model_dir(tmp_path, "m", None)
        entry = ModelRepository(tmp_path, default_max_batch_size=32).scan()["m"]
        assert isinstance(entry, ModelEntry)
        assert entry.config.max_batch_size == 32


# ---------------------------------------------------------------------------------------------------------------------
# JSON


class TestJson:
    @pytest.mark.parametrize(
        "config, policy",
        [
            (XY_CONFIG, ""),
            (None, "version_policy { all { } }"),
            (XY_CONFIG + """dynamic_batching { preferred_batch_size: [ 2, 8 ] max_queue_delay_microseconds: 500
               priority_levels: 2 default_priority_level: 1
               default_queue_policy { max_queue_size: 5 timeout_action: DELAY default_timeout_microseconds: 9 }
               priority_queue_policy { key: 2 value { max_queue_size: 7 } } }
               instance_group [ { count: 2 kind: KIND_GPU gpus: [ 1 ] } ]
               parameters { key: "k" value { string_value: "v" } }
               optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" } ] } }""",
             "version_policy { specific { versions: [ 1 ] } }"),
        ],
    )
    def test_round_trip_through_parse_dict(self, tmp_path, config, policy):
        text = None if config is None and not policy else (config or "") + "\n" + policy
        entry = load_model(make_model_dir(tmp_path, "m", text))
        d = model_config_json(ServedModelConfig(entry.config, entry.version_policy))
        message = json_format.ParseDict(d, model_config_pb2.ModelConfig())
        # the JSON means the same config: converting the protobuf back gives the same typed values
        again, again_policy = config_from_proto(message, "m", "<json>")
        assert again == entry.config
        assert again_policy == entry.version_policy
        assert d["max_batch_size"] == entry.config.max_batch_size
        assert isinstance(d["input"][0]["dims"][0], int)  # numbers, not protobuf's int64-as-string

    def test_triton_field_names(self, tmp_path):
        text = XY_CONFIG + "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 100 }"
        d = model_config_json(ServedModelConfig(load_model_config(make_model_dir(tmp_path, "m", text))))
        assert d["input"][0]["data_type"] == "TYPE_FP32"
        assert d["input"][0]["dims"] == [4]
        assert d["version_policy"] == {"latest": {"num_versions": 1}}
        assert d["dynamic_batching"]["preferred_batch_size"] == [4]
        assert d["dynamic_batching"]["max_queue_delay_microseconds"] == 100
        assert d["dynamic_batching"]["default_queue_policy"]["timeout_action"] == "REJECT"
        assert d["instance_group"] == [{"name": "m", "kind": "KIND_AUTO", "count": 1, "gpus": []}]

    def test_scalar_per_item_uses_triton_reshape(self):
        # a batching model whose tensor is [-1]: Triton's auto-complete writes dims [1] and an empty reshape
        cfg = load_cfg_from(identity_model(("x", "y", TensorProto.FLOAT, [B])))
        assert (cfg.inputs[0].dims, cfg.inputs[0].reshape, cfg.inputs[0].model_dims) == ((1,), (), ())
        d = model_config_json(ServedModelConfig(cfg))
        assert d["input"][0]["dims"] == [1] and d["input"][0]["reshape"] == {"shape": []}
        json_format.ParseDict(d, model_config_pb2.ModelConfig())

    @pytest.mark.parametrize(
        "model, default_mbs, in_shape",
        [(BATCHING, 4, [-1, 4]), (BATCHING, 0, [-1, 4]), (FIXED, 4, [2, 4])],
    )
    def test_metadata(self, model, default_mbs, in_shape):
        cfg = load_cfg_from(model, default_mbs)
        md = model_metadata_json(ModelMetadata.of(cfg, [1, 3]))
        assert md == {
            "name": "m",
            "versions": ["1", "3"],
            "platform": "onnxruntime_onnx",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": in_shape}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": in_shape}],
        }


def load_cfg_from(model: onnx.ModelProto, default_mbs: int = 4):
    with tempfile.TemporaryDirectory() as d:
        return load_model_config(make_model_dir(Path(d), "m", None, model), default_max_batch_size=default_mbs)


# ---------------------------------------------------------------------------------------------------------------------
# parsing and footprint


def test_parse_config_text_accepts_triton_syntax():
    text = """
    # comments, both list syntaxes, colon before messages
    name: "m"
    max_batch_size: 8
    input: [ { name: "x", data_type: TYPE_FP32, dims: [ -1, 3 ] } ]
    input { name: "x2" data_type: TYPE_UINT8 dims: 1 dims: 2 }
    """
    msg = parse_config_text(text, "m/config.pbtxt")
    assert [i.name for i in msg.input] == ["x", "x2"]
    assert list(msg.input[1].dims) == [1, 2]


class TestFootprint:
    def test_arithmetic(self, tmp_path):
        # y = x @ w + b with x FP32 [batch, 8], w [8, 16], b [16]
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, 16])],
            initializer=[
                numpy_helper.from_array(np.zeros((8, 16), np.float32), "w"),
                numpy_helper.from_array(np.zeros(16, np.float32), "b"),
            ],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        entry = load_model(make_model_dir(tmp_path, "m", "max_batch_size: 10\n", model))
        # weights: (8*16 + 16) * 4 = 576
        # activations per item: x 8 + h 16 + y 16 = 40 floats = 160 bytes; * max_batch_size 10 = 1600
        assert estimate_footprint_bytes(entry.model_path(), entry.config) == 576 + 1600
        # not batching: one item
        assert estimate_footprint_bytes(entry.model_path(), replace(entry.config, max_batch_size=0)) == 576 + 160

    def test_corrupt_file(self, tmp_path):
        path = tmp_path / "model.onnx"
        path.write_bytes(b"\x00\x01\x02")
        with pytest.raises(ModelConfigError, match="not a valid ONNX file"):
            estimate_footprint_bytes(path, load_cfg_from(BATCHING))
