"""Which live instances a load may evict, in the order it may (the pure rule is gpud.controller.eviction_order), and
how a plan is read to tell whether unloading some of them makes room: the placement service's on-demand loads and
the controller's scale-ups use both."""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from executor.pool import InstanceHandle
from gpud.controller import EvictionCandidate, eviction_order
from gpud.placing.inputs import PlacementInputs, candidate_kinds
from gpud.registry import RegisteredVersion
from placement import Plan


def eviction_candidates(vs: RegisteredVersion, live: Iterable[RegisteredVersion], device_kinds: Mapping[str, str],
                        has_gpus: bool, now_unix_s: float, *, exclude: set[RegisteredVersion] = frozenset(),
                        min_idle_s: float = 0.0) -> list[tuple[RegisteredVersion, InstanceHandle]]:
    """The instances of `live` versions on device kinds `vs` can use, least recently used first, of versions not in
    `exclude` that have had no request for `min_idle_s` (and never one of a busy version, never below a version's
    minimum: eviction_order). `device_kinds`: device id -> kind."""
    kinds = {k for g in vs.entry.config.instance_groups for k in candidate_kinds(g.kind, has_gpus)}
    handles: dict[tuple[str, str, int, str], tuple[RegisteredVersion, InstanceHandle]] = {}
    candidates = []
    for other in live:
        if other is vs or other in exclude or now_unix_s - other.last_used_unix_s < min_idle_s:
            continue
        for inst in other.instances:
            if device_kinds.get(inst.device_id) not in kinds:
                continue
            handles[(other.name, other.version, inst.index, inst.device_id)] = (other, inst)
            candidates.append(EvictionCandidate(
                other.name, other.version, inst.index, inst.device_id, inst.footprint_bytes,
                other.last_used_unix_s, other.scheduler.pending_requests > 0, len(other.instances),
                other.bounds.minimum))
    return [handles[(c.model, c.version, c.index, c.device_id)] for c in eviction_order(candidates)]


def unplaced_of(vs: RegisteredVersion, inputs: PlacementInputs, result: Plan) -> int:
    """How many of `vs`'s instances the plan left without a device."""
    return sum(1 for u in result.unplaced if (inputs.groups[u.model].model, inputs.groups[u.model].version)
               == (vs.name, vs.version))
