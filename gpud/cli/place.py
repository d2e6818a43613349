"""`gpudctl place`: plan a placement of model instances on a node's devices, offline for a machine you do not have
or live against a running gpud, and optionally apply it.

The problem is built by the daemon's own code (gpud.placing.inputs): a model repository is registered and estimated
as gpud registers it at start-up, and a node description (`config/nodes/*.yaml`, what `gpud --node` takes) becomes
the devices gpud would plan with (the same ids, reserves and GPU pins), so the plan printed for a repository on a
node is the plan gpud makes of it. `live` reads a running gpud's own planning inputs (`GET /v2/gpud/inspect`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

from gpud.cli.client import (Endpoint, GpudUnreachable, add_endpoint_arguments, endpoint, fetch_inspect,
                             post_json)
from gpud.placing.inputs import build_inputs, has_gpus, pin_errors, planning_devices
from gpud.settings import Settings
from gpud.placement import spec
from gpud.placement.model import Assignment, Device, ModelDemand, Plan, fmt_bytes
from gpud.placement.solver import PlannerConfig, plan

EXIT_OK, EXIT_UNPLACED, EXIT_INPUT, EXIT_APPLY = 0, 1, 2, 3
_BAR = 20
_DEFAULTS = Settings()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpudctl place",
        description="Plan where model instances go on GPUs and MIG instances (memory + compute packing), as gpud "
                    "plans them.")
    p.add_argument("--devices", required=True, metavar="DEVICES",
                   help="a node description as `gpud --node` takes (config/nodes/*.yaml), a devices YAML/JSON "
                        "file, a preset (" + ", ".join(sorted(spec.PRESETS)) + "), or 'live' (the running gpud's)")
    p.add_argument("--models", required=True, metavar="MODELS",
                   help="a model repository directory (estimated as gpud does), a YAML/JSON file with a 'models' "
                        "list, or 'live' (the running gpud's models with their measured footprints)")
    p.add_argument("--current", metavar="PLAN.json",
                   help="current placement (a plan JSON, or 'live': the running gpud's): re-plan with the fewest moves")
    p.add_argument("--strategy", choices=["pack", "spread"], default=_DEFAULTS.placement_strategy)
    p.add_argument("--time-limit", type=float, default=_DEFAULTS.placement_time_limit_seconds, metavar="SECONDS",
                   help="time for improvement and proofs (default %(default)g; 0 = heuristics only)")
    p.add_argument("--device-reserve-bytes", type=int, default=_DEFAULTS.device_reserve_bytes, metavar="N",
                   help="memory kept free on each GPU / MIG instance of a node description, as gpud's flag of the "
                        "same name (default %(default)d)")
    p.add_argument("--default-max-batch-size", type=int, default=_DEFAULTS.default_max_batch_size, metavar="N",
                   help="max_batch_size of a repository's auto-completed models, as gpud's flag (default %(default)d)")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.add_argument("--apply", action="store_true",
                   help="apply the plan to a running gpud (needs --url or --socket, or GPUD_URL or GPUD_ADMIN_SOCKET)")
    add_endpoint_arguments(p, "the running gpud for 'live' and --apply")
    return p


def load_file(path: str) -> Any:
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


class LiveInputs:
    """A running gpud's planning inputs, fetched once per command."""

    def __init__(self, ep: Endpoint):
        self.endpoint = ep
        self._data: dict[str, Any] | None = None

    def placement(self) -> tuple[dict[str, Any], str]:
        if self._data is None:
            try:
                self._data = fetch_inspect(self.endpoint)
            except GpudUnreachable as e:
                raise ValueError(str(e)) from None
        section = self._data.get("placement") if isinstance(self._data, dict) else None
        if not isinstance(section, dict):
            raise ValueError("the running gpud does not publish its planning inputs (it is older than this gpudctl)")
        return section, "gpud's planning inputs"


def load_devices(arg: str, live: LiveInputs, reserve_bytes: int) -> list[Device]:
    if arg == "live":
        return spec.devices_from_data(*live.placement())
    if arg in spec.PRESETS:
        return spec.devices_from_data(spec.PRESETS[arg], f"preset {arg}")
    if not os.path.exists(arg):
        raise ValueError(f"{arg}: no such file, and not a preset (presets: {', '.join(sorted(spec.PRESETS))}, live)")
    data = load_file(arg)
    if isinstance(data, dict) and "gpus" in data:  # a node description, as gpud --node takes
        from gpud.telemetry.simulated import SimulatedBackend

        return planning_devices(SimulatedBackend.from_file(arg).leaf_devices(), device_reserve_bytes=reserve_bytes)
    return spec.devices_from_data(data, arg)


def repository_demands(path: str, devices: list[Device], default_max_batch_size: int) -> list[ModelDemand]:
    """A Triton-layout repository's demands on `devices`, registered exactly as the daemon registers it at start-up
    (gpud.registry: every served version, its footprint estimate, its instance groups' kinds and pins). A model the
    daemon could not load is reported on stderr and left out."""
    from gpud.repository.layout import ModelRepository
    from gpud.scheduling import new_registry

    try:
        scanned = ModelRepository(path, default_max_batch_size=default_max_batch_size).scan()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the model repository: {e}") from None
    registry = new_registry(has_gpus(devices))
    versions = []
    for name, result in scanned.items():
        placeable = registry.register(name, result)
        for vs in registry.models[name].versions.values():
            if vs not in placeable and vs.entry.config.ensemble is None:  # an ensemble has nothing to place
                print(f"gpudctl place: warning: model {name} version {vs.version} left out: {vs.reason}",
                      file=sys.stderr)
        if registry.models[name].error:
            print(f"gpudctl place: warning: model {name} left out: {registry.models[name].error}", file=sys.stderr)
        for vs in placeable:
            errors = pin_errors(vs.demand(), devices)
            if errors:
                print(f"gpudctl place: warning: model {name} version {vs.version} left out: {'; '.join(errors)}",
                      file=sys.stderr)
            else:
                versions.append(vs.demand())
    if not versions:
        raise ValueError(f"{path}: no loadable models found (expected <repo>/<model>/<version>/model.onnx)")
    return list(build_inputs(devices, versions).demands)


def load_models(arg: str, live: LiveInputs, devices: list[Device], default_max_batch_size: int) -> list[ModelDemand]:
    if arg == "live":
        return spec.models_from_data(*live.placement())
    if os.path.isdir(arg):
        return repository_demands(arg, devices, default_max_batch_size)
    if not os.path.exists(arg):
        raise ValueError(f"{arg}: no such file or model repository")
    return spec.models_from_data(load_file(arg), arg)


def load_current(arg: str | None, live: LiveInputs) -> list[Assignment]:
    if arg is None:
        return []
    if arg == "live":
        return spec.current_from_data(*live.placement())
    return spec.current_from_data(load_file(arg), arg)


def apply_plan(result: Plan, ep: Endpoint, token_file: str | None = None) -> dict:
    """POST the plan's placements to gpud, which applies the steps between its placement and this one in order,
    make-before-break, and undoes them all if a load fails."""
    body = {"placements": [{"model": a.model, "instance": a.instance, "device": a.device} for a in result.placements]}
    try:
        return post_json(ep, "/v2/gpud/placement", body, token_file=token_file)
    except GpudUnreachable as e:
        raise ValueError(f"placement not applied: {e}") from None


def _bar(frac: float) -> str:
    frac = min(max(frac, 0.0), 1.0)
    n = int(round(frac * _BAR))
    return "[" + "#" * n + "." * (_BAR - n) + f"] {frac * 100:5.1f}%"


NO_EXACT_SOLVER = ("no exact solver installed (scipy / HiGHS cannot be imported): plans are heuristic and unproven "
                   "beyond the simple bounds; reinstall gpud with its dependencies (pip install .)")


def _bounds_text(result: Plan) -> str:
    """The lower bound of each kind, e.g. " (memory 25, compute 24, conflicts 12)"."""
    if not result.bounds:
        return ""
    return " (" + ", ".join(f"{k} {v}" for k, v in result.bounds) + ")"


def _optimal_text(result: Plan) -> str:
    if result.optimal:
        return "yes"
    if result.strategy != "pack" or result.unplaced:
        return "not proven"
    return f"not proven, gap {result.gap}"


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
    out.write(f"\ndevices used: {result.devices_used}   lower bound: {result.lower_bound}{_bounds_text(result)}   "
              f"optimal: {_optimal_text(result)}   strategy: {result.strategy}   method: {result.method}   "
              f"(first plan {result.first_plan_seconds:.2f} s, "
              + (f"proven at {result.proof_seconds:.2f} s, " if result.proof_seconds is not None else "")
              + f"{result.elapsed_seconds:.2f} s in all)\n")
    if result.exact_solver is None:
        out.write(f"note: {NO_EXACT_SOLVER}\n")
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
    if args.device_reserve_bytes < 0:
        parser.error("--device-reserve-bytes must be >= 0")
    ep = endpoint(args.url, args.socket)
    if args.apply and not ep.chosen and not os.environ.get("GPUD_URL"):
        parser.error("--apply needs --url URL or --socket PATH (or GPUD_URL or GPUD_ADMIN_SOCKET)")
    live = LiveInputs(ep)
    try:
        devices = load_devices(args.devices, live, args.device_reserve_bytes)
        demands = load_models(args.models, live, devices, args.default_max_batch_size)
        current = load_current(args.current, live)
        config = PlannerConfig(strategy=args.strategy, time_limit_seconds=args.time_limit)
        result = plan(devices, demands, current=current, config=config)
    except ValueError as e:
        print(f"gpudctl place: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    if args.output == "json":
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        if result.exact_solver is None:
            print(f"gpudctl place: warning: {NO_EXACT_SOLVER}", file=sys.stderr)
    else:
        render_table(result, devices, demands, sys.stdout, config.memory_reserve_bytes)
    if result.unplaced:
        if args.apply:
            print("gpudctl place: not applied: some instances are unplaced", file=sys.stderr)
        return EXIT_UNPLACED
    if args.apply:
        try:
            applied = apply_plan(result, ep, args.token_file)
        except ValueError as e:
            print(f"gpudctl place: error: {e}", file=sys.stderr)
            return EXIT_APPLY
        print(f"applied: {len(applied['added'])} instance(s) started, {len(applied['removed'])} stopped",
              file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(place_main(sys.argv[1:]))
