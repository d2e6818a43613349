"""gpud.executor.batcher's adaptive rules (rule 6 "not in a stream", rule 7a smoothed rows): liveness.

A discrete-event simulation with a fake clock: one instance, requests arriving at chosen gaps, batches taking chosen
times. Whatever the pattern, with the instance free a queued request is dispatched no later than its enqueue time +
max_queue_delay (or when the instance frees, if later), and decide() never answers Idle while requests could go."""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gpud.executor.batcher import BatchQueue, Dispatch, Idle, QueuedRequest, Wait
from gpud.executor.model_config import DynamicBatching
from tests.fakes import FakeClock

DELAY_US = 2_000


def _simulate(arrivals: list[tuple[float, int]], busy_s: list[float], preferred: tuple[int, ...]) -> None:
    clock = FakeClock()
    q = BatchQueue(max_batch_size=16, dynamic_batching=DynamicBatching(max_queue_delay_us=DELAY_US,
                                                                     preferred_batch_sizes=preferred),
                   clock=clock, dispatch_lone_request=True, quiet_dispatch=True)
    times, t = [], 0.0
    for gap_s, _ in arrivals:
        t += gap_s
        times.append(t)
    next_arrival = 0
    free_at = 0.0
    timer: float | None = None
    dispatched: dict[int, float] = {}
    enqueued: dict[int, float] = {}
    busy_iter = iter(busy_s * (len(arrivals) + 1))
    for _ in range(20 * len(arrivals) + 100):
        now = clock.now
        while next_arrival < len(arrivals) and times[next_arrival] <= now:
            q.enqueue(QueuedRequest(payload=next_arrival, batch_rows=arrivals[next_arrival][1], shape_key="k"))
            enqueued[next_arrival] = now
            next_arrival += 1
        free = 1 if now >= free_at else 0
        timer = None
        while True:
            d = q.decide(free)
            if isinstance(d, Dispatch):
                assert free, "dispatched with no instance free"
                for r in d.requests:
                    dispatched[r.payload] = now
                free_at = now + next(busy_iter, 1e-3)
                free = 0
                continue
            break
        if len(q) and free:
            assert isinstance(d, Wait), f"queued requests with a free instance and no timer: {d}"
            assert math.isfinite(d.until_s) and d.until_s > now - 1e-12
            oldest = min(enqueued[i] for i in enqueued if i not in dispatched)
            assert d.until_s <= oldest + DELAY_US / 1e6 + 1e-12
        if isinstance(d, Wait):
            timer = d.until_s
        if isinstance(d, Idle):
            assert not len(q) or not free
        # next event: an arrival, the instance freeing, or the timer
        events = [x for x in (times[next_arrival] if next_arrival < len(arrivals) else None,
                              free_at if free_at > now else None, timer) if x is not None]
        if not events:
            break
        clock.now = max(now, min(events))
    assert len(dispatched) == len(arrivals), "a request was never dispatched"
    for i, t_enq in enqueued.items():
        # With one instance it can be busy; the bound is the later of the delay and the instance being free then.
        assert dispatched[i] >= t_enq


@settings(max_examples=300, deadline=None)
@given(arrivals=st.lists(st.tuples(st.sampled_from([0.0, 10e-6, 40e-6, 60e-6, 150e-6, 500e-6, 3e-3, 0.1]),
                                   st.integers(1, 4)), min_size=1, max_size=40),
       busy_s=st.lists(st.sampled_from([5e-6, 50e-6, 300e-6, 1e-3, 5e-3]), min_size=1, max_size=5),
       preferred=st.sampled_from([(), (4,), (8, 16)]))
def test_adaptive_rules_never_leave_a_request_waiting_without_a_timer(arrivals, busy_s, preferred):
    _simulate(arrivals, busy_s, preferred)


def test_stream_lone_request_waits_at_most_the_quiet_time_then_goes():
    # A flood of 16-row batches, then one request arriving in the stream: not alone at once, but within the quiet
    # time (a finite timer), and rule 7a's smoothed bar does not block it (1 row < 16).
    _simulate([(0.0, 4), (20e-6, 4), (20e-6, 4), (20e-6, 4), (30e-6, 1)], [10e-6], (16,))
