"""Placement engine benchmark: the classic one-dimensional bin-packing instances with known optima, and two-dimensional
(memory + compute) sets, built with a known optimum or random (bench/placement_sets.py).

One-dimensional: each instance becomes a node of identical devices of the instance's capacity (memory, in bytes) and
one model per item (memory = the item's weight, one instance). Everything goes through the public engine,
`placement.plan`; the baseline of each 2-D row is the same engine at time limit 0 (the greedy), run in the same run.

    .venv/bin/python bench/placement_bench.py --data ../shared/data --time-limit 2 --sets u120 u250
    .venv/bin/python bench/placement_bench.py --data ../shared/data --time-limit 10 --sets t120 t249
    .venv/bin/python bench/placement_bench.py --time-limit 20 --sets k25 k50 k100 --seeds 10
    .venv/bin/python bench/placement_bench.py --time-limit 20 --sets r100 r200 r100w --seeds 5
    .venv/bin/python bench/placement_bench.py --heuristics-items 1000

Prints per set: the ratio of devices used to the optimum (mean and worst), how many plans were optimal and how
many were proven optimal by the engine, the gap of the engine's lower bound, and the time per instance; for 2-D sets
also the devices of the greedy (time limit 0), the time to the first plan and to the proof.
"""
from __future__ import annotations

import argparse
import glob
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpud.placement.model import Device, ModelDemand  # noqa: E402
from gpud.placement.solver import EXACT_SOLVER, PlannerConfig, plan  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import placement_sets  # noqa: E402

SETS_2D = placement_sets.SETS_2D

# Proven optima (the OR-Library `best` column is wrong for four of these, see ../shared/data/README.md).
OPTIMA = {
    "u120": [48, 49, 46, 49, 50, 48, 48, 49, 50, 46, 52, 49, 48, 49, 50, 48, 52, 52, 49, 49],
    "u250": [99, 100, 102, 100, 101, 101, 102, 103, 105, 101, 105, 101, 105, 103, 100, 105, 97, 100, 100, 102],
}


def read_orlib(path: Path) -> list[tuple[str, int, list[int]]]:
    lines = [x.strip() for x in path.read_text().splitlines() if x.strip()]
    n, p, out = int(lines[0]), 1, []
    for _ in range(n):
        name = lines[p]
        cap, k, _best = map(int, lines[p + 1].split())
        out.append((name, cap, [int(float(x)) for x in lines[p + 2:p + 2 + k]]))
        p += 2 + k
    return out


def read_bpplib_dir(path: Path) -> list[tuple[str, int, list[int]]]:
    out = []
    for f in sorted(glob.glob(str(path / "*.txt"))):
        vals = [int(x) for x in Path(f).read_text().split()]
        out.append((Path(f).stem, vals[1], vals[2:2 + vals[0]]))
    return out


def load_set(data: Path, name: str):
    if name == "u120":
        inst = read_orlib(data / "binpacking" / "falkenauer" / "binpack1.txt")
        return [(n, c, w, OPTIMA["u120"][k]) for k, (n, c, w) in enumerate(inst)]
    if name == "u250":
        inst = read_orlib(data / "binpacking" / "falkenauer" / "binpack2.txt")
        return [(n, c, w, OPTIMA["u250"][k]) for k, (n, c, w) in enumerate(inst)]
    if name in ("t120", "t249"):
        inst = read_bpplib_dir(data / "binpacking" / "triplets" / name)
        return [(n, c, w, len(w) // 3) for n, c, w in inst]  # every optimal bin holds exactly three items
    raise SystemExit(f"unknown set {name!r}")


def to_problem(capacity: int, weights: list[int]):
    devices = [Device(f"d{k}", capacity, 1.0) for k in range(len(weights))]
    demands = [ModelDemand(f"item{k}", w, instances=1) for k, w in enumerate(weights)]
    return devices, demands


def run_set(data: Path, name: str, time_limit: float, use_highs: bool, verbose: bool) -> dict:
    rows = []
    for inst_name, cap, weights, opt in load_set(data, name):
        devices, demands = to_problem(cap, weights)
        t0 = time.perf_counter()
        p = plan(devices, demands, config=PlannerConfig(time_limit_seconds=time_limit, use_highs=use_highs))
        dt = time.perf_counter() - t0
        assert not p.unplaced, inst_name
        assert p.lower_bound <= opt <= p.devices_used, (inst_name, p.lower_bound, opt, p.devices_used)
        rows.append((inst_name, p.devices_used, opt, p.lower_bound, p.optimal, dt, p.method))
        if verbose:
            print(f"  {inst_name:<24} used {p.devices_used:4d}  opt {opt:4d}  lb {p.lower_bound:4d}  "
                  f"proven {str(p.optimal):5}  {dt:6.2f} s  {p.method}")
    ratios = [u / o for _, u, o, *_ in rows]
    times = [r[5] for r in rows]
    return {
        "set": name, "n": len(rows),
        "ratio_mean": statistics.mean(ratios), "ratio_max": max(ratios),
        "at_optimum": sum(1 for _, u, o, *_ in rows if u == o),
        "within_plus_one": sum(1 for _, u, o, *_ in rows if u <= o + 1),
        "proven": sum(1 for r in rows if r[4]),
        "lb_equals_opt": sum(1 for _, _, o, lb, *_ in rows if lb == o),
        "time_mean": statistics.mean(times), "time_max": max(times),
    }


def run_2d(name: str, seeds: int, time_limit: float, use_highs: bool, verbose: bool) -> dict:
    build, known = SETS_2D[name]
    rows = []
    for seed in range(seeds):
        devices, demands = build(seed)
        greedy = plan(devices, demands, config=PlannerConfig(time_limit_seconds=0))
        t0 = time.perf_counter()
        p = plan(devices, demands, config=PlannerConfig(time_limit_seconds=time_limit, use_highs=use_highs))
        dt = time.perf_counter() - t0
        assert not p.unplaced, (name, seed)
        ref = known if known is not None else p.lower_bound
        assert p.lower_bound <= (known or p.devices_used) <= p.devices_used, (name, seed, p.lower_bound, known)
        rows.append((seed, p.devices_used, ref, p.lower_bound, p.optimal, dt, p.first_plan_seconds, p.proof_seconds,
                     greedy.devices_used, len(demands)))
        if verbose:
            print(f"  {name} seed {seed:<3} {len(demands):4d} instances  used {p.devices_used:4d}  "
                  f"{'opt' if known else 'lb'} {ref:4d}  greedy {greedy.devices_used:4d}  proven {str(p.optimal):5}  "
                  f"{dt:6.2f} s  {p.method}  {dict(p.bounds)}")
    ratios = [u / r for _, u, r, *_ in rows]
    proofs = [r[7] for r in rows if r[7] is not None]
    return {
        "set": name, "n": len(rows), "known": known is not None,
        "instances": statistics.mean(r[9] for r in rows),
        "ratio_mean": statistics.mean(ratios), "ratio_max": max(ratios),
        "at_ref": sum(1 for _, u, r, *_ in rows if u == r),
        "within_plus_one": sum(1 for _, u, r, *_ in rows if u <= r + 1),
        "proven": sum(1 for r in rows if r[4]),
        "greedy_ratio": statistics.mean(r[8] / r[2] for r in rows),
        "first_mean": statistics.mean(r[6] for r in rows),
        "proof_mean": statistics.mean(proofs) if proofs else float("nan"),
        "proof_max": max(proofs) if proofs else float("nan"),
        "time_mean": statistics.mean(r[5] for r in rows), "time_max": max(r[5] for r in rows),
    }


def _heuristics_only(devices, demands, repeats: int):
    """The heuristics' plan (no search: time limit 0) and its best time of `repeats`, seconds."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        p = plan(devices, demands, config=PlannerConfig(time_limit_seconds=0))
        best = min(best, time.perf_counter() - t0)
    return best, p


def heuristics_timing_2d(n_items: int, repeats: int, seed: int) -> None:
    devices, demands = placement_sets.random_2d(n_items, seed)
    best, p = _heuristics_only(devices, demands, repeats)
    used = p.devices_used
    print(f"heuristics only, {n_items} items (2-D: memory and compute uniform 1-50% of a GPU): {best * 1000:.1f} ms "
          f"(best of {repeats}), {used} devices, lower bound {p.lower_bound}, ratio to bound "
          f"{used / p.lower_bound:.3f}")


def heuristics_timing(n_items: int, repeats: int, seed: int) -> None:
    rng = random.Random(seed)
    cap = 80 * 2**30
    for label, gen in (("uniform 1-50% of a GPU", lambda: rng.randint(cap // 100, cap // 2)),
                       ("uniform 20-100 of 150 (u-like)", lambda: rng.randint(20, 100) * (cap // 150))):
        weights = [gen() for _ in range(n_items)]
        devices, demands = to_problem(cap, weights)
        best, p = _heuristics_only(devices, demands, repeats)
        used = p.devices_used
        print(f"heuristics only, {n_items} items ({label}): {best * 1000:.1f} ms (best of {repeats}), "
              f"{used} devices, lower bound {p.lower_bound}, ratio to bound {used / p.lower_bound:.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.environ.get("GPUD_SHARED_DATA", "../shared/data"))
    ap.add_argument("--sets", nargs="*", default=["u120", "u250", "t120", "t249"],
                    help="1-D: u120 u250 t120 t249 (need --data); 2-D: " + " ".join(SETS_2D))
    ap.add_argument("--seeds", type=int, default=10, help="instances per 2-D set (default %(default)d)")
    ap.add_argument("--time-limit", type=float, default=2.0, help="seconds per instance")
    ap.add_argument("--no-highs", action="store_true", help="pure Python only (no scipy/HiGHS)")
    ap.add_argument("--heuristics-items", type=int, default=0, help="also time heuristics on N random items")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    data = Path(args.data)
    sets_1d = [s for s in args.sets if s not in SETS_2D]
    sets_2d = [s for s in args.sets if s in SETS_2D]
    if sets_1d and not (data / "binpacking").exists():
        print(f"no binpacking data under {data}; skipping the reference sets", file=sys.stderr)
        sets_1d = []
    print(f"exact solver: {EXACT_SOLVER or 'none (heuristics only)'}")
    if sets_2d:
        print(f"2-D: time limit {args.time_limit} s per instance, HiGHS {'off' if args.no_highs else 'on'}; "
              f"ref = the known optimum (k*) or the engine's lower bound (r*); greedy = the engine at time limit 0")
        print(f"{'set':<6} {'n':>3} {'inst':>5} {'used/ref mean':>13} {'max':>6} {'=ref':>5} {'<=ref+1':>7} "
              f"{'proven':>6} {'greedy/ref':>10} {'first plan s':>12} {'proof s mean':>12} {'max':>6} "
              f"{'s/inst mean':>11} {'max':>6}")
    for name in sets_2d:
        r = run_2d(name, args.seeds, args.time_limit, not args.no_highs, args.verbose)
        print(f"{r['set']:<6} {r['n']:>3} {r['instances']:>5.0f} {r['ratio_mean']:>13.4f} {r['ratio_max']:>6.3f} "
              f"{r['at_ref']:>5} {r['within_plus_one']:>7} {r['proven']:>6} {r['greedy_ratio']:>10.4f} "
              f"{r['first_mean']:>12.4f} {r['proof_mean']:>12.2f} {r['proof_max']:>6.2f} {r['time_mean']:>11.2f} "
              f"{r['time_max']:>6.2f}")
        sys.stdout.flush()
    if sets_1d:
        print(f"time limit {args.time_limit} s per instance, HiGHS {'off' if args.no_highs else 'on'}")
        print(f"{'set':<6} {'n':>3} {'used/opt mean':>13} {'max':>6} {'=opt':>5} {'<=opt+1':>7} {'proven':>6} "
              f"{'lb=opt':>6} {'s/inst mean':>11} {'max':>6}")
    for name in sets_1d:
        r = run_set(data, name, args.time_limit, not args.no_highs, args.verbose)
        print(f"{r['set']:<6} {r['n']:>3} {r['ratio_mean']:>13.4f} {r['ratio_max']:>6.3f} {r['at_optimum']:>5} "
              f"{r['within_plus_one']:>7} {r['proven']:>6} {r['lb_equals_opt']:>6} {r['time_mean']:>11.2f} "
              f"{r['time_max']:>6.2f}")
        sys.stdout.flush()
    if args.heuristics_items:
        heuristics_timing(args.heuristics_items, 5, 0)
        heuristics_timing_2d(args.heuristics_items, 5, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
