"""ModelMetrics: inference (rows) counter, per-instance gauges, and the Triton-compatible names (triton_names=True)."""
from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpud.telemetry.devices import DeviceInfo, DeviceReading
from gpud.telemetry.model_metrics import ModelMetrics
from tests.promtool_check import promtool_check
from tests.serving_fakes import FakeServing, instance


class FakeDevices:
    """A MIG-enabled GPU with one MIG instance, a whole GPU, and the CPU."""

    def __init__(self) -> None:
        self._devices = [
            DeviceInfo("gpu0", "gpu", 0, "NVIDIA A100", "GPU-aaa", "0:07", 80 * 2**30),
            DeviceInfo("gpu1", "gpu", 1, "NVIDIA A100", "GPU-bbb", "0:0F", 80 * 2**30, mig_enabled=True),
            DeviceInfo("gpu1/mig1.0", "mig", 1, "NVIDIA A100", "MIG-ccc", "0:0F", 40 * 2**30, parent_id="gpu1",
                       mig_profile="3g.40gb", gpu_instance_id=1, compute_instance_id=0),
            DeviceInfo("cpu", "cpu", -1, "CPU", "", "", 64 * 2**30),
        ]

    def devices(self):
        return list(self._devices)

    def sample(self, device_id: str) -> DeviceReading:
        if device_id == "gpu0":
            return DeviceReading(utilization_ratio=0.5, memory_used_bytes=2**30, power_w=250.0, power_limit_w=400.0)
        return DeviceReading()  # N/A everywhere


def lines(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(rf"{name}[{{ ]", line)]


@pytest.fixture
def triton():
    registry, serving = CollectorRegistry(), FakeServing()
    ModelMetrics(serving, registry, triton_names=True, devices=FakeDevices())
    return registry, serving


def test_inferences_count_rows(triton):
    registry, serving = triton
    serving.batch("bert", "1", rows=8)
    serving.batch("bert", "1", rows=3)
    assert registry.get_sample_value("gpud_model_inferences_total", {"model": "bert", "version": "1"}) == 11  # 8 + 3
    assert registry.get_sample_value("gpud_model_executions_total", {"model": "bert", "version": "1"}) == 2


def test_triton_counters_in_microseconds(triton):
    registry, serving = triton
    # one batch of 5 rows: two requests, queued 2 ms and 1 ms, 100 us input, 4 ms infer, 200 us output
    serving.batch("bert", "1", rows=5, queue_s=(0.002, 0.001), request_s=(0.0065, 0.0055), input_s=0.0001,
                  infer_s=0.004, output_s=0.0002)
    serving.failure("bert", "1", 0.5)  # failures add no durations, as in Triton
    serving.version("bert", "1", pending=3)
    text = generate_latest(registry).decode()
    lv = {"model": "bert", "version": "1"}

    def v(name):
        return registry.get_sample_value(name, lv)

    assert v("nv_inference_request_success") == 2
    assert v("nv_inference_request_failure") == 1
    assert v("nv_inference_count") == 5 and v("nv_inference_exec_count") == 1
    assert v("nv_inference_queue_duration_us") == pytest.approx(3000.0)  # (0.002 + 0.001) s * 1e6
    assert v("nv_inference_compute_input_duration_us") == pytest.approx(200.0)  # 2 * 100 us
    assert v("nv_inference_compute_infer_duration_us") == pytest.approx(8000.0)  # 2 * 4000 us
    assert v("nv_inference_compute_output_duration_us") == pytest.approx(400.0)  # 2 * 200 us
    assert v("nv_inference_request_duration_us") == pytest.approx(12000.0)  # 6500 + 5500 us, successes only
    assert v("nv_inference_pending_request_count") == 3
    # Triton's exact series names: no `_total` suffix, labels model and version
    assert lines(text, "nv_inference_request_success") == ['nv_inference_request_success{model="bert",version="1"} 2.0']
    assert not lines(text, "nv_inference_request_success_total")


def test_triton_gpu_gauges_per_physical_gpu(triton):
    registry, _ = triton
    text = generate_latest(registry).decode()
    # physical GPUs only (DCGM's view in Triton), labelled gpu_uuid; N/A readings emit no sample
    assert registry.get_sample_value("nv_gpu_memory_total_bytes", {"gpu_uuid": "GPU-bbb"}) == 80 * 2**30
    assert [line.split()[0] for line in lines(text, "nv_gpu_memory_total_bytes")] == [
        'nv_gpu_memory_total_bytes{gpu_uuid="GPU-aaa"}', 'nv_gpu_memory_total_bytes{gpu_uuid="GPU-bbb"}']
    assert lines(text, "nv_gpu_utilization") == ['nv_gpu_utilization{gpu_uuid="GPU-aaa"} 0.5']
    assert lines(text, "nv_gpu_power_usage") == ['nv_gpu_power_usage{gpu_uuid="GPU-aaa"} 250.0']
    assert lines(text, "nv_gpu_power_limit") == ['nv_gpu_power_limit{gpu_uuid="GPU-aaa"} 400.0']
    assert not lines(text, "nv_energy_consumption")


def test_off_by_default():
    registry, serving = CollectorRegistry(), FakeServing()
    ModelMetrics(serving, registry)
    serving.batch("bert", "1")
    assert "nv_" not in generate_latest(registry).decode()


def test_instance_gauges(triton):
    registry, serving = triton
    v = serving.version("bert", "1", instances=(instance(0, "gpu0", 3 * 2**30, load_seconds=2.5),
                                                instance(1, "gpu1/mig1.0", 3 * 2**30, load_seconds=4.0,
                                                         ready=False)))
    lv = {"model": "bert", "version": "1", "model_instance": "1", "device": "gpu1/mig1.0"}
    assert registry.get_sample_value("gpud_model_instance_memory_bytes", lv) == 3 * 2**30
    assert registry.get_sample_value("gpud_model_instance_load_duration_seconds", lv) == 4.0
    assert registry.get_sample_value("gpud_model_instance_ready", lv) == 0
    v.pending = 0  # a change elsewhere in the version leaves the instance gauges as they were
    assert registry.get_sample_value("gpud_model_instance_ready", lv) == 0
    # an instance without a measurement reports its estimate
    serving.version("bert", "1", instances=(instance(0, "gpu0", None, estimate_bytes=2**30),))
    assert registry.get_sample_value("gpud_model_instance_memory_bytes", {**lv, "model_instance": "0", "device": "gpu0"}) \
        == 2**30


def test_unloaded_model_drops_triton_series(triton):
    registry, serving = triton
    serving.request("a", "1", 0.001, 0.001, 0.001, 0.001, 0.004)
    serving.batch("a", "1", rows=2)
    serving.remove("a", "1")
    assert 'model="a"' not in generate_latest(registry).decode()


def test_promtool_accepts_gpud_names():
    # The gpud_* exposition is lint-clean; Triton's names are Triton's (untyped, no _total) and are not linted.
    registry, serving = CollectorRegistry(), FakeServing()
    ModelMetrics(serving, registry)
    serving.batch("a", "1", rows=2)
    serving.version("a", "1", instances=(instance(0, "cpu", 2**20, load_seconds=0.5),))
    promtool_check(generate_latest(registry))
