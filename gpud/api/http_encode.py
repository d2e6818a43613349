"""The core's typed answers as Triton's HTTP JSON (server and model metadata, model configuration, statistics,
repository index): what `tritonclient.http` and `perf_analyzer` read.

Field names are model_config.proto's and grpc_service.proto's, enums are written as their names and integers as
JSON numbers (not protobuf's int64-as-string), as Triton's HTTP server writes them. Read as protobuf JSON, every
document here is the message `gpud.api.grpc_encode` builds from the same value (tests/test_api_encoders.py).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from google.protobuf import json_format

from gpud.executor.model_config import QueuePolicy, TensorSpec
from gpud.executor.datatypes import triton_type
from gpud.executor.stats import Duration, ModelStats
from gpud.executor.types import ErrorKind, InferenceError
from gpud.core_api import (Applied, ModelMetadata, ModelStatistics, RepositoryModel, RequestedPlacement,
                           ServedModelConfig, ServerMetadata, TensorMetadata)
from gpud.api.sequence_encode import sequence_batching_json
from gpud.proto import model_config_pb2 as mc
from gpud.repository.config import VersionPolicy


def server_metadata_json(metadata: ServerMetadata) -> dict[str, Any]:
    return {"name": metadata.name, "version": metadata.version, "extensions": list(metadata.extensions)}


def _tensor_metadata_json(t: TensorMetadata) -> dict[str, Any]:
    return {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}


def model_metadata_json(metadata: ModelMetadata) -> dict[str, Any]:
    """KServe v2 model metadata."""
    return {
        "name": metadata.name,
        "versions": list(metadata.versions),
        "platform": metadata.platform,
        "inputs": [_tensor_metadata_json(t) for t in metadata.inputs],
        "outputs": [_tensor_metadata_json(t) for t in metadata.outputs],
    }


# --------------------------------------------------------------------------------------------------------------------
# Model configuration


def version_policy_json(policy: VersionPolicy) -> dict[str, Any]:
    """The `version_policy` object of Triton's config JSON."""
    if policy.kind == "all":
        return {"all": {}}
    if policy.kind == "specific":
        return {"specific": {"versions": list(policy.versions)}}
    return {"latest": {"num_versions": policy.num_versions}}


def _io_json(spec: TensorSpec, is_input: bool) -> dict[str, Any]:
    d: dict[str, Any] = {"name": spec.name, "data_type": triton_type(spec.datatype)}
    if is_input:
        d["format"] = "FORMAT_NONE"
    d["dims"] = list(spec.dims)
    if spec.reshape is not None:
        d["reshape"] = {"shape": list(spec.reshape)}
    d["is_shape_tensor"] = False
    if is_input:
        d["allow_ragged_batch"] = False
        d["optional"] = spec.optional
    else:
        d["label_filename"] = ""
    return d


def _queue_policy_json(p: QueuePolicy) -> dict[str, Any]:
    return {
        "timeout_action": p.timeout_action,
        "default_timeout_microseconds": p.default_timeout_us,
        "allow_timeout_override": p.allow_timeout_override,
        "max_queue_size": p.max_queue_size,
    }


def model_config_json(served: ServedModelConfig) -> dict[str, Any]:
    """Triton's /v2/models/<m>/config JSON: model_config.proto's ModelConfig."""
    config = served.config
    d: dict[str, Any] = {
        "name": config.name,
        "platform": config.platform,
        "backend": config.backend,
        "version_policy": version_policy_json(served.version_policy),
        "max_batch_size": config.max_batch_size,
        "input": [_io_json(s, True) for s in config.inputs],
        "output": [_io_json(s, False) for s in config.outputs],
        "instance_group": [
            {"name": g.name or config.name, "kind": g.kind, "count": g.count, "gpus": list(g.gpus)}
            for g in config.instance_groups
        ],
        "default_model_filename": config.default_model_filename,
        "parameters": {k: {"string_value": v} for k, v in config.parameters.items()},
    }
    if config.gpu_execution_accelerators:
        d["optimization"] = {
            "execution_accelerators": {
                "gpu_execution_accelerator": [{"name": n} for n in config.gpu_execution_accelerators]
            }
        }
    if config.ensemble is not None:
        d["ensemble_scheduling"] = {"step": [
            {"model_name": s.model_name, "model_version": s.model_version, "input_map": dict(s.input_map),
             "output_map": dict(s.output_map), "model_namespace": ""}
            for s in config.ensemble.steps], "max_inflight_requests": config.ensemble.max_inflight_requests}
    db = config.dynamic_batching
    if db is not None:
        d["dynamic_batching"] = {
            "preferred_batch_size": list(db.preferred_batch_sizes),
            "max_queue_delay_microseconds": db.max_queue_delay_us,
            "preserve_ordering": db.preserve_ordering,
            "priority_levels": db.priority_levels,
            "default_priority_level": db.default_priority_level,
            "default_queue_policy": _queue_policy_json(db.default_queue_policy),
            # JSON object keys are strings; protobuf's JSON mapping reads them back as the uint64 map keys.
            "priority_queue_policy": {
                str(level): _queue_policy_json(p) for level, p in sorted(db.priority_queue_policy.items())
            },
        }
    if config.sequence_batching is not None:
        d["sequence_batching"] = sequence_batching_json(config.sequence_batching)
    if served.source:
        source = mc.ModelConfig.FromString(served.source)
        keep_from_source_json(d, json_format.MessageToDict(source, preserving_proto_field_name=True))
    return d


def _unset(value: Any) -> bool:
    """A value protobuf's JSON mapping leaves out (the field's default), so the source's may stand in for it."""
    return value in ("", 0, False, "FORMAT_NONE") or (isinstance(value, (list, dict)) and not value)


def keep_from_source_json(d: dict[str, Any], source: dict[str, Any]) -> None:
    """grpc_encode.keep_from_source for the JSON config: what config.pbtxt sets and gpud's config leaves at its
    default is kept (inputs and outputs matched by name); what gpud sets stays."""
    for key, value in source.items():
        mine = d.get(key)
        if key in ("input", "output") and isinstance(mine, list) and mine:
            by_name = {entry.get("name"): entry for entry in mine}
            for entry in value:
                if entry.get("name") in by_name:
                    keep_from_source_json(by_name[entry["name"]], entry)
        elif isinstance(mine, dict) and mine and isinstance(value, dict):
            keep_from_source_json(mine, value)
        elif key not in d or _unset(mine):
            d[key] = value


# --------------------------------------------------------------------------------------------------------------------
# Statistics and the repository index


def _duration_json(d: Duration) -> dict[str, int]:
    return {"count": d.count, "ns": d.ns}


def _model_statistics_json(name: str, version: str, stats: ModelStats) -> dict[str, Any]:
    zero = {"count": 0, "ns": 0}
    return {
        "name": name,
        "version": version,
        "last_inference": stats.last_inference_ms,
        "inference_count": stats.inference_count,
        "execution_count": stats.execution_count,
        "inference_stats": {
            "success": _duration_json(stats.success),
            "fail": _duration_json(stats.fail),
            "queue": _duration_json(stats.queue),
            "compute_input": _duration_json(stats.compute_input),
            "compute_infer": _duration_json(stats.compute_infer),
            "compute_output": _duration_json(stats.compute_output),
            "cache_hit": dict(zero),  # gpud has no response cache
            "cache_miss": dict(zero),
        },
        "batch_stats": [
            {
                "batch_size": size,
                "compute_input": _duration_json(b.compute_input),
                "compute_infer": _duration_json(b.compute_infer),
                "compute_output": _duration_json(b.compute_output),
            }
            for size, b in sorted(stats.batches.items())
        ],
    }


def model_statistics_json(statistics: Iterable[ModelStatistics]) -> dict[str, Any]:
    """Triton's statistics extension: {"model_stats": [...]}, one entry per model version."""
    return {"model_stats": [_model_statistics_json(s.name, s.version, s.stats) for s in statistics]}


def repository_index_json(models: Iterable[RepositoryModel]) -> list[dict[str, Any]]:
    return [{"name": m.name, "version": m.version, "state": m.state.value, "reason": m.reason} for m in models]


# --- gpud's placement route (POST /v2/gpud/placement) -------------------------------------------------------------
def placements_from_json(placements: Any) -> list[RequestedPlacement]:
    """The shape of a placement document, checked before anything changes (bad input changes nothing)."""
    if not isinstance(placements, list):
        raise InferenceError(ErrorKind.INVALID_ARGUMENT, "'placements' must be a list")
    out = []
    for k, p in enumerate(placements):
        if not isinstance(p, dict) or not isinstance(p.get("model"), str) or isinstance(p.get("instance"), bool) \
                or not isinstance(p.get("instance"), int) or not isinstance(p.get("device"), str):
            raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                 f"placements[{k}]: expected {{\"model\": str, \"instance\": int, \"device\": str}}")
        out.append(RequestedPlacement(p["model"], p["instance"], p["device"]))
    return out


def applied_json(applied: Applied) -> dict[str, Any]:
    """{"added": [{"model", "instance", "device"}], "removed": [...]}: instance is the index within the version."""
    return {"added": [{"model": i.model, "instance": i.index, "device": i.device} for i in applied.added],
            "removed": [{"model": i.model, "instance": i.index, "device": i.device} for i in applied.removed]}
