"""Device metrics, sampled at scrape time from a DeviceBackend (prometheus_client custom collector).

Label names follow DCGM-exporter so existing dashboards translate: `gpu` (NVML index), `UUID`, `modelName`,
`GPU_I_PROFILE`, `GPU_I_ID` ("" where they do not apply); plus gpud's `device` id and `kind`. (DCGM-exporter's own
`device` label is the device node, "nvidia0"; gpud's is its device id, "gpu0" or "gpu1/mig1.0".) A reading that
is N/A emits no sample (a gap, not a 0); a device that is gone is simply not in the next scrape.

A scrape samples every device once (`backend.sample_all()` when the backend has it, nvitop's oneshot), so the
XID events, GPM samples and PCIe windows of one scrape are read together. docs/telemetry.md lists every series.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from gpud.telemetry.devices import DeviceBackend, DeviceInfo, DeviceReading
from gpud.telemetry.nvml import CLOCK_EVENT_REASONS

log = logging.getLogger(__name__)

LABELS = ("device", "gpu", "UUID", "modelName", "kind", "GPU_I_PROFILE", "GPU_I_ID")
INFO_LABELS = LABELS + ("name", "mig_profile", "parent", "simulated")

# (metric name, help, DeviceReading attribute): gauges, one sample per device where the reading is not None
_GAUGES = (
    ("gpud_device_utilization_ratio", "Compute utilization of the device, 0..1 (NVML; GPM graphics activity for "
     "MIG instances on Hopper; gpud's own busy time for the CPU and simulated devices).", "utilization_ratio"),
    ("gpud_device_memory_utilization_ratio", "Share of time device memory was being read or written, 0..1 "
     "(NVML).", "memory_utilization_ratio"),
    ("gpud_device_memory_used_bytes", "Device memory in use, bytes.", "memory_used_bytes"),
    ("gpud_device_memory_free_bytes", "Device memory free, bytes (NVML).", "memory_free_bytes"),
    ("gpud_device_power_watts", "Power draw, watts.", "power_w"),
    ("gpud_device_power_limit_watts", "Enforced power limit, watts.", "power_limit_w"),
    ("gpud_device_temperature_celsius", "GPU temperature, degrees Celsius.", "temperature_c"),
    ("gpud_device_sm_clock_hertz", "SM clock, hertz.", "sm_clock_hz"),
    ("gpud_device_memory_clock_hertz", "Memory clock, hertz.", "memory_clock_hz"),
    ("gpud_device_pcie_tx_bytes_per_second", "PCIe traffic from the GPU, bytes per second (GPM over the scrape "
     "interval on Hopper, else NVML's 20 ms window).", "pcie_tx_bytes_per_second"),
    ("gpud_device_pcie_rx_bytes_per_second", "PCIe traffic to the GPU, bytes per second (GPM over the scrape "
     "interval on Hopper, else NVML's 20 ms window).", "pcie_rx_bytes_per_second"),
    ("gpud_device_gr_engine_active_ratio", "Share of time any graphics/compute work was active, 0..1, over the "
     "interval since the previous scrape (GPM, Hopper or newer; DCGM_FI_PROF_GR_ENGINE_ACTIVE).",
     "gr_engine_active_ratio"),
    ("gpud_device_sm_active_ratio", "Share of SMs busy, 0..1, over the interval since the previous scrape (GPM, "
     "Hopper or newer).", "sm_active_ratio"),
    ("gpud_device_clock_event_reasons", "Bitmask of NVML clock event (throttle) reasons active now, as "
     "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS.", "clock_event_reasons"),
)
_ALL_REASONS = sum(bit for bit, _ in CLOCK_EVENT_REASONS)
_Family = GaugeMetricFamily | CounterMetricFamily  # both take add_metric(labels, value)


def label_values(d: DeviceInfo) -> list[str]:
    return [
        d.id,
        str(d.index) if d.index >= 0 else "",
        d.uuid,
        d.name,
        d.kind,
        d.mig_profile or "",
        str(d.gpu_instance_id) if d.gpu_instance_id is not None else "",
    ]


class DeviceCollector(Collector):
    def __init__(self, backend: DeviceBackend, registry: CollectorRegistry | None = None):
        self._backend = backend
        if registry is not None:
            registry.register(self)

    def describe(self) -> Iterable[Metric]:
        # Lets the registry check names without sampling every device at register time.
        return list(self._families().values())

    def _families(self) -> dict[str, _Family]:
        fams: dict[str, _Family] = {name: GaugeMetricFamily(name, doc, labels=LABELS) for name, doc, _ in _GAUGES}
        fams["energy"] = CounterMetricFamily(
            "gpud_device_energy_joules", "Energy the GPU used since the driver loaded, joules.", labels=LABELS)
        fams["ecc_volatile"] = CounterMetricFamily(
            "gpud_device_ecc_volatile_errors", "ECC memory errors since the driver loaded (NVML volatile "
            "counter), by error_type corrected|uncorrected.", labels=LABELS + ("error_type",))
        fams["ecc_aggregate"] = CounterMetricFamily(
            "gpud_device_ecc_aggregate_errors", "ECC memory errors over the life of the board (NVML aggregate "
            "counter), by error_type corrected|uncorrected.", labels=LABELS + ("error_type",))
        fams["xid"] = CounterMetricFamily(
            "gpud_device_xid_errors", "XID errors the driver reported since gpud started, by XID code.",
            labels=LABELS + ("xid",))
        fams["reason"] = GaugeMetricFamily(
            "gpud_device_clock_event_reason_active", "1 while the clock event (throttle) reason holds the "
            "clocks, 0 while it does not; one series per reason the GPU supports.", labels=LABELS + ("reason",))
        fams["total"] = GaugeMetricFamily("gpud_device_memory_total_bytes", "Device memory capacity, bytes.",
                                          labels=LABELS)
        fams["healthy"] = GaugeMetricFamily("gpud_device_healthy", "1 while the device answers, 0 once the driver "
                                            "reported it lost.", labels=LABELS)
        fams["info"] = GaugeMetricFamily("gpud_device_info", "Device identity; the value is always 1.",
                                         labels=INFO_LABELS)
        return fams

    def _readings(self, devices: list[DeviceInfo]) -> dict[str, DeviceReading]:
        readings: Mapping[str, DeviceReading] = {}
        try:
            readings = self._backend.sample_all()
        except Exception:  # noqa: BLE001 - fall back to device by device, so one bad device is isolated
            log.exception("sampling all devices failed; sampling one by one")
        out = {}
        for d in devices:
            reading = readings.get(d.id)
            if reading is None:
                try:
                    reading = self._backend.sample(d.id)
                except Exception:  # noqa: BLE001 - one bad device must not take the whole scrape down
                    log.exception("sampling %s failed", d.id)
                    reading = DeviceReading(healthy=False)
            out[d.id] = reading
        return out

    def collect(self) -> Iterable[Metric]:
        fams = self._families()
        devices = self._backend.devices()
        readings = self._readings(devices)
        for d in devices:
            labels = label_values(d)
            r = readings[d.id]
            for name, _, attr in _GAUGES:
                value = getattr(r, attr)
                if value is not None:
                    fams[name].add_metric(labels, float(value))
            if r.energy_joules is not None:
                fams["energy"].add_metric(labels, r.energy_joules)
            for (error_type, counter_type), n in sorted(r.ecc_errors.items()):
                fams[f"ecc_{counter_type}"].add_metric(labels + [error_type], float(n))
            for xid, n in sorted(r.xid_errors.items()):
                fams["xid"].add_metric(labels + [str(xid)], float(n))
            for reason, active in reason_states(r.clock_event_reasons, r.clock_event_reasons_supported):
                fams["reason"].add_metric(labels + [reason], 1.0 if active else 0.0)
            fams["total"].add_metric(labels, float(d.memory_total_bytes))
            fams["healthy"].add_metric(labels, 1.0 if r.healthy else 0.0)
            fams["info"].add_metric(labels + [d.name, d.mig_profile or "", d.parent_id or "",
                                              "true" if d.simulated else "false"], 1.0)
        return list(fams.values())


def reason_states(active: int | None, supported: int | None) -> Iterator[tuple[str, bool]]:
    """(reason, active) for every reason the GPU can report (all known reasons if it does not say which).
    Nothing when the current reasons are unknown: a 0 would claim "not throttled"."""
    if active is None:
        return
    mask = supported if supported is not None else _ALL_REASONS
    for bit, name in CLOCK_EVENT_REASONS:
        if mask & bit:
            yield name, bool(active & bit)
