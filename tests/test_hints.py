"""gpud.scaling.hints: the HPA-style instance hint and node headroom, driven by a fake clock (plain numbers)."""
from __future__ import annotations

import pytest

from gpud.scaling.bounds import InstanceBounds
from gpud.scaling.hints import (DeviceFree, HintPolicy, HintState, ModelCounters, ModelFootprint, ModelObservation,
                             batch_capacity_per_second, desired_instances, node_headroom, observe, recommend,
                             total_headroom)

GIB = 2**30
# target queue 10 ms, plan for 80 % of measured throughput, tolerance 0.1, up window 30 s, down window 300 s
POLICY = HintPolicy()
BOUNDS = InstanceBounds(1, 8)  # the version's bounds (gpud.scaling.bounds), 1..8 unless a test says otherwise


def obs(current: int, arrival: float = 0.0, throughput: float | None = 50.0,
        queue_s: float | None = None) -> ModelObservation:
    return ModelObservation(ready_instances=current, arrival_rate_per_second=arrival,
                            throughput_per_instance_per_second=throughput, queue_seconds=queue_s)


def run(observations, state: HintState = HintState(), policy: HintPolicy = POLICY, start_s: float = 0.0,
        step_s: float = 5.0, bounds: InstanceBounds = BOUNDS):
    """Feed observations every `step_s` seconds of the fake clock; returns [(time_s, desired)] and the state."""
    out = []
    for i, o in enumerate(observations):
        now = start_s + i * step_s
        decision, state = desired_instances(policy, state, o, now, bounds)
        out.append((now, decision.desired_instances))
    return out, state


class TestRecommend:
    @pytest.mark.parametrize("o, expected", [
        # 160 / 50 = 3.2 instances busy; 3.2 / 2 = 1.6 utilization; 1.6 / 0.8 = 2.0; ceil(2 * 2.0) = 4
        (obs(2, arrival=160), 4),
        # 84 / 50 = 1.68; 1.68 / 2 = 0.84; 0.84 / 0.8 = 1.05, within 1 +- 0.1: keep 2
        (obs(2, arrival=84), 2),
        # 72 / 50 = 1.44; 1.44 / 2 = 0.72; 0.72 / 0.8 = 0.9, within tolerance (|0.9 - 1| <= 0.1): keep 2
        (obs(2, arrival=72), 2),
        # 40 / 50 = 0.8; 0.8 / 2 = 0.4; 0.4 / 0.8 = 0.5; ceil(2 * 0.5) = 1
        (obs(2, arrival=40), 1),
        # load says 1 (as above), queue 30 ms / 10 ms = 3.0; ceil(2 * 3.0) = 6, at most 2 x 2 = 4; max(1, 4) = 4
        (obs(2, arrival=40, queue_s=0.030), 4),
        # queue 12 ms / 10 ms = 1.2 (over tolerance): ceil(2 * 1.2) = 3 <= 4, not capped; max(1, 3) = 3
        (obs(2, arrival=40, queue_s=0.012), 3),
        # queue 10.5 ms / 10 ms = 1.05: within tolerance, no queue proposal; load 84 req/s keeps 2
        (obs(2, arrival=84, queue_s=0.0105), 2),
        # 1000 / 50 = 20; 20 / 0.8 = 25 instances; bounded to max 8
        (obs(2, arrival=1000), 8),
        # no requests: 0 instances needed for load; bounded to min 1
        (obs(3, arrival=0.0), 1),
        # nothing ready yet: 30 / 50 = 0.6 busy; 0.6 / 0.8 = 0.75; ceil(0.75) = 1
        (obs(0, arrival=30), 1),
        # requests but no throughput measured yet and no queue reading: hold the current 2
        (obs(2, arrival=30, throughput=None), 2),
        # 24 req/s at 10 per instance-second = 2.4 busy; / 3 = 0.8 utilization = target exactly: keep 3
        (obs(3, arrival=24, throughput=10), 3),
    ])
    def test_recommendation(self, o, expected):
        assert recommend(POLICY, o, BOUNDS)[0] == expected

    def test_float_ceil_does_not_round_up_exact_counts(self):
        # 0.3 * 10 is 3.0000000000000004 in floating point: still 3 instances.
        # arrival 12, throughput 5, current 1: 12 / 5 = 2.4 busy; 2.4 / 0.8 = 3.0 -> 3
        assert recommend(POLICY, obs(1, arrival=12, throughput=5), BOUNDS)[0] == 3

    def test_the_versions_own_bounds_and_no_other(self):
        # No maximum (gpud_max_instances unset, no node default): 1000 / 50 = 20; 20 / 0.8 = 25, not capped at 8.
        assert recommend(POLICY, obs(2, arrival=1000), InstanceBounds(1, None))[0] == 25
        # Minimum 0 (scale to zero allowed): no requests need no instance; nothing to bound.
        count, *_, reason = recommend(POLICY, obs(3, arrival=0.0), InstanceBounds(0, None))
        assert count == 0 and "bounded" not in reason
        # Bounded: the reason says by what, as inspect shows it.
        assert recommend(POLICY, obs(2, arrival=1000), InstanceBounds(0, 4))[4].endswith("; bounded to [0, 4]")

    @pytest.mark.parametrize("kwargs, message", [
        (dict(target_queue_seconds=0), "target_queue_seconds"),
        (dict(target_utilization_ratio=1.5), "target_utilization_ratio"),
        (dict(tolerance=-0.1), "tolerance"),
        (dict(scale_down_stabilization_seconds=-1), "stabilization"),
    ])
    def test_bad_policy_raises_at_once(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            HintPolicy(**kwargs)


class TestStabilization:
    def test_scale_up_after_sustained_queueing(self):
        # queue 30 ms with 2 instances: every sample recommends ceil(2 * 30 / 10) = 6, at most 2 x 2 = 4. The first
        # sample is at t=0: until t=30 part of the 30 s up-window has no evidence, the current 2 stands in and
        # min(4, 2) = 2. At t=30 the window [0, 30] holds only 4s: min = 4 > 2, scale up.
        out, _ = run([obs(2, arrival=40, queue_s=0.030)] * 7)
        assert out == [(0, 2), (5, 2), (10, 2), (15, 2), (20, 2), (25, 2), (30, 4)]

    def test_a_short_burst_does_not_scale_up(self):
        # 40 s of steady load recommending 2 (84 req/s, in tolerance), then one 5 s burst of queueing (6), then calm.
        # The up-window always holds a 2 besides the 6: min = 2, never a scale-up.
        calm, burst = obs(2, arrival=84), obs(2, arrival=84, queue_s=0.030)
        out, _ = run([calm] * 9 + [burst] + [calm] * 6)
        assert {d for _, d in out} == {2}

    def test_no_flapping_under_noisy_load(self):
        # The rate swings every 5 s between 40 req/s (recommends 1) and 160 req/s (recommends 4) for 10 minutes.
        # Up-window min = 1 and down-window max = 4 bracket the current 2: the hint never moves.
        noisy = [obs(2, arrival=40 if i % 2 else 160) for i in range(120)]
        out, _ = run(noisy)
        assert {d for _, d in out} == {2}

    def test_noise_inside_tolerance_changes_nothing(self):
        # 76..88 req/s on 2 instances at 50 each: utilization / 0.8 = 0.95 .. 1.1, all within 1 +- 0.1
        rates = [76, 88, 80, 84, 78, 86, 82, 88, 76, 80] * 10
        out, _ = run([obs(2, arrival=r) for r in rates])
        assert {d for _, d in out} == {2}

    def test_scale_down_only_after_the_stabilization_window(self):
        # 5 minutes at 160 req/s on 4 instances: 160 / 50 / 4 = 0.8 = target, recommends 4 (t = -300 .. 0).
        busy, state = run([obs(4, arrival=160)] * 61, start_s=-300.0)
        assert {d for _, d in busy} == {4}
        # Then idle from t=5: recommends 1 (bounded min). The last 4 was at t=0; it leaves the 300 s down-window
        # after t=300 (300 - 0 = 300 is still inside): 4 until t=300, 1 from t=305.
        idle, _ = run([obs(4, arrival=0.0)] * 62, state=state, start_s=5.0)
        assert dict(idle)[300.0] == 4
        assert dict(idle)[305.0] == 1
        assert all(d == 4 for t, d in idle if t <= 300) and all(d == 1 for t, d in idle if t > 300)

    def test_no_scale_down_before_a_full_window_after_start(self):
        # A fresh daemon sees an idle model with 3 instances. Recommends 1, but the 300 s down-window is not
        # covered until t=300: the current 3 stands in for the missing part and max(1, 3) = 3.
        out, _ = run([obs(3, arrival=0.0)] * 62)
        assert all(d == 3 for t, d in out if t < 300) and dict(out)[300.0] == 1

    def test_bounds_respected_through_stabilization(self):
        # Queue 200 ms on 5 instances: ceil(5 * 200 / 10) = 100, at most 2 x 5 = 10, bounded to max 8 -- never more.
        out, _ = run([obs(5, queue_s=0.2, arrival=10)] * 10)
        assert max(d for _, d in out) == 8 and dict(out)[30.0] == 8
        # Above the bound already (10 ready, max 8) and idle: recommends min 1. With a 10 s down-window the current
        # 10 stands in until t=10 (10 - 0 < 10 is false there): 10, 10, then max(1, 1, 1) = 1.
        policy = HintPolicy(scale_down_stabilization_seconds=10)
        out, _ = run([obs(10, arrival=0.0)] * 4, policy=policy)
        assert out == [(0, 10), (5, 10), (10, 1), (15, 1)]
        # min 2: idle never hints fewer than 2 (0 needed, bounded up to 2).
        policy = HintPolicy(scale_down_stabilization_seconds=0)
        out, _ = run([obs(3, arrival=0.0)] * 3, policy=policy, bounds=InstanceBounds(2, 8))
        assert [d for _, d in out] == [2, 2, 2]

    def test_state_is_pruned_to_the_longest_window(self):
        # 100 samples 5 s apart (495 s); only those within 300 s of the newest are kept: t = 195 .. 495 = 61 entries
        _, state = run([obs(2, arrival=84)] * 100)
        assert len(state.recommendations) == 61 and state.recommendations[0][0] == 195.0

    def test_pure(self):
        o, state = obs(2, arrival=160), HintState(((0.0, 4),), 0.0)
        assert desired_instances(POLICY, state, o, 40.0, BOUNDS) == desired_instances(POLICY, state, o, 40.0, BOUNDS)


class TestObserve:
    def test_rates_from_counter_deltas(self):
        a = ModelCounters(time_s=100.0, requests=1000, successes=990, queue_ns=5_000_000_000,
                          batch_compute_ns=20_000_000_000, ready_instances=2)
        b = ModelCounters(time_s=110.0, requests=1500, successes=1480, queue_ns=5_000_000_000 + 490 * 4_000_000,
                          batch_compute_ns=20_000_000_000 + 7_000_000_000, ready_instances=2)
        o = observe(a, b)
        assert o.arrival_rate_per_second == pytest.approx(50.0)  # (1500 - 1000) / 10 s
        assert o.throughput_per_instance_per_second == pytest.approx(70.0)  # 490 done / 7 s busy
        assert o.queue_seconds == pytest.approx(0.004)  # 490 * 4 ms / 490
        assert o.ready_instances == 2

    def test_idle_window_keeps_last_throughput(self):
        a = ModelCounters(0.0, 10, 10, 0, 1_000_000_000, 1)
        b = ModelCounters(5.0, 10, 10, 0, 1_000_000_000, 1)
        o = observe(a, b, last_throughput_per_second=12.5)
        assert (o.arrival_rate_per_second, o.throughput_per_instance_per_second, o.queue_seconds) == (0.0, 12.5, None)

    def test_empty_window_refused(self):
        a = ModelCounters(5.0, 0, 0, 0, 0, 1)
        with pytest.raises(ValueError, match="positive"):
            observe(a, a)


class TestBatchCapacity:
    def test_the_line_through_batch_times_gives_full_batches(self):
        # sizes 1 and 2: 10 ms and 12 ms (100 executions each) -> t(b) = 8 ms + 2 ms x b; max batch 3 (within
        # 1.5 x 2): 3 / (8 + 6) ms = 214.3 per second, above the best size shown (2 / 12 ms = 166.7)
        batches = [(1, 100, 100 * 10_000_000), (2, 100, 100 * 12_000_000)]
        assert batch_capacity_per_second(batches, 3) == pytest.approx(3 / 0.014)

    def test_no_further_than_one_and_a_half_times_the_largest_batch_seen(self):
        # the same line, max batch 64: trusted up to 1.5 x 2 = 3 rows, so 214.3 per second, not 64 / 136 ms = 470.6
        batches = [(1, 100, 100 * 10_000_000), (2, 100, 100 * 12_000_000)]
        assert batch_capacity_per_second(batches, 64) == pytest.approx(3 / 0.014)

    def test_one_size_or_a_falling_line_gives_the_best_shown(self):
        assert batch_capacity_per_second([(4, 10, 10 * 20_000_000)], 8) == pytest.approx(200.0)  # 4 / 20 ms
        # 2 rows took longer than 4 (noise): the slope is clamped at 0, t = mean 25 ms, trusted to 1.5 x 4 = 6 rows:
        # 6 / 25 ms = 240 per second
        assert batch_capacity_per_second([(2, 10, 10 * 30_000_000), (4, 10, 10 * 20_000_000)], 8) == \
            pytest.approx(240.0)
        assert batch_capacity_per_second([], 8) is None

    def test_a_model_that_does_not_batch_runs_one_request_at_a_time(self):
        # max_batch_size 0: one row per execution, 1 / 5 ms = 200 per second
        assert batch_capacity_per_second([(1, 50, 50 * 5_000_000)], 0) == pytest.approx(200.0)

    def test_spreading_a_load_over_more_instances_does_not_make_it_look_heavier(self):
        # The trap of busy time: 340 req/s over 8 instances gives batches of 1 (19.6 ms each): 51 per busy second,
        # utilization 340 / (8 x 51) = 0.83, "keep 8". The batch line through sizes 1 and 2 (19.6, 20.0 ms) is
        # t(b) = 19.2 + 0.4 b ms; trusted to 1.5 x 2 = 3 rows: 3 / 20.4 ms = 147.1 per second, so
        # 340 / (147.1 x 0.8) = 2.9 -> 3 instances are asked for.
        a = ModelCounters(0.0, 0, 0, 0, 0, 8, batches=((1, 0, 0), (2, 0, 0)), max_batch_size=8)
        b = ModelCounters(10.0, 3400, 3400, 3400 * 1_000_000, 3000 * 19_600_000 + 200 * 20_000_000, 8,
                          batches=((1, 3000, 3000 * 19_600_000), (2, 200, 200 * 20_000_000)), max_batch_size=8)
        o = observe(a, b)
        assert o.throughput_per_instance_per_second == pytest.approx(3 / 0.0204)
        assert recommend(POLICY, o, BOUNDS)[1] == 3


class TestHeadroom:
    def test_instances_that_fit_per_device(self):
        devices = [DeviceFree("gpu0", "gpu", 10 * GIB), DeviceFree("gpu1/mig1.0", "mig", int(4.5 * GIB)),
                   DeviceFree("gpu1/mig2.0", "mig", -GIB), DeviceFree("cpu", "cpu", 100 * GIB)]
        models = [ModelFootprint("bert", 2 * GIB, ("gpu", "mig")), ModelFootprint("tiny", GIB // 2, ("cpu",))]
        h = node_headroom(devices, models)
        # 10 // 2 = 5; 4.5 // 2 = 2; over-committed (-1 GiB) counts as 0; the CPU is not bert's kind
        assert h["bert"] == {"gpu0": 5, "gpu1/mig1.0": 2, "gpu1/mig2.0": 0}
        assert h["tiny"] == {"cpu": 200}  # 100 GiB // 0.5 GiB
        assert total_headroom(h) == {"bert": 7, "tiny": 200}

    def test_zero_footprint_refused(self):
        with pytest.raises(ValueError, match="footprint"):
            node_headroom([DeviceFree("gpu0", "gpu", GIB)], [ModelFootprint("m", 0, ("gpu",))])
