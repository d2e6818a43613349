"""What one Prometheus scrape of a big node costs: 8 GPUs x 7 MIG 1g instances (56 MIG devices) and 100 models.

Two device backends, each with the host collector in the registry and the model metrics served as the daemon serves
them (gpud/api/metrics_server.py: `generate_latest(registry)` followed by `ModelMetrics.render_text()`):
  nvml       the NVML backend over the behavioural fake NVML (tests/fake_nvml.py): 8 H100 in MIG mode, so every
             scrape takes GPM samples for 8 GPUs and 56 GPU instances, drains 8 XID event sets and reads ECC,
             clocks, energy, throttle reasons; the clock advances 15 s per scrape, as between real scrapes.
  simulated  the simulated backend over the same layout (readings from a usage source).
The fake answers in microseconds where a driver takes longer, so the nvml figure is gpud's own cost (Python,
prometheus_client), not the driver's. Target: a scrape answers in under 50 ms. The last row times the model metrics
through prometheus_client's exposition (ModelMetrics registered as a collector), for comparison.

    .venv/bin/python bench/scrape_bench.py [--repeat 100]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prometheus_client import CollectorRegistry  # noqa: E402

from gpud.api.metrics_server import exposition  # noqa: E402
from gpud.telemetry.device_metrics import DeviceCollector  # noqa: E402
from gpud.telemetry.host_metrics import HostCollector  # noqa: E402
from gpud.executor.stats import ModelStats  # noqa: E402
from gpud.telemetry.model_metrics import ModelMetrics  # noqa: E402
from gpud.telemetry.serving import InstanceView, ModelState, ModelView, ServingSnapshot, VersionView  # noqa: E402
from gpud.telemetry.nvml import NvmlBackend  # noqa: E402
from gpud.telemetry.simulated import SimulatedBackend  # noqa: E402
from tests.fake_nvml import hgx_h100_mig  # noqa: E402

TARGET_MS = 50.0
GPUS, MIGS_PER_GPU, MODELS = 8, 7, 100


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Usage:
    """Every MIG instance holds 4 GiB and is 50 % busy: a loaded node, so every series has a value."""

    def memory_used_bytes(self, device_id: str) -> int | None:
        return 4 * 2**30 if "/mig" in device_id else None

    def utilization_ratio(self, device_id: str) -> float | None:
        return 0.5 if "/mig" in device_id else None

    def unhealthy_reason(self, device_id: str) -> str | None:
        return None


def populate_models(registry: CollectorRegistry | None = None) -> ModelMetrics:
    """100 model versions, each with a few batches recorded (so every histogram has buckets filled), a failure, a
    pending count and one instance on a MIG device, read from a snapshot as the daemon's collectors read it."""
    devices = [f"gpu{g}/mig{i}.0" for g in range(GPUS) for i in range(1, MIGS_PER_GPU + 1)]
    versions = []
    for m in range(MODELS):
        stats = ModelStats()
        for k in range(5):
            stats.record_batch(1 + k, [1_000_000 * k], [6_000_000 + 1_000_000 * k], 100_000,
                               4_000_000 + 1_000_000 * k, 100_000, 0)
        stats.record_failure(0)
        inst = InstanceView(0, devices[m % len(devices)], True, 2**30, 2**30, "device_memory", 1.0, "CUDA", "")
        versions.append(VersionView(f"model-{m:03d}", "1", ModelState.READY, "", 8, frozenset({"mig"}), m % 3,
                                    (inst,), stats))
    snapshot = ServingSnapshot(tuple(ModelView(v.model, "", (v,)) for v in versions))
    return ModelMetrics(lambda: snapshot, registry)


Scrape = tuple[CollectorRegistry, Clock, tuple[ModelMetrics, ...]]


def nvml_registry(models: bool = True) -> Scrape:
    clock = Clock()
    fake = hgx_h100_mig(gpus=GPUS, profiles=("1g.10gb",) * MIGS_PER_GPU, record_calls=False)
    backend = NvmlBackend(nvml=fake, usage=Usage(), clock=clock)
    registry = CollectorRegistry()
    DeviceCollector(backend, registry=registry)
    HostCollector(lambda: {"cpu": os.getpid()}, registry=registry)
    sources = (populate_models(),) if models else ()
    for i in range(GPUS):
        fake.queue_xid(i, 79)  # not yet registered: ignored; the event sets are created by the first scrape
    return registry, clock, sources


def simulated_registry(tmp: str, models: bool = True) -> Scrape:
    node = os.path.join(tmp, "bench-8xh100-56mig.yaml")
    with open(node, "w", encoding="utf-8") as f:
        f.write("gpus:\n" + "".join(
            "  - model: NVIDIA H100 80GB HBM3\n    mig: [" + ", ".join(["1g.10gb"] * MIGS_PER_GPU) + "]\n"
            for _ in range(GPUS)))
    registry = CollectorRegistry()
    DeviceCollector(SimulatedBackend.from_file(node, Usage()), registry=registry)
    HostCollector(lambda: {"cpu": os.getpid()}, registry=registry)
    sources = (populate_models(),) if models else ()
    return registry, Clock(), sources


def models_only() -> Scrape:
    return CollectorRegistry(), Clock(), (populate_models(),)


def models_collector_path() -> Scrape:
    registry = CollectorRegistry()
    populate_models(registry)
    return registry, Clock(), ()


def measure(scrape: Scrape, repeat: int) -> tuple[list[float], int, int]:
    registry, clock, sources = scrape
    body = exposition(registry, sources)  # warm-up: registers event sets, takes the first GPM samples
    times_ms = []
    for _ in range(repeat):
        clock.now += 15.0
        t0 = time.perf_counter()
        body = exposition(registry, sources)
        times_ms.append((time.perf_counter() - t0) * 1000.0)
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    return times_ms, series, len(body)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=100, help="timed scrapes per backend (default 100)")
    args = parser.parse_args(argv)
    print(f"node: {GPUS} GPUs x {MIGS_PER_GPU} MIG 1g instances = {GPUS * MIGS_PER_GPU} MIG devices, "
          f"{MODELS} models; {args.repeat} scrapes each; target {TARGET_MS:.0f} ms")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        runs = (
            ("nvml: full scrape", nvml_registry, True),
            ("simulated: full scrape", lambda: simulated_registry(tmp), True),
            ("nvml: devices + host only", lambda: nvml_registry(models=False), False),
            ("simulated: devices + host", lambda: simulated_registry(tmp, models=False), False),
            ("100 models only", models_only, False),
            ("100 models, collector path", models_collector_path, False),
        )
        for name, build, counts in runs:
            times, series, size = measure(build(), args.repeat)
            median, tail = statistics.median(times), p99(times)
            if counts:
                worst = max(worst, tail)
            print(f"{name:26s} median {median:7.2f} ms  p99 {tail:7.2f} ms  p99/target {tail / TARGET_MS:5.2f}  "
                  f"({series} samples, {size / 1024:.0f} KiB)")
    return 0 if worst < TARGET_MS else 1


if __name__ == "__main__":
    sys.exit(main())
