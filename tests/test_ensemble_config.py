"""Ensemble configs read and checked as Triton checks them (gpud.repository.ensemble): the config alone when the
repository is read, and against the models of its steps once they serve. Every error names the step and tensor."""
from __future__ import annotations

import pytest

from gpud.executor.model_config import ENSEMBLE_PLATFORM, EnsembleStep, ModelConfig, TensorSpec
from gpud.examples import PIPELINE_CONFIG_PBTXT
from gpud.repository.config import parse_config_text
from gpud.repository.errors import ModelConfigError
from gpud.repository.ensemble import check_against_steps, ensemble_config_from_proto, find_cycle
from gpud.repository.layout import ModelRepository
from tests.ensemble_models import ensemble_config, save_model, step

PATH = "/repo/ens/config.pbtxt"
IN = [("IN", "TYPE_FP32", [4])]
OUT = [("OUT", "TYPE_FP32", [4])]


def read(text: str, name: str = "ens") -> ModelConfig:
    return ensemble_config_from_proto(parse_config_text(text, PATH), name, PATH)[0]


def error(text: str) -> str:
    with pytest.raises(ModelConfigError) as e:
        read(text)
    assert e.value.path == PATH
    return e.value.problem


class TestReading:
    def test_the_example_pipeline(self):
        config = read(PIPELINE_CONFIG_PBTXT, "pipeline")
        assert (config.platform, config.backend, config.instance_groups, config.max_batch_size) == \
            (ENSEMBLE_PLATFORM, "", (), 16)
        assert [s.model_name for s in config.ensemble.steps] == ["preprocess", "classifier", "postprocess"]
        assert config.ensemble.steps[2] == EnsembleStep("postprocess", -1, (("logits", "logits"),),
                                                        (("label", "LABEL"), ("probabilities", "PROBABILITIES")))
        assert config.inputs == (TensorSpec("IMAGE", "UINT8", (16,)),)

    def test_a_specific_step_version_and_the_version_policy(self):
        text = ensemble_config("ens", IN, OUT, [step("m", {"x": "IN"}, {"y": "OUT"}, version=3)],
                               extra="version_policy { all { } }\n")
        config, policy = ensemble_config_from_proto(parse_config_text(text, PATH), "ens", PATH)
        assert config.ensemble.steps[0].model_version == 3 and policy.kind == "all"

    def test_a_repository_ensemble_has_an_empty_version_directory_and_no_model_file(self, tmp_path):
        save_model(tmp_path, "ens", None, ensemble_config("ens", IN, OUT, [step("m", {"x": "IN"}, {"y": "OUT"})]))
        entry = ModelRepository(tmp_path).load("ens")
        assert entry.versions == (1,) and entry.model_paths == {} and entry.config.ensemble is not None

    def test_an_ensemble_without_a_version_directory_says_what_to_add(self, tmp_path):
        (tmp_path / "ens").mkdir()
        (tmp_path / "ens" / "config.pbtxt").write_text(
            ensemble_config("ens", IN, OUT, [step("m", {"x": "IN"}, {"y": "OUT"})]))
        with pytest.raises(ModelConfigError, match="expected e.g. an empty directory 1/ for an ensemble"):
            ModelRepository(tmp_path).load("ens")


GOOD = [step("a", {"x": "IN"}, {"y": "mid"}), step("b", {"x": "mid"}, {"y": "OUT"})]


@pytest.mark.parametrize("text, problem", [
    (ensemble_config("ens", IN, OUT, GOOD).replace('platform: "ensemble"', 'platform: "onnxruntime_onnx"'),
     "ensemble_scheduling cannot be set for model 'ens' whose platform is not 'ensemble'"),
    ('name: "ens"\nplatform: "ensemble"\ninput [ { name: "IN", data_type: TYPE_FP32, dims: [4] } ]\n',
     "ensemble_scheduling must be set for ensemble 'ens'"),
    (ensemble_config("ens", IN, OUT, GOOD, extra='backend: "onnxruntime"\n'), "no backend"),
    (ensemble_config("ens", IN, OUT, GOOD, extra="instance_group [ { count: 2 } ]\n"),
     "instance_group should not be specified for ensemble 'ens'"),
    (ensemble_config("ens", IN, OUT, GOOD, extra="optimization { }\n"), "optimization should not be specified"),
    (ensemble_config("ens", [], OUT, GOOD), "ensemble 'ens' must declare its inputs"),
    (ensemble_config("ens", IN, OUT, []).replace("step [\n\n  ]", ""), "must specify 'step' for ensemble 'ens'"),
    (ensemble_config("ens", IN, OUT, [step("", {"x": "IN"}, {"y": "OUT"})]),
     "must specify 'model_name' in step 0 of ensemble 'ens'"),
    (ensemble_config("ens", IN, OUT, [step("a", {}, {"y": "OUT"})]),
     "must specify 'input_map' in step 0 (model 'a') of ensemble 'ens'"),
    (ensemble_config("ens", IN, OUT, [step("a", {"x": "IN"}, {})]),
     "must specify 'output_map' in step 0 (model 'a')"),
    (ensemble_config("ens", IN, OUT, [step("a", {"x": "IN"}, {"y": "OUT"}, version=-2)]),
     "step 0 (model 'a'): model_version -2 must be -1"),
    (ensemble_config("ens", IN, OUT, [step("ens", {"x": "IN"}, {"y": "OUT"})]),
     "step 0 (model 'ens') of ensemble 'ens' names the ensemble itself"),
    # a tensor produced twice
    (ensemble_config("ens", IN, OUT, [step("a", {"x": "IN"}, {"y": "OUT"}), step("b", {"x": "IN"}, {"y": "OUT"})]),
     "ensemble tensor 'OUT' is produced twice: by step 0 (model 'a') and by step 1 (model 'b')"),
    (ensemble_config("ens", IN, OUT, [step("a", {"x": "IN"}, {"y": "OUT", "z": "OUT"})]),
     "ensemble tensor 'OUT' is produced twice"),
    (ensemble_config("ens", IN, OUT, [step("a", {"x": "IN"}, {"y": "OUT", "z": "IN"})]),
     "ensemble tensor 'IN' is an ensemble input and also produced by step 0 (model 'a')"),
    # data flow
    (ensemble_config("ens", IN + [("UNUSED", "TYPE_FP32", [4])], OUT, GOOD),
     "ensemble input 'UNUSED' for ensemble 'ens' is not used by any step"),
    (ensemble_config("ens", IN, OUT + [("LOST", "TYPE_FP32", [4])], GOOD),
     "output 'LOST' for ensemble 'ens' is not written"),
    (ensemble_config("ens", IN, OUT, [step("a", {"x": "IN", "w": "nowhere"}, {"y": "OUT"})]),
     "step 0 (model 'a') reads ensemble tensor 'nowhere' (for its input 'w'), which is not an ensemble input"),
    (ensemble_config("ens", IN, OUT, [step("a", {"x": "IN"}, {"y": "OUT", "z": "dangling"})]),
     "ensemble tensor 'dangling' (produced by step 0 (model 'a')) is unused in ensemble 'ens'"),
    # a cycle: b reads c's output and c reads b's
    (ensemble_config("ens", IN, OUT, [step("a", {"x": "IN"}, {"y": "OUT"}),
                                      step("b", {"x": "IN", "w": "from_c"}, {"y": "from_b"}),
                                      step("c", {"x": "from_b"}, {"y": "from_c"})]),
     "the steps of ensemble 'ens' form a cycle: step 1 (model 'b') -> step 2 (model 'c') -> step 1 (model 'b')"),
])
def test_a_bad_ensemble_config_is_refused_with_the_problem(text, problem):
    assert problem in error(text)


def test_find_cycle_is_empty_for_a_diamond():
    steps = [EnsembleStep("a", input_map=(("x", "IN"),), output_map=(("y", "m1"),)),
             EnsembleStep("b", input_map=(("x", "m1"),), output_map=(("y", "m2"),)),
             EnsembleStep("c", input_map=(("x", "m1"),), output_map=(("y", "m3"),)),
             EnsembleStep("d", input_map=(("x", "m2"), ("w", "m3")), output_map=(("y", "OUT"),))]
    producer = {"m1": 0, "m2": 1, "m3": 2, "OUT": 3}
    assert find_cycle(steps, producer) == []


# --------------------------------------------------------------------------------------------------------------------
# Against the steps' models


def model(name: str, inputs, outputs, max_batch_size: int = 8) -> ModelConfig:
    return ModelConfig(name=name, max_batch_size=max_batch_size,
                       inputs=tuple(TensorSpec(*i) for i in inputs), outputs=tuple(TensorSpec(*o) for o in outputs))


ENS = read(ensemble_config("ens", IN, OUT, GOOD, max_batch_size=8))
A = model("a", [("x", "FP32", (4,))], [("y", "FP32", (4,))])
B = model("b", [("x", "FP32", (4,))], [("y", "FP32", (4,))])


class TestAgainstSteps:
    def test_matching_steps_pass(self):
        check_against_steps(ENS, [A, B])

    def test_variable_dims_match_any_size(self):
        check_against_steps(ENS, [model("a", [("x", "FP32", (-1,))], [("y", "FP32", (4,))]), B])

    def test_a_non_batching_step_with_the_batch_dimension_written_out_fits_a_batching_ensemble(self):
        # Triton compares with the batch dimension when dims alone differ: [-1, 4] (no batching) vs -1 + [4]
        check_against_steps(ENS, [model("a", [("x", "FP32", (-1, 4))], [("y", "FP32", (-1, 4))], 0), B])

    @pytest.mark.parametrize("steps, problem", [
        ([model("a", [("x", "FP32", (4,))], [("y", "FP32", (4,))], max_batch_size=4), B],
         "ensemble 'ens' allows maximum batch size 8, but step 0 (model 'a') only allows 4"),
        ([model("a", [("x", "FP32", (4,)), ("extra", "FP32", (4,))], [("y", "FP32", (4,))]), B],
         "in ensemble 'ens', step 0 (model 'a'): input 'extra' is not mapped to any ensemble tensor"),
        ([model("a", [("other", "FP32", (4,))], [("y", "FP32", (4,))]), B],
         "step 0 (model 'a'): input_map names input 'x', which the model does not have (its inputs: ['other'])"),
        ([A, model("b", [("x", "FP32", (4,))], [("z", "FP32", (4,))])],
         "step 1 (model 'b'): output_map names output 'y', which the model does not have"),
        ([model("a", [("x", "INT64", (4,))], [("y", "FP32", (4,))]), B],
         "ensemble tensor 'IN': inconsistent data type: FP32 from the ensemble's input 'IN', INT64 from step 0 "
         "(model 'a')'s input 'x'"),
        ([model("a", [("x", "FP32", (4,))], [("y", "FP32", (5,))]), B],
         "ensemble tensor 'mid': inconsistent shape: [-1,5] from step 0 (model 'a')'s output 'y', [-1,4] from step 1 "
         "(model 'b')'s input 'x'"),
        ([A, model("b", [("x", "FP32", (4,))], [("y", "FP16", (4,))])],
         "ensemble tensor 'OUT': inconsistent data type: FP32 from the ensemble's output 'OUT', FP16 from step 1"),
    ])
    def test_a_step_that_does_not_fit_is_named(self, steps, problem):
        with pytest.raises(ValueError) as e:
            check_against_steps(ENS, steps)
        assert problem in str(e.value)

    def test_an_optional_input_may_stay_unmapped(self):
        check_against_steps(ENS, [model("a", [("x", "FP32", (4,)), ("opt", "FP32", (4,), True)],
                                        [("y", "FP32", (4,))]), B])


def test_the_readmes_ensemble_example_is_the_pipeline_scripts_run_serves():
    from pathlib import Path
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("## Ensembles: pipelines in one request"):]
    block = section[section.index("```\n") + 4:]
    block = block[:block.index("```")]
    assert read(block, "pipeline") == read(PIPELINE_CONFIG_PBTXT, "pipeline")
