"""One-dimensional bin packing on integer sizes: fast heuristics, lower bounds, improvement, an exact arc-flow model.

Everything here is a pure function of integer item sizes and one integer capacity. The multi-dimensional engine
(`gpud.placement.solver`) uses this module when an instance reduces to one dimension over identical bins; the benchmark
uses it directly.

Methods:
- `first_fit_decreasing`, `best_fit_decreasing`: O(n log n) constructive heuristics.
- `lower_bound_l1` (ceil(sum / capacity)) and `lower_bound_l2` (Martello & Toth 1990).
- `improve`: a bin-elimination local search (empty the emptiest bins, refill the others by dominating swaps,
  re-insert), bounded by a deadline read from an injected clock.
- `solve_arcflow`: Valério de Carvalho's arc-flow model solved with HiGHS (scipy.optimize.milp), an optional
  dependency. Its LP relaxation equals the Gilmore-Gomory bound, which is what proves optimality when the simple
  bound is not tight (u250_13 of the Falkenauer set).
"""
from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass
from collections.abc import Callable, Sequence

Clock = Callable[[], float]
Bins = list[list[int]]  # each bin is a list of item indices


@dataclass(frozen=True)
class ArcFlowResult:
    bins: Bins | None  # None when no integer solution was found in time
    lower_bound: int  # a proven lower bound on the number of bins
    optimal: bool  # True when HiGHS proved the returned packing optimal
    arcs: int  # size of the model (number of item arcs)


def _check(sizes: Sequence[int], capacity_units: int) -> None:
    if capacity_units <= 0:
        raise ValueError(f"capacity must be positive, got {capacity_units}")
    for i, s in enumerate(sizes):
        if s < 0:
            raise ValueError(f"item {i}: size must be non-negative, got {s}")
        if s > capacity_units:
            raise ValueError(f"item {i}: size {s} exceeds capacity {capacity_units}")


def _decreasing_order(sizes: Sequence[int]) -> list[int]:
    return sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))


def first_fit_decreasing(sizes: Sequence[int], capacity_units: int) -> Bins:
    """First fit over items in decreasing size, with a max segment tree over bin residuals: O(n log n)."""
    _check(sizes, capacity_units)
    n = len(sizes)
    if n == 0:
        return []
    size = 1
    while size < n:
        size *= 2
    tree = [0] * (2 * size)  # max residual in each subtree; unopened bins have residual capacity
    for j in range(n):
        tree[size + j] = capacity_units
    for j in range(size - 1, 0, -1):
        tree[j] = max(tree[2 * j], tree[2 * j + 1])
    bins: Bins = [[] for _ in range(n)]
    for i in _decreasing_order(sizes):
        s = sizes[i]
        j = 1
        while j < size:  # leftmost leaf with residual >= s
            j = 2 * j if tree[2 * j] >= s else 2 * j + 1
        bins[j - size].append(i)
        tree[j] -= s
        j //= 2
        while j:
            tree[j] = max(tree[2 * j], tree[2 * j + 1])
            j //= 2
    return [b for b in bins if b]


def best_fit_decreasing(sizes: Sequence[int], capacity_units: int) -> Bins:
    """Best fit over items in decreasing size: the open bin with the least residual that still fits. O(n log n)."""
    _check(sizes, capacity_units)
    residuals: list[tuple[int, int]] = []  # sorted (residual, bin index)
    bins: Bins = []
    for i in _decreasing_order(sizes):
        s = sizes[i]
        k = bisect.bisect_left(residuals, (s, -1))
        if k < len(residuals):
            r, b = residuals.pop(k)
        else:
            r, b = capacity_units, len(bins)
            bins.append([])
        bins[b].append(i)
        if r - s > 0:
            bisect.insort(residuals, (r - s, b))
    return bins


def lower_bound_l1(sizes: Sequence[int], capacity_units: int) -> int:
    """ceil(sum / capacity)."""
    return -(-sum(sizes) // capacity_units) if sizes else 0


def lower_bound_l2(sizes: Sequence[int], capacity_units: int) -> int:
    """Martello & Toth's L2: for each threshold k <= C/2, items > C-k need a bin alone, items in (C/2, C-k] need a
    bin each, and items in [k, C/2] fill the space left in those bins before opening new ones. O(n log n)."""
    if not sizes:
        return 0
    c = capacity_units
    asc = sorted(sizes)
    prefix = [0]
    for s in asc:
        prefix.append(prefix[-1] + s)
    n = len(asc)

    def count_sum(lo_incl: int, hi_incl: int) -> tuple[int, int]:  # items with lo <= s <= hi
        a = bisect.bisect_left(asc, lo_incl)
        b_ = bisect.bisect_right(asc, hi_incl)
        return (b_ - a, prefix[b_] - prefix[a]) if b_ > a else (0, 0)

    best = lower_bound_l1(sizes, c)
    half = c // 2  # s <= c/2  <=>  2s <= c  <=>  s <= c // 2
    ks = sorted({s for s in asc if 2 * s <= c} | {0})
    for k in ks:
        n1 = n - bisect.bisect_right(asc, c - k)  # s > c - k
        n2, sum2 = count_sum(half + 1, c - k)  # c/2 < s <= c - k
        _, sum3 = count_sum(max(k, 0), half)  # k <= s <= c/2
        slack2 = n2 * c - sum2
        extra = max(0, -(-(sum3 - slack2) // c))
        best = max(best, n1 + n2 + extra)
    return best


def improve(sizes: Sequence[int], capacity_units: int, bins: Bins, *, deadline: float, clock: Clock,
            target_bins: int = 0, seed: int = 0) -> Bins:
    """Bin-elimination local search. Repeatedly empties the least-filled bins, lets every other bin swap its items
    for freed ones when that fills it more (1-1, 2-1, 1-2, 2-2 exchanges, Falkenauer's dominance idea), then
    re-inserts what is left by best fit. Keeps the better packing; stops at `target_bins` or the deadline."""
    rng = random.Random(seed)
    c = capacity_units
    best = [list(b) for b in bins]
    if len(best) <= target_bins:
        return best
    cur = [list(b) for b in best]
    cur_fit = _fitness([sum(sizes[i] for i in b) for b in cur], c)
    stall = 0
    iteration = 0
    while clock() < deadline and len(best) > target_bins:
        iteration += 1
        loads = [sum(sizes[i] for i in b) for b in cur]
        order = sorted(range(len(cur)), key=lambda j: (loads[j], rng.random()))
        k = 2 + (stall % 3) if len(cur) > 3 else 1
        if rng.random() < 0.3:  # occasionally empty a random bin too, to escape plateaus
            victims = set(order[: k - 1]) | {rng.randrange(len(cur))}
        else:
            victims = set(order[:k])
        free = [i for j in victims for i in cur[j]]
        kept = [cur[j] for j in range(len(cur)) if j not in victims]
        kept_loads = [loads[j] for j in range(len(cur)) if j not in victims]
        rng.shuffle(kept_idx := list(range(len(kept))))
        for j in kept_idx:
            free, kept[j], kept_loads[j] = _dominate(sizes, c, kept[j], kept_loads[j], free)
            if not free:
                break
        # re-insert the free items by best fit into the kept bins, opening new bins when needed
        free.sort(key=lambda i: -sizes[i])
        for i in free:
            s = sizes[i]
            pick, pick_res = -1, c + 1
            for j, load in enumerate(kept_loads):
                r = c - load - s
                if 0 <= r < pick_res:
                    pick, pick_res = j, r
                    if r == 0:
                        break
            if pick < 0:
                kept.append([i])
                kept_loads.append(s)
            else:
                kept[pick].append(i)
                kept_loads[pick] += s
        fit = _fitness(kept_loads, c)
        if len(kept) < len(cur) or fit >= cur_fit or rng.random() < 0.02:
            cur, cur_fit = kept, fit
        if len(cur) < len(best):
            best = [list(b) for b in cur]
            stall = 0
        else:
            stall += 1
            if stall > 200:
                cur = [list(b) for b in best]
                cur_fit = _fitness([sum(sizes[i] for i in b) for b in cur], c)
                stall = 0
    return best


def _fitness(loads: list[int], c: int) -> float:
    """Falkenauer's fitness: the mean squared fill; fewer, fuller bins score higher."""
    return sum((load / c) ** 2 for load in loads) / len(loads) if loads else 0.0


def _dominate(sizes: Sequence[int], c: int, bin_items: list[int], load: int,
              free: list[int]) -> tuple[list[int], list[int], int]:
    """Swap up to two items of a bin for up to two free items when the bin gets fuller (but stays <= c)."""
    improved = True
    while improved and free:
        improved = False
        best_gain = 0
        best_move: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (bin positions out, free positions in)
        nb, nf = len(bin_items), len(free)
        # candidate groups from the bin (1 or 2 items) and from the free list (1 or 2 items)
        bin_groups = [(a,) for a in range(nb)] + [(a, b) for a in range(nb) for b in range(a + 1, nb)]
        if nf <= 40:
            free_groups = [(a,) for a in range(nf)] + [(a, b) for a in range(nf) for b in range(a + 1, nf)]
        else:
            free_groups = [(a,) for a in range(nf)]
        room = c - load
        for fg in free_groups:
            fsum = sum(sizes[free[x]] for x in fg)
            for bg in bin_groups:
                bsum = sum(sizes[bin_items[x]] for x in bg)
                gain = fsum - bsum
                if gain > best_gain and gain <= room and (len(fg) >= len(bg) or gain > 0):
                    best_gain, best_move = gain, (bg, fg)
            if fsum <= room and fsum > best_gain:  # pure insertion
                best_gain, best_move = fsum, ((), fg)
        if best_move is not None:
            out_at, in_at = best_move
            out_items = [bin_items[x] for x in out_at]
            in_items = [free[x] for x in in_at]
            bin_items = [it for x, it in enumerate(bin_items) if x not in out_at] + in_items
            free = [it for x, it in enumerate(free) if x not in in_at] + out_items
            load += best_gain
            improved = load < c
    return free, bin_items, load


# ---------------------------------------------------------------------------------------------------------------
# Arc-flow (optional HiGHS via scipy)

def highs_available() -> bool:
    try:
        from scipy.optimize import milp  # noqa: F401
    except Exception:  # noqa: BLE001 - depends on the environment
        return False
    return True


def build_arcflow(sizes: Sequence[int], capacity_units: int, max_arcs: int = 400_000):
    """Valério de Carvalho's graph with items in non-increasing order along every path. Nodes are the reachable
    partial loads, so byte-sized capacities are fine as long as the number of distinct reachable loads stays small.
    Returns (types, demands, arcs) or None when the graph would exceed `max_arcs`."""
    counts: dict[int, int] = {}
    for s in sizes:
        if s > 0:
            counts[s] = counts.get(s, 0) + 1
    types = sorted(counts, reverse=True)
    demands = [counts[w] for w in types]
    reach = {0}
    arcs: set[tuple[int, int, int]] = set()
    for t, (w, b) in enumerate(zip(types, demands)):
        new: set[int] = set()
        for u in reach:
            v = u
            for _ in range(b):
                if v + w > capacity_units:
                    break
                arcs.add((v, v + w, t))
                v += w
                new.add(v)
            if len(arcs) > max_arcs:
                return None
        reach |= new
    return types, demands, sorted(arcs)


class _ArcFlowModel:
    """The arc-flow model as sparse matrices: variables are item arcs then loss arcs (node -> sink)."""

    def __init__(self, sizes: Sequence[int], capacity_units: int, max_arcs: int):
        import numpy as np
        from scipy.sparse import coo_matrix

        built = build_arcflow(sizes, capacity_units, max_arcs)
        self.ok = built is not None
        if not self.ok:
            return
        self.types, self.demands, self.arcs = built
        self.sink = sink = capacity_units
        nodes = sorted({u for u, _, _ in self.arcs} | {v for _, v, _ in self.arcs} | {sink})
        inner = [v for v in nodes if v not in (0, sink)]
        row_of = {v: r for r, v in enumerate(inner)}
        self.loss_nodes = inner
        n_item, n_loss = len(self.arcs), len(inner)
        self.n_item, self.n_var = n_item, n_item + n_loss
        rows, cols, vals = [], [], []
        n_flow = len(inner)
        for k, (u, v, t) in enumerate(self.arcs):
            if u in row_of:
                rows.append(row_of[u]); cols.append(k); vals.append(-1.0)
            if v in row_of:
                rows.append(row_of[v]); cols.append(k); vals.append(1.0)
            rows.append(n_flow + t); cols.append(k); vals.append(1.0)
        for k, u in enumerate(inner):
            rows.append(row_of[u]); cols.append(n_item + k); vals.append(-1.0)
        self.a = coo_matrix((vals, (rows, cols)), shape=(n_flow + len(self.types), self.n_var)).tocsr()
        self.lo = np.concatenate([np.zeros(n_flow), np.array(self.demands, dtype=float)])
        self.hi = np.concatenate([np.zeros(n_flow), np.full(len(self.types), np.inf)])
        self.c = np.zeros(self.n_var)
        for k, (u, _, _) in enumerate(self.arcs):
            if u == 0:
                self.c[k] = 1.0
        self.ub = np.concatenate([np.array([self.demands[t] for _, _, t in self.arcs], dtype=float),
                                  np.full(n_loss, np.inf)])


def arcflow_lp_bound(sizes: Sequence[int], capacity_units: int, *, time_limit_seconds: float = 60.0,
                     max_arcs: int = 400_000):
    """The arc-flow LP relaxation (= Gilmore-Gomory bound). Returns (ceil(LP), fractional bins as (weight, sizes))
    or None when HiGHS is missing or the graph is too large."""
    if not highs_available() or not sizes:
        return None
    import numpy as np
    from scipy.optimize import linprog

    m = _ArcFlowModel(sizes, capacity_units, max_arcs)
    if not m.ok or not m.arcs:
        return None
    n_flow = len(m.loss_nodes)
    a = m.a
    res = linprog(m.c, A_ub=-a[n_flow:], b_ub=-m.lo[n_flow:], A_eq=a[:n_flow], b_eq=np.zeros(n_flow),
                  bounds=list(zip([0.0] * m.n_var, m.ub)), method="highs",
                  options={"time_limit": max(0.01, float(time_limit_seconds))})
    if res.status != 0:
        return None
    bound = int(math.ceil(res.fun - 1e-6))
    # decompose the fractional flow into patterns, heaviest arc first
    out: dict[int, dict[tuple[int, int], float]] = {}
    for k, (u, v, t) in enumerate(m.arcs):
        if res.x[k] > 1e-9:
            out.setdefault(u, {})[(v, t)] = res.x[k]
    for k, u in enumerate(m.loss_nodes):
        if res.x[m.n_item + k] > 1e-9:
            out.setdefault(u, {})[(m.sink, -1)] = res.x[m.n_item + k]
    patterns: list[tuple[float, list[int]]] = []
    while out.get(0):
        u, weight, edges, path = 0, math.inf, [], []
        while u != m.sink and u in out:
            key, val = max(out[u].items(), key=lambda kv: kv[1])
            edges.append((u, key))
            weight = min(weight, val)
            if key[1] >= 0:
                path.append(m.types[key[1]])
            u = key[0]
        for node, key in edges:
            out[node][key] -= weight
            if out[node][key] <= 1e-9:
                del out[node][key]
            if not out[node]:
                del out[node]
        patterns.append((weight, path))
    return bound, patterns


def solve_arcflow(sizes: Sequence[int], capacity_units: int, *, time_limit_seconds: float,
                  max_bins: int | None = None, max_arcs: int = 400_000) -> ArcFlowResult | None:
    """Solve bin packing exactly (within the time limit) with the arc-flow model and HiGHS. Returns None when scipy
    is missing or the graph is too large.

    `max_bins` (the incumbent minus one, usually) adds the cut "at most max_bins bins": HiGHS then only searches for
    a strictly better packing, and an infeasible model proves the incumbent optimal (`bins` None, `lower_bound`
    max_bins + 1)."""
    _check(sizes, capacity_units)
    if not highs_available() or time_limit_seconds <= 0:
        return None
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    m = _ArcFlowModel(sizes, capacity_units, max_arcs)
    if not m.ok:
        return None
    if not m.arcs:
        return ArcFlowResult(bins=[[i for i in range(len(sizes))]] if sizes else [], lower_bound=min(1, len(sizes)),
                             optimal=True, arcs=0)
    constraints = [LinearConstraint(m.a, m.lo, m.hi)]
    if max_bins is not None:
        if max_bins <= 0:
            return ArcFlowResult(bins=None, lower_bound=1, optimal=False, arcs=m.n_item)
        constraints.append(LinearConstraint(m.c.reshape(1, -1), -np.inf, float(max_bins)))
    res = milp(m.c, integrality=np.ones(m.n_var), bounds=Bounds(np.zeros(m.n_var), m.ub), constraints=constraints,
               options={"time_limit": float(time_limit_seconds), "disp": False})
    if res.status == 2:  # infeasible: no packing within max_bins exists
        return ArcFlowResult(bins=None, lower_bound=(max_bins or 0) + 1, optimal=False, arcs=m.n_item)
    dual = getattr(res, "mip_dual_bound", None)
    lb = 0
    if dual is not None and np.isfinite(dual):
        lb = int(math.ceil(dual - 1e-6))
    if res.x is None:
        return ArcFlowResult(bins=None, lower_bound=lb, optimal=False, arcs=m.n_item)
    x = np.rint(res.x).astype(int)
    bins = _decompose(sizes, m.types, m.arcs, m.loss_nodes, x, m.sink)
    optimal = res.status == 0
    if optimal:
        lb = max(lb, len(bins))
    return ArcFlowResult(bins=bins, lower_bound=lb, optimal=optimal and lb >= len(bins), arcs=m.n_item)


def _decompose(sizes, types, arcs, loss_nodes, x, sink) -> Bins:
    out: dict[int, list[list]] = {}
    n_item = len(arcs)
    for k, (u, v, t) in enumerate(arcs):
        if x[k] > 0:
            out.setdefault(u, []).append([v, t, int(x[k])])
    for k, u in enumerate(loss_nodes):
        if x[n_item + k] > 0:
            out.setdefault(u, []).append([sink, -1, int(x[n_item + k])])
    pool: dict[int, list[int]] = {}
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        pool.setdefault(sizes[i], []).append(i)
    zero_items = pool.pop(0, [])
    bins: Bins = []
    while True:
        start = out.get(0)
        if not start:
            break
        path, u = [], 0
        while u != sink:
            edges = out.get(u)
            if not edges:
                break
            e = edges[-1]
            e[2] -= 1
            if e[2] == 0:
                edges.pop()
            if e[1] >= 0:
                path.append(e[1])
            u = e[0]
        items = []
        for t in path:
            lst = pool.get(types[t])
            if lst:
                items.append(lst.pop())
        if items:
            bins.append(items)
    leftovers = [i for lst in pool.values() for i in lst]
    if leftovers:  # cannot happen with a feasible solution; keep the packing valid anyway
        for i in leftovers:
            bins.append([i])
    if zero_items:
        if bins:
            bins[0].extend(zero_items)
        else:
            bins.append(zero_items)
    return bins


@dataclass(frozen=True)
class Packing:
    bins: Bins  # item indices per bin
    lower_bound: int  # proven lower bound on the number of bins
    optimal: bool  # len(bins) == lower_bound, or HiGHS proved it
    method: str  # which stage produced the packing


def solve(sizes: Sequence[int], capacity_units: int, *, time_limit_seconds: float, clock: Clock,
          use_highs: bool = True, seed: int = 0) -> Packing:
    """Best packing found within the time limit, with a lower bound. Stages, each only while the gap is open:
    FFD/BFD and the L2 bound; the arc-flow LP bound and LP rounding (residual items re-packed); local search;
    the arc-flow MIP with the cut "one bin fewer than the incumbent"."""
    _check(sizes, capacity_units)
    start = clock()
    deadline = start + max(0.0, time_limit_seconds)
    c = capacity_units
    ffd = first_fit_decreasing(sizes, c)
    bfd = best_fit_decreasing(sizes, c)
    best, method = (bfd, "bfd") if len(bfd) <= len(ffd) else (ffd, "ffd")
    lb = lower_bound_l2(sizes, c)
    if len(best) <= lb or time_limit_seconds <= 0:
        return Packing(best, lb, len(best) <= lb, method)
    highs = use_highs and highs_available()
    quick = improve(sizes, c, best, deadline=start + (0.25 if highs else 1.0) * time_limit_seconds, clock=clock,
                    target_bins=lb, seed=seed)
    if len(quick) < len(best):
        best, method = quick, "local-search"
    if len(best) <= lb:
        return Packing(best, lb, True, method)
    if highs and clock() < deadline:
        lp = arcflow_lp_bound(sizes, c, time_limit_seconds=0.3 * (deadline - clock()))
        if lp is not None:
            lp_bound, patterns = lp
            lb = max(lb, lp_bound)
            if len(best) <= lb:
                return Packing(best, lb, True, method)
            rounded = _round_patterns(sizes, c, patterns, deadline=deadline, clock=clock, seed=seed)
            if len(rounded) < len(best):
                best, method = rounded, "lp-rounding"
            if len(best) <= lb:
                return Packing(best, lb, True, method)
    if not highs:
        return Packing(best, lb, len(best) <= lb, method)
    # local search again from the (possibly better) incumbent, then the exact model for the rest of the time
    ls_deadline = clock() + 0.3 * max(0.0, deadline - clock())
    improved = improve(sizes, c, best, deadline=ls_deadline, clock=clock, target_bins=lb, seed=seed + 1)
    if len(improved) < len(best):
        best, method = improved, "local-search"
    if len(best) <= lb:
        return Packing(best, lb, True, method)
    if highs:
        remaining = deadline - clock()
        remaining -= 0.05 * time_limit_seconds + 0.1  # model building and scipy overhead
        res = solve_arcflow(sizes, c, time_limit_seconds=remaining, max_bins=len(best) - 1) if remaining > 0 else None
        if res is not None:
            lb = max(lb, res.lower_bound)
            if res.bins is not None and len(res.bins) < len(best):
                best, method = res.bins, "arc-flow-mip"
            if res.optimal:
                return Packing(best, max(lb, len(best)), True, method)
    return Packing(best, lb, len(best) <= lb, method)


def _round_patterns(sizes, c, patterns, *, deadline, clock, seed) -> Bins:
    """Take floor(weight) copies of each fractional LP pattern while items remain, then pack the residual items."""
    pool: dict[int, list[int]] = {}
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        pool.setdefault(sizes[i], []).append(i)
    bins: Bins = []
    for weight, pattern in sorted(patterns, key=lambda p: -p[0]):
        need: dict[int, int] = {}
        for w in pattern:
            need[w] = need.get(w, 0) + 1
        for _ in range(int(math.floor(weight + 1e-9))):
            if any(len(pool.get(w, ())) < k for w, k in need.items()):
                break
            bins.append([pool[w].pop() for w in pattern])
    residual = [i for lst in pool.values() for i in lst]
    if residual:
        sub = [sizes[i] for i in residual]
        rb = best_fit_decreasing(sub, c)
        rlb = lower_bound_l2(sub, c)
        if len(rb) > rlb:
            left = deadline - clock()
            rb = improve(sub, c, rb, deadline=clock() + min(0.25, 0.2 * max(0.0, left)), clock=clock,
                         target_bins=rlb, seed=seed)
        if len(rb) > rlb:
            left = deadline - clock()
            res = solve_arcflow(sub, c, time_limit_seconds=min(0.5, 0.3 * left), max_bins=len(rb) - 1) \
                if left > 0 else None
            if res is not None and res.bins is not None and len(res.bins) < len(rb):
                rb = res.bins
        bins.extend([[residual[j] for j in b] for b in rb])
    return bins
