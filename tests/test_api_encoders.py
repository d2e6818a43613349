"""The two KServe encoders of the core's typed answers agree: the HTTP JSON (gpud.api.http_encode), read as
protobuf JSON, is the very message the gRPC encoder (gpud.api.grpc_encode) builds from the same value, down to which
sub-messages are present. So the HTTP and gRPC front ends cannot drift apart."""
from __future__ import annotations

import pytest
from google.protobuf import json_format

from gpud.executor.model_config import (DynamicBatching, EnsembleScheduling, EnsembleStep, InstanceGroup, ModelConfig,
                                   QueuePolicy, TensorSpec)
from gpud.executor.stats import BatchStats, Duration, ModelStats
from gpud.api import grpc_encode, http_encode
from gpud.core_api import (ModelMetadata, ModelStatistics, RepositoryModel, ServedModelConfig,
                           ServerMetadata)
from gpud.examples import write_example_repository
from gpud.proto import grpc_service_pb2 as pb
from gpud.proto import model_config_pb2
from gpud.repository.config import VersionPolicy
from gpud.repository.layout import ModelEntry, ModelRepository
from gpud.telemetry.serving import ModelState

FULL = ModelConfig(
    name="full", max_batch_size=16,
    inputs=(TensorSpec("a", "INT8", (3,)), TensorSpec("b", "BOOL", (1,))),
    outputs=(TensorSpec("c", "UINT64", (3,)),),
    instance_groups=(InstanceGroup(2, "KIND_GPU", (0, 1), "g0"), InstanceGroup(1, "KIND_CPU", (), "")),
    dynamic_batching=DynamicBatching(
        preferred_batch_sizes=(2, 8), max_queue_delay_us=500, preserve_ordering=True, priority_levels=3,
        default_priority_level=2, default_queue_policy=QueuePolicy(5, 9, "DELAY", True),
        priority_queue_policy={3: QueuePolicy(7), 1: QueuePolicy(1, 2, "REJECT", False)}),
    gpu_execution_accelerators=("tensorrt", "cuda"), parameters={"k": "v", "empty": ""},
    default_model_filename="model2.onnx")

CONFIGS = {
    "plain": ServedModelConfig(ModelConfig(name="plain", inputs=(TensorSpec("x", "FP32", (4,)),),
                                           outputs=(TensorSpec("y", "FP32", (4,)),))),
    "batching, scalars, optional, all versions": ServedModelConfig(
        ModelConfig(name="batch", max_batch_size=8,
                    inputs=(TensorSpec("x", "FP32", ()), TensorSpec("s", "BYTES", (-1, 3), optional=True)),
                    outputs=(TensorSpec("y", "INT64", ()), TensorSpec("z", "FP16", (2, -1))),
                    dynamic_batching=DynamicBatching()),
        VersionPolicy(kind="all")),
    "every field": ServedModelConfig(FULL, VersionPolicy(kind="specific", versions=(1, 3))),
    "ensemble": ServedModelConfig(ModelConfig(
        name="ens", platform="ensemble", backend="", max_batch_size=4, inputs=(TensorSpec("IN", "UINT8", (16,)),),
        outputs=(TensorSpec("OUT", "FP32", (4,)),), instance_groups=(), default_model_filename="",
        ensemble=EnsembleScheduling((EnsembleStep("a", -1, (("x", "IN"),), (("y", "mid"), ("z", "mid2"))),
                                     EnsembleStep("b", 3, (("x", "mid"), ("w", "mid2")), (("y", "OUT"),))),
                                    max_inflight_requests=16))),
    "scalar, no batching, no instance group": ServedModelConfig(
        ModelConfig(name="scalar", inputs=(TensorSpec("x", "FP64", ()),), outputs=(TensorSpec("y", "UINT8", ()),),
                    instance_groups=()),
        VersionPolicy(kind="latest", num_versions=3)),
}


def _stats() -> ModelStats:
    stats = ModelStats(success=Duration(10, 12345), fail=Duration(2, 99), queue=Duration(10, 2**40),
                       compute_input=Duration(3, 4), compute_infer=Duration(5, 6), compute_output=Duration(7, 8),
                       inference_count=40, execution_count=12, last_inference_ms=1_700_000_000_123)
    stats.batches[4] = BatchStats(Duration(1, 2), Duration(3, 4), Duration(5, 6))
    stats.batches[1] = BatchStats(Duration(7, 8), Duration(9, 10), Duration(11, 2**50))
    return stats


def _same(http_json, message) -> None:
    """The HTTP JSON, parsed as protobuf JSON (strictly: no unknown fields), equals the gRPC message."""
    parsed = json_format.ParseDict(http_json, type(message)())
    assert parsed == message
    assert parsed.SerializeToString(deterministic=True) == message.SerializeToString(deterministic=True)


class TestEncodersAgree:
    @pytest.mark.parametrize("served", CONFIGS.values(), ids=CONFIGS.keys())
    def test_model_config(self, served):
        _same(http_encode.model_config_json(served), grpc_encode.model_config_message(served))

    def test_model_config_of_the_example_repository(self, tmp_path):
        write_example_repository(tmp_path)
        entries = ModelRepository(tmp_path).scan().values()
        assert entries and all(isinstance(e, ModelEntry) for e in entries)
        for entry in entries:
            served = ServedModelConfig(entry.config, entry.version_policy)
            _same(http_encode.model_config_json(served), grpc_encode.model_config_message(served))

    @pytest.mark.parametrize("served", CONFIGS.values(), ids=CONFIGS.keys())
    def test_model_metadata(self, served):
        metadata = ModelMetadata.of(served.config, [1, "3"])
        _same(http_encode.model_metadata_json(metadata), grpc_encode.model_metadata_message(metadata))

    @pytest.mark.parametrize("count", [0, 1, 2])
    def test_model_statistics(self, count):
        statistics = [ModelStatistics("m", "3", _stats()), ModelStatistics("idle", "1", ModelStats())][:count]
        _same(http_encode.model_statistics_json(statistics), grpc_encode.model_statistics_message(statistics))

    def test_repository_index(self):
        models = [RepositoryModel("a", "1", ModelState.READY),
                  RepositoryModel("a", "2", ModelState.UNAVAILABLE, "no instance is ready"),
                  RepositoryModel("b", "", ModelState.UNAVAILABLE, "b/config.pbtxt: bad"),
                  RepositoryModel("c", "1", ModelState.LOADING), RepositoryModel("d", "1", ModelState.UNLOADING)]
        _same({"models": http_encode.repository_index_json(models)}, grpc_encode.repository_index_message(models))

    def test_server_metadata(self):
        metadata = ServerMetadata("gpud", "1.2.3", ("statistics", "binary_tensor_data"))
        _same(http_encode.server_metadata_json(metadata), grpc_encode.server_metadata_message(metadata))


class TestHttpJson:
    def test_statistics_shape(self):
        # Triton's statistics extension as perf_analyzer reads it: batch sizes ascending, no response cache
        (doc,) = http_encode.model_statistics_json([ModelStatistics("m", "3", _stats())])["model_stats"]
        assert doc == {
            "name": "m", "version": "3", "last_inference": 1_700_000_000_123, "inference_count": 40,
            "execution_count": 12,
            "inference_stats": {
                "success": {"count": 10, "ns": 12345}, "fail": {"count": 2, "ns": 99},
                "queue": {"count": 10, "ns": 2**40}, "compute_input": {"count": 3, "ns": 4},
                "compute_infer": {"count": 5, "ns": 6}, "compute_output": {"count": 7, "ns": 8},
                "cache_hit": {"count": 0, "ns": 0}, "cache_miss": {"count": 0, "ns": 0},
            },
            "batch_stats": [
                {"batch_size": 1, "compute_input": {"count": 7, "ns": 8}, "compute_infer": {"count": 9, "ns": 10},
                 "compute_output": {"count": 11, "ns": 2**50}},
                {"batch_size": 4, "compute_input": {"count": 1, "ns": 2}, "compute_infer": {"count": 3, "ns": 4},
                 "compute_output": {"count": 5, "ns": 6}},
            ],
        }

    def test_repository_index_and_server_metadata(self):
        assert http_encode.repository_index_json([RepositoryModel("b", "", ModelState.UNAVAILABLE, "why")]) == [
            {"name": "b", "version": "", "state": "UNAVAILABLE", "reason": "why"}]
        assert http_encode.server_metadata_json(ServerMetadata("gpud", "1", ("statistics",))) == {
            "name": "gpud", "version": "1", "extensions": ["statistics"]}

    def test_version_policies(self):
        assert http_encode.version_policy_json(VersionPolicy()) == {"latest": {"num_versions": 1}}
        assert http_encode.version_policy_json(VersionPolicy(kind="all")) == {"all": {}}
        assert http_encode.version_policy_json(VersionPolicy(kind="specific", versions=(1, 3))) == {
            "specific": {"versions": [1, 3]}}


def test_grpc_config_message_in_the_response():
    # what ModelConfig answers: the message above inside ModelConfigResponse.config
    served = CONFIGS["every field"]
    response = pb.ModelConfigResponse(config=grpc_encode.model_config_message(served))
    assert isinstance(response.config, model_config_pb2.ModelConfig) and response.config.name == "full"
    assert response.config.dynamic_batching.priority_queue_policy[3].max_queue_size == 7
