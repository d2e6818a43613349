"""`gpudctl inspect`: a running gpud's devices as a GPU -> MIG tree, the instances on each, per-model queues and
latencies, its workers and its autoscaling hints."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gpud.cli.client import ENDPOINT_HELP, GpudUnreachable, endpoint, fetch_inspect


def _bar(used: float | None, total: float, width: int = 20) -> str:
    if used is None or total <= 0:
        return "[" + "?" * width + "]"
    filled = min(width, round(width * used / total))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _gib(n: float | None) -> str:
    return "N/A" if n is None else f"{n / 2**30:.2f}"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def render_inspect(data: dict[str, Any]) -> str:
    """Devices as a GPU -> MIG tree with memory bars, the instances placed on each, and per-model latencies."""
    lines = [f"gpud {data['server']['version']}  devices: {data['device_source']}", ""]
    devices = data["devices"]
    by_device: dict[str, list[str]] = {}
    for m in data["models"]:
        for inst in m["instances"]:
            state = "" if inst["ready"] else " (not ready)"
            by_device.setdefault(inst["device"], []).append(
                f"{m['name']}:{m['version']}#{inst['index']} {_gib(inst['memory_bytes'])} GiB{state}")
    children: dict[str, list[dict]] = {}
    for d in devices:
        if d.get("parent_id"):
            children.setdefault(d["parent_id"], []).append(d)

    def device_line(d: dict, prefix: str) -> list[str]:
        util = d.get("utilization_ratio")
        util_s = "N/A" if util is None else f"{util * 100:.0f}%"
        label = d["mig_profile"] and f"MIG {d['mig_profile']}" or d["name"]
        out = [f"{prefix}{d['id']:<14} {label:<28} mem {_bar(d['memory_used_bytes'], d['memory_total_bytes'])} "
               f"{_gib(d['memory_used_bytes'])}/{_gib(d['memory_total_bytes'])} GiB  util {util_s}"
               + ("" if d.get("healthy", True) else f"  UNHEALTHY: {d.get('unhealthy_reason') or 'lost'}")]
        indent = " " * len(prefix)  # instances hang under their device, without repeating the tree mark
        for inst in by_device.get(d["id"], []):
            out.append(f"{indent}    - {inst}")
        return out

    lines.append("DEVICES")
    for d in devices:
        if d.get("parent_id"):
            continue
        lines += device_line(d, "  ")
        for child in children.get(d["id"], []):
            lines += device_line(child, "    └─ ")
    lines += ["", "MODELS",
              f"  {'model':<20} {'ver':>3} {'state':<12} {'inst':>4} {'pending':>7} {'ok':>8} {'failed':>6} "
              f"{'queue ms':>9} {'compute ms':>10}  {'objective':<16} {'attained':>8}"]
    for m in data["models"]:
        ready = "-" if m.get("pipeline") else sum(1 for i in m["instances"] if i["ready"])  # an ensemble has none
        lines.append(f"  {m['name']:<20} {m['version']:>3} {m['state']:<12} {ready:>4} "
                     f"{m.get('pending_requests', 0):>7} {m.get('requests_success', 0):>8} "
                     f"{m.get('requests_failed', 0):>6} {_ms(m.get('queue_seconds_avg')):>9} "
                     f"{_ms(m.get('compute_seconds_avg')):>10}  {_objective(m.get('latency_objective'))}")
        if m.get("reason"):
            lines.append(f"      reason: {m['reason']}")
        if "sequences_in_slots" in m:  # a sequence model
            lines.append(f"      sequences: {m['sequences_in_slots']} in slots, {m['sequences_in_backlog']} waiting "
                         "for one")
    lines += _render_pipelines(data["models"])
    lines += _render_workers(data.get("workers") or [])
    lines += _render_frontends((data.get("frontends") or {}).get("processes") or [])
    lines += _render_loops((data.get("event_loops") or {}).get("loops") or [])
    lines += _render_hints(data.get("hints"))
    lines += _render_controller(data.get("controller"), data.get("time_unix_s"))
    return "\n".join(lines)


def _objective(o: dict[str, Any] | None) -> str:
    """The OBJECTIVE and ATTAINED columns: "99% <= 40 ms", and the share of requests within it so far ("-": none
    counted yet), flagged "!" below the share it must reach."""
    if not o:
        return f"{'-':<16} {'-':>8}"
    spec = f"{o['share'] * 100:g}% <= {o['seconds'] * 1e3:g} ms"
    attained = o.get("attainment")
    text = "-" if attained is None else f"{attained * 100:.2f}%" + ("!" if attained < o["share"] else "")
    return f"{spec:<16} {text:>8}"


def _render_pipelines(models: list[dict[str, Any]]) -> list[str]:
    """PIPELINES: each ensemble's steps, the model version serving each and how the tensors flow through it."""
    ensembles = [m for m in models if m.get("pipeline")]
    if not ensembles:
        return []
    lines = ["", "PIPELINES (ensembles; the models of their steps are placed and scaled, not the ensemble)"]
    for m in ensembles:
        lines.append(f"  {m['name']}:{m['version']} {m['state']}")
        for s in m["pipeline"]:
            wanted = "newest" if s["version"] == "-1" else f"version {s['version']}"
            serving = f"{s['model']}:{s['serving_version']}" if s["serving_version"] else f"{s['model']}:-"
            inputs = ", ".join(f"{t}->{i}" for i, t in s["inputs"].items())
            outputs = ", ".join(f"{o}->{t}" for o, t in s["outputs"].items())
            state = "ready" if s["ready"] else "NOT READY"
            lines.append(f"    step {s['step']}  {serving:<24} ({wanted}) {state:<9}  in: {inputs}  out: {outputs}")
    return lines


def _render_frontends(frontends: list[dict[str, Any]]) -> list[str]:
    """One line per front-end process (--http-processes, --grpc-processes): none when the front ends run on the
    core's event loop."""
    if not frontends:
        return []
    lines = ["", "FRONT ENDS (processes of their own)", f"  {'protocol':<8} {'#':>2} {'pid':>8} {'state':<10} "
             f"{'in flight':>9} {'restarts':>8} {'grouped':>9}"]
    for f in sorted(frontends, key=lambda f: (f["kind"], f["index"])):
        state = "up" if f["alive"] else "restarting"
        lines.append(f"  {f['kind']:<8} {f['index']:>2} {f['pid']:>8} {state:<10} {f['in_flight']:>9} "
                     f"{f['restarts']:>8} {f.get('grouped', 0):>9}")
    return lines


def _render_loops(loops: list[dict[str, Any]]) -> list[str]:
    """One line per event loop (the core's, each front-end process's): how busy it is now, and since it started its
    ticks over 50 ms late and the stalls of its own over 50 ms (gpud_event_loop_*)."""
    if not loops:
        return []
    lines = ["", "EVENT LOOPS (busy: the last second; late and stalls: over 50 ms, since start)",
             f"  {'process':<10} {'busy':>6} {'cpu s':>9} {'late':>6} {'stalls':>6}"]
    for loop in loops:
        busy = f"{loop['busy_ratio'] * 100:.0f}%"
        lines.append(f"  {loop['process']:<10} {busy:>6} {loop['cpu_s']:>9.1f} {loop['lag_over_50ms']:>6} "
                     f"{loop['stalls_over_50ms']:>6}")
    return lines


def _render_workers(workers: list[dict[str, Any]]) -> list[str]:
    """One line per device worker: its process, and how often gpud lost it (died, or killed when hung)."""
    if not workers:
        return []
    lines = ["", "WORKERS", f"  {'device':<14} {'pid':>8} {'state':<10} {'died':>5} {'hung':>5}"]
    for w in sorted(workers, key=lambda w: w["device"]):
        failures = w.get("failures") or {}
        state = "up" if w.get("alive") else "crashloop" if w.get("unhealthy_reason") else "restarting"
        if w.get("in_process"):  # the in-process server's models_in_process: no worker process of its own
            state = "in-process" if w.get("alive") else "stopped"
        lines.append(f"  {w['device']:<14} {w.get('pid') or '-':>8} {state:<10} {failures.get('died', 0):>5} "
                     f"{failures.get('hung', 0):>5}")
    return lines


# --- autoscaling hints (gpud.scaling.sampler) -------------------------------------------------------------------------
def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _render_hints(hints: dict[str, Any] | None) -> list[str]:
    """HINTS: per model version the hinted instance count and the observations behind it; HEADROOM: how many more
    instances of each model fit on each device. Nothing when the daemon reports no hints (an older gpud)."""
    if not hints:
        return []
    lines = ["", f"HINTS (advice; every {hints['interval_seconds']:g} s over {hints['rate_window_seconds']:g} s)",
             f"  {'model':<20} {'ver':>3} {'now':>4} {'hint':>4} {'req/s':>8} {'req/s/inst':>10} {'queue ms':>9}  why"]
    for m in hints.get("models", []):
        desired = "-" if m.get("desired_instances") is None else str(m["desired_instances"])
        lines.append(f"  {m['name']:<20} {m['version']:>3} {m.get('current_instances', 0):>4} {desired:>4} "
                     f"{_num(m.get('arrival_rate_per_second')):>8} "
                     f"{_num(m.get('throughput_per_instance_per_second')):>10} "
                     f"{_ms(m.get('queue_seconds')):>9}  {m.get('reason', '')}")
    headroom = hints.get("headroom") or {}
    if headroom:
        lines += ["", "HEADROOM (more instances that fit, by free memory and measured footprint)"]
        for model, per_device in headroom.items():
            cells = ", ".join(f"{dev} {n}" for dev, n in per_device.items()) or "no eligible device"
            lines.append(f"  {model:<20} {cells}")
    return lines


# --- the placement controller (gpud.scaling.controller) --------------------------------------------------------------
def _render_controller(ctl: dict[str, Any] | None, now_unix_s: float | None, last: int = 10) -> list[str]:
    """CONTROLLER: its mode, each version's target and why, and its last steps. Nothing when the daemon runs no
    controller (--placement-control off, or an older gpud)."""
    if not ctl:
        return []
    policy = ctl.get("policy") or {}
    when = ctl.get("last_plan_unix_s")
    ago = "never" if when is None or now_unix_s is None else f"{max(0.0, now_unix_s - when):.0f} s ago"
    mode = ctl.get("mode", "?") + (" (plans are logged, not applied)" if ctl.get("mode") == "advise" else "")
    lines = ["", f"CONTROLLER {mode}; every {policy.get('interval_seconds', 0):g} s, at most "
                 f"{policy.get('max_steps_per_interval', 0)} steps; last plan {ago}",
             f"  {'model':<20} {'ver':>3} {'now':>4} {'target':>6}  why"]
    for t in ctl.get("targets", []):
        lines.append(f"  {t['model']:<20} {t['version']:>3} {t['current']:>4} {t['target']:>6}  "
                     f"{t['reason']}: {t['detail']}")
    decisions = (ctl.get("decisions") or [])[-last:]
    if decisions:
        lines += ["", f"  last {len(decisions)} step(s):"]
        for d in decisions:
            where = f"{d.get('from_device') or '-'} -> {d.get('to_device') or '-'}"
            state = "" if d.get("applied") else (f"  FAILED: {d['error']}" if d.get("error") else "  (not applied)")
            lines.append(f"  {d['action']:<6} {d['model']}:{d['version']}#{d['instance']} {where}  "
                         f"{d['reason']}: {d['detail']}{state}")
    return lines


def inspect_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gpudctl inspect",
                                description="Show a running gpud's devices (GPU -> MIG tree), placed instances, "
                                            "queues and latencies.")
    p.add_argument("--url", help=f"gpud HTTP endpoint ({ENDPOINT_HELP})")
    p.add_argument("--socket", metavar="PATH", help="gpud's admin socket (gpud --admin-socket) instead of --url")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    args = p.parse_args(argv)
    try:
        data = fetch_inspect(endpoint(args.url, args.socket))
    except GpudUnreachable as exc:
        print(f"gpudctl: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(data, indent=2) if args.json else render_inspect(data))
    return 0
