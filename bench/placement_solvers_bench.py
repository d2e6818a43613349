"""Which exact solver for memory + compute packing: OR-Tools CP-SAT against HiGHS, on the 2-D sets of
bench/placement_sets.py, each from the same greedy incumbent (the engine at time limit 0) and with the same time.

- CP-SAT: the assignment model (x[i, b] instance i on device b, y[b] device b used, sum_i size x <= capacity y in
  memory and compute, y[b] >= y[b + 1], instance i only on devices <= i in decreasing size order: the usual symmetry
  breaking), the greedy plan as a hint, minimise sum y; `--workers` search workers (2: this machine's cores).
- HiGHS aggregated MIP: gpud's exact stage alone (gpud.placement.solver._aggregated_mip, asked for one device fewer than
  the greedy; an infeasible answer proves the greedy optimal).
- gpud: the whole engine (`placement.plan`: greedy, minimum-bin-slack restarts, elimination, HiGHS).

OR-Tools is not a gpud dependency (its protobuf pin, < 6.34, excludes the protobuf 7 that gpud's gRPC code needs), so
run this in a separate environment:

    python3 -m venv /tmp/ortools && /tmp/ortools/bin/pip install ortools scipy pyyaml
    /tmp/ortools/bin/python bench/placement_solvers_bench.py --sets k25 k50 r100w --seeds 3 --time-limit 20

Without ortools the CP-SAT column says "n/a".
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import placement_sets  # noqa: E402
from gpud.placement.framework import NodeState, eligible_devices  # noqa: E402
from gpud.placement.model import compute_units  # noqa: E402
from gpud.placement.solver import PlannerConfig, _aggregated_mip, plan  # noqa: E402

SETS = {name: entry for name, entry in placement_sets.SETS_2D.items() if name != "r200"}


def cpsat(devices, demands, greedy, time_limit: float, workers: int):
    """(devices used, proven optimal, seconds) or None without ortools."""
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        return None
    cap_mem, cap_cu = devices[0].memory_bytes, compute_units(devices[0].compute_fraction)
    sizes = [(d.memory_bytes, compute_units(d.compute_fraction)) for d in demands]
    n, nb = len(sizes), greedy.devices_used
    order = sorted(range(n), key=lambda i: -(sizes[i][0] / cap_mem + sizes[i][1] / cap_cu))
    rank = {i: r for r, i in enumerate(order)}
    m = cp_model.CpModel()
    x = {(i, b): m.new_bool_var(f"x{i}_{b}") for i in range(n) for b in range(min(nb, rank[i] + 1))}
    y = [m.new_bool_var(f"y{b}") for b in range(nb)]
    for i in range(n):
        m.add_exactly_one(x[i, b] for b in range(nb) if (i, b) in x)
    for b in range(nb):
        members = [i for i in range(n) if (i, b) in x]
        m.add(sum(sizes[i][0] * x[i, b] for i in members) <= cap_mem * y[b])
        m.add(sum(sizes[i][1] * x[i, b] for i in members) <= cap_cu * y[b])
        if b:
            m.add(y[b] <= y[b - 1])
    m.minimize(sum(y))
    # the greedy plan as a hint, its devices renumbered by their largest instance to respect the symmetry breaking
    index = {d.name: k for k, d in enumerate(demands)}
    by_dev: dict[str, list[int]] = {}
    for a in greedy.placements:
        by_dev.setdefault(a.device, []).append(index[a.model])
    bins = sorted(by_dev.values(), key=lambda b: min(rank[i] for i in b))
    where = {i: b for b, items in enumerate(bins) for i in items}
    for (i, b), var in x.items():
        m.add_hint(var, where[i] == b)
    for b in range(nb):
        m.add_hint(y[b], b < len(bins))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = workers
    t0 = time.perf_counter()
    status = solver.solve(m)
    dt = time.perf_counter() - t0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return nb, False, dt
    return int(round(solver.objective_value)), status == cp_model.OPTIMAL, dt


def highs_aggregated(devices, demands, greedy, time_limit: float):
    state = NodeState(devices)
    for a in greedy.placements:
        state.reserve(next(d for d in demands if d.name == a.model), a.instance, a.device)
    eligible = {d.name: eligible_devices(d, devices, state.capacity) for d in demands}
    t0 = time.perf_counter()
    got = _aggregated_mip(devices, demands, state, eligible, time_limit, max_devices=greedy.devices_used - 1)
    dt = time.perf_counter() - t0
    if got is None:
        return greedy.devices_used, False, dt, "model too large (> 20,000 model x device pairs)"
    assign, lb, proven = got
    used = len({a.device for a in assign}) if assign else greedy.devices_used
    return used, proven, dt, ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="*", default=["k25", "k50", "r100w"], help=" ".join(SETS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=2, help="CP-SAT search workers (default %(default)d)")
    args = ap.parse_args(argv)
    print(f"time limit {args.time_limit} s per solver and instance; CP-SAT workers {args.workers}")
    print(f"{'set':<6} {'seed':>4} {'ref':>4} {'greedy':>6} | {'gpud':>12} | {'HiGHS agg. MIP':>16} | "
          f"{'CP-SAT':>16}")
    for name in args.sets:
        build, known = SETS[name]
        for seed in range(args.seeds):
            devices, demands = build(seed)
            greedy = plan(devices, demands, config=PlannerConfig(time_limit_seconds=0))
            t0 = time.perf_counter()
            ours = plan(devices, demands, config=PlannerConfig(time_limit_seconds=args.time_limit))
            t_ours = time.perf_counter() - t0
            h_used, h_proven, h_dt, note = highs_aggregated(devices, demands, greedy, args.time_limit)
            c = cpsat(devices, demands, greedy, args.time_limit, args.workers)
            ref = known if known is not None else ours.lower_bound

            def cell(used, proven, dt):
                return f"{used}{'*' if proven else ' '} {dt:5.1f} s"

            c_txt = "n/a" if c is None else cell(*c)
            print(f"{name:<6} {seed:>4} {ref:>4} {greedy.devices_used:>6} | {cell(ours.devices_used, ours.optimal, t_ours):>12}"
                  f" | {cell(h_used, h_proven, h_dt):>16} | {c_txt:>16} {note}")
            sys.stdout.flush()
    print("(* = proven optimal; ref = the known optimum, or gpud's lower bound for random sets)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
