"""gpud's config.pbtxt options, read once when the configuration is read (gpud.repository.options), and the one
bounds system built on them (gpud.scaling.bounds)."""
from __future__ import annotations

import pytest

from gpud.examples import write_example_repository
from gpud.executor.model_config import InstanceGroup, ModelConfig, ModelOptions
from gpud.repository.errors import ModelConfigError
from gpud.repository.layout import ModelLoadError, ModelRepository
from gpud.repository.options import read_options
from gpud.scaling.bounds import BoundsDefaults, InstanceBounds, instance_bounds

PATH = "/repo/m/config.pbtxt"
ONE = (InstanceGroup(count=1),)


class TestReadOptions:
    def test_nothing_set_is_the_defaults(self):
        assert read_options({}, ONE, PATH) == ModelOptions()

    def test_every_option(self):
        options = read_options({"gpud_min_instances": "0", "gpud_max_instances": "6", "gpud_compute_fraction": "0.25",
                                "gpud_batching": "triton", "gpud_cuda_tf32": "True", "intra_op_thread_count": "2",
                                "someone_elses": "kept, not read"}, ONE, PATH)
        assert options == ModelOptions(min_instances=0, max_instances=6, compute_fraction=0.25, batching="triton",
                                       cuda_tf32=True, intra_op_threads=2)

    def test_a_latency_objective_and_the_nodes_default(self):
        from gpud.executor.objective import LatencyObjective, ObjectiveDefaults, objective_of

        own = read_options({"gpud_latency_objective_ms": "20", "gpud_latency_objective_share": "0.999",
                            "gpud_latency_objective_shed": "true"}, ONE, PATH)
        assert objective_of(own) == LatencyObjective(0.020, 0.999, True)
        assert objective_of(own, ObjectiveDefaults(500.0, 0.9)) == LatencyObjective(0.020, 0.999, True)
        share_only = read_options({"gpud_latency_objective_share": "0.95"}, ONE, PATH)
        assert objective_of(share_only) is None  # no bound anywhere: none
        assert objective_of(share_only, ObjectiveDefaults(150.0)) == LatencyObjective(0.150, 0.95)
        assert objective_of(read_options({}, ONE, PATH), ObjectiveDefaults(150.0)) == LatencyObjective(0.150, 0.99)

    @pytest.mark.parametrize("key, text, message", [
        ("gpud_min_instances", "two", "parameter gpud_min_instances must be a whole number of instances >= 0, "
                                      "got 'two'"),
        ("gpud_max_instances", "-1", "parameter gpud_max_instances must be a whole number of instances >= 0, "
                                     "got '-1'"),
        ("gpud_compute_fraction", "0", "parameter gpud_compute_fraction must be a number in (0, 1]"),
        ("gpud_compute_fraction", "1.5", "parameter gpud_compute_fraction must be a number in (0, 1]"),
        ("gpud_compute_fraction", "nan", "parameter gpud_compute_fraction must be a number in (0, 1]"),
        ("gpud_compute_fraction", "half", "parameter gpud_compute_fraction must be a number in (0, 1]"),
        ("gpud_batching", "fast", "parameter gpud_batching must be one of adaptive, triton, got 'fast'"),
        ("gpud_cuda_tf32", "maybe", "parameter gpud_cuda_tf32 must be true or false, got 'maybe'"),
        ("intra_op_thread_count", "x", "parameter intra_op_thread_count must be a whole number of threads"),
        ("gpud_min_instance", "1", "unknown parameter 'gpud_min_instance'; gpud's parameters are gpud_batching, "
                                   "gpud_compute_fraction, gpud_cuda_tf32, gpud_latency_objective_ms, "
                                   "gpud_latency_objective_share, gpud_latency_objective_shed, gpud_max_instances, "
                                   "gpud_min_instances"),
        ("gpud_latency_objective_ms", "0", "parameter gpud_latency_objective_ms must be a number of milliseconds > 0"),
        ("gpud_latency_objective_ms", "fast", "parameter gpud_latency_objective_ms must be a number of milliseconds"),
        ("gpud_latency_objective_ms", "inf", "parameter gpud_latency_objective_ms must be a number of milliseconds"),
        ("gpud_latency_objective_ms", "3600001", "and at most 3600000 (an hour), got '3600001'"),
        ("gpud_latency_objective_share", "1", "parameter gpud_latency_objective_share must be a share of requests, "
                                              "a number in (0, 1) such as 0.99, got '1'"),
        ("gpud_latency_objective_share", "99%", "parameter gpud_latency_objective_share must be a share"),
        ("gpud_latency_objective_shed", "yes", "parameter gpud_latency_objective_shed must be true or false"),
    ])
    def test_a_bad_value_names_the_file_the_key_and_what_is_allowed(self, key, text, message):
        with pytest.raises(ModelConfigError) as info:
            read_options({key: text}, ONE, PATH)
        assert info.value.path == PATH and message in info.value.problem

    def test_a_maximum_below_the_minimum(self):
        with pytest.raises(ModelConfigError, match=r"gpud_max_instances \(2\) is below the minimum \(3\)"):
            read_options({"gpud_min_instances": "3", "gpud_max_instances": "2"}, ONE, PATH)
        with pytest.raises(ModelConfigError, match="the instance_group count; set gpud_min_instances too"):
            read_options({"gpud_max_instances": "1"}, (InstanceGroup(count=2),), PATH)


def test_a_bad_option_is_reported_when_the_repository_is_read_with_the_file(tmp_path):
    write_example_repository(tmp_path, ["mlp"])
    with open(tmp_path / "mlp" / "config.pbtxt", "a") as f:
        f.write('parameters { key: "gpud_batching" value: { string_value: "fastest" } }\n')
    scanned = ModelRepository(tmp_path).scan()["mlp"]
    assert isinstance(scanned, ModelLoadError)
    assert f"{tmp_path / 'mlp' / 'config.pbtxt'}: parameter gpud_batching must be one of adaptive, triton" \
        in scanned.reason


def _config(counts=(1,), **options) -> ModelConfig:
    return ModelConfig("m", instance_groups=tuple(InstanceGroup(count=c) for c in counts),
                       options=ModelOptions(**options))


class TestBounds:
    @pytest.mark.parametrize("counts, options, defaults, want", [
        ((2, 1), {}, BoundsDefaults(), InstanceBounds(3, None)),  # 2 + 1 configured, no maximum but the room
        ((1,), {"min_instances": 0, "max_instances": 6}, BoundsDefaults(), InstanceBounds(0, 6)),
        ((1,), {}, BoundsDefaults(0, 4), InstanceBounds(0, 4)),  # the node's defaults where the model sets none
        ((1,), {"max_instances": 2}, BoundsDefaults(None, 8), InstanceBounds(1, 2)),  # the model's own first
        ((3,), {}, BoundsDefaults(None, 2), InstanceBounds(3, 3)),  # its count is its own: the default max yields
        ((1,), {"min_instances": 5}, BoundsDefaults(None, 2), InstanceBounds(5, 5)),  # so does it to its own min
        ((1,), {"max_instances": 1}, BoundsDefaults(4, None), InstanceBounds(1, 1)),  # the default min to its max
    ])
    def test_the_models_own_then_the_nodes_defaults_then_its_count(self, counts, options, defaults, want):
        assert instance_bounds(_config(counts, **options), defaults) == want

    def test_defaults_that_cross_are_refused(self):
        with pytest.raises(ValueError, match=r"max_instances \(1\) must be >= min_instances \(2\)"):
            BoundsDefaults(2, 1)

    def test_clamp_and_describe(self):
        assert [InstanceBounds(1, 4).clamp(n) for n in (0, 2, 9)] == [1, 2, 4]
        assert InstanceBounds(0, None).clamp(50) == 50
        assert InstanceBounds(0, None).describe() == "[0, no limit]"
