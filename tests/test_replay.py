"""The replay benchmark's parts (bench/replay): the serving model's rules one by one with hand-computed times, the
trace's live counts, gpud's control plane driven in the model's time on a small synthetic step, and the verdict
arithmetic. The benchmark's figures themselves are in docs/benchmarks.md, not asserted here."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from replay import alibaba, des  # noqa: E402
from replay.control import ModelSpec, config_pbtxt, instances_needed  # noqa: E402
from replay.des import Kind, Serving, SimDevice, SimModel  # noqa: E402

GIB = 2**30
# 10 ms alone for 1 row, 12 ms for 2, 20 ms for 4 (linear between, proportional beyond 4)
KIND = Kind("k", ((1, 0.010), (2, 0.012), (4, 0.020)), share=0.5)


def serving(arrivals: dict[str, list[float]], *, capacity: float = 1.0, max_batch: int = 4, timeout_s: float = 30.0,
            kind: Kind = KIND) -> Serving:
    models = [SimModel(name, "1", kind, max_batch, np.asarray(ts, dtype=float)) for name, ts in arrivals.items()]
    return Serving([SimDevice("gpu0", capacity, True), SimDevice("cpu", 2.0, False)], models, slo_queue_s=0.005,
                   timeout_s=timeout_s)


def instance(s: Serving, model: str, device: str = "gpu0", memory: int = GIB) -> des.SimInstance:
    inst = s.add_instance(f"{model}#{len(s.models[(model, '1')].instances)}", s.models[(model, "1")], device, memory)
    s.ready(inst)
    return inst


class TestKind:
    @pytest.mark.parametrize("rows, seconds", [
        (1, 0.010), (2, 0.012),
        (3, 0.016),  # halfway between 12 ms (2 rows) and 20 ms (4 rows)
        (8, 0.040),  # beyond the largest measured: 20 ms x 8 / 4
    ])
    def test_batch_time(self, rows, seconds):
        assert KIND.seconds(rows) == pytest.approx(seconds)


class TestServing:
    def test_a_free_instance_takes_what_is_queued_up_to_the_max_batch(self):
        # 5 requests at t=0 on one instance, max batch 4: a batch of 4 (20 ms alone; share 0.5 <= capacity 1, so at
        # full speed) from 0 to 0.020, then the 5th alone (10 ms) to 0.030, having queued 20 ms.
        s = serving({"m": [0.0] * 5})
        instance(s, "m")
        s.finish(1.0)
        m = s.models[("m", "1")]
        assert (m.stats.execution_count, m.stats.inference_count) == (2, 5)
        assert sorted(m.stats.batches) == [1, 4]
        assert m.stats.batches[4].compute_infer.ns == pytest.approx(20e6, rel=1e-6)
        assert m.stats.queue.ns == pytest.approx(4 * 0 + 20e6, rel=1e-6)
        assert (m.served, m.within_slo) == (5, 4)  # 20 ms > the 5 ms SLO for the last one

    def test_batches_on_one_device_share_it_up_to_their_caps(self):
        # Two models, each one request at t=0, share 0.8 on a capacity-1 GPU: the fair part is 0.5 each, below the
        # cap, so each runs at 0.5 / 0.8 = 0.625 of its speed: 10 ms of work takes 16 ms.
        k = Kind("big", ((1, 0.010),), share=0.8)
        s = serving({"a": [0.0], "b": [0.0]}, kind=k)
        instance(s, "a")
        instance(s, "b")
        s.finish(1.0)
        for name in ("a", "b"):
            assert s.models[(name, "1")].stats.batches[1].compute_infer.ns == pytest.approx(16e6, rel=1e-6)

    def test_small_batches_overlap_at_full_speed(self):
        # share 0.5 each: 0.5 + 0.5 <= 1, both at full speed: 10 ms each
        s = serving({"a": [0.0], "b": [0.0]})
        instance(s, "a")
        instance(s, "b")
        s.finish(1.0)
        assert s.models[("a", "1")].stats.batches[1].compute_infer.ns == pytest.approx(10e6, rel=1e-6)

    def test_a_small_mig_slice_runs_a_big_model_slower(self):
        # capacity 1/7 for a share-0.5 batch: speed (1/7) / 0.5 = 0.2857, 10 ms of work takes 35 ms
        s = serving({"m": [0.0]}, capacity=1 / 7)
        instance(s, "m")
        s.finish(1.0)
        assert s.models[("m", "1")].stats.batches[1].compute_infer.ns == pytest.approx(35e6, rel=1e-6)

    def test_speeds_change_when_a_batch_joins(self):
        # share 0.8, capacity 1. a starts alone at 0 (speed 1): 10 ms of work. b joins at 5 ms: both at 0.625.
        # a has 5 ms of work left: 5 / 0.625 = 8 ms, done at 13 ms (13 ms in all). b: 0.625 speed for 8 ms = 5 ms
        # of work done, 5 left alone at speed 1: done at 18 ms (13 ms in all).
        k = Kind("big", ((1, 0.010),), share=0.8)
        s = serving({"a": [0.0], "b": [0.005]}, kind=k)
        instance(s, "a")
        instance(s, "b")
        s.finish(1.0)
        assert s.models[("a", "1")].stats.batches[1].compute_infer.ns == pytest.approx(13e6, rel=1e-6)
        assert s.models[("b", "1")].stats.batches[1].compute_infer.ns == pytest.approx(13e6, rel=1e-6)

    def test_requests_older_than_the_timeout_fail(self):
        # No instance until t=40: the requests of t=0 and t=5 have waited over 30 s, the one of t=20 has not.
        s = serving({"m": [0.0, 5.0, 20.0]})
        s.at(40.0, lambda: instance(s, "m"))
        s.finish(60.0)
        m = s.models[("m", "1")]
        assert (m.failed, m.served, m.stats.fail.count) == (2, 1, 2)

    def test_a_model_with_no_instance_asks_for_one_at_each_arrival(self):
        s = serving({"m": [1.0, 2.0]})
        asked = []
        s.on_no_instance = lambda m: asked.append(s.now_s)
        s.finish(5.0)
        assert asked == [1.0, 2.0]
        assert s.models[("m", "1")].failed == 2  # never served: failed at the end

    def test_a_removed_instance_finishes_its_batch_and_holds_memory_until_then(self):
        # One request at 0 (10 ms alone). Removed at 5 ms: it finishes at 10 ms, then its 1 GiB is free.
        s = serving({"m": [0.0]})
        inst = instance(s, "m")
        s.at(0.005, lambda: s.remove_instance(inst))
        s.finish(1.0)
        assert s.models[("m", "1")].served == 1 and not s.models[("m", "1")].instances
        assert s.memory_byte_seconds == pytest.approx(GIB * 0.010)

    def test_cpu_memory_is_not_gpu_memory(self):
        s = serving({"m": []})
        instance(s, "m", device="cpu")
        s.finish(10.0)
        assert s.memory_byte_seconds == 0

    def test_poisson_arrivals_follow_the_rate(self):
        t = des.poisson_arrivals([100.0, 0.0, 300.0], 10.0, np.random.default_rng(0))
        assert np.all(np.diff(t) >= 0)
        counts = np.histogram(t, bins=[0, 10, 20, 30])[0]
        # 1000, 0 and 3000 expected; Poisson noise is ~sqrt(n)
        assert abs(counts[0] - 1000) < 150 and counts[1] == 0 and abs(counts[2] - 3000) < 250


class TestTrace:
    def test_live_counts(self):
        # created -inf (before the trace), 10, 10; deleted 25, +inf, 15
        spans = [(-math.inf, 25.0), (10.0, math.inf), (10.0, 15.0)]
        # t = 0, 10, 20, 30: 1; 3 (created at 10 counts at 10); 2 (deleted at 15); 1 (deleted at 25)
        assert alibaba.live_counts(spans, 0.0, 10.0, 4) == (1, 3, 2, 1)

    def test_dynamic_services_are_chosen_by_how_much_they_move(self):
        flat = alibaba.ServiceCurve("flat", (10,) * 8)
        steady_step = alibaba.ServiceCurve("step", (2, 2, 2, 2, 10, 10, 10, 10))  # moves 8 / 10
        jumpy = alibaba.ServiceCurve("jumpy", (0, 8, 0, 8, 0, 8, 0, 8))  # moves 56 / 8 = 7
        small = alibaba.ServiceCurve("small", (0, 2, 0, 2, 0, 2, 0, 2))  # peak 2 < 4: left out
        chosen = alibaba.select_dynamic([flat, steady_step, jumpy, small], 3)
        assert [c.app for c in chosen] == ["jumpy", "step"]


class TestControlPlane:
    def test_gpud_follows_a_load_step_in_the_models_time(self, tmp_path):
        """One model on the 8-GPU node: 30 req/s, then 250 (one instance takes 4 / 20 ms = 200 at full batches),
        then 30 again. gpud's own hints, controller and placement service scale it up within the step and back
        down after it, with no flapping."""
        from replay.policies import run_controlled, settings_for
        from replay.scenario import Scenario

        kind = Kind("k", ((1, 0.010), (2, 0.012), (4, 0.020)), share=0.3)
        rates = np.concatenate([np.full(100, 30.0), np.full(150, 250.0), np.full(250, 30.0)])
        spec = ModelSpec("m", "k", 4 * GIB, 3.0, compute_fraction=0.24, min_instances=1)
        scenario = Scenario({"m": spec}, {"k": kind}, {"m": "synthetic"}, {"m": 250.0}, {"m": rates}, 500.0, 20.0,
                            0.2, 0.8, 30.0, 3600.0)
        settings = settings_for(scenario, incremental=True, scale_down_s=60.0, idle_unload_s=600.0)
        result = run_controlled("gpud", scenario, settings, workdir=tmp_path)
        instances = dict(zip(result.series["t"], result.series["instances"]))
        assert max(n for t, n in instances.items() if 100 < t < 250) >= 2  # 250 / (200 x 0.8) = 1.6 -> 2
        assert instances[max(instances)] == 1  # back to one after the step
        assert result.flaps == 0 and result.steps["add"] >= 1 and result.steps["remove"] >= 1
        assert result.slo_attainment > 0.9

    def test_config_and_sizing(self):
        spec = ModelSpec("m", "k", GIB, 1.0, compute_fraction=0.24, min_instances=0, max_instances=3, threads=1)
        text = config_pbtxt(spec)
        assert "kind: KIND_GPU" in text and '"gpud_compute_fraction" value: { string_value: "0.24" }' in text
        assert '"gpud_max_instances" value: { string_value: "3" }' in text and "intra_op_thread_count" in text
        # 250 / (200 x 0.8) = 1.5625 -> 2; no load still needs one
        assert instances_needed(250.0, 200.0, 0.8) == 2 and instances_needed(0.0, 200.0, 0.8) == 1



NODE = """
gpus:
  - model: NVIDIA A100-SXM4-80GB
  - model: NVIDIA A100-SXM4-80GB
"""


def control_plane(tmp_path, arrivals: dict[str, list[float]], load_s: dict[str, float]):
    """gpud's control plane on two whole GPUs, one 4 GiB model per name with the given load time and requests, every
    version served with no instance yet (scaled to zero: placed by `place`, or loaded on demand)."""
    from gpud.scaling.hints import HintPolicy
    from gpud.scaling.rules import ScalingPolicy
    from gpud.telemetry.serving import ModelState
    from gpud.telemetry.simulated import SimulatedBackend
    from replay.control import ControlPlane, ControlSettings

    (tmp_path / "node.yaml").write_text(NODE)
    backend = SimulatedBackend.from_file(tmp_path / "node.yaml")
    devices = [SimDevice(d.id, d.compute_fraction, d.kind != "cpu") for d in backend.leaf_devices()]
    models = [SimModel(name, "1", KIND, 4, np.asarray(arrivals.get(name, []), dtype=float)) for name in load_s]
    s = Serving(devices, models, slo_queue_s=0.005)
    specs = {name: ModelSpec(name, "k", 4 * GIB, seconds) for name, seconds in load_s.items()}
    settings = ControlSettings(HintPolicy(), ScalingPolicy(interval_seconds=5.0), 2.5, 15.0)
    plane = ControlPlane(s, backend, specs, settings, tmp_path / "repo")
    for vs in plane.versions:
        vs.state = ModelState.READY
    return plane


def place(plane, *where: tuple[str, str]) -> None:
    """Load one instance of each (model, device), in this order, from now (`gpudctl place --apply`'s path)."""
    from gpud.core_api import RequestedPlacement

    async def apply() -> None:
        await plane.service.apply_requested([RequestedPlacement(m, 0, d) for m, d in where])

    plane._run(apply)


def serving_since(plane, model: str) -> float:
    """When the model's instance started serving, in model time."""
    return plane.registry.version(model).loaded_unix_s - plane.serving.epoch_unix_s


class TestLoadsInModelTime:
    """Loads wait for model time to pass; the adds of one wave on different devices overlap, as the daemon's do."""

    def test_adds_on_different_devices_load_at_once_each_holding_its_devices_share(self, tmp_path):
        plane = control_plane(tmp_path, {}, {"a": 10.0, "b": 10.0})
        plane.pool.load_compute = 0.25
        taken = []
        gpus = [plane.serving.devices[d] for d in ("gpu0", "gpu1")]
        plane.serving.at(5.0, lambda: taken.append([d.taken for d in gpus]))
        place(plane, ("a", "gpu0"), ("b", "gpu1"))
        assert (serving_since(plane, "a"), serving_since(plane, "b"), plane.serving.now_s) == (10.0, 10.0, 10.0)
        assert taken == [[0.25, 0.25]]  # both loads run at 5 s, each holding its own device's share
        assert [d.taken for d in gpus] == [0.0, 0.0]
        assert plane.pool.loads == 2

    def test_a_devices_loads_stay_one_after_another(self, tmp_path):
        # a and c on gpu0, b on gpu1: gpu0's two loads take 10 s each, one after the other; b's overlaps them.
        plane = control_plane(tmp_path, {}, {"a": 10.0, "b": 10.0, "c": 10.0})
        place(plane, ("a", "gpu0"), ("c", "gpu0"), ("b", "gpu1"))
        assert sorted([serving_since(plane, "a"), serving_since(plane, "c")]) == [10.0, 20.0]
        assert serving_since(plane, "b") in (10.0, 20.0) and plane.serving.now_s == 20.0  # not 30 s

    def test_a_cold_start_and_a_tick_falling_due_during_loads_run_once_they_are_done(self, tmp_path):
        # a and b load from 0 to 10 s. A request for d at 2 s asks for a cold start, and a controller tick falls due
        # at 3 s: both run at 10 s, when the loads (and the placement holding the service's lock) are done; d then
        # loads for 4 s and answers the request at 14 s.
        plane = control_plane(tmp_path, {"d": [2.0]}, {"a": 10.0, "b": 10.0, "d": 4.0})
        ticks = []

        async def tick() -> None:
            ticks.append(plane.serving.now_s)

        plane.controller.tick = tick
        plane._schedule_tick(3.0)
        place(plane, ("a", "gpu0"), ("b", "gpu1"))
        plane.serving.finish(20.0)
        assert ticks[0] == 10.0 and ticks[1] == 15.0  # the next interval starts when the tick is done
        assert serving_since(plane, "d") == 14.0 and plane.cold_starts() == 1
        d = plane.serving.models[("d", "1")]
        assert (d.served, d.failed) == (1, 0)

    def test_a_sample_that_finds_a_missed_objective_ticks_the_controller_at_once(self, tmp_path):
        # hints every 2.5 s, the controller every 5 s: the sample at 2.5 s wakes it (as the daemon's sampler does), so
        # it ticks at 2.5 s, and the next interval runs from there (7.5 s), not 5 s and 10 s
        plane = control_plane(tmp_path, {}, {"a": 1.0})
        ticks = []

        async def tick() -> None:
            ticks.append(plane.serving.now_s)

        plane.controller.tick = tick
        plane.controller.wake_if_urgent = lambda: [("a", "1")] if plane.serving.now_s == 2.5 else []
        plane.start()
        plane.serving.finish(11.0)
        assert ticks == [2.5, 7.5]


def test_verdicts_are_ratios_within_the_run():
    from replay.policies import Result
    from replay.run import verdicts

    def r(policy, slo, mem, loads, flaps=0):
        return Result(policy, slo, 1000, 0, 1.0, mem, loads, loads, flaps=flaps)

    out = verdicts({"peak": r("peak", 1.0, 100.0, 0), "scratch": r("scratch", 0.9, 80.0, 100),
                    "gpud": r("gpud", 0.995, 55.0, 10)})
    # SLO 99.5% >= 99%; 55 / 100 = 0.55x <= 0.6x; (10 + 10) / (100 + 100) = 0.10x <= 0.2x; 0 flaps
    assert [(t.split()[0], met) for t, _, met in out] == [("SLO", True), ("memory-hours", True), ("moves", True),
                                                          ("no", True)]
    out = verdicts({"peak": r("peak", 1.0, 100.0, 0), "gpud": r("gpud", 0.98, 70.0, 10, flaps=1)})
    assert [met for _, _, met in out] == [False, False, False]  # 98% < 99%, 0.70x > 0.6x, 1 flap


def test_the_validation_reads_both_sides_the_same_way():
    from gpud.executor.stats import ModelStats
    from replay.validate import figures_from_record, queue_share_from_metrics

    st = ModelStats()
    # 4 requests queued 0, 50, 100 and 200 ms in one batch of 4 rows (20 ms): 3 of 4 within the 100 ms SLO
    st.record_batch(4, [0, 50_000_000, 100_000_000, 200_000_000], [0] * 4, 0, 20_000_000, 0, 0)
    f = figures_from_record(st, [(0.0, 1), (10.0, 2), (20.0, 2)])  # 1 instance for 10 s, 2 for 10 s: 30
    assert (f.requests, f.within_slo, f.rows_per_batch, f.instance_seconds) == (4, 0.75, 4.0, 30.0)
    assert f.mean_queue_ms == pytest.approx(87.5)  # (0 + 50 + 100 + 200) / 4
    text = """# TYPE gpud_model_queue_duration_seconds histogram
gpud_model_queue_duration_seconds_bucket{model="a",version="1",le="0.05"} 2.0
gpud_model_queue_duration_seconds_bucket{model="a",version="1",le="0.1"} 3.0
gpud_model_queue_duration_seconds_bucket{model="a",version="1",le="+Inf"} 4.0
gpud_model_queue_duration_seconds_count{model="a",version="1"} 4.0
gpud_model_queue_duration_seconds_sum{model="a",version="1"} 0.35
"""
    assert queue_share_from_metrics(text, "a") == 0.75


def test_each_request_is_counted_within_its_models_own_objective():
    # the same 5 requests: a batch of 4 answered at 20 ms, the 5th at 30 ms (queued 20 ms, ran 10 ms)
    s = serving({"m": [0.0] * 5})
    s.models[("m", "1")].objective_s = 0.025
    instance(s, "m")
    s.finish(1.0)
    m = s.models[("m", "1")]
    assert m.within_objective == 4 and m.objective_attainment == pytest.approx(0.8)


def test_the_objectives_policy_puts_the_objective_in_the_models_config():
    spec = ModelSpec("m", "ranker", GIB, 1.0, objective_ms=50.0)
    assert 'key: "gpud_latency_objective_ms" value: { string_value: "50.0" }' in config_pbtxt(spec)
    assert "gpud_latency_objective_ms" not in config_pbtxt(ModelSpec("m", "ranker", GIB, 1.0))


class TestObjectiveValidation:
    """replay.validate --objectives: each model's attainment from the real gpud's metrics against the model's
    record, in points; the arithmetic only (the real run takes minutes)."""

    METRICS = """# TYPE gpud_model_requests_within_objective_total counter
gpud_model_requests_within_objective_total{model="fast",version="1"} 970.0
gpud_model_requests_within_objective_total{model="slow",version="1"} 100.0
# TYPE gpud_model_requests_over_objective_total counter
gpud_model_requests_over_objective_total{model="fast",version="1"} 30.0
gpud_model_requests_over_objective_total{model="slow",version="1"} 0.0
"""

    def test_the_real_side_reads_gpuds_objective_counters(self):
        from replay.validate import Attainment, attainment_from_metrics

        assert attainment_from_metrics(self.METRICS, "fast") == Attainment(970, 30)  # 970 / 1000 = 97%
        assert attainment_from_metrics(self.METRICS, "slow").share == 1.0
        assert math.isnan(attainment_from_metrics(self.METRICS, "absent").share)  # no requests: no attainment

    def test_the_model_side_reads_the_same_counters_of_its_record(self):
        from gpud.executor.stats import ModelStats
        from replay.validate import Attainment, attainment_from_record

        st = ModelStats(objective_ns=50_000_000, objective_share=0.99)
        # 3 requests of one batch answered at 20, 50 and 60 ms (`le` inclusive: 50 ms is within), and one failure
        st.record_batch(3, [0, 30_000_000, 40_000_000], [20_000_000, 50_000_000, 60_000_000], 0, 20_000_000, 0, 0)
        st.record_failure(1_000_000)
        assert attainment_from_record(st) == Attainment(2, 2)

    @pytest.mark.parametrize("measured, predicted, gap, within", [
        ((970, 30), (985, 15), 1.5, True),  # 98.5% - 97.0% = +1.5 points
        ((970, 30), (950, 50), -2.0, True),  # 95.0% - 97.0% = -2.0: the bound is inclusive
        ((900, 100), (990, 10), 9.0, False),  # 99.0% - 90.0% = +9.0: optimistic by 9 points
    ])
    def test_the_gap_is_prediction_minus_measurement_in_points(self, measured, predicted, gap, within):
        from replay.validate import Attainment, gap_points, within_tolerance

        g = gap_points(Attainment(*measured), Attainment(*predicted))
        assert g == pytest.approx(gap) and within_tolerance(g) is within

    def test_the_cores_left_to_batches_are_the_machines_busy_cpu_less_the_workers(self):
        from replay.validate import other_cores

        # (s, machine busy CPU s, workers' CPU s): in 0..1 s the machine ran 1.5 CPU s, the workers 1.0 -> 0.5
        # cores elsewhere; in 1..3 s 2.0 and 1.6 -> 0.4 / 2 s = 0.2 cores
        assert other_cores([(0.0, 10.0, 4.0), (1.0, 11.5, 5.0), (3.0, 13.5, 6.6)]) == \
            [(0.0, pytest.approx(0.5)), (1.0, pytest.approx(0.2))]

    def test_a_kind_from_the_real_runs_batch_stats(self):
        from replay.validate import kind_from_batch_stats

        def size(rows, count, infer_ns):
            return {"batch_size": rows, "compute_input": {"count": count, "ns": count * 1_000_000},
                    "compute_infer": {"count": count, "ns": infer_ns}, "compute_output": {"count": count, "ns": 0}}

        # rows 1: 10 x (1 + 20) ms = 21 ms a batch; rows 2: too few batches (3 < 5) to count; rows 4: 1 + 30 ms
        kind = kind_from_batch_stats("k", [size(4, 5, 150_000_000), size(1, 10, 200_000_000), size(2, 3, 1)])
        assert kind.batch_seconds == (pytest.approx((1, 0.021)), pytest.approx((4, 0.031)))
        assert kind_from_batch_stats("k", [size(1, 2, 1)]) is None

    def test_cores_taken_by_others_slow_the_batches_down(self):
        s = serving({"m": [0.0]}, kind=Kind("k", ((1, 0.010),), share=1.0))
        s.set_capacity("cpu", 0.5)  # half a core left: a 10 ms batch at half speed takes 20 ms
        instance(s, "m", device="cpu")
        s.finish(1.0)
        assert s.models[("m", "1")].stats.compute_infer.ns == 20_000_000

    def test_a_load_takes_a_core_of_the_cpu_while_it_runs(self):
        s = serving({"m": [0.0, 0.0]}, max_batch=1, kind=Kind("k", ((1, 0.010),), share=1.0))
        s.take("cpu", 1.0)  # a load holds 1 of the 2 cores: the two 10 ms batches share the other one
        instance(s, "m", device="cpu")
        instance(s, "m", device="cpu")
        s.run_until(0.010)
        s.take("cpu", -1.0)  # the load is done at 10 ms, each batch half done: 5 ms of work left at full speed
        s.finish(1.0)
        assert s.models[("m", "1")].stats.compute_infer.ns == 2 * 15_000_000  # both finish at 10 + 5 = 15 ms
