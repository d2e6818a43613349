"""Device metrics, sampled at scrape time from a DeviceBackend (prometheus_client custom collector).

Label names follow DCGM-exporter so existing dashboards translate: `gpu` (NVML index), `UUID`, `GPU_I_PROFILE`,
`GPU_I_ID` ("" where they do not apply); plus gpud's `device` id and `kind`. A reading that is N/A emits no
sample (a gap, not a 0); a device that is gone is simply not in the next scrape.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from telemetry.devices import DeviceBackend, DeviceInfo, DeviceReading

log = logging.getLogger(__name__)

LABELS = ("device", "gpu", "UUID", "kind", "GPU_I_PROFILE", "GPU_I_ID")
INFO_LABELS = LABELS + ("name", "mig_profile", "parent", "simulated")

# (metric name, help, DeviceReading attribute)
_READINGS = (
    ("gpud_device_utilization_ratio", "Compute utilization of the device, 0..1 (NVML, or gpud's own busy time "
     "for the CPU and simulated devices).", "utilization_ratio"),
    ("gpud_device_memory_used_bytes", "Device memory in use, bytes.", "memory_used_bytes"),
    ("gpud_device_power_watts", "Power draw, watts.", "power_w"),
    ("gpud_device_power_limit_watts", "Enforced power limit, watts.", "power_limit_w"),
    ("gpud_device_temperature_celsius", "GPU temperature, degrees Celsius.", "temperature_c"),
)


def label_values(d: DeviceInfo) -> list[str]:
    return [
        d.id,
        str(d.index) if d.index >= 0 else "",
        d.uuid,
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
        return list(self._families())

    def _families(self) -> Iterator[GaugeMetricFamily]:
        for name, doc, _ in _READINGS:
            yield GaugeMetricFamily(name, doc, labels=LABELS)
        yield GaugeMetricFamily("gpud_device_memory_total_bytes", "Device memory capacity, bytes.", labels=LABELS)
        yield GaugeMetricFamily("gpud_device_healthy", "1 while the device answers, 0 once the driver reported it "
                                "lost.", labels=LABELS)
        yield GaugeMetricFamily("gpud_device_info", "Device identity; the value is always 1.", labels=INFO_LABELS)

    def collect(self) -> Iterable[Metric]:
        families = list(self._families())
        readings_fams = families[: len(_READINGS)]
        total_fam, healthy_fam, info_fam = families[len(_READINGS):]
        for d in self._backend.devices():
            labels = label_values(d)
            try:
                reading = self._backend.sample(d.id)
            except Exception:  # noqa: BLE001 - one bad device must not take the whole scrape down
                log.exception("sampling %s failed", d.id)
                reading = DeviceReading(healthy=False)
            for fam, (_, _, attr) in zip(readings_fams, _READINGS):
                value = getattr(reading, attr)
                if value is not None:
                    fam.add_metric(labels, float(value))
            total_fam.add_metric(labels, float(d.memory_total_bytes))
            healthy_fam.add_metric(labels, 1.0 if reading.healthy else 0.0)
            info_fam.add_metric(labels + [d.name, d.mig_profile or "", d.parent_id or "",
                                          "true" if d.simulated else "false"], 1.0)
        return families
