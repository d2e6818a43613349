"""Multi-dimensional packing (memory, compute, instance count) over the ledger: a minimum-bin-slack construction and
lower bounds per dimension. Pure: no I/O; time is read from an injected clock.

Minimum bin slack (Gupta & Ho 1999, here on vectors): devices are filled one at a time. The next device takes the
largest instance left and the subset of the other instances left that fills it best, found by a depth-first search
over the instances in decreasing size with a node budget; "best" is the lowest fill over the dimensions in use, so a
device filled 99% in memory and 40% in compute ranks below one filled 97% in both. A device filled to `stop_fill` in
every dimension ends the search at once. On instances built from devices split exactly in memory and compute this
finds the split where best fit does not (it closes each device on whatever fits next): 25 devices where best fit
uses 26-28 (docs/benchmarks.md). Restarts perturb the order and the stopping fill.

Lower bounds, each valid for the placed instances (relaxations of the real problem):
- per dimension: Martello & Toth's L2 with every device given the largest capacity in that dimension, and the fewest
  largest devices whose capacities add up to the demand (L1 over unequal devices);
- instances: the fewest devices whose instance caps add up to the number of instances;
- conflicts: a set of instances no two of which can share any device (together they exceed the largest capacity in
  some dimension, or no device accepts both), each needing its own device.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from collections.abc import Callable, Sequence

from gpud.placement import binpack1d
from gpud.placement.framework import NodeState
from gpud.placement.model import Device, ModelDemand, compute_units

Clock = Callable[[], float]
Item = tuple[ModelDemand, int]  # (demand, instance index)


def dimensions_in_use(demands: Sequence[ModelDemand], state: NodeState) -> tuple[bool, bool]:
    """(compute, instances): whether any demand declares compute, and whether any device caps its instances."""
    return (any(d.compute_fraction for d in demands),
            any(c.instances is not None for c in state.capacity.values()))


def item_size(state: NodeState) -> Callable[[ModelDemand], float]:
    """An instance's size as the largest share it takes of the largest device, over memory and compute."""
    max_mem = max((c.memory_bytes for c in state.capacity.values()), default=1) or 1
    max_cu = max((c.compute_units for c in state.capacity.values()), default=1) or 1
    return lambda d: max(d.memory_bytes / max_mem, compute_units(d.compute_fraction) / max_cu)


@dataclass(frozen=True)
class SlackParams:
    node_budget: int = 20_000  # search nodes per device
    stop_fill: float = 0.999  # a device this full in every dimension in use takes its subset at once
    noise: float = 0.0  # relative noise on the size order (restarts)


class _Timeout(Exception):
    pass


def min_bin_slack(devices: Sequence[Device], items: Sequence[Item], eligible: dict[str, list[str]],
                  memory_reserve_bytes: int, *, params: SlackParams = SlackParams(), deadline: float,
                  clock: Clock, seed: int = 0) -> NodeState | None:
    """A packing of `items` built device by device (see the module doc); None when the deadline passes first.
    Instances that fit no device left are not placed (the caller compares plans by what they place)."""
    state = NodeState(devices, memory_reserve_bytes)
    size = item_size(state)
    rng = random.Random(seed)
    keyed = [(-size(d) * (1.0 + params.noise * rng.random()), d.name, i, d) for d, i in items]
    keyed.sort(key=lambda k: (k[0], k[1], k[2]))
    remaining: list[Item] = [(d, i) for _, _, i, d in keyed]
    eligible_sets = {name: set(devs) for name, devs in eligible.items()}
    use_cu, use_n = dimensions_in_use([d for d, _ in items], state)
    # devices that accept the same models with the same capacity are interchangeable: search one per class
    # (models with the same constraints share one eligible list: a device is described by the lists it is in)
    accepts: dict[str, list[int]] = {dev: [] for dev in state.order}
    distinct = {id(devs): devs for devs in eligible.values()}
    for key, devs in distinct.items():
        for dev in devs:
            accepts[dev].append(key)
    # (the parent GPU is part of the class: spread models may sit on one MIG instance of a GPU and not another)
    signature = {dev: (state.capacity[dev], tuple(sorted(accepts[dev])), state.devices[dev].parent_id)
                 for dev in state.order}
    nodes_checked = [0]

    def fill(dev: str) -> float:
        cap = state.capacity[dev]
        parts = [state.used_memory[dev] / cap.memory_bytes if cap.memory_bytes else 1.0]
        if use_cu:
            parts.append(state.used_compute[dev] / cap.compute_units if cap.compute_units else 1.0)
        if use_n and cap.instances:
            parts.append(len(state.members[dev]) / cap.instances)
        low = min(parts)
        return low + 1e-3 * sum(parts)

    def search(dev: str, rest: list[Item]) -> tuple[float, list[Item]]:
        best: list = [fill(dev), []]
        chosen: list[Item] = []
        budget = [params.node_budget]

        def dfs(k: int) -> bool:  # True: stop the whole search
            budget[0] -= 1
            nodes_checked[0] += 1
            if nodes_checked[0] & 1023 == 0 and clock() >= deadline:
                raise _Timeout
            f = fill(dev)
            if f > best[0]:
                best[0], best[1] = f, list(chosen)
                if f >= params.stop_fill:
                    return True
            if budget[0] <= 0:
                return True
            j, n = k, len(rest)
            while j < n:
                d, i = rest[j]
                if dev in eligible_sets[d.name] and state.fits(d, dev):
                    state.reserve(d, i, dev)
                    chosen.append((d, i))
                    stop = dfs(j + 1)
                    chosen.pop()
                    state.unreserve(d.name, i)
                    if stop:
                        return True
                    # leaving this instance out leaves out its identical siblings too: no duplicate subsets
                    while j + 1 < n and rest[j + 1][0] is d:
                        j += 1
                j += 1
            return False

        dfs(0)
        return best[0], best[1]

    try:
        while remaining:
            anchor, a_i = remaining[0]
            rest = remaining[1:]
            tried: set = set()
            pick, pick_fill, pick_items = None, -1.0, []
            for dev in eligible[anchor.name]:
                if state.members[dev] or signature[dev] in tried or not state.fits(anchor, dev):
                    continue
                tried.add(signature[dev])
                state.reserve(anchor, a_i, dev)
                f, extra = search(dev, rest)
                for d, i in extra:
                    state.unreserve(d.name, i)
                state.unreserve(anchor.name, a_i)
                if f > pick_fill:
                    pick, pick_fill, pick_items = dev, f, extra
            if pick is None:  # no empty device takes it: the fullest open device with room, else unplaced
                open_fit = [dev for dev in eligible[anchor.name] if state.members[dev] and state.fits(anchor, dev)]
                if open_fit:
                    dev = max(open_fit, key=lambda x: state.utilization(x, anchor))
                    state.reserve(anchor, a_i, dev)
                remaining = rest
                continue
            state.reserve(anchor, a_i, pick)
            taken = {(anchor.name, a_i)}
            for d, i in pick_items:
                state.reserve(d, i, pick)
                taken.add((d.name, i))
            remaining = [it for it in rest if (it[0].name, it[1]) not in taken]
    except _Timeout:
        return None
    return state


# ---------------------------------------------------------------------------------------------------------------
# lower bounds

def _fewest_covering(capacities: list[int], total: int) -> int:
    """The fewest of `capacities` (largest first) whose sum reaches `total`; len + 1 when all of them do not."""
    acc, k = 0, 0
    for c in sorted(capacities, reverse=True):
        if acc >= total:
            break
        acc += c
        k += 1
    return k if acc >= total else len(capacities) + 1


def dimension_bounds(devices: Sequence[Device], items: Sequence[Item], state: NodeState,
                     eligible: dict[str, list[str]]) -> dict[str, int]:
    """Lower bounds on the devices needed by `items`, by kind (see the module doc). Empty for no items."""
    if not items:
        return {}
    healthy = [d.id for d in devices if d.healthy]
    if not healthy:
        return {}
    out: dict[str, int] = {}
    caps = [state.capacity[i] for i in healthy]
    for name, get_cap, get_req in (
            ("memory", lambda c: c.memory_bytes, lambda d: d.memory_bytes),
            ("compute", lambda c: c.compute_units, lambda d: compute_units(d.compute_fraction))):
        sizes = [get_req(d) for d, _ in items]
        total = sum(sizes)
        if total <= 0:
            continue
        cap_values = [get_cap(c) for c in caps]
        biggest = max(cap_values)
        lb = _fewest_covering(cap_values, total)
        if biggest > 0 and max(sizes) <= biggest:
            lb = max(lb, binpack1d.lower_bound_l2(sizes, biggest))
        out[name] = lb
    if any(c.instances is not None for c in caps):
        big = len(items)  # an uncapped device could take every instance
        out["instances"] = _fewest_covering([big if c.instances is None else c.instances for c in caps], len(items))
    out["conflicts"] = conflict_clique(items, state, eligible)
    spread: dict[str, int] = {}
    for d, _ in items:
        if d.constraints.spread:
            spread[d.name] = spread.get(d.name, 0) + 1
    if spread:
        out["spread"] = max(spread.values())
    return out


def conflict_clique(items: Sequence[Item], state: NodeState, eligible: dict[str, list[str]],
                    max_items: int = 2_000) -> int:
    """The size of a set of instances that pairwise cannot share a device, found greedily from the largest. Two
    instances conflict when together they exceed the largest device in memory or compute, when no device takes more
    than one instance, or when no device accepts both. Only models of instances are compared (two instances of one
    model conflict exactly when one instance's double does not fit), so the work is per model."""
    if not items:
        return 0
    caps = list(state.capacity.values())
    max_mem = max(c.memory_bytes for c in caps)
    max_cu = max(c.compute_units for c in caps)
    max_n = max((len(items) if c.instances is None else c.instances) for c in caps)
    if max_n <= 1:
        return len(items)
    counts: dict[str, int] = {}
    demand_of: dict[str, ModelDemand] = {}
    for d, _ in items:
        counts[d.name] = counts.get(d.name, 0) + 1
        demand_of[d.name] = d
    size = item_size(state)
    models = sorted(demand_of.values(), key=lambda d: (-size(d), d.name))[:max_items]
    sets_by_list: dict[int, frozenset[str]] = {}  # eligible lists are shared between models: one set per list
    elig = {}
    for d in models:
        lst = eligible.get(d.name, [])
        got = sets_by_list.get(id(lst))
        if got is None:
            got = sets_by_list[id(lst)] = frozenset(lst)
        elig[d.name] = got

    def conflict(a: ModelDemand, b: ModelDemand) -> bool:
        if a.memory_bytes + b.memory_bytes > max_mem:
            return True
        if compute_units(a.compute_fraction) + compute_units(b.compute_fraction) > max_cu:
            return True
        if a is b:  # two instances of one model: apart only when spread
            return a.constraints.spread
        ea, eb = elig[a.name], elig[b.name]
        return ea is not eb and ea.isdisjoint(eb)

    clique: list[ModelDemand] = []
    total = 0
    for d in models:
        if all(conflict(d, c) for c in clique):
            k = counts[d.name] if conflict(d, d) else 1
            clique.append(d)
            total += k
    return total
