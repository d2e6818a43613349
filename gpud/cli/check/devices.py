"""gpud's view of the devices against nvidia-smi's: one row per reading, with both values, the difference and the
tolerance (pure: the observations come in, rows go out).

gpud's view comes from its own backend (`Observed` of DeviceInfo and DeviceReading), from a running daemon's
`/v2/gpud/inspect`, or from its `/metrics` exposition; all three are compared the same way.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpud.cli.check.report import Row, Status
from gpud.cli.check.smi import SmiGpu
from gpud.placement.model import is_device_kind
from gpud.telemetry.devices import DeviceBackend, DeviceInfo, DeviceReading

MIB = 2**20


@dataclass(frozen=True)
class Tolerances:
    """How far gpud's reading may be from nvidia-smi's. Memory is exact (at nvidia-smi's MiB resolution); the
    rest is sampled at two instants or averaged over different windows by the two tools."""

    power_ratio: float = 0.05
    utilization_points: float = 10.0  # percentage points
    temperature_c: float = 2.0
    clock_ratio: float = 0.10  # clocks follow the load within milliseconds


@dataclass(frozen=True)
class Observed:
    """One device as gpud sees it."""

    info: DeviceInfo
    reading: DeviceReading


def observe(backend: DeviceBackend, devices: Iterable[DeviceInfo] | None = None) -> list[Observed]:
    """Every device of a DeviceBackend with one reading each (one sampling pass)."""
    devices = list(devices if devices is not None else backend.devices())
    readings = backend.sample_all()
    return [Observed(d, readings.get(d.id) or backend.sample(d.id)) for d in devices]


def observed_from_inspect(doc: dict[str, Any]) -> list[Observed]:
    """Devices of a running daemon's /v2/gpud/inspect document."""
    out = []
    for d in doc.get("devices", []):
        info = DeviceInfo(id=d["id"], kind=d["kind"], index=d.get("index", -1), name=d.get("name", ""),
                          uuid=d.get("uuid", ""), pci_bus_id="", memory_total_bytes=d.get("memory_total_bytes", 0),
                          parent_id=d.get("parent_id"), mig_profile=d.get("mig_profile"),
                          mig_enabled=bool(d.get("mig_enabled")), simulated=bool(d.get("simulated")),
                          compute_fraction=d.get("compute_fraction", 1.0))
        reading = DeviceReading(utilization_ratio=d.get("utilization_ratio"),
                                memory_used_bytes=d.get("memory_used_bytes"), power_w=d.get("power_w"),
                                temperature_c=d.get("temperature_c"), healthy=d.get("healthy", True))
        out.append(Observed(info, reading))
    return out


# gauge -> DeviceReading field, for a /metrics exposition
_METRIC_FIELDS = {
    "gpud_device_utilization_ratio": "utilization_ratio",
    "gpud_device_memory_used_bytes": "memory_used_bytes",
    "gpud_device_power_watts": "power_w",
    "gpud_device_power_limit_watts": "power_limit_w",
    "gpud_device_temperature_celsius": "temperature_c",
    "gpud_device_sm_clock_hertz": "sm_clock_hz",
    "gpud_device_memory_clock_hertz": "memory_clock_hz",
}


def observed_from_metrics(text: str) -> list[Observed]:
    """Devices of a gpud /metrics exposition (gpud_device_info for identity, the gauges for readings)."""
    from prometheus_client.parser import text_string_to_metric_families

    infos: dict[str, dict[str, str]] = {}
    totals: dict[str, float] = {}
    values: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            device = s.labels.get("device")
            if device is None:
                continue
            if s.name == "gpud_device_info":
                infos[device] = s.labels
            elif s.name == "gpud_device_memory_total_bytes":
                totals[device] = s.value
            elif s.name == "gpud_device_healthy":
                values.setdefault(device, {})["healthy"] = s.value == 1.0
            elif s.name in _METRIC_FIELDS:
                value = int(s.value) if s.name == "gpud_device_memory_used_bytes" else s.value
                values.setdefault(device, {})[_METRIC_FIELDS[s.name]] = value
    out = []
    for device, labels in infos.items():
        kind = labels.get("kind")
        if not is_device_kind(kind):
            continue  # not a device kind gpud writes: nothing to compare it as
        children = [d for d, ls in infos.items() if ls.get("parent") == device]
        info = DeviceInfo(id=device, kind=kind, index=int(labels["gpu"]) if labels.get("gpu") else -1,
                          name=labels.get("name", ""), uuid=labels.get("UUID", ""), pci_bus_id="",
                          memory_total_bytes=int(totals.get(device, 0)), parent_id=labels.get("parent") or None,
                          mig_profile=labels.get("mig_profile") or None, mig_enabled=kind == "gpu" and bool(children),
                          simulated=labels.get("simulated") == "true")
        out.append(Observed(info, DeviceReading(**values.get(device, {}))))
    return out


# --- comparison ---------------------------------------------------------------------------------------------------
def _fmt(value: float | None, unit: str, digits: int = 0) -> str:
    return "N/A" if value is None else f"{value:.{digits}f} {unit}".rstrip()


def _numeric(device: str, item: str, mine: float | None, theirs: float | None, unit: str,
             ok: Callable[[float, float], bool], tolerance: str, digits: int = 0) -> Row:
    g, r = _fmt(mine, unit, digits), _fmt(theirs, unit, digits)
    if mine is None and theirs is None:
        return Row("device", device, item, Status.SKIP, g, r, reason="N/A in both")
    if mine is None or theirs is None:
        who = "gpud" if mine is None else "nvidia-smi"
        return Row("device", device, item, Status.FAIL, g, r, reason=f"{who} has no reading where the other has one")
    diff = mine - theirs
    rel = f" ({diff / theirs:+.1%})" if theirs else ""
    row = Row("device", device, item, Status.PASS, g, r, f"{diff:+.{digits}f}{rel}", reason=f"within {tolerance}")
    if not ok(mine, theirs):
        row = Row("device", device, item, Status.FAIL, g, r, row.diff,
                  reason=f"differs from nvidia-smi by more than {tolerance}")
    return row


def _text(device: str, item: str, mine: str, theirs: str) -> Row:
    if mine == theirs:
        return Row("device", device, item, Status.PASS, mine, theirs, reason="equal")
    return Row("device", device, item, Status.FAIL, mine or "(none)", theirs or "(none)",
               reason="differs from nvidia-smi")


def _within_ratio(ratio: float) -> Callable[[float, float], bool]:
    return lambda a, b: abs(a - b) <= ratio * abs(b)


def _mib(n: float | None) -> float | None:
    return None if n is None else n / MIB


def compare_gpu(obs: Observed, smi: SmiGpu, children: list[Observed], tol: Tolerances) -> list[Row]:
    """Rows for one GPU that both gpud and nvidia-smi list."""
    d, r = obs.info, obs.reading
    dev = d.id
    rows = [_text(dev, "name", d.name, smi.name), _text(dev, "uuid", d.uuid, smi.uuid)]
    exact_mib = lambda a, b: abs(a - b) < 1.0  # noqa: E731 - nvidia-smi prints whole MiB
    rows.append(_numeric(dev, "memory.total", _mib(d.memory_total_bytes), smi.memory_total_mib, "MiB", exact_mib,
                         "1 MiB (exact)"))
    rows.append(_numeric(dev, "memory.used", _mib(r.memory_used_bytes), smi.memory_used_mib, "MiB", exact_mib,
                         "1 MiB (exact)"))
    rows.append(_numeric(dev, "power.draw", r.power_w, smi.power_draw_w, "W", _within_ratio(tol.power_ratio),
                         f"{tol.power_ratio:.0%}", 1))
    rows.append(_numeric(dev, "power.limit", r.power_limit_w, smi.power_limit_w, "W",
                         _within_ratio(tol.power_ratio), f"{tol.power_ratio:.0%}", 1))
    util = None if r.utilization_ratio is None else r.utilization_ratio * 100
    rows.append(_numeric(dev, "utilization.gpu", util, smi.utilization_percent, "%",
                         lambda a, b: abs(a - b) <= tol.utilization_points, f"{tol.utilization_points:g} points"))
    rows.append(_numeric(dev, "temperature.gpu", r.temperature_c, smi.temperature_c, "C",
                         lambda a, b: abs(a - b) <= tol.temperature_c, f"{tol.temperature_c:g} C"))
    for item, hz, mhz in (("clocks.sm", r.sm_clock_hz, smi.sm_clock_mhz),
                          ("clocks.mem", r.memory_clock_hz, smi.memory_clock_mhz)):
        rows.append(_numeric(dev, item, None if hz is None else hz / 1e6, mhz, "MHz", _within_ratio(tol.clock_ratio),
                             f"{tol.clock_ratio:.0%}"))
    mode = {True: "Enabled", False: "Disabled", None: "N/A"}
    rows.append(_text(dev, "mig.mode", mode[d.mig_enabled] if smi.mig_enabled is not None else "N/A",
                      mode[smi.mig_enabled]))
    if d.mig_enabled or smi.mig_devices:
        mine = sorted(f"{c.info.mig_profile} {c.info.uuid}" for c in children)
        theirs = sorted(f"{m.profile.split('c.', 1)[-1]} {m.uuid}" for m in smi.mig_devices)
        row = _text(dev, "mig.devices", "; ".join(mine), "; ".join(theirs))
        if row.status is Status.FAIL:
            missing = sorted(set(theirs) - set(mine))
            extra = sorted(set(mine) - set(theirs))
            row = Row(row.section, dev, row.item, Status.FAIL, row.gpud, row.reference,
                      reason=f"nvidia-smi lists {missing or 'nothing more'}, gpud {extra or 'nothing more'} besides")
        rows.append(row)
    return rows


def compare_devices(observed: list[Observed], smi: list[SmiGpu], tol: Tolerances = Tolerances()) -> list[Row]:
    """Health of every device gpud lists, then each GPU's readings against nvidia-smi's."""
    rows = [health_row(o) for o in observed]
    gpus = {o.info.index: o for o in observed if o.info.kind == "gpu"}
    lost = {o.info.id for o in observed if not o.reading.healthy}
    for s in smi:
        obs = gpus.pop(s.index, None)
        if obs is None:
            rows.append(Row("device", f"gpu{s.index}", "present", Status.FAIL, "(absent)", f"{s.name} {s.uuid}",
                            reason="nvidia-smi lists this GPU; gpud does not"))
            continue
        if obs.info.id in lost:
            continue  # its health row says why; a lost GPU has no readings to compare
        children = [o for o in observed if o.info.parent_id == obs.info.id]
        rows += compare_gpu(obs, s, children, tol)
    for obs in gpus.values():
        rows.append(Row("device", obs.info.id, "present", Status.FAIL, f"{obs.info.name} {obs.info.uuid}",
                        "(absent)", reason="gpud lists this GPU; nvidia-smi does not"))
    return rows


def health_row(obs: Observed) -> Row:
    if obs.reading.healthy:
        return Row("device", obs.info.id, "health", Status.PASS, "healthy", reason="answers")
    return Row("device", obs.info.id, "health", Status.FAIL, "lost",
               reason="gpud reads it unhealthy: the driver reports it lost (NVML_ERROR_GPU_IS_LOST) or its worker "
                      "crash-loops; see `gpudctl inspect`, dmesg for XID 79, and reset the GPU")
