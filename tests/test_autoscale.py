"""gpud.scaling.sampler: the sampler between the core and gpud.scaling.hints, driven by a fake clock and fake stats."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpud.executor.stats import ModelStats
from gpud.scaling.sampler import MIN_FOOTPRINT_BYTES, HintsSampler
from gpud.cli.inspect import render_inspect
from gpud.scaling.hints import DeviceFree, HintPolicy
from tests.promtool_check import promtool_check
from tests.fakes import FakeClock
from tests.serving_fakes import FakeServing, instance

GIB = 2**30


def make_serving() -> FakeServing:
    serving = FakeServing()
    serving.version("bert", instances=(instance(0, "gpu0", 2 * GIB), instance(1, "gpu1/mig1.0", 3 * GIB)),
                    kinds=frozenset({"gpu", "mig"}))
    serving.version("tiny", instances=(instance(0, "cpu", 0, estimate_bytes=GIB),), kinds=frozenset({"cpu"}))
    return serving


FREE = [DeviceFree("gpu0", "gpu", 10 * GIB), DeviceFree("gpu1/mig1.0", "mig", 7 * GIB),
        DeviceFree("cpu", "cpu", 4 * GIB)]


def serve(stats: ModelStats, requests: int, queue_ms: float, batch_rows: int, batch_ms: float) -> None:
    """`requests` successful requests in batches of `batch_rows`, each batch computing `batch_ms`."""
    for _ in range(requests // batch_rows):
        stats.record_batch(batch_rows, [int(queue_ms * 1e6)] * batch_rows, [0] * batch_rows, 0, int(batch_ms * 1e6),
                           0, 0)


@pytest.fixture
def setup():
    clock, serving, registry = FakeClock(1000.0), make_serving(), CollectorRegistry()
    policy = HintPolicy(scale_up_stabilization_seconds=10, scale_down_stabilization_seconds=60)
    sampler = HintsSampler(serving, lambda: FREE, policy, clock=clock, interval_s=5, rate_window_s=10,
                           registry=registry)
    return clock, serving, registry, sampler


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels)


def test_first_tick_collects_then_hints(setup):
    clock, serving, registry, sampler = setup
    sampler.tick()
    assert value(registry, "gpud_model_desired_instances", model="bert", version="1") is None  # no delta yet
    clock.now += 5
    sampler.tick()
    # no requests: 0 needed, bounded to min 1; the 60 s down-window is not covered yet: the current 2 stands in
    assert value(registry, "gpud_model_desired_instances", model="bert", version="1") == 2
    assert value(registry, "gpud_model_instances_current", model="bert", version="1") == 2


def test_sustained_queueing_raises_the_hint(setup):
    clock, serving, registry, sampler = setup
    stats = serving.stats("bert")
    sampler.tick()
    for _ in range(4):
        clock.now += 5
        # per 5 s: 400 requests in batches of 8 at 40 ms each = 50 batches * 0.04 s = 2 s busy; queue 30 ms each
        serve(stats, 400, queue_ms=30, batch_rows=8, batch_ms=40)
        sampler.tick()
    d = sampler.decisions()[("bert", "1")]
    # rate window 10 s: 800 requests / 10 s = 80 req/s; 800 done / 4 s busy = 200 req/s per instance
    # load: 80 / 200 = 0.4 busy; / 2 = 0.2; / 0.8 = 0.25 -> ceil(2 * 0.25) = 1
    # queue: 30 ms / 10 ms = 3.0 -> ceil(2 * 3.0) = 6, at most 2 x 2 = 4; max(1, 4) = 4; sustained over the 10 s
    # up-window -> 4
    assert (d.load_instances, d.queue_instances, d.desired_instances) == (1, 4, 4)
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
    clock, serving, registry, sampler = setup
    sampler.tick()
    clock.now += 5
    sampler.tick()
    assert ("bert", "1") in sampler.decisions()
    serving.remove("bert")
    serving.version("bert", instances=(instance(0, "gpu0", 2 * GIB),))  # reloaded: a new record, new counters
    clock.now += 5
    sampler.tick()
    assert ("bert", "1") not in sampler.decisions()  # collecting a first window again
    serving.remove("tiny")
    clock.now += 5
    sampler.tick()
    assert 'model="tiny",version' not in generate_latest(registry).decode()


def test_bad_intervals_refused():
    with pytest.raises(ValueError, match="interval"):
        HintsSampler(make_serving(), lambda: FREE, HintPolicy(), interval_s=0)
    with pytest.raises(ValueError, match="rate window"):
        HintsSampler(make_serving(), lambda: FREE, HintPolicy(), interval_s=5, rate_window_s=1)


def test_gpudctl_renders_hints_and_headroom(setup):
    clock, _, _, sampler = setup
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


class TestOneBoundsSystem:
    """The hint keeps to the version's own bounds (gpud.scaling.bounds), the ones the controller applies: no node-wide
    clamp of its own (the README: gpud_max_instances defaults to as many as the node has room for)."""

    @staticmethod
    def heavy(clock, serving, sampler) -> None:
        stats = serving.stats("bert")
        sampler.tick()
        for _ in range(4):
            clock.now += 5
            # per 5 s: 4000 requests, batches of 8 at 40 ms: capacity 8 / 0.04 = 200 req/s per instance; arrival
            # 800 req/s; 800 / 200 = 4 busy; / 0.8 = 5 -- the load metric; queue 300 ms / 10 ms: 2 x 2 = 4 at most.
            # And from a window later (the up-window covered) the queue keeps asking twice the current count.
            serve(stats, 4000, queue_ms=300, batch_rows=8, batch_ms=40)
            sampler.tick()

    def test_no_maximum_is_no_limit_but_the_nodes_room(self, setup):
        clock, serving, registry, sampler = setup
        serving.version("bert").max_instances = None
        serving.version("bert").instances = tuple(instance(i, "gpu0", GIB) for i in range(10))  # 10 ready
        self.heavy(clock, serving, sampler)
        # 10 ready, 800 req/s: 4 busy / 10 = 0.4 utilization, under target; but the queue (300 ms over 10 ms) asks
        # min(ceil(10 * 30), 2 x 10) = 20: past the old node-wide clamp of 8.
        assert sampler.decisions()[("bert", "1")].desired_instances == 20

    def test_its_maximum_and_minimum(self, setup):
        clock, serving, registry, sampler = setup
        v = serving.version("bert")
        v.min_instances, v.max_instances = 0, 3
        self.heavy(clock, serving, sampler)
        d = sampler.decisions()[("bert", "1")]
        assert d.desired_instances == 3 and "bounded to [0, 3]" in d.reason
        row = next(m for m in sampler.inspect()["models"] if m["name"] == "bert")
        assert row["desired_instances"] == 3
