"""DeviceCollector exposition: scrape-time sampling, DCGM-style labels, N/A omitted, lost devices."""
from __future__ import annotations


import pytest

from tests.promtool_check import promtool_problems
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpud.telemetry.device_metrics import DeviceCollector, reason_states
from gpud.telemetry.devices import WATCHED_XIDS, DeviceInfo, DeviceReading
from gpud.telemetry.nvml import CLOCK_EVENT_REASONS, NvmlBackend
from gpud.telemetry.simulated import DEFAULT_NODE_FILE, SimulatedBackend
from tests.fake_nvml import a100_40gb_and_h100, dgx_a100_2gpu_mig, hgx_h100_mig
from tests.fakes import FakeClock


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
        self.busy: dict[str, float] = {}

    def memory_used_bytes(self, device_id: str) -> int | None:
        return self.memory.get(device_id)

    def utilization_ratio(self, device_id: str) -> float | None:
        return self.busy.get(device_id)

    def unhealthy_reason(self, device_id: str) -> str | None:
        return None


def test_nvml_exposition():
    registry = CollectorRegistry()
    DeviceCollector(NvmlBackend(nvml=dgx_a100_2gpu_mig()), registry=registry)
    s = samples(registry)
    gpu0 = dict(device="gpu0", gpu="0", kind="gpu", GPU_I_PROFILE="", GPU_I_ID="", modelName="NVIDIA A100-SXM4-80GB")
    assert find(s, "gpud_device_utilization_ratio", **gpu0) == [0.37]
    assert find(s, "gpud_device_power_watts", **gpu0) == [123.456]
    assert find(s, "gpud_device_power_limit_watts", **gpu0) == [400.0]
    assert find(s, "gpud_device_temperature_celsius", **gpu0) == [41.0]
    assert find(s, "gpud_device_memory_total_bytes", **gpu0) == [81920 * 2**20]
    mig = dict(device="gpu1/mig1.0", gpu="1", kind="mig", GPU_I_PROFILE="3g.40gb", GPU_I_ID="1",
               modelName="NVIDIA A100-SXM4-80GB")  # a MIG instance carries its GPU's model, as in DCGM-exporter
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
    assert find(s, "gpud_device_info", device="gpu0", simulated="true") == [1.0]


def test_simulated_board_follows_its_load():
    """The simulated node's power and temperature come from the GPU model's power table (A100-SXM4-80GB: idle 60 W,
    limit 400 W, 32 C idle, 70 C at the limit); its ECC and watched XID counters read 0."""
    usage = Usage()
    registry = CollectorRegistry()
    DeviceCollector(SimulatedBackend.from_file(DEFAULT_NODE_FILE, usage), registry=registry)
    s = samples(registry)
    assert find(s, "gpud_device_power_watts", device="gpu0") == [60.0]  # nothing runs: idle
    assert find(s, "gpud_device_temperature_celsius", device="gpu0") == [32.0]
    assert find(s, "gpud_device_power_limit_watts", device="gpu0") == [400.0]
    usage.busy["gpu0"] = 0.5
    usage.busy["gpu1/mig1.0"] = 1.0  # 3g.40gb: 3 of the GPU's 7 compute slices
    s = samples(registry)
    assert find(s, "gpud_device_power_watts", device="gpu0") == [230.0]  # 60 + 0.5 * (400 - 60)
    assert find(s, "gpud_device_temperature_celsius", device="gpu0") == [51.0]  # 32 + 0.5 * (70 - 32)
    assert find(s, "gpud_device_power_watts", device="gpu1") == [pytest.approx(60 + 3 / 7 * 340)]
    assert find(s, "gpud_device_power_watts", device="gpu1/mig1.0") == []  # the board's, as NVML has it
    assert find(s, "gpud_device_power_watts", device="cpu") == []
    for counter in ("gpud_device_ecc_volatile_errors_total", "gpud_device_ecc_aggregate_errors_total"):
        assert find(s, counter, device="gpu0") == [0.0, 0.0]
    xids = find(s, "gpud_device_xid_errors_total", device="gpu1")
    assert xids and set(xids) == {0.0}


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

    def sample_all(self):
        return {}  # nothing in one pass: the collector samples device by device

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


@pytest.mark.parametrize("fake", [dgx_a100_2gpu_mig, a100_40gb_and_h100, hgx_h100_mig])
def test_promtool_accepts_exposition(fake):
    nvml = fake()
    nvml.queue_xid(0, 79)
    registry = CollectorRegistry()
    DeviceCollector(NvmlBackend(nvml=nvml, pcie_legacy=True), registry=registry)
    generate_latest(registry)  # a first scrape, so GPM series exist in the second
    assert promtool_problems(generate_latest(registry)) == []


class TestNvmlSeries:
    def test_gpu_series_units_and_labels(self):
        registry = CollectorRegistry()
        DeviceCollector(NvmlBackend(nvml=dgx_a100_2gpu_mig()), registry=registry)
        s = samples(registry)
        gpu0 = dict(device="gpu0", gpu="0", kind="gpu")
        assert find(s, "gpud_device_memory_utilization_ratio", **gpu0) == [0.12]  # 12 %
        assert find(s, "gpud_device_memory_free_bytes", **gpu0) == [(81920 - 1024) * 2**20]
        assert find(s, "gpud_device_energy_joules_total", **gpu0) == [5000.25]  # 5 000 250 mJ
        assert find(s, "gpud_device_sm_clock_hertz", **gpu0) == [1410e6]  # 1410 MHz
        assert find(s, "gpud_device_memory_clock_hertz", **gpu0) == [1593e6]
        assert find(s, "gpud_device_pcie_tx_bytes_per_second", **gpu0) == [2_000 * 1024]  # KB/s -> bytes/s
        assert find(s, "gpud_device_pcie_rx_bytes_per_second", **gpu0) == [500_000 * 1024]
        # ECC: volatile and aggregate in separate counters (summing them would double count)
        assert find(s, "gpud_device_ecc_volatile_errors_total", error_type="corrected", **gpu0) == [3.0]
        assert find(s, "gpud_device_ecc_volatile_errors_total", error_type="uncorrected", **gpu0) == [0.0]
        assert find(s, "gpud_device_ecc_aggregate_errors_total", error_type="corrected", **gpu0) == [17.0]
        assert find(s, "gpud_device_ecc_aggregate_errors_total", error_type="uncorrected", **gpu0) == [1.0]
        # throttle reasons 0x4 | 0x40: bitmask as DCGM gives it, and one 0/1 series per supported reason
        assert find(s, "gpud_device_clock_event_reasons", **gpu0) == [68.0]
        assert find(s, "gpud_device_clock_event_reason_active", reason="sw_power_cap", **gpu0) == [1.0]
        assert find(s, "gpud_device_clock_event_reason_active", reason="hw_thermal_slowdown", **gpu0) == [1.0]
        assert find(s, "gpud_device_clock_event_reason_active", reason="gpu_idle", **gpu0) == [0.0]
        assert len(find(s, "gpud_device_clock_event_reason_active", **gpu0)) == 9
        # no XID yet: the watched codes at 0 (so a first event is an increase), not a 0 for every possible code
        assert sorted(int(dict(ls)["xid"]) for (n, ls) in s if n == "gpud_device_xid_errors_total"
                      and dict(ls)["device"] == "gpu0") == sorted(WATCHED_XIDS)
        assert set(find(s, "gpud_device_xid_errors_total")) == {0.0}

    def test_mig_instances_carry_memory_only_without_gpm(self):
        registry = CollectorRegistry()
        DeviceCollector(NvmlBackend(nvml=dgx_a100_2gpu_mig()), registry=registry)
        generate_latest(registry)
        s = samples(registry)
        mig = dict(device="gpu1/mig2.0")
        assert find(s, "gpud_device_memory_free_bytes", **mig) == [19968 * 2**20]  # 2g.20gb, nothing used
        for metric in ("gpud_device_utilization_ratio", "gpud_device_gr_engine_active_ratio",
                       "gpud_device_sm_active_ratio", "gpud_device_energy_joules_total",
                       "gpud_device_sm_clock_hertz", "gpud_device_clock_event_reasons",
                       "gpud_device_pcie_tx_bytes_per_second"):
            assert find(s, metric, **mig) == [], metric  # A100: no GPM; the rest belongs to the GPU
        # the MIG-on GPU itself still reports its board readings
        assert find(s, "gpud_device_energy_joules_total", device="gpu1") == [0.0]
        assert find(s, "gpud_device_gr_engine_active_ratio") == []  # no GPM anywhere on an A100 node

    def test_gpm_activity_on_h100_mig_from_the_second_scrape(self):
        fake, clock = hgx_h100_mig(gpus=1), FakeClock(1000.0)
        fake.gpus[0].mig[0].gpm_graphics_percent = 75.0
        fake.gpus[0].mig[0].gpm_sm_percent = 50.0
        registry = CollectorRegistry()
        DeviceCollector(NvmlBackend(nvml=fake, clock=clock), registry=registry)
        mig = dict(device="gpu0/mig1.0", GPU_I_PROFILE="3g.40gb", GPU_I_ID="1")
        # GPM needs two samples: the first scrape only takes one
        assert find(samples(registry), "gpud_device_gr_engine_active_ratio", **mig) == []
        clock.now += 15  # one scrape interval later
        s = samples(registry)
        assert find(s, "gpud_device_gr_engine_active_ratio", **mig) == [0.75]
        assert find(s, "gpud_device_sm_active_ratio", **mig) == [0.5]
        assert find(s, "gpud_device_utilization_ratio", **mig) == [0.75]  # stands in for NVML's missing value
        assert find(s, "gpud_device_gr_engine_active_ratio", device="gpu0") == [0.6]  # whole GPU
        assert find(s, "gpud_device_utilization_ratio", device="gpu0") == []  # MIG on: NVML has none
        # GPM PCIe (MiB/s) on the GPU; none per GPU instance
        assert find(s, "gpud_device_pcie_tx_bytes_per_second", device="gpu0") == [0.0]
        assert find(s, "gpud_device_pcie_rx_bytes_per_second", **mig) == []
        assert "nvmlDeviceGetPcieThroughput" not in fake.calls  # GPM replaces the 20 ms legacy window

    def test_gpm_pcie_on_h100_whole_gpu(self):
        clock = FakeClock(1000.0)
        registry = CollectorRegistry()
        DeviceCollector(NvmlBackend(nvml=a100_40gb_and_h100(), clock=clock), registry=registry)
        samples(registry)
        clock.now += 15
        s = samples(registry)
        assert find(s, "gpud_device_pcie_rx_bytes_per_second", device="gpu1") == [250.0 * 2**20]  # 250 MiB/s
        assert find(s, "gpud_device_sm_active_ratio", device="gpu1") == [0.815]
        assert find(s, "gpud_device_utilization_ratio", device="gpu1") == [1.0]  # NVML's own, not GPM's

    def test_xid_counted_per_code_and_attributed_to_mig_instance(self):
        fake = dgx_a100_2gpu_mig()
        registry = CollectorRegistry()
        DeviceCollector(NvmlBackend(nvml=fake), registry=registry)
        samples(registry)  # the first scrape registers the event sets; earlier XIDs are not gpud's to count
        fake.queue_xid(0, 79)
        fake.queue_xid(0, 79)
        fake.queue_xid(0, 48)
        fake.queue_xid(1, 31, gpu_instance_id=2, compute_instance_id=0)  # attributable to gpu1/mig2.0
        fake.queue_xid(1, 94)  # not attributable: the GPU
        s = samples(registry)
        assert find(s, "gpud_device_xid_errors_total", device="gpu0", xid="79") == [2.0]
        assert find(s, "gpud_device_xid_errors_total", device="gpu0", xid="48") == [1.0]
        assert find(s, "gpud_device_xid_errors_total", device="gpu1/mig2.0", xid="31") == [1.0]
        assert find(s, "gpud_device_xid_errors_total", device="gpu1", xid="94") == [1.0]
        assert find(samples(registry), "gpud_device_xid_errors_total", device="gpu0", xid="79") == [2.0]  # read once

    def test_gpu_lost_after_xid_79_keeps_its_counter_and_reads_unhealthy(self):
        fake = dgx_a100_2gpu_mig()
        registry = CollectorRegistry()
        DeviceCollector(NvmlBackend(nvml=fake), registry=registry)
        samples(registry)
        fake.queue_xid(1, 79)
        assert find(samples(registry), "gpud_device_xid_errors_total", device="gpu1", xid="79") == [1.0]
        fake.lose_gpu(1)  # fell off the bus
        s = samples(registry)  # never raises
        assert find(s, "gpud_device_healthy", device="gpu1") == [0.0]
        assert find(s, "gpud_device_healthy", device="gpu1/mig3.0") == [0.0]
        assert find(s, "gpud_device_xid_errors_total", device="gpu1", xid="79") == [1.0]
        assert find(s, "gpud_device_energy_joules_total", device="gpu1") == []
        assert find(s, "gpud_device_memory_used_bytes", device="gpu1/mig3.0") == []
        assert find(s, "gpud_device_healthy", device="gpu0") == [1.0]
        assert find(s, "gpud_device_energy_joules_total", device="gpu0") == [5000.25]

    def test_not_supported_per_call_omits_only_that_series(self):
        fake = dgx_a100_2gpu_mig()
        fake.not_supported("nvmlDeviceGetTotalEnergyConsumption", index=0)
        fake.not_supported("nvmlDeviceGetClockInfo")
        fake.not_supported("nvmlDeviceGetCurrentClocksEventReasons", index=0)
        fake.not_supported("nvmlEventSetCreate")
        fake.gpus[1].ecc = None  # ECC mode off
        registry = CollectorRegistry()
        DeviceCollector(NvmlBackend(nvml=fake), registry=registry)
        s = samples(registry)
        assert find(s, "gpud_device_energy_joules_total", device="gpu0") == []
        assert find(s, "gpud_device_energy_joules_total", device="gpu1") == [0.0]
        assert find(s, "gpud_device_sm_clock_hertz") == []
        assert find(s, "gpud_device_clock_event_reason_active", device="gpu0") == []  # unknown, not "no throttle"
        assert find(s, "gpud_device_ecc_volatile_errors_total", device="gpu1") == []
        assert find(s, "gpud_device_power_watts", device="gpu0") == [123.456]
        assert find(s, "gpud_device_healthy", device="gpu0") == [1.0]

    def test_one_sampling_pass_per_device_per_scrape(self):
        fake = dgx_a100_2gpu_mig()
        registry = CollectorRegistry()
        DeviceCollector(NvmlBackend(nvml=fake), registry=registry)
        generate_latest(registry)
        fake.calls.clear()
        generate_latest(registry)
        # 2 GPUs: one memory call each, plus one per MIG instance (4) -- not one per metric family
        assert fake.calls.count("nvmlDeviceGetMemoryInfo") == 2 + 4
        assert fake.calls.count("nvmlDeviceGetPowerUsage") == 2  # never asked of MIG handles
        assert fake.calls.count("nvmlDeviceGetPcieThroughput") == 2 * 2  # TX and RX per A100


@pytest.mark.parametrize("active, supported, expected", [
    (None, 0x1FF, []),  # unknown: no series
    (0x0, 0x5, [("gpu_idle", False), ("sw_power_cap", False)]),  # only what the GPU can report
    (0x4, None, [(name, name == "sw_power_cap") for _, name in CLOCK_EVENT_REASONS]),  # all 9 known reasons
])
def test_reason_states(active, supported, expected):
    assert list(reason_states(active, supported)) == expected


def test_simulated_devices_export_only_what_gpud_knows_and_the_board_model():
    usage = Usage()
    usage.memory["gpu1/mig1.0"] = 2**30
    registry = CollectorRegistry()
    DeviceCollector(SimulatedBackend.from_file(DEFAULT_NODE_FILE, usage), registry=registry)
    s = samples(registry)
    names = {n for (n, _) in s}
    # what gpud knows (memory, health, identity) and the board model (power, temperature, zero error counters);
    # no clocks, PCIe, energy or GPM: nothing would stand behind them
    assert names == {"gpud_device_memory_used_bytes", "gpud_device_memory_total_bytes", "gpud_device_healthy",
                     "gpud_device_info", "gpud_device_power_watts", "gpud_device_power_limit_watts",
                     "gpud_device_temperature_celsius", "gpud_device_ecc_volatile_errors_total",
                     "gpud_device_ecc_aggregate_errors_total", "gpud_device_xid_errors_total"}
    assert find(s, "gpud_device_memory_used_bytes", device="gpu1/mig1.0", modelName="NVIDIA A100-SXM4-80GB") \
        == [2.0**30]
    assert find(s, "gpud_device_memory_used_bytes", device="gpu1") == [2.0**30]  # its instances' sum
