"""A load that ramps beyond the counts' noise adds instances at once for a version with a latency objective (issue 26):
gpud.scaling.hints.rising_rate_lower_bound (pure), the observation it feeds, the hint that skips the scale-up window
for it, and the sampler and controller acting on it."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from gpud.scaling.bounds import InstanceBounds
from gpud.scaling.hints import (BatchLine, HintPolicy, HintState, ModelCounters, ModelObservation, desired_instances,
                                observe, rising_instances, rising_rate_lower_bound)
from tests import test_latency_objective  # its controller-on-the-tail set-up (imported by module: not collected twice)

ANY = InstanceBounds(0, None)


def at(t: float, arrived: int, *, objective_s: float | None = 0.15, load_s: float = 7.0) -> ModelCounters:
    return ModelCounters(time_s=t, requests=arrived, successes=arrived, queue_ns=0, batch_compute_ns=0,
                         ready_instances=1, max_batch_size=8, objective_seconds=objective_s, load_s=load_s)


def spans(early: int, late: int, step_s: float = 2.5) -> tuple[tuple[ModelCounters, ModelCounters],
                                                                 tuple[ModelCounters, ModelCounters]]:
    """`early` arrivals in [0, step], nothing counted in the span between, `late` in [2 step, 3 step]."""
    return (at(0.0, 0), at(step_s, early)), (at(2 * step_s, early + 50), at(3 * step_s, early + 50 + late))


class TestTheBound:
    def test_a_ramp_is_extrapolated_to_the_horizon_less_two_standard_deviations(self):
        # The replay's encoder 7 s into its ramp: 11 arrivals in one 2.5 s span, 102 two spans later. Rates 4.4 and
        # 40.8 req/s, 5 s apart; 9.5 s ahead (a 7 s load and a 2.5 s interval) plus half the late span: k = 2.15.
        early, late = spans(11, 102)
        k = (9.5 + 1.25) / 5.0
        forecast = 40.8 + (40.8 - 4.4) * k
        sd = math.sqrt((1 + k) ** 2 * 102 / 2.5 ** 2 + k ** 2 * 11 / 2.5 ** 2)
        assert forecast == pytest.approx(119.06) and sd == pytest.approx(13.04, abs=0.01)
        assert rising_rate_lower_bound(early, late, 9.5) == pytest.approx(forecast - 2 * sd)

    def test_a_steady_load_or_a_rise_within_the_noise_is_no_rise(self):
        assert rising_rate_lower_bound(*spans(125, 125), 9.5) is None
        assert rising_rate_lower_bound(*spans(125, 150), 9.5) is None  # +20% in 2.5 s at 50 req/s: noise
        # the same chance difference is not multiplied into a rise by a long horizon (a model that loads in 2 min):
        # 125 -> 165 is 2.3 standard deviations of the difference, under the 3 a rise must clear
        assert rising_rate_lower_bound(*spans(125, 165), 120.0) is None
        assert rising_rate_lower_bound(*spans(125, 185), 120.0) is not None  # 3.4: a rise
        assert rising_rate_lower_bound(*spans(125, 60), 9.5) is None  # a fall
        assert rising_rate_lower_bound(*spans(0, 0), 9.5) is None  # nothing at all
        # The same relative rise with twenty times the requests is beyond the noise.
        assert rising_rate_lower_bound(*spans(2500, 3000), 9.5) is not None

    def test_an_empty_early_span_is_not_certainty(self):
        # after a lull, 20 requests in one span: the early span's variance is taken as one request's, not none
        early, late = spans(0, 20, step_s=5.0)
        k = (7.0 + 2.5) / 10.0
        sd = math.sqrt((1 + k) ** 2 * 20 / 25 + k ** 2 * 1 / 25)
        assert rising_rate_lower_bound(early, late, 7.0) == pytest.approx(4 + 4 * k - 2 * sd)

    def test_spans_out_of_order_or_empty_give_nothing(self):
        (a, b), (c, d) = spans(11, 102)
        assert rising_rate_lower_bound((c, d), (a, b), 9.5) is None  # the late span before the early one
        assert rising_rate_lower_bound((a, a), (c, d), 9.5) is None  # an empty span


def test_the_observation_carries_the_rise_for_a_version_with_an_objective_only():
    def counters(objective_s):
        return [at(t, n, objective_s=objective_s) for t, n in ((0.0, 0), (2.5, 11), (5.0, 58), (7.5, 160))]
    a, b, c, d = counters(0.15)
    o = observe(a, d, None, previous=c, early=(a, b))
    # the horizon is the instance's load and one interval (7 + 2.5 s); the spans are 11 and 102 arrivals
    assert o.rising_rate_per_second == pytest.approx(rising_rate_lower_bound((a, b), (c, d), 9.5))
    # planned for the larger of it and the window's rise over the load (here, a short window, that one: 95.3)
    assert o.planned_arrival_rate_per_second() == pytest.approx(max(40.8 + (40.8 - 160 / 7.5) / 2.5 * 7.0, 92.98),
                                                                abs=0.01)
    assert replace(o, arrival_rate_per_second=0.0, arrival_rise_per_second2=0.0).planned_arrival_rate_per_second() \
        == pytest.approx(o.rising_rate_per_second)
    assert observe(a, d, None, previous=c).rising_rate_per_second is None  # no earlier span: no rise seen
    a, b, c, d = counters(None)
    assert observe(a, d, None, previous=c, early=(a, b)).rising_rate_per_second is None


ENCODER = BatchLine(0.0335, 0.0055)  # the replay's encoder: 39 ms for one row, 77.5 ms for eight


def ramp(rising: float | None, current: int = 1) -> ModelObservation:
    return ModelObservation(ready_instances=current, arrival_rate_per_second=10.0,
                            throughput_per_instance_per_second=None, queue_seconds=None, objective_seconds=0.15,
                            objective_share=0.99, attainment=1.0, batch_line=ENCODER, max_batch_size=8,
                            recent_arrival_rate_per_second=40.0, rising_rate_per_second=rising)


def test_a_rise_beyond_the_noise_is_hinted_at_once_where_the_scale_up_window_holds_the_rest():
    policy = HintPolicy(scale_up_stabilization_seconds=30)
    state = HintState(((940.0, 1), (960.0, 1)), since_s=900.0)
    # planned for the rise's lower bound, 110 req/s: two instances, hinted now
    decision, _ = desired_instances(policy, state, ramp(110.0), 970.0, ANY)
    assert decision.recommended_instances == decision.desired_instances == 2
    assert "rising beyond noise to 110.0 req/s: added at once" in decision.reason
    # the same need for two without such a rise (the window's and the last interval's rates) waits out the window
    steady = ModelObservation(**{**ramp(None).__dict__, "arrival_rate_per_second": 110.0})
    decision, _ = desired_instances(policy, state, steady, 970.0, ANY)
    assert decision.recommended_instances == 2 and decision.desired_instances == 1
    assert "scale-up stabilized" in decision.reason


def test_the_rise_adds_at_most_double_and_never_past_the_bounds_nor_for_an_unreachable_objective():
    assert rising_instances(ramp(10_000.0), ANY) == 2  # overloaded at any count: doubling
    assert rising_instances(ramp(10_000.0, current=3), ANY) == 6
    assert rising_instances(ramp(10_000.0, current=3), InstanceBounds(0, 4)) == 4
    assert rising_instances(ramp(None), ANY) is None
    unreachable = ModelObservation(**{**ramp(110.0).__dict__, "objective_seconds": 0.020})  # a lone row: 39 ms
    assert rising_instances(unreachable, ANY) is None


def test_the_sampler_and_controller_add_an_instance_on_a_ramp_before_the_scale_up_window_ends():
    """A ranker (50 ms at 99%) on one instance, sampled every 5 s, with a 30 s scale-up window: 20, 40 then 60 req/s.
    One instance meets 50 ms at 60 req/s (49.1 ms); the window's rise planned over the 1.5 s load asks for 66
    req/s, which the 30 s window holds back. The rise beyond the noise, 20 to 60 req/s over two intervals (10 s
    apart), extrapolated over the load, an interval and half the last span (9 s) ahead: 96 req/s, less two standard
    deviations (6.8): 82.4 req/s, which needs a second instance, at once."""
    tail = test_latency_objective.TestControllerOnTheTail
    clock, serving, version, sampler, loop, placer = tail.setup()
    sampler.policy = HintPolicy(scale_up_stabilization_seconds=30, scale_down_stabilization_seconds=20)
    sampler.tick()
    for per_second in (20, 40):
        tail().run(clock, version, sampler, loop, per_second, ticks=1)
    assert placer.totals == []
    tail().run(clock, version, sampler, loop, 60, ticks=1)
    o = sampler._tracks[("ranker", "1")].observation
    assert o is not None and o.rising_rate_per_second == pytest.approx(82.35, abs=0.01)
    assert placer.totals == [{("ranker", "1"): 2}]
    assert "rising beyond noise to 82.4 req/s: added at once" in loop.targets[0].detail
    # the same 60 req/s reached without a ramp (steady at 60): one instance stays
    clock, serving, version, sampler, loop, placer = tail.setup()
    sampler.policy = HintPolicy(scale_up_stabilization_seconds=30, scale_down_stabilization_seconds=20)
    sampler.tick()
    tail().run(clock, version, sampler, loop, 60, ticks=4)
    assert placer.totals == []


@pytest.mark.parametrize("load_s", [2.0, 20.0, 120.0])
def test_a_steady_poisson_load_is_seldom_taken_for_a_rise_whatever_the_load_time(load_s):
    """The daemon's defaults (5 s samples): under steady Poisson arrivals (seeded: deterministic), a rise is seen
    in about one sample in a thousand at most, however long the horizon the rate is extrapolated over (the rise
    itself must be beyond the noise; a long load would otherwise multiply chance differences into rises: 1.7% of
    samples at 120 s before that test)."""
    import numpy as np

    def at_n(t: float, n: int) -> ModelCounters:
        return at(t, n, load_s=load_s)
    rng = np.random.default_rng(7)
    for rate in (2, 20, 200, 2000):
        counts = rng.poisson(rate * 5.0, (5000, 3))
        bounds = [rising_rate_lower_bound((at_n(0, 0), at_n(5, a)), (at_n(10, a + b), at_n(15, a + b + c)),
                                          load_s + 5.0)
                  for a, b, c in counts.tolist()]
        seen = [b for b in bounds if b is not None]
        assert len(seen) <= 0.0025 * len(bounds), (rate, len(seen))
