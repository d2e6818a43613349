"""`gpudctl mig`: MIG layout advice.

    gpudctl mig profiles [GPU]                          the MIG profile table of a GPU model (or the known models)
    gpudctl mig recommend --gpus PRESET|FILE --models FILE|REPO|live [-o table|json|mig-parted]

`recommend` chooses per GPU a MIG layout (or MIG off) so the models' instances fit on the fewest GPUs
(gpud.placement.mig.recommend_layouts), compares it with MIG off everywhere and with mig-parted's all-balanced layout,
and with `-o mig-parted` prints a mig-parted config for `nvidia-mig-parted apply -f FILE -c gpud-recommended`. The
models are read as `gpudctl place` reads them (a repository is estimated as gpud estimates it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

from gpud.cli.client import endpoint
from gpud.cli.place import EXIT_INPUT, EXIT_OK, EXIT_UNPLACED, LiveInputs, load_file, load_models
from gpud.settings import Settings
from gpud.placement import mig, spec
from gpud.placement.model import Device, ModelDemand, fmt_bytes
from gpud.placement.solver import PlannerConfig

_DEFAULTS = Settings()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpudctl mig", description="MIG layout advice: profile tables and the layout "
                                                                 "that serves a set of models on the fewest GPUs.")
    sub = p.add_subparsers(dest="command", metavar="{profiles,recommend}")
    prof = sub.add_parser("profiles", help="list a GPU model's MIG profiles (no GPU: list the known models)",
                          description="The MIG GPU instance profiles of a GPU model, as the planner knows them.")
    prof.add_argument("gpu", nargs="?", help="a GPU model: short name (A100-SXM4-80GB), alias (H100) or NVML name "
                                             "('NVIDIA H100 80GB HBM3')")
    prof.add_argument("-o", "--output", choices=["table", "json"], default="table")
    rec = sub.add_parser("recommend", help="recommend a MIG layout per GPU for a set of models",
                         description="Choose per GPU a MIG layout (or MIG off) that serves the models on the fewest "
                                     "GPUs, compared with MIG off and with mig-parted's all-balanced layout.")
    rec.add_argument("--gpus", required=True, metavar="GPUS",
                     help="a preset (" + ", ".join(sorted(spec.PRESETS)) + "), a node description as `gpud --node` "
                          "takes, or a devices file whose entries name a GPU 'model'; existing MIG layouts are "
                          "ignored (the recommender chooses them)")
    rec.add_argument("--models", required=True, metavar="MODELS",
                     help="a model repository directory, a YAML/JSON file with a 'models' list, or 'live'")
    rec.add_argument("--time-limit", type=float, default=0.5, metavar="SECONDS",
                     help="planner time per layout evaluated (default %(default)g)")
    rec.add_argument("--default-max-batch-size", type=int, default=_DEFAULTS.default_max_batch_size, metavar="N",
                     help="max_batch_size of a repository's auto-completed models, as gpud's flag")
    rec.add_argument("--config-name", default="gpud-recommended",
                     help="the mig-parted config name for -o mig-parted (default %(default)s)")
    rec.add_argument("-o", "--output", choices=["table", "json", "mig-parted"], default="table")
    rec.add_argument("--url", default=None, help="the running gpud for --models live (default $GPUD_URL)")
    rec.add_argument("--socket", default=None, metavar="PATH",
                     help="the running gpud's admin socket for --models live (default $GPUD_ADMIN_SOCKET)")
    return p


# -- profiles ---------------------------------------------------------------------------------------------------

def profile_rows(model: mig.GpuModel) -> list[dict[str, Any]]:
    return [{"id": p.profile_id, "name": p.name, "memory_bytes": p.memory_bytes, "memory_mib": p.memory_mib,
             "compute_slices": p.compute_slices, "compute_fraction": round(p.compute_slices / model.compute_slices, 6),
             "memory_slots": p.memory_slices, "max_count": p.max_count, "starts": list(p.starts)}
            for p in model.profiles]


def render_profiles(model: mig.GpuModel, out: TextIO) -> None:
    out.write(f"{model.name} ({model.nvml_name}): {fmt_bytes(model.memory_bytes)} with MIG off, "
              f"{model.compute_slices} compute slices, {model.memory_slots} memory slots\n\n")
    out.write(f"{'ID':>3}  {'PROFILE':<12} {'MEMORY':>10}  {'COMPUTE':>9}  {'SLOTS':>5}  {'MAX':>3}  STARTS\n")
    for r in profile_rows(model):
        out.write(f"{r['id']:>3}  {r['name']:<12} {fmt_bytes(r['memory_bytes']):>10}  "
                  f"{r['compute_slices']}/{model.compute_slices:<7}  {r['memory_slots']:>5}  {r['max_count']:>3}  "
                  f"{','.join(map(str, r['starts']))}\n")


def profiles_main(args: argparse.Namespace) -> int:
    if args.gpu is None:
        rows: list[dict[str, Any]] = [{"name": g.name, "nvml_name": g.nvml_name, "memory_bytes": g.memory_bytes,
                 "profiles": [p.name for p in g.profiles]} for g in mig.GPU_MODELS.values()]
        if args.output == "json":
            json.dump(rows, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            for r in rows:
                sys.stdout.write(f"{r['name']:<16} {r['nvml_name']:<24} {', '.join(r['profiles'])}\n")
            sys.stdout.write("\n'gpudctl mig profiles GPU' for one model's table\n")
        return EXIT_OK
    try:
        model = mig.gpu_model(args.gpu)
    except ValueError as e:
        print(f"gpudctl mig: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    if args.output == "json":
        json.dump({"name": model.name, "nvml_name": model.nvml_name, "memory_bytes": model.memory_bytes,
                   "compute_slices": model.compute_slices, "memory_slots": model.memory_slots,
                   "profiles": profile_rows(model)}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render_profiles(model, sys.stdout)
    return EXIT_OK


# -- recommend --------------------------------------------------------------------------------------------------

def load_gpus(arg: str) -> list[tuple[str, str]]:
    """(GPU id, GPU model name) in the node's index order, from a preset, a node description or a devices file."""
    if arg in spec.PRESETS:
        data, source = spec.PRESETS[arg], f"preset {arg}"
    elif os.path.exists(arg):
        data, source = load_file(arg), arg
    else:
        raise ValueError(f"{arg}: no such file, and not a preset (presets: {', '.join(sorted(spec.PRESETS))})")
    rows: list[tuple[object, object]]  # (GPU id, GPU model) as the file has them: checked below
    if isinstance(data, dict) and isinstance(data.get("gpus"), list):  # a node description, as gpud --node takes
        from gpud.telemetry.devices import gpu_device_id

        rows = [(gpu_device_id(k), g.get("model") if isinstance(g, dict) else None) for k, g in enumerate(data["gpus"])]
        where = "gpus"
    elif isinstance(data, dict) and isinstance(data.get("devices"), list):
        rows = [((d.get("id") or d.get("name") or f"gpu{k}"), d.get("model")) if isinstance(d, dict) else (None, None)
                for k, d in enumerate(data["devices"])]
        where = "devices"
    else:
        raise ValueError(f"{source}: expected a node description ('gpus' list) or a devices file ('devices' list)")
    out = []
    for k, (gpu_id, model) in enumerate(rows):
        if not isinstance(model, str) or mig.find_gpu_model(model) is None:
            raise ValueError(f"{source}: {where}[{k}]: needs a known GPU 'model' for MIG advice, got {model!r} "
                             f"(known: {', '.join(sorted(mig.GPU_MODELS))})")
        out.append((str(gpu_id), mig.gpu_model(model).name))
    if not out:
        raise ValueError(f"{source}: no GPUs")
    return out


def _mig_off_devices(gpus: list[tuple[str, str]]) -> list[Device]:
    devices: list[Device] = []
    for gpu_id, model in gpus:
        devices += mig.expand_gpu(gpu_id, mig.gpu_model(model), None)
    return devices


def _summary_dict(name: str, rec: mig.MigRecommendation, s: mig.LayoutSummary) -> dict[str, Any]:
    return {"name": name, "gpus_used": s.gpus_used, "devices_used": s.devices_used,
            "instances_placed": s.instances_placed, "instances": s.instances,
            "memory_fill": round(s.memory_fill, 4), "compute_fill": round(s.compute_fill, 4),
            "layouts": [{"gpu": g.gpu_id, "model": g.model, "mig": list(g.layout) if g.layout is not None else None}
                        for g in rec.layouts]}


def why(rec: mig.LayoutSummary, off: mig.LayoutSummary, bal: mig.LayoutSummary) -> list[str]:
    """One line per comparison, for people: GPUs saved, instances served, fill."""
    out = []
    for label, other in (("MIG off", off), ("balanced", bal)):
        more = rec.instances_placed - other.instances_placed
        saved = other.gpus_used - rec.gpus_used
        if more > 0:
            gpus = f"the same {rec.gpus_used} GPU(s)" if saved == 0 else \
                f"{rec.gpus_used} GPU(s) instead of {other.gpus_used}"
            out.append(f"vs {label}: serves {more} more instance(s) ({other.instances_placed}/{other.instances} "
                       f"there), on {gpus}")
        elif more < 0:
            out.append(f"vs {label}: serves {-more} fewer instance(s)")
        elif saved > 0:
            out.append(f"vs {label}: saves {saved} GPU(s) ({rec.gpus_used} instead of {other.gpus_used}), "
                       f"memory fill {rec.memory_fill * 100:.0f}% instead of {other.memory_fill * 100:.0f}%")
        elif saved < 0:
            out.append(f"vs {label}: uses {-saved} more GPU(s)")
        else:
            out.append(f"vs {label}: the same GPUs ({rec.gpus_used}), "
                       f"memory fill {rec.memory_fill * 100:.0f}% vs {other.memory_fill * 100:.0f}%")
    return out


def render_recommendation(gpus, rec, summaries: dict[str, tuple[mig.MigRecommendation, mig.LayoutSummary]],
                          balanced: dict[str, tuple[str, ...]], demands: list[ModelDemand], out: TextIO) -> None:
    by_name = {d.name: d for d in demands}
    per_device: dict[str, list[str]] = {}
    gpu_of = {}
    for g in rec.layouts:
        for dev in mig.expand_gpu(g.gpu_id, mig.gpu_model(g.model), g.layout):
            gpu_of[dev.id] = g.gpu_id
    mem_on: dict[str, int] = {}
    for a in rec.plan.placements:
        per_device.setdefault(gpu_of[a.device], []).append(f"{a.model}[{a.instance}]")
        mem_on[gpu_of[a.device]] = mem_on.get(gpu_of[a.device], 0) + by_name[a.model].memory_bytes
    w = max(len(g.gpu_id) for g in rec.layouts)
    out.write(f"{'GPU':<{w}}  {'MODEL':<15} {'LAYOUT':<40} {'MEMORY':>7}  INSTANCES\n")
    for g in rec.layouts:
        layout = "MIG off" if g.layout is None else " + ".join(g.layout)
        insts = per_device.get(g.gpu_id, [])
        fill = mem_on.get(g.gpu_id, 0) / mig.gpu_model(g.model).memory_bytes
        text = ", ".join(insts) if len(insts) <= 6 else ", ".join(insts[:6]) + f", ... ({len(insts)} in all)"
        out.write(f"{g.gpu_id:<{w}}  {g.model:<15} {layout:<40} {fill * 100:6.1f}%  {text or '- (unused)'}\n")
    out.write(f"\n{'LAYOUTS':<12} {'GPUS USED':>9} {'DEVICES':>8} {'PLACED':>9} {'MEMORY FILL':>12} "
              f"{'COMPUTE FILL':>13}\n")
    for name, (_, s) in summaries.items():
        out.write(f"{name:<12} {s.gpus_used:>9} {s.devices_used:>8} {f'{s.instances_placed}/{s.instances}':>9} "
                  f"{s.memory_fill * 100:11.1f}% {s.compute_fill * 100:12.1f}%\n")
    bal_text = "; ".join(f"{m}: {' + '.join(lay)}" for m, lay in balanced.items())
    out.write(f"(balanced = mig-parted's all-balanced: {bal_text}; fill is over the used GPUs)\n\nwhy:\n")
    s_rec, s_off, s_bal = (summaries[k][1] for k in ("recommended", "MIG off", "balanced"))
    for line in why(s_rec, s_off, s_bal):
        out.write(f"  {line}\n")
    if rec.unplaced_instances:
        out.write(f"\n{rec.unplaced_instances} instance(s) left unplaced by the recommended layouts:\n")
        for u in rec.plan.unplaced:
            out.write(f"  {u.model}[{u.instance}]: {u.reason}\n")


def recommend_main(args: argparse.Namespace) -> int:
    if args.time_limit < 0:
        print("gpudctl mig: error: --time-limit must be >= 0", file=sys.stderr)
        return EXIT_INPUT
    try:
        gpus = load_gpus(args.gpus)
        live = LiveInputs(endpoint(args.url, args.socket))
        demands = load_models(args.models, live, _mig_off_devices(gpus), args.default_max_batch_size)
        config = PlannerConfig(time_limit_seconds=args.time_limit)
        rec = mig.recommend_layouts(gpus, demands, config=config)
        off = mig.evaluate_layouts(gpus, [None] * len(gpus), demands, config=config)
        balanced = {model: mig.balanced_layout(mig.gpu_model(model)) for _, model in gpus}
        bal = mig.evaluate_layouts(gpus, [balanced[model] for _, model in gpus], demands, config=config)
    except ValueError as e:
        print(f"gpudctl mig: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    summaries = {"recommended": (rec, mig.summarize(rec, demands)), "MIG off": (off, mig.summarize(off, demands)),
                 "balanced": (bal, mig.summarize(bal, demands))}
    if args.output == "mig-parted":
        sys.stdout.write(mig.mig_parted_yaml(rec, args.config_name))
    elif args.output == "json":
        json.dump({"recommended": _summary_dict("recommended", rec, summaries["recommended"][1]),
                   "alternatives": [_summary_dict(k, r, s) for k, (r, s) in summaries.items() if k != "recommended"],
                   "why": why(*(summaries[k][1] for k in ("recommended", "MIG off", "balanced"))),
                   "plan": rec.plan.to_dict()}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render_recommendation(gpus, rec, summaries, balanced, demands, sys.stdout)
    if rec.unplaced_instances:
        print(f"gpudctl mig: {rec.unplaced_instances} instance(s) left unplaced by the recommended layouts",
              file=sys.stderr)
        return EXIT_UNPLACED
    return EXIT_OK


def mig_main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "profiles":
        return profiles_main(args)
    if args.command == "recommend":
        return recommend_main(args)
    parser.print_help()
    return EXIT_INPUT


if __name__ == "__main__":  # pragma: no cover
    sys.exit(mig_main(sys.argv[1:]))
