"""gpud.autoscale: the sampler between the core and telemetry.hints, driven by a fake clock and fake stats."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from executor.stats import ModelStats
from gpud.autoscale import MIN_FOOTPRINT_BYTES, HintsSampler, instance_infos
from gpud.ctl import render_inspect
from gpud.placer import DeviceRoom
from telemetry.hints import HintPolicy
from tests.promtool_check import promtool_check
from tests.fakes import FakeClock

GIB = 2**30


def _instance(index: int, device: str, memory_bytes: int | None, ready: bool = True):
    return NS(index=index, device_id=device, memory_bytes=memory_bytes, estimate_bytes=GIB, ready=ready,
              load_seconds=1.5, footprint_bytes=memory_bytes if memory_bytes is not None else GIB)


def _version(name: str, instances: list, kind: str = "KIND_GPU"):
    scheduler = NS(stats=ModelStats(), ready_instances=sum(1 for i in instances if i.ready))
    config = NS(instance_groups=[NS(kind=kind, count=len(instances))])
    return NS(version="1", scheduler=scheduler, entry=NS(config=config), instances=instances)


def make_core():
    versions = {"bert": _version("bert", [_instance(0, "gpu0", 2 * GIB), _instance(1, "gpu1/mig1.0", 3 * GIB)]),
                "tiny": _version("tiny", [_instance(0, "cpu", 0)], kind="KIND_CPU")}
    models = {n: NS(name=n, versions={"1": v}) for n, v in versions.items()}
    rooms = [DeviceRoom("gpu0", "gpu", 0, 10 * GIB, 80 * GIB), DeviceRoom("gpu1/mig1.0", "mig", 1, 7 * GIB, 40 * GIB),
             DeviceRoom("cpu", "cpu", -1, 4 * GIB, 64 * GIB)]
    leaves = [NS(kind=r.kind) for r in rooms]
    return NS(models=models, devices=NS(leaf_devices=lambda: leaves), device_rooms=lambda: rooms)


def serve(stats: ModelStats, requests: int, queue_ms: float, batch_rows: int, batch_ms: float) -> None:
    """`requests` successful requests in batches of `batch_rows`, each batch computing `batch_ms`."""
    for _ in range(requests // batch_rows):
        stats.record_batch(batch_rows, 0, int(batch_ms * 1e6), 0, 0)
    for _ in range(requests):
        stats.success.add(0)
        stats.queue.add(int(queue_ms * 1e6))


@pytest.fixture
def setup():
    clock, core, registry = FakeClock(1000.0), make_core(), CollectorRegistry()
    policy = HintPolicy(scale_up_stabilization_seconds=10, scale_down_stabilization_seconds=60)
    sampler = HintsSampler(core, policy, clock=clock, interval_s=5, rate_window_s=10, registry=registry)
    return clock, core, registry, sampler


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels)


def test_first_tick_collects_then_hints(setup):
    clock, core, registry, sampler = setup
    sampler.tick()
    assert value(registry, "gpud_model_desired_instances", model="bert", version="1") is None  # no delta yet
    clock.now += 5
    sampler.tick()
    # no requests: 0 needed, bounded to min 1; the 60 s down-window is not covered yet: the current 2 stands in
    assert value(registry, "gpud_model_desired_instances", model="bert", version="1") == 2
    assert value(registry, "gpud_model_instances_current", model="bert", version="1") == 2


def test_sustained_queueing_raises_the_hint(setup):
    clock, core, registry, sampler = setup
    stats = core.models["bert"].versions["1"].scheduler.stats
    sampler.tick()
    for _ in range(4):
        clock.now += 5
        # per 5 s: 400 requests in batches of 8 at 40 ms each = 50 batches * 0.04 s = 2 s busy; queue 30 ms each
        serve(stats, 400, queue_ms=30, batch_rows=8, batch_ms=40)
        sampler.tick()
    d = sampler.decisions()[("bert", "1")]
    # rate window 10 s: 800 requests / 10 s = 80 req/s; 800 done / 4 s busy = 200 req/s per instance
    # load: 80 / 200 = 0.4 busy; / 2 = 0.2; / 0.8 = 0.25 -> ceil(2 * 0.25) = 1
    # queue: 30 ms / 10 ms = 3.0 -> ceil(2 * 3.0) = 6; max(1, 6) = 6; sustained over the 10 s up-window -> 6
    assert (d.load_instances, d.queue_instances, d.desired_instances) == (1, 6, 6)
    assert value(registry, "gpud_model_instance_throughput_requests_per_second", model="bert",
                 version="1") == pytest.approx(200.0)
    hints = sampler.inspect()
    bert = next(m for m in hints["models"] if m["name"] == "bert")
    assert bert["arrival_rate_per_second"] == pytest.approx(80.0) and bert["queue_seconds"] == pytest.approx(0.03)


def test_headroom_from_free_memory_and_measured_footprint(setup):
    _, _, registry, sampler = setup
    sampler.tick()
    # bert: largest measured footprint 3 GiB, GPU kinds: gpu0 10 // 3 = 3, mig 7 // 3 = 2; the CPU is not its kind
    assert value(registry, "gpud_node_headroom_instances", model="bert", device="gpu0") == 3
    assert value(registry, "gpud_node_headroom_instances", model="bert", device="gpu1/mig1.0") == 2
    assert value(registry, "gpud_node_headroom_instances", model="bert", device="cpu") is None
    # tiny measured 0 bytes (resident-memory delta): its 1 GiB estimate is used; cpu 4 GiB // 1 GiB = 4
    assert value(registry, "gpud_node_headroom_instances", model="tiny", device="cpu") == 4
    assert MIN_FOOTPRINT_BYTES == 2**20


def test_reload_restarts_the_history_and_unload_drops_series(setup):
    clock, core, registry, sampler = setup
    sampler.tick()
    clock.now += 5
    sampler.tick()
    assert ("bert", "1") in sampler.decisions()
    core.models["bert"].versions["1"] = _version("bert", [_instance(0, "gpu0", 2 * GIB)])  # reloaded: new counters
    clock.now += 5
    sampler.tick()
    assert ("bert", "1") not in sampler.decisions()  # collecting a first window again
    del core.models["tiny"]
    clock.now += 5
    sampler.tick()
    assert 'model="tiny",version' not in generate_latest(registry).decode()


def test_instance_infos_feed_the_per_instance_gauges(setup):
    _, core, _, _ = setup
    infos = instance_infos(core)
    assert [(i.model, i.instance, i.device, i.memory_bytes) for i in infos] == [
        ("bert", "0", "gpu0", 2 * GIB), ("bert", "1", "gpu1/mig1.0", 3 * GIB), ("tiny", "0", "cpu", 0)]


def test_bad_intervals_refused():
    with pytest.raises(ValueError, match="interval"):
        HintsSampler(make_core(), HintPolicy(), interval_s=0)
    with pytest.raises(ValueError, match="rate window"):
        HintsSampler(make_core(), HintPolicy(), interval_s=5, rate_window_s=1)


def test_gpudctl_renders_hints_and_headroom(setup):
    clock, core, _, sampler = setup
    sampler.tick()
    clock.now += 5
    sampler.tick()
    data = {"server": {"version": "x"}, "device_source": "simulated", "devices": [], "models": [],
            "hints": sampler.inspect()}
    text = render_inspect(data)
    assert "HINTS" in text and "HEADROOM" in text
    assert "bert" in text and "gpu0 3" in text
    # an older daemon without hints renders as before
    assert "HINTS" not in render_inspect({k: v for k, v in data.items() if k != "hints"})


def test_promtool_accepts_exposition(setup):
    clock, _, registry, sampler = setup
    sampler.tick()
    clock.now += 5
    sampler.tick()
    promtool_check(generate_latest(registry))
