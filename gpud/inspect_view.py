"""gpud's own view of itself (`GET /v2/gpud/inspect`, what `gpudctl inspect` shows): devices with a fresh reading
each, model versions and their instances from the core's snapshot, the device workers, the sections other parts add
(the autoscaling hints, the controller), and the placement service's planning inputs (devices, demands and the
current placement, in `gpud.placement.spec`'s file formats: what `gpudctl place --devices live --models live --current
live` plans with, so an offline re-plan of a running gpud starts from exactly what the daemon would use).
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from gpud.core_api import ServerMetadata
from gpud.placing.service import PlacementService
from gpud.placement import spec
from gpud.telemetry.serving import ModelState, ServingSnapshot, VersionView


class InspectView(Protocol):
    """A part of gpud that adds its own section to the document (the hints, the controller)."""

    def inspect(self) -> dict[str, Any]: ...


def inspect_document(server: ServerMetadata, snapshot: ServingSnapshot, placement: PlacementService,
                     workers: list[dict[str, Any]], views: Mapping[str, InspectView]) -> dict[str, Any]:
    backend = placement.devices
    devices = []
    for d in backend.devices():
        r = backend.sample(d.id)
        devices.append({
            "id": d.id, "kind": d.kind, "index": d.index, "name": d.name, "uuid": d.uuid,
            "parent_id": d.parent_id, "mig_profile": d.mig_profile, "mig_enabled": d.mig_enabled,
            "leaf": d.is_leaf, "simulated": d.simulated, "compute_fraction": d.compute_fraction,
            "memory_total_bytes": d.memory_total_bytes, "memory_used_bytes": r.memory_used_bytes,
            "utilization_ratio": r.utilization_ratio, "power_w": r.power_w,
            "temperature_c": r.temperature_c, "healthy": r.healthy, "labels": dict(d.labels),
            "unhealthy_reason": None if r.healthy else (placement.pool.unhealthy_reason(d.id)
                                                        or "the driver reports it lost"),
        })
    models = []
    for m in snapshot.models:
        if not m.versions:
            models.append({"name": m.name, "version": "", "state": ModelState.UNAVAILABLE.value,
                           "reason": m.error or "unloaded", "instances": []})
        models += [_version(v) for v in m.versions]
    inputs = placement.inputs()
    out = {"server": {"name": server.name, "version": server.version, "extensions": list(server.extensions)},
           "device_source": backend.source, "time_unix_s": time.time(), "devices": devices,
           "models": models, "workers": workers,
           "placement": {**spec.devices_to_data(list(inputs.devices)), **spec.models_to_data(list(inputs.demands)),
                         **spec.current_to_data(list(inputs.current)),
                         "strategy": placement.config.strategy}}
    for name, view in views.items():
        out[name] = view.inspect()
    return out


def _objective(st) -> dict[str, Any]:
    """A version's latency objective and how it holds: its attainment (the share of requests within it so far)."""
    counted = st.within_objective + st.over_objective
    return {"seconds": st.objective_ns / 1e9, "share": st.objective_share, "within": st.within_objective,
            "over": st.over_objective, "attainment": st.within_objective / counted if counted else None}


def _version(v: VersionView) -> dict[str, Any]:
    st = v.stats
    n = st.success.count
    return {
        "name": v.model, "version": v.version, "state": v.state.value, "reason": v.reason,
        "max_batch_size": v.max_batch_size, "pending_requests": v.pending_requests,
        **({} if not st.objective_ns else {"latency_objective": _objective(st)}),
        "requests_success": n, "requests_failed": st.fail.count,
        "executions": st.execution_count, "inferences": st.inference_count,
        "queue_seconds_avg": st.queue.ns / n / 1e9 if n else None,
        "compute_seconds_avg": (st.compute_input.ns + st.compute_infer.ns + st.compute_output.ns) / n / 1e9
        if n else None,
        **({} if v.sequences_in_slots is None else
           {"sequences_in_slots": v.sequences_in_slots, "sequences_in_backlog": v.sequences_in_backlog}),
        "instances": [{"index": i.index, "device": i.device_id, "ready": i.ready, "memory_bytes": i.footprint_bytes,
                       "measured_by": i.measured_by or "estimate", "provider": i.provider,
                       "load_seconds": i.load_seconds, "error": i.error}
                      for i in v.instances],
        # an ensemble: its steps, in config order (it has no instances; its steps' models do)
        "pipeline": [{"step": s.index, "model": s.model, "version": s.version, "serving_version": s.serving_version,
                      "ready": s.ready, "inputs": {m: t for m, t in s.inputs}, "outputs": {m: t for m, t in s.outputs}}
                     for s in v.pipeline] if v.is_ensemble else None,
    }
