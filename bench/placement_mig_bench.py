"""MIG layout recommender vs "MIG off" and vs a fixed balanced layout (mig-parted's all-balanced) on model mixes.

    .venv/bin/python bench/placement_mig_bench.py

For each mix: physical GPUs used and instances left unplaced for each of the three layouts.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpud.placement import mig  # noqa: E402
from gpud.placement.model import Constraints, ModelDemand  # noqa: E402
from gpud.placement.solver import PlannerConfig  # noqa: E402

GiB = 2**30
MIG_ONLY = Constraints(kinds=frozenset({"mig"}))


def m(name, mem_gib, n, compute, cons=None) -> ModelDemand:
    return ModelDemand(name, int(mem_gib * GiB), instances=n, compute_fraction=compute,
                       constraints=cons or Constraints())


MIXES = {
    # multi-tenant SaaS: tenants' small models must run in their own MIG instance; two shared LLMs anywhere
    "tenant-isolation": [m(f"tenant{k}", 1 + k % 4, 1, 0.1, MIG_ONLY) for k in range(20)]
                        + [m("llm-7b", 16, 2, 0.5), m("llm-13b", 30, 2, 0.5)],
    # a typical inference mix, no isolation requirements
    "mixed-inference": [m("embed", 2, 6, 0.1), m("rerank", 6, 4, 0.15), m("asr", 10, 3, 0.25),
                        m("llm-13b", 30, 2, 0.5, Constraints(spread=True)), m("vision", 4, 4, 0.2)],
    # many latency-sensitive small models, each a slice of compute: MIG instances as isolation, same density
    "small-fleet": [m(f"svc{k}", 2.5, 2, 1 / 7, MIG_ONLY if k % 2 else None) for k in range(24)],
    # large models only
    "llm-only": [m("llm-70b-shard", 70, 4, 1.0), m("llm-13b", 30, 3, 0.5)],
}


def main() -> int:
    config = PlannerConfig(time_limit_seconds=0.5)
    for gpu_name in ("A100-SXM4-80GB", "H100-80GB"):
        gpus = [(f"gpu{k}", gpu_name) for k in range(8)]
        balanced = mig.balanced_layout(mig.gpu_model(gpu_name))
        print(f"\n8 x {gpu_name}; balanced = {'+'.join(balanced)}")
        print(f"{'mix':<18} {'instances':>9} | {'MIG off':>14} | {'balanced':>14} | {'recommended':>14} | layouts")
        for name, demands in MIXES.items():
            n = sum(d.instances for d in demands)
            off = mig.evaluate_layouts(gpus, [None] * 8, demands, config=config)
            bal = mig.evaluate_layouts(gpus, [balanced] * 8, demands, config=config)
            t0 = time.perf_counter()
            rec = mig.recommend_layouts(gpus, demands, config=config)
            dt = time.perf_counter() - t0
            used = [g.layout for g in rec.layouts if g.layout is not None] or []
            summary = ", ".join(sorted({"+".join(lay) for lay in used})) or "all off"

            def cell(r):
                return f"{r.gpus_used} GPUs" + (f", {r.unplaced_instances} unpl." if r.unplaced_instances else "")

            print(f"{name:<18} {n:>9} | {cell(off):>14} | {cell(bal):>14} | {cell(rec):>14} | {summary} "
                  f"({dt:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
