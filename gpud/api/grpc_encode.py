"""The core's typed answers as Triton's gRPC messages (server and model metadata, model configuration, statistics,
repository index), built field by field from the typed values.

Every message here is the one Triton's HTTP JSON of the same value (`gpud.api.http_encode`) means, down to which
sub-messages are present: tests/test_api_encoders.py reads that JSON as protobuf JSON and compares.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from google.protobuf.message import Message

from gpud.executor.model_config import QueuePolicy, TensorSpec
from gpud.executor.datatypes import triton_type
from gpud.executor.stats import Duration, ModelStats
from gpud.core_api import (ModelMetadata, ModelStatistics, RepositoryModel, ServedModelConfig, ServerMetadata,
                           TensorMetadata)
from gpud.api.sequence_encode import sequence_batching_message
from gpud.executor.process_log import LogSettings
from gpud.tracing.settings import TraceSettings
from gpud.repository.config import VersionPolicy
from gpud.proto import grpc_service_pb2 as pb
from gpud.proto import model_config_pb2 as mc


def server_metadata_message(metadata: ServerMetadata) -> pb.ServerMetadataResponse:
    return pb.ServerMetadataResponse(name=metadata.name, version=metadata.version, extensions=metadata.extensions)


def log_settings_message(settings: LogSettings) -> pb.LogSettingsResponse:
    """Every log setting, each in the oneof member of its type (as Triton's)."""
    message = pb.LogSettingsResponse()
    for name, value in settings.wire().items():
        if isinstance(value, bool):
            message.settings[name].bool_param = value
        elif isinstance(value, int):
            message.settings[name].uint32_param = value
        else:
            message.settings[name].string_param = value
    return message


def trace_settings_message(settings: TraceSettings) -> pb.TraceSettingResponse:
    """Every trace setting, as a list of strings (the level's several, the others' one)."""
    message = pb.TraceSettingResponse()
    for name, value in settings.wire().items():
        message.settings[name].value.extend(value if isinstance(value, list) else [value])
    return message


def _tensor_metadata(t: TensorMetadata) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype, shape=t.shape)


def model_metadata_message(metadata: ModelMetadata) -> pb.ModelMetadataResponse:
    return pb.ModelMetadataResponse(
        name=metadata.name,
        versions=metadata.versions,
        platform=metadata.platform,
        inputs=[_tensor_metadata(t) for t in metadata.inputs],
        outputs=[_tensor_metadata(t) for t in metadata.outputs],
    )


# --------------------------------------------------------------------------------------------------------------------
# Model configuration


def _version_policy(policy: VersionPolicy, message: mc.ModelVersionPolicy) -> None:
    if policy.kind == "all":
        message.all.SetInParent()
    elif policy.kind == "specific":
        message.specific.versions.extend(policy.versions)
        message.specific.SetInParent()  # present even if it were empty, as {"specific": {...}} is in the JSON
    else:
        message.latest.num_versions = policy.num_versions
        message.latest.SetInParent()


def _tensor(spec: TensorSpec, message: mc.ModelInput | mc.ModelOutput) -> None:
    message.name = spec.name
    # cast: protoc's .pyi types an enum field as its enum class, while types-protobuf types Value() as int
    message.data_type = cast(mc.DataType, mc.DataType.Value(triton_type(spec.datatype)))
    message.dims.extend(spec.dims)
    if spec.reshape is not None:
        message.reshape.shape.extend(spec.reshape)
        message.reshape.SetInParent()  # present also when empty (a scalar per batch item)
    # format FORMAT_NONE, is_shape_tensor, allow_ragged_batch and label_filename are their defaults


def _queue_policy(policy: QueuePolicy, message: mc.ModelQueuePolicy) -> None:
    message.SetInParent()
    message.timeout_action = cast(mc.ModelQueuePolicy.TimeoutAction,  # cast: as in _tensor
                                  mc.ModelQueuePolicy.TimeoutAction.Value(policy.timeout_action))
    message.default_timeout_microseconds = policy.default_timeout_us
    message.allow_timeout_override = policy.allow_timeout_override
    message.max_queue_size = policy.max_queue_size


def model_config_message(served: ServedModelConfig) -> mc.ModelConfig:
    """model_config.proto's ModelConfig (what ModelConfigResponse.config carries)."""
    config = served.config
    message = mc.ModelConfig(
        name=config.name,
        platform=config.platform,
        backend=config.backend,
        max_batch_size=config.max_batch_size,
        default_model_filename=config.default_model_filename,
    )
    _version_policy(served.version_policy, message.version_policy)
    for spec in config.inputs:
        tensor = message.input.add()
        _tensor(spec, tensor)
        tensor.optional = spec.optional
    for spec in config.outputs:
        _tensor(spec, message.output.add())
    for g in config.instance_groups:
        message.instance_group.add(name=g.name or config.name, kind=mc.ModelInstanceGroup.Kind.Value(g.kind),
                                   count=g.count, gpus=g.gpus)
    for key, value in config.parameters.items():
        message.parameters[key].string_value = value  # the entry exists even for an empty value
    if config.gpu_execution_accelerators:
        accelerators = message.optimization.execution_accelerators.gpu_execution_accelerator
        for name in config.gpu_execution_accelerators:
            accelerators.add(name=name)
    if config.ensemble is not None:
        message.ensemble_scheduling.SetInParent()
        message.ensemble_scheduling.max_inflight_requests = config.ensemble.max_inflight_requests
        for step in config.ensemble.steps:
            added = message.ensemble_scheduling.step.add(model_name=step.model_name, model_version=step.model_version)
            added.input_map.update(dict(step.input_map))
            added.output_map.update(dict(step.output_map))
    db = config.dynamic_batching
    if db is not None:
        batching = message.dynamic_batching
        batching.SetInParent()
        batching.preferred_batch_size.extend(db.preferred_batch_sizes)
        batching.max_queue_delay_microseconds = db.max_queue_delay_us
        batching.preserve_ordering = db.preserve_ordering
        batching.priority_levels = db.priority_levels
        batching.default_priority_level = db.default_priority_level
        _queue_policy(db.default_queue_policy, batching.default_queue_policy)
        for level, policy in sorted(db.priority_queue_policy.items()):
            _queue_policy(policy, batching.priority_queue_policy[level])
    if config.sequence_batching is not None:
        sequence_batching_message(config.sequence_batching, message.sequence_batching)
    if served.source:
        keep_from_source(message, mc.ModelConfig.FromString(served.source))
    return message


_BY_NAME = ("input", "output")  # repeated fields whose entries are matched by name


def keep_from_source(message: Message, source: Message) -> None:
    """Fill in what config.pbtxt (`source`) sets and gpud's config does not: fields `message` lacks are copied,
    message fields present in both are filled in the same way, inputs and outputs matched by name (an input's
    format, an output's label_filename, model_warmup, response_cache, ...). What gpud sets stays."""
    have = {f.name for f, _ in message.ListFields()}
    for field, value in source.ListFields():
        name = field.name
        if field.is_repeated:
            if name in _BY_NAME and name in have:
                by_name = {entry.name: entry for entry in getattr(message, name)}
                for entry in value:
                    if entry.name in by_name:
                        keep_from_source(by_name[entry.name], entry)
            elif name not in have:
                getattr(message, name).MergeFrom(value)
        elif field.type == field.TYPE_MESSAGE:
            if name in have:
                keep_from_source(getattr(message, name), value)
            else:
                getattr(message, name).CopyFrom(value)
        elif name not in have:
            setattr(message, name, value)


# --------------------------------------------------------------------------------------------------------------------
# Statistics and the repository index


def _duration(d: Duration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=d.count, ns=d.ns)


def _model_statistics(name: str, version: str, stats: ModelStats) -> pb.ModelStatistics:
    return pb.ModelStatistics(
        name=name,
        version=version,
        last_inference=stats.last_inference_ms,
        inference_count=stats.inference_count,
        execution_count=stats.execution_count,
        inference_stats=pb.InferStatistics(
            success=_duration(stats.success),
            fail=_duration(stats.fail),
            queue=_duration(stats.queue),
            compute_input=_duration(stats.compute_input),
            compute_infer=_duration(stats.compute_infer),
            compute_output=_duration(stats.compute_output),
            cache_hit=pb.StatisticDuration(),  # gpud has no response cache
            cache_miss=pb.StatisticDuration(),
        ),
        batch_stats=[
            pb.InferBatchStatistics(
                batch_size=size,
                compute_input=_duration(b.compute_input),
                compute_infer=_duration(b.compute_infer),
                compute_output=_duration(b.compute_output),
            )
            for size, b in sorted(stats.batches.items())
        ],
    )


def model_statistics_message(statistics: Iterable[ModelStatistics]) -> pb.ModelStatisticsResponse:
    return pb.ModelStatisticsResponse(model_stats=[_model_statistics(s.name, s.version, s.stats) for s in statistics])


def repository_index_message(models: Iterable[RepositoryModel]) -> pb.RepositoryIndexResponse:
    return pb.RepositoryIndexResponse(models=[
        pb.RepositoryIndexResponse.ModelIndex(name=m.name, version=m.version, state=m.state.value, reason=m.reason)
        for m in models
    ])
