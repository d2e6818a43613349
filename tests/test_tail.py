"""The latency quantile a batching model's requests are predicted to finish within (gpud.scaling.tail): its parts on
hand-computed numbers, and the whole against the replay's discrete-event model of serving (bench/replay/des.py,
seeded Poisson arrivals: deterministic)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from gpud.scaling.tail import BatchLine, backlog_decay, erlang_c, instances_for_objective, predicted_latency_s

LINE = BatchLine(0.004, 0.001)  # 4 ms + 1 ms a row: t(1) = 5 ms, t(4) = 8 ms


class TestErlangC:
    @pytest.mark.parametrize("servers, offered, expected", [
        (1, 0.5, 0.5),  # one server: an arrival waits with the utilization's probability
        (2, 1.0, 1 / 3),  # A^2/2! x 2/(2-1) = 1 against 1 + A = 2: 1 / (2 + 1)
        (3, 0.0, 0.0),
        (2, 2.0, 1.0),  # at or past the servers: every arrival waits
    ])
    def test_values(self, servers, offered, expected):
        assert erlang_c(servers, offered) == pytest.approx(expected)


class TestBacklogDecay:
    def test_the_root_solves_its_equation(self):
        d = backlog_decay(4.0, 3.2)  # 4 rows a round, 3.2 arriving in one: 4 ln z = 3.2 (z - 1)
        z = math.exp(d)
        assert z > 1 and 4 * math.log(z) == pytest.approx(3.2 * (z - 1), rel=1e-9)

    def test_a_heavier_load_makes_longer_backlogs_likelier(self):
        assert backlog_decay(4.0, 1.0) > backlog_decay(4.0, 2.0) > backlog_decay(4.0, 3.6) > 0

    def test_no_root_past_capacity(self):
        with pytest.raises(ValueError):
            backlog_decay(4.0, 4.0)


class TestPrediction:
    def test_a_lone_request_takes_one_batch_of_one(self):
        assert predicted_latency_s(0.0, 1, LINE, 4) == pytest.approx(0.005)
        # 2 req/s: one instance busy 2 x 5 ms = 1% of the time (no wait at the 99th percentile); full batches of 4
        # would be 2 x 8 ms / 4 = 0.4% busy: no backlog either
        assert predicted_latency_s(2.0, 1, LINE, 4) == pytest.approx(0.005)

    def test_a_busy_instance_adds_what_is_left_of_its_batch(self):
        # 4 req/s: busy 4 x 5 ms = 2%; of the 2% that wait, the 1% past the quantile wait more than half a batch:
        # 5 ms x (1 - 0.01 / 0.02) = 2.5 ms; backlog: 4 x 8 ms / 4 = 0.8% < 1%, none
        assert predicted_latency_s(4.0, 1, LINE, 4) == pytest.approx(0.0075)

    def test_the_tail_grows_long_before_capacity(self):
        # full batches: 4 rows / 8 ms = 500 req/s. At 80% the quantile is far above two batch times (16 ms)
        light, heavy = predicted_latency_s(100, 1, LINE, 4), predicted_latency_s(400, 1, LINE, 4)
        assert light < 0.016 < 2 * 0.016 < heavy < math.inf
        assert predicted_latency_s(400, 2, LINE, 4) < heavy
        assert predicted_latency_s(500, 1, LINE, 4) == math.inf
        assert predicted_latency_s(0, 0, LINE, 4) == 0.0 and predicted_latency_s(1, 0, LINE, 4) == math.inf

    def test_a_larger_share_asks_for_a_longer_bound(self):
        assert predicted_latency_s(300, 1, LINE, 4, share=0.9) < predicted_latency_s(300, 1, LINE, 4, share=0.999)

    def test_the_fewest_instances_meeting_an_objective(self):
        need = instances_for_objective(400, LINE, 4, 0.020, 8)
        assert need is not None and predicted_latency_s(400, need, LINE, 4) <= 0.020
        assert predicted_latency_s(400, need - 1, LINE, 4) > 0.020
        assert instances_for_objective(400, LINE, 4, 0.004, 8) is None  # below a lone request: no count meets it


sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))


@pytest.mark.parametrize("kind, instances, load", [
    ("ranker", 1, 0.3), ("ranker", 1, 0.8), ("ranker", 2, 0.7), ("ranker", 3, 0.5),
    ("encoder", 1, 0.5), ("encoder", 2, 0.9), ("vision", 2, 0.8), ("vision", 3, 0.1),
])
def test_the_prediction_follows_the_serving_models_99th_percentile(kind, instances, load):
    """Poisson arrivals at `load` x the instances' full-batch capacity, each instance on a GPU of its own: the
    prediction from the batch line fitted to the kind's measured times is within 0.85-1.35x what the model serves
    (the whole grid: `python -m replay.tail_check`, docs/benchmarks.md)."""
    from replay.kinds import load_kinds
    from replay.tail_check import MAX_BATCH, line_of, served_quantile_s

    k = load_kinds()[kind]
    rate = load * instances * MAX_BATCH / k.seconds(MAX_BATCH)
    predicted_s = predicted_latency_s(rate, instances, line_of(k), MAX_BATCH)
    assert 0.85 <= predicted_s / served_quantile_s(k, rate, instances) <= 1.35
