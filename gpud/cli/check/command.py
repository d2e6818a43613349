"""`gpudctl check`: is this node good for gpud, and does gpud tell the truth about it?

On the node it runs on, without a daemon: enumerates the devices through gpud's own backend (NVML, or the simulated
node without a driver) and compares every reading with nvidia-smi's; then starts one worker per leaf device through
gpud's executor pool, loads a check model, checks its outputs against onnxruntime on the CPU, its footprint against
NVML and gpud's estimate, its served throughput against raw onnxruntime on the same device, whether two instances on
one GPU overlap, and which execution provider runs it. Against a running daemon (--url): its devices (and /metrics,
--metrics-url) against nvidia-smi, and each loaded instance's provider and readiness. Prints a table (or --json) and
exits 1 when a check failed.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import tempfile
import urllib.error
import urllib.request
from typing import Any, TextIO

from gpud.executor.pool import ExecutorPool
from gpud.executor.process_log import LogSettings
from gpud.cli.check.progress import QUIET, Progress, outcome, wants_progress
from gpud.cli.check.devices import (Observed, Tolerances, compare_devices, health_row, observe,
                                    observed_from_inspect, observed_from_metrics)
from gpud.cli.check.report import Report, Row, Status
from gpud.cli.check.serving import RawRunner, ServingCheck, ServingOptions, provider_row, subprocess_raw
from gpud.cli.check.smi import Runner, SmiError, query, subprocess_runner
from gpud.cli.client import GpudUnreachable, base_url, endpoint, fetch_inspect
from gpud.telemetry.devices import DeviceBackend
from gpud.telemetry.discovery import open_nvml
from gpud.telemetry.nvml import NA, NvmlBackend
from gpud.telemetry.simulated import DEFAULT_NODE_FILE, SimulatedBackend

log = logging.getLogger("gpud.check")


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpudctl check", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_argument_group("what to check")
    where.add_argument("--node", metavar="FILE", help="check a simulated node (as `gpud --node` takes) instead of "
                       "this machine's GPUs")
    where.add_argument("--url", metavar="URL", help="check a running gpud (its /v2/gpud/inspect) instead of "
                       "starting workers here; GPUD_URL sets the default address")
    where.add_argument("--metrics-url", metavar="URL", help="with --url: also compare this /metrics scrape "
                       "(e.g. http://127.0.0.1:8002/metrics) with nvidia-smi")
    where.add_argument("--devices", metavar="IDS", help="comma list of leaf device ids whose serving path to check "
                       "(default: every leaf device)")
    where.add_argument("--skip-serving", action="store_true", help="compare readings only; start no worker")
    where.add_argument("--expect-gpu", action="store_true", help="fail when no NVIDIA GPU is usable (default: say "
                       "so and check the simulated node's path)")
    where.add_argument("--nvidia-smi", default="nvidia-smi", metavar="PATH", help="the nvidia-smi to compare with")
    how = p.add_argument_group("how hard")
    how.add_argument("--batch-sizes", type=_positive_ints, default=ServingOptions.batch_sizes, metavar="LIST",
                     help="batch sizes for outputs and throughput (default 1,2,8,32,64)")
    how.add_argument("--seconds", type=_positive_float, default=ServingOptions.seconds, metavar="S",
                     help="seconds per throughput point (default 1)")
    how.add_argument("--min-served-ratio", type=_ratio, default=ServingOptions.min_served_ratio, metavar="X",
                     help="served throughput at the best batch size over raw onnxruntime's (default 0.9)")
    how.add_argument("--min-overlap-gain", type=_ratio, default=ServingOptions.min_overlap_gain, metavar="X",
                     help="two instances on one GPU over one, at batch 1 (default 1.05)")
    how.add_argument("--power-tolerance", type=_ratio, default=Tolerances.power_ratio, metavar="RATIO",
                     help="power draw and limit against nvidia-smi's (default 0.05)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="the report as JSON (and no progress on stderr, as when "
                     "stdout is not a terminal)")
    out.add_argument("-v", "--verbose", action="store_true", help="log what the check and the workers do")
    return p


def check_main(argv: list[str] | None = None, *, nvml: Any = None, smi: Runner | None = None,
               raw: RawRunner | None = None, out: TextIO | None = None) -> int:
    """The command. `nvml`, `smi` and `raw` inject the NVML module, the nvidia-smi runner and the raw onnxruntime
    runner (tests); None means the real ones."""
    args = parser().parse_args(argv)
    out = out or sys.stdout
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.metrics_url and not args.url:
        parser().error("--metrics-url needs --url")
    runner = smi or subprocess_runner(args.nvidia_smi)
    tol = Tolerances(power_ratio=args.power_tolerance)
    progress = Progress(sys.stderr if wants_progress(args.json, out) else None)
    if args.url:
        report = check_daemon(args.url, args.metrics_url, runner, tol, progress)
    else:
        options = ServingOptions(batch_sizes=args.batch_sizes, seconds=args.seconds,
                                 min_served_ratio=args.min_served_ratio, min_overlap_gain=args.min_overlap_gain)
        try:
            report = asyncio.run(check_node(args, nvml, runner, raw or subprocess_raw, tol, options, progress))
        except ValueError as exc:  # a bad node file or device list: nothing was started
            print(f"gpudctl check: {exc}", file=sys.stderr)
            return 2
    out.write((json.dumps(report.to_json(), indent=1) if args.json else report.render()) + "\n")
    return 1 if report.failed else 0


def _driver_version(backend: NvmlBackend) -> str:
    version = backend.session.query("nvmlSystemGetDriverVersion")
    return "" if version is NA else (version.decode() if isinstance(version, bytes) else str(version))


def open_backend(args: argparse.Namespace, pool: ExecutorPool, nvml: Any) -> tuple[DeviceBackend, Row]:
    """The device backend the daemon would use here, and the row that says which it is and why."""
    if args.node:
        backend = SimulatedBackend.from_file(args.node, pool)  # ValueError names the file and the field
        return backend, Row("node", "", "devices", Status.PASS, f"simulated:{args.node}",
                            reason="a simulated node (--node): its serving path is checked, on the CPU")
    nvml_backend, reason = open_nvml(pool, nvml, log)
    if nvml_backend is not None:
        gpus = nvml_backend.gpu_count()
        driver = _driver_version(nvml_backend)
        return nvml_backend, Row("node", "", "devices", Status.PASS, f"NVML, {gpus} GPU(s)",
                                 reason=f"driver {driver}" if driver else "")
    backend = SimulatedBackend.from_file(DEFAULT_NODE_FILE, pool)
    return backend, Row("node", "", "devices", Status.FAIL if args.expect_gpu else Status.WARN, "no NVIDIA GPU",
                        f"simulated:{DEFAULT_NODE_FILE}",
                        reason=f"no NVIDIA GPU usable ({reason}); checking the simulated node's path instead, "
                               f"as gpud would run here")


def device_rows(backend: DeviceBackend, observed: list[Observed], runner: Runner, tol: Tolerances) -> list[Row]:
    if backend.source != "nvml":
        return [health_row(o) for o in observed] + [
            Row("device", "", "nvidia-smi", Status.SKIP, reason="a simulated node: no driver readings to compare")]
    try:
        smi = query(runner)
    except SmiError as exc:
        return [health_row(o) for o in observed] + [
            Row("device", "", "nvidia-smi", Status.WARN, reason=f"readings not compared: {exc}")]
    return compare_devices(observed, smi, tol)


async def check_node(args: argparse.Namespace, nvml: Any, runner: Runner, raw: RawRunner, tol: Tolerances,
                     options: ServingOptions, progress: Progress = QUIET) -> Report:
    pool = ExecutorPool(worker_log_settings=LogSettings.of_level(logging.INFO if args.verbose else logging.WARNING),
                        worker_start_timeout_s=120.0)
    backend, node_row = open_backend(args, pool, nvml)
    report = Report(node=f"{node_row.gpud} ({backend.source})")
    try:
        leaves = [d for d in backend.leaf_devices()]
        if args.devices:
            wanted = [d.strip() for d in args.devices.split(",") if d.strip()]
            unknown = sorted(set(wanted) - {d.id for d in leaves})
            if unknown:
                raise ValueError(f"--devices: no leaf device {', '.join(unknown)} here (leaf devices: "
                                 f"{', '.join(d.id for d in leaves)})")
            leaves = [d for d in leaves if d.id in wanted]
        report.add(node_row)
        # readings first, before any worker of this check holds memory on the devices
        progress.start(f"device readings ({backend.source})" + ("" if backend.source != "nvml"
                                                                 else " against nvidia-smi"))
        rows = device_rows(backend, observe(backend), runner, tol)
        report.add(rows)
        progress.end(outcome(rows))
        if not args.skip_serving:
            progress.start("writing the check model")
            with tempfile.TemporaryDirectory(prefix="gpud-check-") as workdir:
                serving = ServingCheck(backend, pool, workdir, options, raw)
                progress.end("done")
                healthy = {o.info.id for o in observe(backend, leaves) if o.reading.healthy}
                for device in leaves:
                    if device.id not in healthy:
                        report.add(Row("serving", device.id, "load", Status.SKIP, reason="the device is unhealthy"))
                        continue
                    log.info("checking the serving path on %s", device.id)
                    progress.start(f"serving path on {device.id}")
                    rows = await serving.check_device(device, progress)
                    report.add(rows)
                    progress.end(outcome(rows))
    finally:
        await pool.shutdown()
        backend.close()
    return report


# --- against a running daemon ----------------------------------------------------------------------------------------
def check_daemon(url: str, metrics_url: str | None, runner: Runner, tol: Tolerances,
                 progress: Progress = QUIET) -> Report:
    report = Report(node=f"gpud at {base_url(url)}")
    progress.start(f"reading gpud at {base_url(url)}")
    try:
        doc = fetch_inspect(endpoint(url))
    except GpudUnreachable as exc:
        report.add(Row("daemon", "", "reachable", Status.FAIL, reason=str(exc)))
        progress.end("unreachable")
        return report
    progress.end("reachable")
    progress.start("its devices, models and workers")
    source = doc.get("device_source", "")
    report.node += f" ({source})"
    report.add(Row("daemon", "", "reachable", Status.PASS, f"gpud {doc.get('server', {}).get('version', '')}",
                   reason=f"devices: {source}"))
    observed = observed_from_inspect(doc)
    nvml = source == "nvml"
    if nvml:
        try:
            smi = query(runner)
        except SmiError as exc:
            smi = None
            report.add(Row("device", "", "nvidia-smi", Status.WARN, reason=f"readings not compared: {exc}"))
        if smi is not None:
            report.add(compare_devices(observed, smi, tol))
            if metrics_url:
                report.add(_metrics_rows(metrics_url, smi, tol))
    else:
        report.add([health_row(o) for o in observed])
        report.add(Row("device", "", "nvidia-smi", Status.SKIP, reason="the daemon runs on a simulated node"))
    kinds = {o.info.id: o.info for o in observed}
    for m in doc.get("models", []):
        for inst in m.get("instances", []):
            info = kinds.get(inst["device"])
            has_cuda = info is not None and info.kind in ("gpu", "mig") and not info.simulated
            name = f"{m['name']}:{m['version']}#{inst['index']}"
            if not inst.get("ready"):
                report.add(Row("daemon", inst["device"], f"{name} ready", Status.FAIL, "not ready",
                               reason=inst.get("error") or "not ready"))
                continue
            row = provider_row(inst["device"], has_cuda, inst.get("provider", ""), ())
            report.add(dataclasses.replace(row, section="daemon", item=f"{name} provider"))
    for w in doc.get("workers", []):
        bad = w.get("unhealthy_reason") or ("" if w.get("alive") else "not running")
        report.add(Row("daemon", w["device"], "worker", Status.FAIL if bad else Status.PASS,
                       f"pid {w.get('pid')}", reason=bad or f"alive, {w.get('restarts', 0)} restart(s)"))
    progress.end(outcome(report.rows[1:]))
    return report


def _metrics_rows(metrics_url: str, smi: list, tol: Tolerances) -> list[Row]:
    try:
        with urllib.request.urlopen(metrics_url, timeout=10) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        return [Row("metrics", "", "scrape", Status.FAIL, reason=f"cannot scrape {metrics_url}: "
                                                                   f"{getattr(exc, 'reason', exc)}")]
    rows = compare_devices(observed_from_metrics(text), smi, tol)
    return [dataclasses.replace(r, section="metrics") for r in rows]


