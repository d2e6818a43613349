"""`gpudctl place`: plan a placement of model instances on a node's devices (also offline, for a machine you do not
have). A thin face over `placement`: reads files or a running gpud, calls `placement.plan`, prints the plan."""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any, TextIO

from placement import spec
from placement.model import COMPUTE_UNITS, Assignment, Constraints, Device, ModelDemand, Plan, fmt_bytes
from placement.solver import PlannerConfig, plan

EXIT_OK, EXIT_UNPLACED, EXIT_INPUT, EXIT_APPLY = 0, 1, 2, 3
_BAR = 20


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpudctl place",
        description="Plan where model instances go on GPUs and MIG instances (memory + compute packing).")
    p.add_argument("--devices", required=True, metavar="DEVICES",
                   help="YAML/JSON file, a preset (" + ", ".join(sorted(spec.PRESETS)) + "), or 'live'")
    p.add_argument("--models", required=True, metavar="MODELS",
                   help="YAML/JSON file with a 'models' list, a model repository directory, or 'live' "
                        "(the running gpud's models with their measured footprints)")
    p.add_argument("--current", metavar="PLAN.json",
                   help="current placement (a plan JSON, or 'live': the running gpud's): re-plan with the fewest moves")
    p.add_argument("--strategy", choices=["pack", "spread"], default="pack")
    p.add_argument("--time-limit", type=float, default=2.0, metavar="SECONDS",
                   help="time for improvement and proofs (default 2; 0 = heuristics only)")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.add_argument("--apply", action="store_true", help="apply the plan to a running gpud (needs --url)")
    p.add_argument("--url", default=None, help="gpud HTTP address, e.g. http://localhost:8000")
    return p


def _load_file(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror or e}") from None
    if path.endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    import yaml
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{path}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None


def _inspect(url: str | None) -> tuple[Any, str]:
    """A running gpud's GET /v2/gpud/inspect (through gpudctl inspect's client) and where it came from."""
    from gpud.ctl import fetch_inspect

    base = _base_url(url)
    try:
        return fetch_inspect(base), f"{base}/v2/gpud/inspect"
    except RuntimeError as e:
        raise ValueError(str(e)) from None


def load_devices(arg: str, url: str | None) -> list[Device]:
    if arg == "live":
        return spec.devices_from_inspect(*_inspect(url))
    if arg in spec.PRESETS:
        return spec.devices_from_data(spec.PRESETS[arg], f"preset {arg}")
    if not os.path.exists(arg):
        raise ValueError(f"{arg}: no such file, and not a preset (presets: {', '.join(sorted(spec.PRESETS))}, live)")
    return spec.devices_from_data(_load_file(arg), arg)


def _base_url(url: str | None) -> str:
    base = (url or os.environ.get("GPUD_URL") or "http://localhost:8000").rstrip("/")
    return base if "://" in base else "http://" + base


def models_from_inspect(data: Any, source: str) -> list[ModelDemand]:
    """A running gpud's models: each served model's measured footprint (its largest instance) and instance count."""
    out = []
    for m in data.get("models", []) if isinstance(data, dict) else []:
        instances = m.get("instances") or []
        if not instances:
            continue
        memory = max(int(i.get("memory_bytes") or 0) for i in instances) or 1
        out.append(ModelDemand(m["name"], memory, instances=len(instances)))
    if not out:
        raise ValueError(f"{source}: the running gpud serves no model instances")
    return out


def current_from_inspect(data: Any) -> list[Assignment]:
    return [Assignment(m["name"], i["index"], i["device"]) for m in data.get("models", [])
            for i in m.get("instances") or []]


def apply_plan(result: Plan, url: str) -> dict:
    """POST the plan's placements to gpud, which loads the new instances before it stops the old ones."""
    body = json.dumps({"placements": [{"model": a.model, "instance": a.instance, "device": a.device}
                                      for a in result.placements]}).encode()
    req = urllib.request.Request(f"{_base_url(url)}/v2/gpud/placement", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read()).get("error", "")
        except (ValueError, AttributeError):
            message = ""
        raise ValueError(f"gpud refused the placement (HTTP {e.code}): {message}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"cannot reach gpud at {url}: {getattr(e, 'reason', e)}") from None


def estimate_repository(path: str) -> list[ModelDemand]:
    """Demands from a Triton-layout repository, read and estimated exactly as the daemon does at start-up: the
    footprint from the newest served version's ONNX file, the instance count and device kinds from instance_group.
    A model the daemon could not load is reported on stderr and left out."""
    from gpud.placer import candidate_kinds
    from gpud.repository.footprint import estimate_footprint_bytes
    from gpud.repository.layout import ModelLoadError, ModelRepository

    out = []
    try:
        scanned = ModelRepository(path).scan()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the model repository: {e}") from None
    for name, entry in scanned.items():
        if isinstance(entry, ModelLoadError):
            print(f"gpudctl place: warning: model {name} left out: {entry.reason}", file=sys.stderr)
            continue
        groups = entry.config.instance_groups
        kinds = frozenset(k for g in groups for k in candidate_kinds(g.kind, has_gpus=True))
        out.append(ModelDemand(name, max(1, estimate_footprint_bytes(entry.model_path(), entry.config)),
                               instances=sum(g.count for g in groups), constraints=Constraints(kinds=kinds)))
    if not out:
        raise ValueError(f"{path}: no loadable models found (expected <repo>/<model>/<version>/model.onnx)")
    return out


def load_models(arg: str, url: str | None = None) -> list[ModelDemand]:
    if arg == "live":
        return models_from_inspect(*_inspect(url))
    if os.path.isdir(arg):
        return estimate_repository(arg)
    if not os.path.exists(arg):
        raise ValueError(f"{arg}: no such file or model repository")
    return spec.models_from_data(_load_file(arg), arg)


def _bar(frac: float) -> str:
    frac = min(max(frac, 0.0), 1.0)
    n = int(round(frac * _BAR))
    return "[" + "#" * n + "." * (_BAR - n) + f"] {frac * 100:5.1f}%"


def render_table(result: Plan, devices: list[Device], demands: list[ModelDemand], out: TextIO,
                 reserve_bytes: int = 0) -> None:
    by_name = {d.name: d for d in demands}
    by_dev = result.by_device()
    w = max([len(d.id) for d in devices] + [6])
    out.write(f"{'DEVICE':<{w}}  {'MEMORY':<46}  {'COMPUTE':<29}  INSTANCES\n")
    for d in devices:
        cap = max(0, d.memory_bytes - (d.memory_reserve_bytes if d.memory_reserve_bytes is not None
                                       else reserve_bytes))
        members = by_dev.get(d.id, [])
        mem = sum(by_name[a.model].memory_bytes for a in members if a.model in by_name)
        cu = sum(by_name[a.model].compute_fraction for a in members if a.model in by_name)
        mem_txt = f"{_bar(mem / cap if cap else 0.0)} {fmt_bytes(mem)}/{fmt_bytes(cap)}"
        cu_txt = _bar(cu / d.compute_fraction if d.compute_fraction else 0.0)
        names = ", ".join(f"{a.model}[{a.instance}]" for a in members) or "-"
        flag = "" if d.healthy else " (unhealthy)"
        out.write(f"{d.id:<{w}}  {mem_txt:<46}  {cu_txt:<29}  {names}{flag}\n")
    out.write("\nMODELS\n")
    for m in demands:
        placed = sorted((a for a in result.placements if a.model == m.name), key=lambda a: a.instance)
        out.write(f"  {m.name}: {len(placed)}/{m.instances} placed, {fmt_bytes(m.memory_bytes)}"
                  f" + {m.compute_fraction:.2f} GPU each"
                  + (": " + ", ".join(f"#{a.instance}->{a.device}" for a in placed) if placed else "") + "\n")
    out.write(f"\ndevices used: {result.devices_used}   lower bound: {result.lower_bound}   "
              f"optimal: {'yes' if result.optimal else 'not proven'}   strategy: {result.strategy}   "
              f"method: {result.method}   ({result.elapsed_seconds:.2f} s)\n")
    if result.moves:
        out.write("\nMOVES (in order)\n")
        for k, mv in enumerate(result.moves, 1):
            src = mv.from_device or "-"
            dst = mv.to_device or "-"
            extra = "" if mv.make_before_break else "  [break-before-make]"
            note = f"  ({mv.note})" if mv.note else ""
            out.write(f"  {k:3d}. {mv.kind:<6} {mv.model}[{mv.instance}]  {src} -> {dst}{extra}{note}\n")
    if result.unplaced:
        out.write("\nUNPLACED\n")
        for u in result.unplaced:
            out.write(f"  {u.model}[{u.instance}]: {u.reason}\n")
            for r in u.rejections:
                mark = "  <- closest" if r.device == u.closest_device else ""
                out.write(f"      {r.device}: {r.message()}{mark}\n")


def place_main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.time_limit < 0:
        parser.error("--time-limit must be >= 0")
    if args.apply and not args.url:
        parser.error("--apply needs --url URL")
    try:
        devices = load_devices(args.devices, args.url)
        demands = load_models(args.models, args.url)
        if args.current == "live":
            current = current_from_inspect(_inspect(args.url)[0])
        else:
            current = spec.current_from_data(_load_file(args.current), args.current) if args.current else []
        config = PlannerConfig(strategy=args.strategy, time_limit_seconds=args.time_limit)
        result = plan(devices, demands, current=current, config=config)
    except ValueError as e:
        print(f"gpudctl place: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    if args.output == "json":
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render_table(result, devices, demands, sys.stdout, config.memory_reserve_bytes)
    if result.unplaced:
        if args.apply:
            print("gpudctl place: not applied: some instances are unplaced", file=sys.stderr)
        return EXIT_UNPLACED
    if args.apply:
        try:
            applied = apply_plan(result, args.url)
        except ValueError as e:
            print(f"gpudctl place: error: {e}", file=sys.stderr)
            return EXIT_APPLY
        print(f"applied: {len(applied['added'])} instance(s) started, {len(applied['removed'])} stopped",
              file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(place_main(sys.argv[1:]))
