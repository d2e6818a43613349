"""A placement a person asked for (`POST /v2/gpud/placement`, `gpudctl place --apply`), checked before anything
changes: which versions it names, the whole node after it, that every instance may run where it is asked to (the
placement engine's static filters) and that every device holds what it is given. Each check raises InferenceError
(INVALID_ARGUMENT or UNAVAILABLE) with the reason; the placement service applies only what passed them all."""
from __future__ import annotations

from collections.abc import Sequence

from gpud.executor.types import ErrorKind, InferenceError
from gpud.core_api import RequestedPlacement
from gpud.placing.inputs import PlacementInputs
from gpud.registry import RegisteredVersion, Registry
from gpud.placement import Assignment
from gpud.placement.framework import static_reasons
from gpud.placement.model import fmt_bytes
from gpud.telemetry.serving import ModelState


def resolve_versions(requested: Sequence[RequestedPlacement], registry: Registry,
                     leaves: set[str]) -> dict[str, RegisteredVersion]:
    """The version each requested model name means (`leaves`: the node's leaf device ids); errors before anything
    changes."""
    named: dict[str, RegisteredVersion] = {}
    for k, p in enumerate(requested):
        where = f"placements[{k}]"
        if p.device not in leaves:
            raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                 f"{where}: unknown device '{p.device}' (devices: {', '.join(sorted(leaves))})")
        if p.instance < 0:
            raise InferenceError(ErrorKind.INVALID_ARGUMENT, f"{where}: instance must be >= 0")
        if p.model not in named:
            model, _, version = p.model.partition(":")
            if p.model in registry.models or not version:
                vs = registry.version(p.model)
            else:
                vs = registry.version(model, version.partition(":")[0])
            if vs.entry.config.ensemble is not None:
                steps = ", ".join(dict.fromkeys(s.model_name for s in vs.entry.config.ensemble.steps))
                raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                     f"{where}: '{vs.name}' is an ensemble: it has no instances of its own; place "
                                     f"the models of its steps ({steps})")
            if vs.state not in (ModelState.READY, ModelState.UNAVAILABLE):
                raise InferenceError(ErrorKind.UNAVAILABLE,
                                     f"{where}: model '{vs.name}' is {vs.state.value.lower()}")
            named[p.model] = vs
    return named


def desired_assignments(inputs: PlacementInputs, requested: Sequence[RequestedPlacement],
             named: dict[str, RegisteredVersion]) -> list[Assignment]:
    """The whole node after the change: the requested instances, and every live instance of the others."""
    wanted: list[Assignment] = []
    seen: set[tuple[str, int]] = set()
    for k, p in enumerate(requested):
        vs = named[p.model]
        groups = vs.entry.config.instance_groups
        if p.model == vs.name:
            a = inputs.assignment(vs.name, vs.version, p.instance, p.device, groups)
        elif p.model not in inputs.groups:
            names = sorted(n for n, key in inputs.groups.items() if key.model == vs.name)
            raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                 f"placements[{k}]: '{p.model}' is neither a model nor a placement name "
                                 f"(model '{vs.name}' is placed as {', '.join(names) or 'nothing yet'})")
        else:  # a placement name (model:version[:group]): the index is within its demand
            key = inputs.groups[p.model]
            if key.group < len(groups) - 1 and p.instance >= groups[key.group].count:
                raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                     f"placements[{k}]: instance group {key.group} of '{vs.name}' holds "
                                     f"{groups[key.group].count} instance(s), not instance {p.instance}")
            a = Assignment(p.model, p.instance, p.device)
        if (a.model, a.instance) in seen:
            raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                 f"placements[{k}]: instance {p.instance} of '{p.model}' placed twice")
        seen.add((a.model, a.instance))
        wanted.append(a)
    touched = {(vs.name, vs.version) for vs in named.values()}
    kept = [a for a in inputs.current if inputs.version_of(a.model) not in touched]
    return sorted(kept + wanted)


def check_allowed(inputs: PlacementInputs, desired: Sequence[Assignment], touched: set[tuple[str, str]]) -> None:
    """Refuse an instance of the requested versions on a device its model may not use (the placement engine's
    static filters: kind, pinned GPUs, labels, health), with the reasons."""
    demands = {d.name: d for d in inputs.demands}
    devices = {d.id: d for d in inputs.devices}
    for a in desired:
        key = inputs.groups[a.model]
        if (key.model, key.version) not in touched:
            continue
        reasons = static_reasons(demands[a.model], devices[a.device])
        if reasons:
            why = "; ".join(r.message() for r in reasons)
            raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                 f"placement not applied: model '{key.model}' instance {a.instance} may not run "
                                 f"on {a.device}: {why}; nothing changed")


def check_fits(inputs: PlacementInputs, desired: Sequence[Assignment]) -> None:
    """Refuse a placement that puts more on a device than it holds: the end state must fit."""
    memory = {d.name: d.memory_bytes for d in inputs.demands}
    per_device: dict[str, int] = {}
    for a in desired:
        per_device[a.device] = per_device.get(a.device, 0) + memory[a.model]
    for d in inputs.devices:
        usable = max(0, d.memory_bytes - (d.memory_reserve_bytes or 0))
        if per_device.get(d.id, 0) > usable:
            raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                 f"placement not applied: it puts {fmt_bytes(per_device[d.id])} of model "
                                 f"instances on {d.id}, which has {fmt_bytes(usable)} for them; nothing changed")
