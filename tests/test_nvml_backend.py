"""NvmlBackend against the behavioural fake NVML (tests/fake_nvml.py): MIG tree, N/A readings, faults."""
from __future__ import annotations

import logging

import pytest

from gpud.placement.mig import MIB
from gpud.telemetry.devices import DeviceBackend, DeviceReading
from gpud.telemetry.discovery import discover
from gpud.telemetry.nvml import NA, NvmlBackend, NvmlSession, parse_mig_profile
from tests.fake_nvml import A100_SXM4_80GB, FakeNvml, a100_40gb_and_h100, dgx_a100_2gpu_mig, hgx_h100_mig
from tests.fakes import FakeClock


class FixedUsage:
    def memory_used_bytes(self, device_id: str) -> int | None:
        return {"cpu": 3 * 2**30}.get(device_id)

    def utilization_ratio(self, device_id: str) -> float | None:
        return {"cpu": 0.25}.get(device_id)

    def unhealthy_reason(self, device_id: str) -> str | None:
        return None


class TestEnumeration:
    def test_mig_tree(self):
        b = NvmlBackend(nvml=dgx_a100_2gpu_mig())
        assert isinstance(b, DeviceBackend)
        assert [d.id for d in b.devices()] == [
            "gpu0", "gpu1", "gpu1/mig1.0", "gpu1/mig2.0", "gpu1/mig3.0", "gpu1/mig4.0", "cpu"]
        by_id = {d.id: d for d in b.devices()}
        assert by_id["gpu0"].name == "NVIDIA A100-SXM4-80GB"
        assert by_id["gpu0"].memory_total_bytes == 81920 * MIB
        assert by_id["gpu0"].pci_bus_id == "00000000:07:00.0"  # bytes from pynvml decoded
        assert by_id["gpu0"].uuid.startswith("GPU-")
        assert not by_id["gpu0"].mig_enabled and by_id["gpu1"].mig_enabled
        mig = by_id["gpu1/mig1.0"]
        assert (mig.kind, mig.index, mig.parent_id, mig.mig_profile) == ("mig", 1, "gpu1", "3g.40gb")
        assert (mig.gpu_instance_id, mig.compute_instance_id) == (1, 0)
        assert mig.uuid.startswith("MIG-")
        assert mig.memory_total_bytes == 40192 * MIB  # NVML memorySizeMB for A100-80GB 3g.40gb
        assert mig.compute_fraction == pytest.approx(3 / 7)
        assert mig.labels == {"gpu_model": "NVIDIA A100-SXM4-80GB", "mig_profile": "3g.40gb", "parent": "gpu1"}
        assert [d.id for d in b.leaf_devices()] == [
            "gpu0", "gpu1/mig1.0", "gpu1/mig2.0", "gpu1/mig3.0", "gpu1/mig4.0", "cpu"]
        assert b.source == "nvml"

    def test_a100_40gb_mig_and_h100(self):
        b = NvmlBackend(nvml=a100_40gb_and_h100())
        by_id = {d.id: d for d in b.devices()}
        # 4g.20gb 19968 MiB, 2g.10gb 9856 MiB, 1g.5gb 4864 MiB (NVML memorySizeMB on A100-SXM4-40GB)
        assert [(d.mig_profile, d.memory_total_bytes // MIB) for d in b.devices() if d.kind == "mig"] == [
            ("4g.20gb", 19968), ("2g.10gb", 9856), ("1g.5gb", 4864)]
        assert by_id["gpu1"].name == "NVIDIA H100 80GB HBM3"
        assert by_id["gpu1"].memory_total_bytes == 81559 * MIB

    def test_profile_from_device_name_when_instance_query_is_unsupported(self):
        fake = dgx_a100_2gpu_mig()
        fake.not_supported("nvmlDeviceGetGpuInstanceById")  # e.g. unprivileged on some drivers
        mig = {d.id: d for d in NvmlBackend(nvml=fake).devices()}["gpu1/mig2.0"]
        assert mig.mig_profile == "2g.20gb"
        assert mig.compute_fraction == pytest.approx(2 / 7)

    @pytest.mark.parametrize("text, expected", [
        ("MIG 3g.40gb", ("3g.40gb", 3 / 7)),
        ("NVIDIA A100-SXM4-80GB MIG 1c.3g.40gb", ("3g.40gb", 1 / 7)),
        ("MIG 1g.10gb+me", ("1g.10gb+me", 1 / 7)),
        ("NVIDIA A100-SXM4-80GB", None),
    ])
    def test_parse_mig_profile(self, text, expected):
        assert parse_mig_profile(text) == (expected if expected is None else (expected[0], pytest.approx(expected[1])))


class TestReadings:
    def test_gpu_reading_units(self):
        b = NvmlBackend(nvml=dgx_a100_2gpu_mig())
        r = b.sample("gpu0")
        assert r.utilization_ratio == pytest.approx(0.37)  # 37 %
        assert r.memory_used_bytes == 2**30
        assert r.power_w == pytest.approx(123.456)  # 123456 mW
        assert r.power_limit_w == pytest.approx(400.0)  # 400000 mW
        assert r.temperature_c == 41.0
        assert r.healthy

    def test_mig_readings_are_none_not_zero(self):
        b = NvmlBackend(nvml=dgx_a100_2gpu_mig())
        r = b.sample("gpu1/mig1.0")
        assert (r.utilization_ratio, r.power_w, r.power_limit_w, r.temperature_c) == (None, None, None, None)
        assert r.memory_used_bytes == 0  # memory is supported on MIG devices
        assert b.sample("gpu1").utilization_ratio is None  # MIG-on GPU: NotSupported

    def test_not_supported_call_is_na(self):
        fake = dgx_a100_2gpu_mig()
        fake.not_supported("nvmlDeviceGetPowerUsage", index=0)
        r = NvmlBackend(nvml=fake).sample("gpu0")
        assert r.power_w is None and r.temperature_c == 41.0

    def test_missing_function_logged_once(self, caplog):
        fake = dgx_a100_2gpu_mig()
        fake.remove_function("nvmlDeviceGetEnforcedPowerLimit")
        b = NvmlBackend(nvml=fake)
        with caplog.at_level(logging.WARNING):
            for _ in range(3):
                assert b.sample("gpu0").power_limit_w is None
        assert sum("nvmlDeviceGetEnforcedPowerLimit" in r.message for r in caplog.records) == 1

    def test_cpu_from_usage_source(self):
        b = NvmlBackend(nvml=dgx_a100_2gpu_mig(), usage=FixedUsage())
        r = b.sample("cpu")
        assert (r.memory_used_bytes, r.utilization_ratio) == (3 * 2**30, 0.25)

    def test_memory_used_leaves_out_the_drivers_reserved_memory(self):
        """nvidia-smi's Used is the v2 struct's `used`; the v1 struct adds what the driver reserves for itself."""
        fake = dgx_a100_2gpu_mig()
        fake.gpus[0].memory_reserved_bytes = 527 * MIB  # as an idle A100 80GB shows it
        r = NvmlBackend(nvml=fake).sample("gpu0")
        assert r.memory_used_bytes == 1 << 30  # what runs there, as nvidia-smi shows
        assert r.memory_free_bytes == 81920 * MIB - (1 << 30) - 527 * MIB

    def test_memory_v1_where_the_driver_has_no_v2(self, caplog):
        fake = dgx_a100_2gpu_mig()
        fake.gpus[0].memory_reserved_bytes = 527 * MIB
        fake.remove_function("nvmlDeviceGetMemoryInfo_v2")
        b = NvmlBackend(nvml=fake)
        with caplog.at_level(logging.INFO):
            assert b.sample("gpu0").memory_used_bytes == (1 << 30) + 527 * MIB  # v1: reserved counts as used
            b.sample("gpu0")
        assert sum("reserved memory" in r.getMessage() for r in caplog.records) == 1  # said once, asked once

    def test_unknown_device_is_keyerror(self):
        with pytest.raises(KeyError):
            NvmlBackend(nvml=dgx_a100_2gpu_mig()).sample("gpu9")


class TestFaults:
    def test_lost_gpu_marked_unhealthy_with_its_mig_devices(self, caplog):
        fake = dgx_a100_2gpu_mig()
        b = NvmlBackend(nvml=fake)
        assert b.sample("gpu1").healthy
        fake.lose_gpu(1)
        with caplog.at_level(logging.ERROR):
            assert not b.sample("gpu1/mig2.0").healthy  # a MIG call reports its physical GPU lost
        assert not b.sample("gpu1").healthy
        assert not b.sample("gpu1/mig1.0").healthy
        assert b.sample("gpu0").healthy
        assert [d.id for d in b.devices()][:2] == ["gpu0", "gpu1"]  # still listed, so healthy=0 is exported
        assert sum("lost" in r.message for r in caplog.records) == 1

    def test_gpu_lost_before_enumeration(self):
        fake = dgx_a100_2gpu_mig()
        fake.lose_gpu(0)
        b = NvmlBackend(nvml=fake)
        assert b.devices()[0].id == "gpu0"
        assert not b.sample("gpu0").healthy
        assert b.sample("gpu1").healthy

    @pytest.mark.parametrize("driver, words", [("missing", "not found"), ("not_loaded", "not loaded")])
    def test_no_driver_reason(self, driver, words):
        b = NvmlBackend(nvml=FakeNvml(driver=driver))
        assert words in (b.unavailable_reason() or "")
        assert [d.id for d in b.devices()] == ["cpu"]  # never raises; the CPU is always there

    def test_lazy_init_and_shutdown(self):
        fake = dgx_a100_2gpu_mig()
        b = NvmlBackend(nvml=fake)
        assert fake.init_calls == 0  # constructing touches nothing
        b.devices()
        assert fake.initialized == 1
        b.close()
        assert fake.initialized == 0

    def test_query_never_raises(self):
        fake = dgx_a100_2gpu_mig()
        s = NvmlSession(fake)
        assert s.query("nvmlDeviceGetHandleByIndex", 99) is NA  # InvalidArgument
        assert s.query("nvmlNoSuchFunction") is NA
        assert s.query("nvmlDeviceGetCount", default=0) == 2
        assert repr(NA) == "N/A" and not NA


class TestDiscovery:
    def test_real_gpus_use_nvml(self):
        assert discover(None, FixedUsage(), nvml=dgx_a100_2gpu_mig()).source == "nvml"

    @pytest.mark.parametrize("fake, why", [
        (FakeNvml(driver="missing"), "libnvidia-ml.so.1"),
        (FakeNvml(driver="not_loaded"), "kernel driver is not loaded"),
        (FakeNvml([]), "0 GPUs"),
    ])
    def test_fallback_says_why(self, fake, why, caplog):
        with caplog.at_level(logging.INFO, logger="gpud.telemetry.discovery"):
            b = discover(None, FixedUsage(), nvml=fake)
        assert b.source.startswith("simulated:") and b.source.endswith("dgx-a100-2gpu-mig.yaml")
        warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and why in warnings[0] and "simulated" in warnings[0]
        tree = "\n".join(r.message for r in caplog.records)
        assert "gpu1/mig1.0: MIG 3g.40gb" in tree

    def test_node_file_wins(self, tmp_path):
        f = tmp_path / "n.yaml"
        f.write_text("gpus:\n  - model: NVIDIA H100 80GB HBM3\n")
        b = discover(str(f), FixedUsage(), nvml=dgx_a100_2gpu_mig())
        assert b.source == f"simulated:{f}"
        assert [d.id for d in b.devices()] == ["gpu0", "cpu"]


def test_fake_rejects_impossible_layout():
    from tests.fake_nvml import mig_layout
    with pytest.raises(ValueError):
        mig_layout(A100_SXM4_80GB, ["4g.40gb", "4g.40gb"])


class TestRicherReadings:
    def test_reading_stays_backward_compatible(self):
        r = DeviceReading(0.5, 10, 100.0, 400.0, 40.0, True)  # the original positional order
        assert (r.utilization_ratio, r.memory_used_bytes, r.power_w, r.temperature_c, r.healthy) == (
            0.5, 10, 100.0, 40.0, True)
        assert r.ecc_errors == {} and r.xid_errors == {} and r.energy_joules is None
        assert hash(r) == hash(DeviceReading(0.5, 10, 100.0, 400.0, 40.0, True))  # still hashable

    def test_gpu_reading_fields(self):
        r = NvmlBackend(nvml=dgx_a100_2gpu_mig()).sample("gpu0")
        assert r.energy_joules == pytest.approx(5000.25)  # 5 000 250 mJ
        assert (r.sm_clock_hz, r.memory_clock_hz) == (1410e6, 1593e6)
        assert r.memory_free_bytes == (81920 - 1024) * MIB
        assert r.memory_utilization_ratio == pytest.approx(0.12)
        assert r.ecc_errors == {("corrected", "volatile"): 3, ("uncorrected", "volatile"): 0,
                                ("corrected", "aggregate"): 17, ("uncorrected", "aggregate"): 1}
        assert (r.clock_event_reasons, r.clock_event_reasons_supported) == (0x44, 0x1FF)
        # sample() leaves out the legacy PCIe window (20 ms per call): sample_all() reads it for a scrape
        assert r.pcie_tx_bytes_per_second is None
        assert NvmlBackend(nvml=dgx_a100_2gpu_mig()).sample_all()["gpu0"].pcie_tx_bytes_per_second == 2_000 * 1024

    def test_pcie_legacy_can_be_turned_off(self):
        fake = dgx_a100_2gpu_mig()
        readings = NvmlBackend(nvml=fake, pcie_legacy=False).sample_all()
        assert readings["gpu0"].pcie_rx_bytes_per_second is None
        assert "nvmlDeviceGetPcieThroughput" not in fake.calls

    def test_gpm_not_used_on_a100(self):
        fake, clock = a100_40gb_and_h100(), FakeClock(100.0)
        b = NvmlBackend(nvml=fake, clock=clock)
        b.sample_all()
        clock.now += 15
        b.sample_all()
        assert fake.calls.count("nvmlGpmQueryDeviceSupport") == 2  # once per GPU, then cached
        assert fake.calls.count("nvmlGpmMigSampleGet") == 0  # the A100's MIG instances: no GPM
        assert fake.calls.count("nvmlGpmSampleGet") == 2  # the H100, once per pass

    def test_gpm_second_sample_within_refresh_interval_reuses_values(self):
        fake, clock = hgx_h100_mig(gpus=1), FakeClock(100.0)
        b = NvmlBackend(nvml=fake, clock=clock)
        b.sample_all()
        clock.now += 10
        assert b.sample_all()["gpu0/mig1.0"].gr_engine_active_ratio == pytest.approx(0.6)
        taken = fake.calls.count("nvmlGpmMigSampleGet")
        clock.now += 0.05  # closer than NVML's GPM refresh: the difference would be noise
        assert b.sample_all()["gpu0/mig1.0"].gr_engine_active_ratio == pytest.approx(0.6)
        assert fake.calls.count("nvmlGpmMigSampleGet") == taken

    def test_gpm_buffers_reused_and_freed(self):
        fake, clock = hgx_h100_mig(gpus=1), FakeClock(100.0)
        b = NvmlBackend(nvml=fake, clock=clock)
        for _ in range(5):
            b.sample_all()
            clock.now += 15
        # two buffers per sampled thing (the GPU and its 3 GPU instances), however many scrapes
        assert len(fake.gpm_samples) == 2 * 4
        b.close()
        assert all(s.freed for s in fake.gpm_samples)
        assert all(es.freed for es in fake.event_sets)

    def test_empty_event_set_is_quiet(self, caplog):
        b = NvmlBackend(nvml=dgx_a100_2gpu_mig())
        with caplog.at_level(logging.DEBUG):
            for _ in range(3):
                b.sample_all()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # Timeout is "nothing pending"

    def test_old_bindings_use_throttle_reason_names(self):
        class OldBindings(FakeNvml):
            """Bindings from before NVML renamed throttle reasons to clock event reasons."""

            def __getattribute__(self, name):
                if "ClocksEventReasons" in name:
                    raise AttributeError(name)
                return super().__getattribute__(name)

            def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
                return FakeNvml.nvmlDeviceGetCurrentClocksEventReasons(self, handle)  # same bits, old name

            def nvmlDeviceGetSupportedClocksThrottleReasons(self, handle):
                return 0x1FF

        fake = OldBindings(dgx_a100_2gpu_mig().gpus)
        assert NvmlBackend(nvml=fake).sample("gpu0").clock_event_reasons == 0x44
