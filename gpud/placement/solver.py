"""The planner: devices + demands (+ the current placement) -> a Plan with reasons, a lower bound, an optimality flag
and an ordered make-before-break diff.

- Fresh plans: when the instance is one-dimensional over identical devices (no constraints, one binding resource)
  it goes to `gpud.placement.binpack1d.solve` (heuristics, L2 and arc-flow LP bounds, local search, arc-flow MIP).
  Otherwise (memory and compute, instance caps, constraints): a best-fit-decreasing greedy over the filter/score
  framework is the first plan (the answer at time limit 0); then, while the gap to the lower bounds of
  `gpud.placement.vector` is open, minimum-bin-slack restarts, device elimination, and the exact aggregated MIP
  (instances of a model per device as integers, HiGHS) asked for one device fewer: it finds that plan or proves
  there is none. Measured against OR-Tools CP-SAT in docs/benchmarks.md.
- Re-plans (`current` given): keep every current instance that is still valid, place what is missing; when that
  leaves something unplaced, plan from scratch too and keep whichever places more, then has fewer moves.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from functools import reduce
from collections.abc import Callable, Sequence

from gpud.placement import binpack1d
from gpud.placement.framework import NodeState, eligible_devices, scorer_for, static_reasons
from gpud.placement.model import (
    Assignment, Device, DeviceRejection, InsufficientResource, ModelDemand, Move, Plan, STRATEGIES, Unplaced,
    compute_units, fmt_bytes,
)
from gpud.placement.vector import SlackParams, dimension_bounds, min_bin_slack

# The exact solver the planner proves plans with: HiGHS through scipy (a main dependency). None when scipy cannot be
# imported anyway: plans are then heuristic and unproven beyond the simple bounds, and say so (Plan.exact_solver).
EXACT_SOLVER: str | None = "highs" if binpack1d.highs_available() else None

Clock = Callable[[], float]


@dataclass(frozen=True)
class PlannerConfig:
    strategy: str = "pack"  # "pack": fewest devices; "spread": balanced load
    time_limit_seconds: float = 1.0  # for improvement and exact stages; 0 = constructive heuristics only
    memory_reserve_bytes: int = 0  # per device, for the CUDA context and workspace (a device may override it)
    use_highs: bool = True  # use scipy's HiGHS when it is installed
    seed: int = 0
    # Re-plans: True tries a plan from scratch too when keeping the current instances leaves something unplaced (and
    # takes it if it places more); False keeps every valid current instance where it is and places only what is
    # missing into the room that is left (a model loaded next to running ones).
    move_current: bool = True

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {list(STRATEGIES)}, got {self.strategy!r}")
        if not (self.time_limit_seconds >= 0):
            raise ValueError(f"time_limit_seconds must be >= 0, got {self.time_limit_seconds!r}")
        if self.memory_reserve_bytes < 0:
            raise ValueError(f"memory_reserve_bytes must be >= 0, got {self.memory_reserve_bytes}")


def plan(devices: Sequence[Device], demands: Sequence[ModelDemand], *, current: Sequence[Assignment] = (),
         config: PlannerConfig = PlannerConfig(), clock: Clock = time.perf_counter) -> Plan:
    """Place every instance of every demand. With `current`, re-plan with the fewest moves and return the diff."""
    start = clock()
    _validate(devices, demands)
    if current:
        result = _replan(devices, demands, tuple(current), config, clock, start)
    else:
        result = _fresh(devices, demands, config, clock, start)
    return replace(result, elapsed_seconds=clock() - start)


def _validate(devices: Sequence[Device], demands: Sequence[ModelDemand]) -> None:
    names = [d.name for d in demands]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate model names: {sorted({n for n in names if names.count(n) > 1})}")
    ids = [d.id for d in devices]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate device ids: {sorted({i for i in ids if ids.count(i) > 1})}")


# ---------------------------------------------------------------------------------------------------------------
# fresh plans

def _fresh(devices, demands, config: PlannerConfig, clock, start) -> Plan:
    state = NodeState(devices, config.memory_reserve_bytes)
    cache: dict = {}
    eligible = {d.name: eligible_devices(d, devices, state.capacity, cache) for d in demands}
    deadline = start + config.time_limit_seconds
    items = [(d, i) for d in demands for i in range(d.instances) if eligible[d.name]]
    exact = EXACT_SOLVER if config.use_highs else None
    one_d = _one_dimensional(devices, demands, state, eligible) if config.strategy == "pack" else None
    bounds: dict[str, int] = {}
    proof_at: float | None = None
    if one_d is not None:
        assignments, lb1, proven, method = _solve_one_d(one_d, devices, demands, state, config, clock, deadline)
        by_name = {d.name: d for d in demands}
        for a in assignments:
            state.reserve(by_name[a.model], a.instance, a.device)
        first_plan = clock() - start  # the 1-D stages report no incumbent time of their own
        bounds[one_d.resource] = lb1
        if proven:
            proof_at = clock() - start
    else:
        greedy(state, items, eligible, config.strategy, demands)
        method = "greedy"
        first_plan = clock() - start
        if config.strategy == "pack":
            state, method, bounds, proof_at = _improve_pack(devices, demands, items, eligible, state, config,
                                                            clock, start, deadline, exact)
    placed = set(state.where)
    unplaced_items = [(d, i) for d in demands for i in range(d.instances) if (d.name, i) not in placed]
    placed_items = [(d, i) for d in demands for i in range(d.instances) if (d.name, i) in placed]
    if not bounds and one_d is None:
        bounds = dimension_bounds(devices, placed_items, state, eligible)
    lb = max(bounds.values(), default=0)
    used = len(state.used_devices())
    optimal = config.strategy == "pack" and not unplaced_items and (used <= lb or proof_at is not None)
    if optimal and proof_at is None:
        proof_at = clock() - start
    unplaced = tuple(_explain(state, d, i, devices) for d, i in unplaced_items)
    return Plan(placements=tuple(state.assignments()), unplaced=unplaced, devices_used=used,
                lower_bound=used if optimal else min(lb, used), optimal=optimal,
                strategy=config.strategy, method=method, bounds=_ordered(bounds),
                exact_solver=exact, first_plan_seconds=first_plan,
                proof_seconds=proof_at if optimal else None)


_BOUND_ORDER = ("memory", "compute", "instances", "conflicts", "spread", "exact")


def _ordered(bounds: dict[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(bounds.items(), key=lambda kv: (_BOUND_ORDER.index(kv[0]) if kv[0] in _BOUND_ORDER
                                                        else len(_BOUND_ORDER), kv[0])))


_SLACK_RESTARTS = 64  # at most, within the time: the first five differ in their stopping fill, then noise


def _plan_key(state: NodeState) -> tuple[int, int]:
    """Better plans place more instances, then use fewer devices."""
    return (-len(state.where), len(state.used_devices()))


def _improve_pack(devices, demands, items, eligible, state: NodeState, config: PlannerConfig, clock, start,
                  deadline, exact):
    """The pack strategy's stages after the greedy incumbent, each only while the gap to the lower bound is open
    and time is left: minimum-bin-slack restarts (up to 40% of the time), device elimination, then the exact
    aggregated MIP for the rest of the time, which finds a plan with one device fewer or proves there is none.
    Returns (state, method, bounds, seconds to the proof or None)."""
    method = "greedy"

    def bounds_of(st: NodeState) -> dict[str, int]:
        placed = [(d, i) for d, i in items if (d.name, i) in st.where]
        return dimension_bounds(devices, placed, st, eligible)

    bounds = bounds_of(state)

    def closed(st: NodeState, b: dict[str, int]) -> bool:
        return len(st.where) == len(items) and len(st.used_devices()) <= max(b.values(), default=0)

    if config.time_limit_seconds <= 0 or closed(state, bounds):
        return state, method, bounds, None
    slack_deadline = min(deadline, clock() + 0.4 * config.time_limit_seconds)
    rounds = (SlackParams(), SlackParams(stop_fill=0.995), SlackParams(stop_fill=0.99),
              SlackParams(stop_fill=0.98), SlackParams(node_budget=2_000, stop_fill=0.9995))
    r = 0
    while clock() < slack_deadline and r < _SLACK_RESTARTS:
        params = rounds[r % len(rounds)]
        if r >= len(rounds):
            params = SlackParams(params.node_budget, params.stop_fill, noise=0.1)
        built = min_bin_slack(devices, items, eligible, config.memory_reserve_bytes, params=params,
                              deadline=slack_deadline, clock=clock, seed=config.seed + r)
        r += 1
        if built is None:
            break
        if _plan_key(built) < _plan_key(state):
            state, method = built, "min-bin-slack"
            bounds = bounds_of(state)
            if closed(state, bounds):
                return state, method, bounds, None
    if len(state.where) == len(items) and clock() < deadline:
        before = len(state.used_devices())
        _eliminate_devices(state, eligible, demands, min(deadline, clock() + 0.1 * config.time_limit_seconds),
                           clock)
        if len(state.used_devices()) < before:
            method += "+elimination"
        if closed(state, bounds):
            return state, method, bounds, None
    used = len(state.used_devices())
    if exact is None or len(state.where) < len(items) or clock() >= deadline:
        return state, method, bounds, None
    mip_devices, mip_eligible, symmetric = devices, eligible, False
    healthy = [d for d in devices if d.healthy]
    if len({state.capacity[d.id] for d in healthy}) == 1 and all(
            len(eligible[d.name]) == len(healthy) for d in demands if d.instances):
        # interchangeable devices: a plan on fewer devices can use the first ones, in order (y_d >= y_d+1)
        mip_devices, symmetric = healthy[:max(1, used - 1)], True
        keep = {d.id for d in mip_devices}
        mip_eligible = {name: [x for x in devs if x in keep] for name, devs in eligible.items()}
    better = _aggregated_mip(mip_devices, demands, state, mip_eligible, deadline - clock(), max_devices=used - 1,
                             symmetric=symmetric)
    if better is None:
        return state, method, bounds, None
    new_assign, mip_lb, mip_proven = better
    if new_assign is not None:
        st = NodeState(devices, config.memory_reserve_bytes)
        by_name = {d.name: d for d in demands}
        for a in new_assign:
            st.reserve(by_name[a.model], a.instance, a.device)
        state, method = st, "aggregated-mip"
    bounds = bounds_of(state)
    if mip_lb > 0:
        bounds["exact"] = mip_lb
    if mip_proven:
        bounds["exact"] = len(state.used_devices())
        return state, method, bounds, clock() - start
    return state, method, bounds, None


def _demand(demands, name) -> ModelDemand:
    for d in demands:
        if d.name == name:
            return d
    raise KeyError(name)


def _size_key(state: NodeState, d: ModelDemand) -> float:
    return _size_keyer(state)(d)


def _size_keyer(state: NodeState):
    max_mem = max((c.memory_bytes for c in state.capacity.values()), default=1) or 1
    max_cu = max((c.compute_units for c in state.capacity.values()), default=1) or 1
    return lambda d: max(d.memory_bytes / max_mem, compute_units(d.compute_fraction) / max_cu)


def greedy(state: NodeState, items, eligible, strategy: str, demands) -> None:
    """Decreasing size; each instance goes to the feasible device with the best score (pack: fullest after placing,
    preferring devices, then physical GPUs, already in use; spread: emptiest). Ties by device order."""
    score = scorer_for(strategy)
    n_dev = sum(1 for d in state.devices.values() if d.healthy)
    # most constrained first (models allowed on fewer devices than all), then decreasing size
    size = _size_keyer(state)
    order = sorted(items, key=lambda it: (len(eligible[it[0].name]) >= n_dev, -size(it[0]),
                                          len(eligible[it[0].name]), it[0].name, it[1]))
    if strategy != "pack":
        for d, i in order:
            best, best_key = None, None
            for dev in eligible[d.name]:
                if state.fits(d, dev):
                    key = score(state, d, dev)
                    if best_key is None or key > best_key:
                        best, best_key = dev, key
            if best is not None:
                state.reserve(d, i, best)
        return
    # pack: best fit among open devices; open a new one (on a GPU already in use if possible) only when none fits.
    # Devices too full for the smallest remaining instance are closed and no longer scanned.
    min_mem = min((d.memory_bytes for d, _ in order), default=0)
    min_cu = min((compute_units(d.compute_fraction) for d, _ in order), default=0)
    open_devs: list[str] = [dev for dev in state.order if state.members[dev]]
    eligible_sets: dict[int, set[str]] = {}
    empty_classes: dict[int, list[list]] = {}
    cap_mem = {k: c.memory_bytes for k, c in state.capacity.items()}
    cap_cu = {k: c.compute_units for k, c in state.capacity.items()}
    cap_n = {k: c.instances for k, c in state.capacity.items() if c.instances is not None}
    used_mem, used_cu, members = state.used_memory, state.used_compute, state.members
    for d, i in order:
        ok = eligible_sets.get(id(eligible[d.name]))
        if ok is None:
            ok = eligible_sets[id(eligible[d.name])] = set(eligible[d.name])
        mem, cu, spread = d.memory_bytes, compute_units(d.compute_fraction), d.constraints.spread
        best, best_key = None, -1.0
        for dev in open_devs:  # inlined fits() and most-allocated score: this loop is the hot path
            if dev not in ok:
                continue
            m_after, c_after = used_mem[dev] + mem, used_cu[dev] + cu
            if m_after > cap_mem[dev] or (cu and c_after > cap_cu[dev]):
                continue
            if (spread or dev in cap_n) and not state.fits(d, dev):
                continue
            cm = cap_mem[dev]
            key = (m_after / cm if cm else 0.0) + (c_after / cap_cu[dev] if cap_cu[dev] and c_after else 0.0)
            if key > best_key:
                best, best_key = dev, key
        if best is None:
            # open an empty device. Empty devices with the same capacity and parent score the same, so only the
            # first unopened one of each such class (in the model's device order) is scored.
            best_key2 = None
            for cls in _empty_classes(state, eligible[d.name], empty_classes):
                group, k = cls
                while k < len(group) and state.members[group[k][1]]:
                    k += 1
                cls[1] = k
                if k == len(group):
                    continue
                pos, dev = group[k]
                if not state.fits(d, dev):
                    continue
                key2 = (state.physical_used.get(state.devices[dev].physical_id, 0) > 0, score(state, d, dev), -pos)
                if best_key2 is None or key2 > best_key2:
                    best, best_key2 = dev, key2
            if best is not None:
                open_devs.append(best)
        if best is not None:
            state.reserve(d, i, best)
            if cap_mem[best] - used_mem[best] < min_mem or cap_cu[best] - used_cu[best] < min_cu or \
                    (best in cap_n and len(members[best]) >= cap_n[best]):
                open_devs.remove(best)


def _empty_classes(state: NodeState, devices: list[str], memo: dict[int, list[list]]) -> list[list]:
    """`devices` grouped by (capacity, parent GPU), each group a [[(position, device id), ...], next index] pair;
    memoized per list object (the eligible lists are shared between models with the same constraints)."""
    got = memo.get(id(devices))
    if got is None:
        groups: dict[tuple, list[tuple[int, str]]] = {}
        for pos, dev in enumerate(devices):
            groups.setdefault((state.capacity[dev], state.devices[dev].parent_id), []).append((pos, dev))
        got = memo[id(devices)] = [[g, 0] for g in groups.values()]
    return got


def _eliminate_devices(state: NodeState, eligible, demands, deadline, clock) -> None:
    """Try to empty the least-filled used devices by moving their instances into other used devices."""
    changed = True
    while changed and clock() < deadline:
        changed = False
        used = sorted(state.used_devices(), key=lambda dev: state.utilization(dev))
        for dev in used:
            if clock() >= deadline:
                return
            members = sorted(state.members[dev].items(), key=lambda kv: -_size_key(state, kv[1]))
            moved = []
            ok = True
            for (name, inst), d in members:
                state.unreserve(name, inst)
                target = None
                best = -1.0
                for other in eligible[name]:
                    if other == dev or not state.members[other] or not state.fits(d, other):
                        continue
                    u = state.utilization(other, d)
                    if u > best:
                        target, best = other, u
                if target is None:
                    state.reserve(d, inst, dev)
                    ok = False
                    break
                state.reserve(d, inst, target)
                moved.append((d, inst))
            if not ok:  # roll back: Unreserve what moved, Reserve it back on dev
                for d, inst in moved:
                    state.unreserve(d.name, inst)
                    state.reserve(d, inst, dev)
            else:
                changed = True


# -- one-dimensional special case -----------------------------------------------------------------------------

@dataclass(frozen=True)
class _OneD:
    resource: str  # "memory" or "compute"
    capacity: int
    device_ids: tuple[str, ...]


def _one_dimensional(devices, demands, state: NodeState, eligible) -> _OneD | None:
    """Identical healthy devices, every model allowed everywhere, no spread, and only one resource requested."""
    healthy = [d for d in devices if d.healthy]
    if not healthy or not demands:
        return None
    caps = {state.capacity[d.id] for d in healthy}
    if len(caps) != 1 or next(iter(caps)).instances is not None:
        return None
    ids = tuple(d.id for d in healthy)
    for d in demands:
        if d.constraints.spread or (d.instances and eligible[d.name] and len(eligible[d.name]) != len(ids)):
            return None
        if d.instances and not eligible[d.name]:
            return None  # some model fits nowhere: let the general path explain it
    cap = next(iter(caps))
    uses_mem = any(d.memory_bytes for d in demands)
    uses_cu = any(d.compute_fraction for d in demands)
    if uses_mem and uses_cu:
        return None
    if uses_cu:
        return _OneD("compute", cap.compute_units, ids)
    return _OneD("memory", cap.memory_bytes, ids)


def _solve_one_d(one: _OneD, devices, demands, state, config, clock, deadline):
    items = [(d, i) for d in demands for i in range(d.instances)]
    sizes = [d.memory_bytes if one.resource == "memory" else compute_units(d.compute_fraction) for d, _ in items]
    g = reduce(math.gcd, sizes, one.capacity) or 1  # byte sizes: scale by the common divisor
    scaled = [s // g for s in sizes]
    cap = one.capacity // g
    packing = binpack1d.solve(scaled, cap, time_limit_seconds=max(0.0, deadline - clock()), clock=clock,
                              use_highs=config.use_highs, seed=config.seed)
    bins = sorted(packing.bins, key=lambda b: -sum(scaled[i] for i in b))
    out = []
    for dev, b in zip(one.device_ids, bins):
        for k in b:
            d, i = items[k]
            out.append(Assignment(d.name, i, dev))
    proven = packing.optimal and len(bins) <= len(one.device_ids)
    return out, packing.lower_bound, proven, f"1d:{packing.method}"


# -- aggregated MIP -------------------------------------------------------------------------------------------

def _aggregated_mip(devices, demands, state: NodeState, eligible, time_limit_seconds: float, max_devices: int,
                    symmetric: bool = False):
    """min sum(y_d) s.t. sum_d n_md = instances_m, sum_m mem_m n_md <= cap_d y_d (and compute), n_md <= [spread]
    per physical GPU. n_md are integer instance counts, so identical instances cause no symmetry; `symmetric`
    (interchangeable devices) adds y_d >= y_d+1. Returns (assignments or None, lower bound, proven) or None
    without HiGHS."""
    if time_limit_seconds <= 0 or not binpack1d.highs_available():
        return None
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    dev_ids = [d.id for d in devices]
    dev_index = {d: k for k, d in enumerate(dev_ids)}
    models = [d for d in demands if d.instances]
    pairs = [(mi, dev_index[dv]) for mi, m in enumerate(models) for dv in eligible[m.name]]
    if not pairs:
        return None
    n_pairs, n_dev = len(pairs), len(dev_ids)
    if n_pairs > 20_000:
        return None
    n_var = n_pairs + n_dev
    rows, cols, vals, lo, hi = [], [], [], [], []

    def put(row, col, val):
        rows.append(row); cols.append(col); vals.append(val)

    n_models = len(models)
    for k, (pm, pd) in enumerate(pairs):  # demand rows 0..n_models-1, capacity rows after
        cap = state.capacity[dev_ids[pd]]
        put(pm, k, 1.0)
        put(n_models + 2 * pd, k, models[pm].memory_bytes / max(1, cap.memory_bytes))
        put(n_models + 2 * pd + 1, k, compute_units(models[pm].compute_fraction) / max(1, cap.compute_units))
    for m in models:
        lo.append(m.instances); hi.append(m.instances)
    for dk in range(n_dev):
        put(n_models + 2 * dk, n_pairs + dk, -1.0)
        put(n_models + 2 * dk + 1, n_pairs + dk, -1.0)
        lo += [-np.inf, -np.inf]; hi += [0, 0]
    r = n_models + 2 * n_dev
    for dk in range(n_dev):  # instance caps: sum_m n_md <= cap_d y_d
        cap_n = state.capacity[dev_ids[dk]].instances
        if cap_n is None:
            continue
        for k, (_, pd) in enumerate(pairs):
            if pd == dk:
                put(r, k, 1.0)
        put(r, n_pairs + dk, -float(cap_n))
        lo.append(-np.inf); hi.append(0); r += 1
    phys: dict[tuple[int, str], list[int]] = {}
    for k, (pm, pd) in enumerate(pairs):
        if models[pm].constraints.spread:
            phys.setdefault((pm, devices[pd].physical_id), []).append(k)
    for ks in phys.values():
        for k in ks:
            put(r, k, 1.0)
        lo.append(-np.inf); hi.append(1); r += 1
    for dk in range(n_dev):
        put(r, n_pairs + dk, 1.0)
    lo.append(-np.inf); hi.append(max_devices); r += 1
    if symmetric:
        for dk in range(n_dev - 1):
            put(r, n_pairs + dk, 1.0)
            put(r, n_pairs + dk + 1, -1.0)
            lo.append(0); hi.append(np.inf); r += 1
    a = coo_matrix((vals, (rows, cols)), shape=(r, n_var))
    a = a.tocsr()
    c = np.concatenate([np.zeros(n_pairs), np.ones(n_dev)])
    ub = np.array([models[pm].instances for pm, _ in pairs] + [1] * n_dev, dtype=float)
    res = milp(c, integrality=np.ones(n_var), bounds=Bounds(np.zeros(n_var), ub),
               constraints=LinearConstraint(a, np.array(lo, float), np.array(hi, float)),
               options={"time_limit": float(time_limit_seconds), "disp": False})
    if res.status == 2:
        return None, max_devices + 1, True  # incumbent proven optimal
    dual = getattr(res, "mip_dual_bound", None)
    lb = int(math.ceil(dual - 1e-6)) if dual is not None and np.isfinite(dual) else 0
    if res.x is None:
        return None, lb, False
    x = np.rint(res.x).astype(int)
    out: list[Assignment] = []
    counter: dict[str, int] = {}
    for k, (pm, pd) in enumerate(pairs):
        for _ in range(x[k]):
            m = models[pm]
            i = counter.get(m.name, 0)
            counter[m.name] = i + 1
            out.append(Assignment(m.name, i, dev_ids[pd]))
    if any(counter.get(m.name, 0) != m.instances for m in models):
        return None, lb, False
    # verify with the ledger (rounding of the scaled capacity rows)
    check = NodeState(devices, 0)
    check.capacity = state.capacity
    for a_ in out:
        d = _demand(models, a_.model)
        if not check.fits(d, a_.device):
            return None, lb, False
        check.reserve(d, a_.instance, a_.device)
    used = len(check.used_devices())
    return out, max(lb, used if res.status == 0 else lb), res.status == 0


# -- explanations ---------------------------------------------------------------------------------------------

def _explain(state: NodeState, demand: ModelDemand, instance: int, devices: Sequence[Device]) -> Unplaced:
    rejections = []
    closest, closest_short = None, None
    for dev in devices:
        reasons = state.filter_device(demand, dev.id)
        if not reasons:
            reasons = [InsufficientResource("memory", demand.memory_bytes, state.used_memory[dev.id],
                                            state.capacity[dev.id].memory_bytes)]
        rejections.append(DeviceRejection(dev.id, tuple(reasons)))
        if not static_reasons(demand, dev):
            short = max(0, demand.memory_bytes - (state.capacity[dev.id].memory_bytes - state.used_memory[dev.id]))
            short_empty = max(0, demand.memory_bytes - state.capacity[dev.id].memory_bytes)
            key = (short_empty, short)
            if closest_short is None or key < closest_short:
                closest, closest_short = dev.id, key
    if not devices:
        summary = "no devices"
    elif closest is None or closest_short is None:  # set together
        summary = "no device satisfies the model's constraints"
    elif closest_short[0] > 0:
        cap = state.capacity[closest].memory_bytes
        summary = (f"needs {fmt_bytes(demand.memory_bytes)}, larger than any allowed device "
                   f"(closest: {closest} with {fmt_bytes(cap)} usable)")
    else:
        summary = f"no allowed device has room left (closest: {closest})"
    return Unplaced(demand.name, instance, summary, tuple(rejections), closest)


# ---------------------------------------------------------------------------------------------------------------
# re-planning and the diff

def _replan(devices, demands, current: tuple[Assignment, ...], config: PlannerConfig, clock, start) -> Plan:
    by_name = {d.name: d for d in demands}
    state = NodeState(devices, config.memory_reserve_bytes)
    cache: dict = {}
    eligible = {d.name: eligible_devices(d, devices, state.capacity, cache) for d in demands}
    # 1. keep what is still valid, in the order given
    for a in sorted(current):
        d = by_name.get(a.model)
        if d is None or a.instance >= d.instances or a.device not in state.devices:
            continue
        if (a.model, a.instance) in state.where:
            continue
        if a.device in eligible[a.model] and state.fits(d, a.device):
            state.reserve(d, a.instance, a.device)
    # 2. place what is missing
    missing = [(d, i) for d in demands for i in range(d.instances)
               if (d.name, i) not in state.where and eligible[d.name]]
    greedy(state, missing, eligible, config.strategy, demands)
    keep_plan_unplaced = [(d, i) for d in demands for i in range(d.instances) if (d.name, i) not in state.where]
    incremental = state.assignments()
    incremental_moves = count_moves(current, incremental)
    candidates = [(len(keep_plan_unplaced), incremental_moves, "incremental", state)]
    if config.move_current and (keep_plan_unplaced or incremental_moves):
        scratch = _fresh(devices, demands, replace(config, time_limit_seconds=max(
            0.0, config.time_limit_seconds - (clock() - start))), clock, clock())
        relabeled = relabel(current, scratch.placements)
        st = NodeState(devices, config.memory_reserve_bytes)
        for a in relabeled:
            st.reserve(by_name[a.model], a.instance, a.device)
        candidates.append((len(scratch.unplaced), count_moves(current, relabeled), "scratch", st))
    candidates.sort(key=lambda c: (c[0], c[1]))
    _, _, method, state = candidates[0]
    placements = state.assignments()
    placed = set(state.where)
    unplaced_items = [(d, i) for d in demands for i in range(d.instances) if (d.name, i) not in placed]
    bounds = dimension_bounds(devices, [(d, i) for d in demands for i in range(d.instances) if (d.name, i) in placed],
                              state, eligible)
    lb = max(bounds.values(), default=0)
    used = len(state.used_devices())
    optimal = config.strategy == "pack" and not unplaced_items and used <= lb
    moves = diff(current, placements, devices, demands, config.memory_reserve_bytes)
    return Plan(placements=tuple(placements), unplaced=tuple(_explain(state, d, i, devices) for d, i in unplaced_items),
                devices_used=used, lower_bound=min(lb, used), optimal=optimal, moves=tuple(moves),
                strategy=config.strategy, method=f"replan:{method}", bounds=_ordered(bounds),
                exact_solver=EXACT_SOLVER if config.use_highs else None,
                proof_seconds=clock() - start if optimal else None)


def count_moves(current: Sequence[Assignment], new: Sequence[Assignment]) -> int:
    """Instances present in both whose device changed."""
    before = {(a.model, a.instance): a.device for a in current}
    return sum(1 for a in new if (a.model, a.instance) in before and before[(a.model, a.instance)] != a.device)


def relabel(current: Sequence[Assignment], new: Sequence[Assignment]) -> list[Assignment]:
    """Renumber each model's instances in `new` so that as many as possible keep their current device."""
    out: list[Assignment] = []
    by_model: dict[str, list[Assignment]] = {}
    for a in new:
        by_model.setdefault(a.model, []).append(a)
    for model, lst in by_model.items():
        n = len(lst)
        cur = sorted((a for a in current if a.model == model and a.instance < n), key=lambda a: a.instance)
        free_slots = list(lst)
        taken: set[int] = set()
        for a in cur:  # keep index and device where the new plan has a slot on that device
            for s in free_slots:
                if s.device == a.device:
                    free_slots.remove(s)
                    out.append(Assignment(model, a.instance, a.device))
                    taken.add(a.instance)
                    break
        spare = [i for i in range(n) if i not in taken]
        for s, i in zip(free_slots, spare):
            out.append(Assignment(model, i, s.device))
    return sorted(out)


def diff(current: Sequence[Assignment], new: Sequence[Assignment], devices: Sequence[Device],
         demands: Sequence[ModelDemand], memory_reserve_bytes: int = 0) -> list[Move]:
    """An ordered add / remove / move list from `current` to `new`. Instances on lost or unhealthy devices are
    removed first (they are gone already); excess instances next (never below a model's minimum); then adds and
    moves, each only when its target has room at that point, a move starting its new instance before stopping the
    old one. A cycle of moves with no room anywhere is broken by a break-before-make move of a model that stays at or
    above its minimum; failing that the move is emitted with a note."""
    by_name = {d.name: d for d in demands}
    healthy = {d.id for d in devices if d.healthy}
    before = {(a.model, a.instance): a.device for a in current}
    after = {(a.model, a.instance): a.device for a in new}
    live: dict[str, int] = {}
    state = NodeState(devices, memory_reserve_bytes)
    moves: list[Move] = []
    for key, dev in sorted(before.items()):
        model, inst = key
        if dev not in healthy:
            moves.append(Move("remove", model, inst, from_device=dev, note="device lost or unhealthy"))
            continue
        d = by_name.get(model)
        if d is None:
            d = ModelDemand(model, 0, instances=0)
        if (model, inst) not in state.where:
            state.reserve(d, inst, dev)
        live[model] = live.get(model, 0) + 1
    for key, dev in sorted(before.items()):
        model, inst = key
        if dev in healthy and key not in after:
            mn = by_name[model].min_instances if model in by_name else 0
            assert mn is not None  # ModelDemand.__post_init__ resolved the default
            if live.get(model, 0) - 1 >= mn or model not in by_name:
                moves.append(Move("remove", model, inst, from_device=dev))
                state.unreserve(model, inst)
                live[model] -= 1
    pending = []
    for key, dev in sorted(after.items()):
        old = before.get(key)
        if old == dev and old in healthy:
            continue
        pending.append((key, old if old in healthy else None, dev))
    while pending:
        progressed = False
        for item in list(pending):
            (model, inst), old, dev = item
            d = by_name[model]
            if old is not None:
                state.unreserve(model, inst)  # make-before-break: both exist for a moment, check target room only
            if state.fits(d, dev):
                state.reserve(d, inst, dev)
                moves.append(Move("move" if old else "add", model, inst, from_device=old, to_device=dev))
                if old is None:
                    live[model] = live.get(model, 0) + 1
                pending.remove(item)
                progressed = True
            elif old is not None:
                state.reserve(d, inst, old)
        if progressed:
            continue
        # stuck: break a cycle
        for item in list(pending):
            (model, inst), old, dev = item
            d = by_name[model]
            assert d.min_instances is not None  # ModelDemand.__post_init__ resolved the default
            if old is not None and live.get(model, 0) - 1 >= d.min_instances:
                # break the cycle: stop this instance now, start it on its target once there is room
                state.unreserve(model, inst)
                live[model] -= 1
                moves.append(Move("remove", model, inst, from_device=old, make_before_break=False,
                                  note=f"no room to start on {dev} first: stopped, started again below"))
                pending[pending.index(item)] = ((model, inst), None, dev)
                break
        else:
            for (model, inst), old, dev in pending:
                moves.append(Move("move" if old else "add", model, inst, from_device=old, to_device=dev,
                                  make_before_break=False, note="needs room freed by other steps"))
            pending = []
    return moves
