"""DeviceCollector exposition: scrape-time sampling, DCGM-style labels, N/A omitted, lost devices."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from telemetry.device_metrics import DeviceCollector
from telemetry.devices import DeviceInfo, DeviceReading
from telemetry.nvml import NvmlBackend
from telemetry.simulated import DEFAULT_NODE_FILE, SimulatedBackend
from tests.fake_nvml import dgx_a100_2gpu_mig
from tests.promtool_check import promtool_check


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def find(samples_: dict, metric: str, /, **labels: str) -> list[float]:
    want = set(labels.items())
    return [v for (n, ls), v in samples_.items() if n == metric and want <= set(ls)]


class Usage:
    def __init__(self) -> None:
        self.memory: dict[str, int] = {}

    def memory_used_bytes(self, device_id: str) -> int | None:
        return self.memory.get(device_id)

    def utilization_ratio(self, device_id: str) -> float | None:
        return None


def test_nvml_exposition():
    registry = CollectorRegistry()
    DeviceCollector(NvmlBackend(nvml=dgx_a100_2gpu_mig()), registry=registry)
    s = samples(registry)
    gpu0 = dict(device="gpu0", gpu="0", kind="gpu", GPU_I_PROFILE="", GPU_I_ID="")
    assert find(s, "gpud_device_utilization_ratio", **gpu0) == [0.37]
    assert find(s, "gpud_device_power_watts", **gpu0) == [123.456]
    assert find(s, "gpud_device_power_limit_watts", **gpu0) == [400.0]
    assert find(s, "gpud_device_temperature_celsius", **gpu0) == [41.0]
    assert find(s, "gpud_device_memory_total_bytes", **gpu0) == [81920 * 2**20]
    mig = dict(device="gpu1/mig1.0", gpu="1", kind="mig", GPU_I_PROFILE="3g.40gb", GPU_I_ID="1")
    assert find(s, "gpud_device_memory_total_bytes", **mig) == [40192 * 2**20]
    assert find(s, "gpud_device_healthy", **mig) == [1.0]
    # N/A readings: no series at all, never a 0
    assert find(s, "gpud_device_power_watts", device="gpu1/mig1.0") == []
    assert find(s, "gpud_device_utilization_ratio", device="gpu1/mig1.0") == []
    assert find(s, "gpud_device_utilization_ratio", device="gpu1") == []
    assert find(s, "gpud_device_info", device="gpu1/mig1.0", name="NVIDIA A100-SXM4-80GB", mig_profile="3g.40gb",
                parent="gpu1", simulated="false") == [1.0]
    assert find(s, "gpud_device_info", device="cpu", gpu="", UUID="", kind="cpu") == [1.0]
    uuid_labels = {dict(ls)["UUID"] for (n, ls) in s if n == "gpud_device_info" and dict(ls)["kind"] != "cpu"}
    assert all(u.startswith(("GPU-", "MIG-")) for u in uuid_labels) and len(uuid_labels) == 6


def test_sampled_at_scrape_time():
    usage = Usage()
    registry = CollectorRegistry()
    DeviceCollector(SimulatedBackend.from_file(DEFAULT_NODE_FILE, usage), registry=registry)
    assert find(samples(registry), "gpud_device_memory_used_bytes", device="gpu0") == []
    usage.memory["gpu0"] = 7 * 2**30
    assert find(samples(registry), "gpud_device_memory_used_bytes", device="gpu0") == [7.0 * 2**30]
    s = samples(registry)
    assert find(s, "gpud_device_power_watts") == []  # simulated: no power sensor
    assert find(s, "gpud_device_info", device="gpu0", simulated="true") == [1.0]


def test_lost_gpu_reports_unhealthy_and_no_readings():
    fake = dgx_a100_2gpu_mig()
    registry = CollectorRegistry()
    DeviceCollector(NvmlBackend(nvml=fake), registry=registry)
    fake.lose_gpu(0)
    s = samples(registry)
    assert find(s, "gpud_device_healthy", device="gpu0") == [0.0]
    assert find(s, "gpud_device_temperature_celsius", device="gpu0") == []
    assert find(s, "gpud_device_healthy", device="gpu1") == [1.0]


class ChangingBackend:
    """Devices can disappear (MIG re-layout): the next scrape simply lacks them."""

    def __init__(self, devices: list[DeviceInfo]):
        self.list = devices
        self.source = "test"

    def devices(self):
        return list(self.list)

    def leaf_devices(self):
        return [d for d in self.list if d.is_leaf]

    def sample(self, device_id):
        if device_id == "bad":
            raise RuntimeError("sensor exploded")
        return DeviceReading(utilization_ratio=0.5)

    def close(self):
        pass


def _dev(id_: str) -> DeviceInfo:
    return DeviceInfo(id=id_, kind="gpu", index=0, name="X", uuid="GPU-x", pci_bus_id="", memory_total_bytes=1)


def test_gone_devices_vanish_and_a_failing_sample_does_not_break_the_scrape():
    backend = ChangingBackend([_dev("a"), _dev("bad")])
    registry = CollectorRegistry()
    DeviceCollector(backend, registry=registry)
    s = samples(registry)
    assert find(s, "gpud_device_utilization_ratio", device="a") == [0.5]
    assert find(s, "gpud_device_healthy", device="bad") == [0.0]
    backend.list = [_dev("bad")]
    assert find(samples(registry), "gpud_device_info", device="a") == []


def test_register_does_not_sample():
    backend = ChangingBackend([_dev("a")])
    calls = []
    backend.sample = lambda i: calls.append(i) or DeviceReading()  # type: ignore[method-assign]
    DeviceCollector(backend, registry=CollectorRegistry())
    assert calls == []


def test_promtool_accepts_exposition():
    registry = CollectorRegistry()
    DeviceCollector(NvmlBackend(nvml=dgx_a100_2gpu_mig()), registry=registry)
    promtool_check(generate_latest(registry))
