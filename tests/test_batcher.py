"""Deterministic tests of gpud.executor.batcher: a fake clock, no sleeps, no asyncio.

Times in comments are in seconds unless a name says otherwise; 1 ms = 1_000 us = 0.001 s.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpud.executor import batcher as batcher_module
from gpud.executor.batcher import (
    QUEUE_FULL_MESSAGE,
    REQUEST_TIMEOUT_MESSAGE,
    BatchQueue,
    Dispatch,
    DispatchReason,
    Idle,
    QueuedRequest,
    Wait,
    choose_dispatch,
    effective_timeout_us,
    preferred_prefix_len,
    resolve_level,
    take_candidate,
    timeout_error,
)
from gpud.executor.model_config import DynamicBatching, QueuePolicy
from gpud.executor.types import ErrorKind, InferenceError
from tests.fakes import FakeClock, wait_until


def req(name: str = "r", rows: int = 1, key: object = "k", priority: int = 0, timeout_us: int = 0) -> QueuedRequest:
    return QueuedRequest(payload=name, batch_rows=rows, shape_key=key, priority=priority, timeout_us=timeout_us)


def names(requests) -> list[str]:
    return [r.payload for r in requests]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make(clock, max_batch_size: int = 8, dynamic_batching: DynamicBatching | None = DynamicBatching(), **kw):
    return BatchQueue(max_batch_size=max_batch_size, dynamic_batching=dynamic_batching, clock=clock, **kw)


def enqueue_all(q: BatchQueue, *requests: QueuedRequest) -> list[QueuedRequest]:
    for r in requests:
        q.enqueue(r)
    return list(requests)


# ---------------------------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------------------------


class TestResolveLevel:
    @pytest.mark.parametrize(
        "priority, levels, default, expected",
        [
            (0, 0, 0, 0),  # levels off: everything at level 0
            (3, 0, 0, 0),  # levels off: a priority is ignored
            (0, 3, 2, 2),  # 0 = the default level
            (1, 3, 2, 1),
            (3, 3, 2, 3),
            (4, 3, 2, 2),  # above priority_levels: the default level, as Triton's SetPriority
        ],
    )
    def test_levels(self, priority, levels, default, expected):
        assert resolve_level(priority, levels, default) == expected

    def test_negative_priority_is_invalid(self):
        with pytest.raises(InferenceError) as e:
            resolve_level(-1, 3, 1)
        assert e.value.kind is ErrorKind.INVALID_ARGUMENT


class TestEffectiveTimeout:
    @pytest.mark.parametrize(
        "request_us, default_us, override, expected_us",
        [
            (0, 0, False, 0),  # nothing set: no timeout
            (0, 500, False, 500),  # the level's default
            (100, 500, False, 500),  # override not allowed: the request's own timeout is ignored
            (100, 500, True, 100),  # allowed and shorter: 100 < 500
            (900, 500, True, 500),  # allowed but longer: may not lengthen
            (100, 0, True, 100),  # no default counts as the longest: any request timeout is shorter
            (0, 500, True, 500),  # 0 = "use the default"
        ],
    )
    def test_table(self, request_us, default_us, override, expected_us):
        policy = QueuePolicy(default_timeout_us=default_us, allow_timeout_override=override)
        assert effective_timeout_us(request_us, policy) == expected_us

    def test_negative_timeout_is_invalid(self):
        with pytest.raises(InferenceError) as e:
            effective_timeout_us(-5, QueuePolicy())
        assert e.value.kind is ErrorKind.INVALID_ARGUMENT


class TestTakeCandidate:
    @pytest.mark.parametrize(
        "spec, max_rows, expected_names, expected_blocked",
        [
            ([("a", 1, "k"), ("b", 1, "k")], 8, ["a", "b"], False),  # 1 + 1 = 2 <= 8, queue exhausted
            ([("a", 3, "k"), ("b", 3, "k"), ("c", 3, "k")], 8, ["a", "b"], True),  # 3 + 3 + 3 = 9 > 8
            ([("a", 4, "k"), ("b", 4, "k"), ("c", 1, "k")], 8, ["a", "b"], True),  # 4 + 4 = 8, c cannot fit
            ([("a", 1, "k"), ("b", 1, "x"), ("c", 1, "k")], 8, ["a"], True),  # b's key stops it; c not reached
            ([("a", 9, "k"), ("b", 1, "k")], 8, ["a"], True),  # head alone even above the limit (after shrink)
            ([], 8, [], False),
        ],
    )
    def test_table(self, spec, max_rows, expected_names, expected_blocked):
        batch, blocked = take_candidate([req(n, rows, key) for n, rows, key in spec], max_rows)
        assert names(batch) == expected_names
        assert blocked is expected_blocked


class TestPreferredPrefixLen:
    @pytest.mark.parametrize(
        "rows, preferred, expected",
        [
            ([1, 1, 1, 1, 1], [4], 4),  # cumulative 1,2,3,4,5: 4 at the 4th request
            ([1, 1, 1, 1, 1], [2, 4], 4),  # 2 and 4 both pass; the longest prefix wins
            ([3, 3], [4], 0),  # cumulative 3,6 skips 4
            ([2, 2, 4], [4, 8], 3),  # cumulative 2,4,8
            ([1, 1], [], 0),
        ],
    )
    def test_table(self, rows, preferred, expected):
        assert preferred_prefix_len(rows, preferred) == expected


class TestChooseDispatch:
    @pytest.mark.parametrize(
        "rows, blocked, preferred, delay_us, exceeded, lone, expected",
        [
            ([1, 1, 1, 1, 1], False, [4], 1000, False, False, (4, DispatchReason.PREFERRED)),  # cum 4 in [4]
            ([1, 1, 1, 1, 1], False, [4], 1000, True, False, (5, DispatchReason.FULL)),  # late: all; 5 >= max pref 4
            ([1, 1, 1], False, [4], 1000, True, False, (3, DispatchReason.DELAY)),  # late: all 3 rows
            ([1, 1, 1], False, [], 1000, False, False, None),  # 3 < max_batch_size 8, delay running: wait
            ([1, 1, 1], True, [], 1000, False, False, (3, DispatchReason.FULL)),  # blocked: cannot grow
            ([4, 4], False, [], 1000, False, False, (2, DispatchReason.FULL)),  # 4 + 4 = 8 = max_batch_size
            ([3, 3], False, [4], 1000, False, False, (2, DispatchReason.FULL)),  # 6 >= largest preferred 4
            ([1, 1], False, [], 0, False, False, (2, DispatchReason.DELAY)),  # delay 0: never wait
            ([1, 1, 1], False, [2], 0, False, False, (2, DispatchReason.PREFERRED)),  # delay 0: preferred still cuts
            ([1], False, [], 1000, False, True, (1, DispatchReason.LONE)),  # gpud rule
            ([1], False, [], 1000, False, False, None),
        ],
    )
    def test_table(self, rows, blocked, preferred, delay_us, exceeded, lone, expected):
        assert (
            choose_dispatch(
                rows,
                blocked=blocked,
                max_batch_size=8,
                preferred_batch_sizes=preferred,
                max_queue_delay_us=delay_us,
                delay_exceeded=exceeded,
                lone=lone,
            )
            == expected
        )


# ---------------------------------------------------------------------------------------------------------------
# Construction and enqueue
# ---------------------------------------------------------------------------------------------------------------


class TestValidation:
    @pytest.mark.parametrize(
        "mbs, db",
        [
            (-1, None),
            (8, DynamicBatching(max_queue_delay_us=-1)),
            (8, DynamicBatching(preferred_batch_sizes=(9,))),  # 9 > max_batch_size 8
            (8, DynamicBatching(preferred_batch_sizes=(0,))),
            (8, DynamicBatching(priority_levels=3, default_priority_level=0)),  # default must be in 1..3
            (8, DynamicBatching(priority_levels=3, default_priority_level=4)),
            (8, DynamicBatching(priority_levels=2, default_priority_level=1, priority_queue_policy={3: QueuePolicy()})),
            (8, DynamicBatching(default_queue_policy=QueuePolicy(timeout_action="DROP"))),
            (8, DynamicBatching(default_queue_policy=QueuePolicy(max_queue_size=-1))),
        ],
    )
    def test_bad_config_raises_at_once(self, clock, mbs, db):
        with pytest.raises(ValueError):
            make(clock, mbs, db)


class TestEnqueue:
    def test_sets_time_level_and_deadline(self, clock):
        q = make(clock, dynamic_batching=DynamicBatching(default_queue_policy=QueuePolicy(default_timeout_us=2_000)))
        clock.now = 5.0
        r = req()
        q.enqueue(r)
        assert r.enqueue_time_s == 5.0
        assert r.deadline_s == pytest.approx(5.002)  # 5.0 + 2_000 us
        assert (r.level, r.delayed) == (0, False)
        assert (len(q), q.pending_rows, q.oldest_enqueue_time_s) == (1, 1, 5.0)

    @pytest.mark.parametrize(
        "mbs, rows",
        [
            (8, 0),  # below 1
            (8, 9),  # above max_batch_size 8
            (0, 2),  # a model that does not batch: one "row", the whole request
        ],
    )
    def test_bad_rows_are_invalid(self, clock, mbs, rows):
        q = make(clock, max_batch_size=mbs)
        with pytest.raises(InferenceError) as e:
            q.enqueue(req(rows=rows))
        assert e.value.kind is ErrorKind.INVALID_ARGUMENT
        assert len(q) == 0

    def test_enqueue_twice_is_a_bug(self, clock):
        q = make(clock)
        r = req()
        q.enqueue(r)
        with pytest.raises(ValueError):
            q.enqueue(r)


class TestMaxQueueSize:
    def test_full_level_rejects_and_changes_nothing(self, clock):
        db = DynamicBatching(max_queue_delay_us=10_000, default_queue_policy=QueuePolicy(max_queue_size=2))
        q = make(clock, dynamic_batching=db)
        a, b = enqueue_all(q, req("a"), req("b"))
        clock.advance(0.001)
        before = (len(q), q.pending_rows, q.oldest_enqueue_time_s, q.level_sizes())
        with pytest.raises(InferenceError) as e:
            q.enqueue(req("c", rows=3))
        assert e.value.kind is ErrorKind.UNAVAILABLE
        assert QUEUE_FULL_MESSAGE in e.value.message  # Triton's text, which clients match on
        assert (len(q), q.pending_rows, q.oldest_enqueue_time_s, q.level_sizes()) == before
        # Decisions are those of a queue that never saw c: 2 rows, delay 10 ms from t=0 -> wait until 0.010
        assert q.decide(1) == Wait(until_s=0.010)

    @pytest.mark.parametrize("dynamic_batching", [None, DynamicBatching()], ids=["no-batching", "no-limit-set"])
    def test_the_daemons_default_bounds_a_queue_whose_config_sets_none(self, clock, dynamic_batching):
        q = BatchQueue(max_batch_size=8, dynamic_batching=dynamic_batching, clock=clock, default_max_queue_size=2)
        enqueue_all(q, req("a"), req("b"))
        with pytest.raises(InferenceError) as e:
            q.enqueue(req("c"))
        assert e.value.kind is ErrorKind.UNAVAILABLE and QUEUE_FULL_MESSAGE in e.value.message
        assert "--default-max-queue-size" in e.value.message and len(q) == 2

    def test_the_models_own_limit_wins_over_the_default(self, clock):
        db = DynamicBatching(default_queue_policy=QueuePolicy(max_queue_size=3))
        q = BatchQueue(max_batch_size=8, dynamic_batching=db, clock=clock, default_max_queue_size=1)
        enqueue_all(q, req("a"), req("b"), req("c"))  # 3 fit: the config's 3, not the default 1
        with pytest.raises(InferenceError, match="of 3 requests"):
            q.enqueue(req("d"))

    def test_a_group_counts_as_its_members_and_fits_whole_or_not_at_all(self, clock):
        db = DynamicBatching(default_queue_policy=QueuePolicy(max_queue_size=4))
        q = make(clock, dynamic_batching=db)
        group = QueuedRequest(payload="g", batch_rows=3, shape_key="k", members=3)
        enqueue_all(q, group)
        with pytest.raises(InferenceError, match="3 of 4 requests"):  # 3 + 2 > 4: the second group is refused
            q.enqueue(QueuedRequest(payload="h", batch_rows=2, shape_key="k", members=2))
        enqueue_all(q, req("a"))  # 3 + 1 = 4 fit
        with pytest.raises(InferenceError, match="4 of 4 requests"):
            q.enqueue(req("b"))
        q.remove(group)  # its 3 members leave with it: 1 queued, 3 more fit
        enqueue_all(q, QueuedRequest(payload="h", batch_rows=3, shape_key="k", members=3))

    def test_limit_is_per_level(self, clock):
        db = DynamicBatching(
            priority_levels=2,
            default_priority_level=2,
            priority_queue_policy={1: QueuePolicy(max_queue_size=1)},
        )
        q = make(clock, dynamic_batching=db)
        q.enqueue(req("hi1", priority=1))
        with pytest.raises(InferenceError):
            q.enqueue(req("hi2", priority=1))  # level 1 holds 1 of 1
        q.enqueue(req("lo", priority=2))  # level 2 uses the default policy: unbounded
        assert q.level_sizes() == {1: 1, 2: 1}

    def test_delayed_requests_count(self, clock):
        policy = QueuePolicy(max_queue_size=1, default_timeout_us=1_000, timeout_action="DELAY")
        q = make(clock, dynamic_batching=DynamicBatching(default_queue_policy=policy))
        q.enqueue(req("a"))
        clock.advance(0.002)  # 2 ms > 1 ms timeout
        assert q.expire() == []  # DELAY: stays queued
        with pytest.raises(InferenceError):
            q.enqueue(req("b"))

    def test_space_frees_after_dispatch(self, clock):
        q = make(clock, dynamic_batching=DynamicBatching(default_queue_policy=QueuePolicy(max_queue_size=1)))
        q.enqueue(req("a"))
        assert isinstance(q.decide(1), Dispatch)
        q.enqueue(req("b"))
        assert len(q) == 1


# ---------------------------------------------------------------------------------------------------------------
# Decision rules
# ---------------------------------------------------------------------------------------------------------------


class TestNoFreeInstance:
    def test_empty_queue_is_idle(self, clock):
        assert make(clock).decide(1) == Idle()

    def test_idle_without_deadlines(self, clock):
        q = make(clock, dynamic_batching=DynamicBatching(max_queue_delay_us=0))
        enqueue_all(q, req("a"), req("b"))
        assert q.decide(0) == Idle()  # would dispatch with an instance, but none is free
        assert len(q) == 2

    def test_waits_for_earliest_deadline(self, clock):
        policy = QueuePolicy(default_timeout_us=5_000, allow_timeout_override=True)
        q = make(clock, dynamic_batching=DynamicBatching(default_queue_policy=policy))
        q.enqueue(req("a"))  # deadline 0 + 5 ms = 0.005
        clock.advance(0.001)
        q.enqueue(req("b", timeout_us=2_000))  # deadline 0.001 + 2 ms = 0.003 < 0.005
        assert wait_until(q.decide(0)) == pytest.approx(0.003)


class TestFullBatch:
    def test_rows_reach_max_batch_size(self, clock):
        q = make(clock, dynamic_batching=DynamicBatching(max_queue_delay_us=1_000_000))
        enqueue_all(q, req("a", rows=4), req("b", rows=4))
        d = q.decide(1)
        assert d == Dispatch(requests=d.requests, rows=8, reason=DispatchReason.FULL)  # 4 + 4 = 8
        assert names(d.requests) == ["a", "b"]
        assert len(q) == 0

    def test_next_request_does_not_fit(self, clock):
        q = make(clock, dynamic_batching=DynamicBatching(max_queue_delay_us=1_000_000))
        enqueue_all(q, req("a", rows=5), req("b", rows=4))  # 5 + 4 = 9 > 8
        d = q.decide(2)
        assert (names(d.requests), d.rows, d.reason) == (["a"], 5, DispatchReason.FULL)
        # b is now alone in the queue with an instance free: the gpud rule sends it
        d = q.decide(1)
        assert (names(d.requests), d.reason) == (["b"], DispatchReason.LONE)

    def test_other_shape_key_ends_the_batch_and_keeps_order(self, clock):
        q = make(clock, dynamic_batching=DynamicBatching(max_queue_delay_us=1_000_000))
        enqueue_all(q, req("a", key=(3, 224)), req("b", key=(3, 112)), req("c", key=(3, 224)))
        d = q.decide(3)
        # b blocks: a cannot grow, and c is not pulled past b (Triton keeps order)
        assert (names(d.requests), d.reason) == (["a"], DispatchReason.FULL)
        d = q.decide(2)
        assert (names(d.requests), d.reason) == (["b"], DispatchReason.FULL)


class TestPreferredSizes:
    DB = DynamicBatching(preferred_batch_sizes=(2, 4), max_queue_delay_us=100_000)

    def test_longest_preferred_prefix(self, clock):
        q = make(clock, dynamic_batching=self.DB)
        enqueue_all(q, *(req(f"r{i}") for i in range(5)))
        d = q.decide(1)
        # cumulative rows 1,2,3,4,5 pass 2 and 4: the longest prefix is 4 requests
        assert (names(d.requests), d.rows, d.reason) == (["r0", "r1", "r2", "r3"], 4, DispatchReason.PREFERRED)
        assert len(q) == 1

    def test_below_preferred_waits_for_delay(self, clock):
        q = make(clock, dynamic_batching=DynamicBatching(preferred_batch_sizes=(4,), max_queue_delay_us=100_000))
        enqueue_all(q, req("a"), req("b"), req("c"))  # 3 rows: no prefix hits 4
        assert q.decide(1) == Wait(until_s=0.1)  # 0 + 100_000 us
        clock.now = 0.1
        d = q.decide(1)
        assert (d.rows, d.reason) == (3, DispatchReason.DELAY)

    def test_late_batch_is_not_cut_to_preferred(self, clock):
        q = make(clock, dynamic_batching=self.DB)
        enqueue_all(q, req("a"), req("b"), req("c"))
        clock.now = 0.1  # the delay ran out: Triton sends the whole pending batch, 3 rows, not the prefix of 2
        d = q.decide(1)
        assert (d.rows, d.reason) == (3, DispatchReason.DELAY)

    def test_rows_skipping_every_preferred_size_dispatch_at_largest(self, clock):
        q = make(clock, dynamic_batching=DynamicBatching(preferred_batch_sizes=(4,), max_queue_delay_us=100_000))
        enqueue_all(q, req("a", rows=3), req("b", rows=3))  # cumulative 3, 6: never 4, but 6 >= 4
        d = q.decide(1)
        assert (d.rows, d.reason) == (6, DispatchReason.FULL)


class TestQueueDelay:
    DB = DynamicBatching(max_queue_delay_us=10_000)  # 10 ms

    def test_delay_is_timed_from_the_oldest_request(self, clock):
        q = make(clock, dynamic_batching=self.DB)
        q.enqueue(req("a"))  # t = 0
        clock.now = 0.004
        q.enqueue(req("b"))  # t = 0.004
        assert q.decide(1) == Wait(until_s=0.010)  # 0 + 10 ms, not 0.004 + 10 ms = 0.014
        clock.now = 0.00999
        assert q.decide(1) == Wait(until_s=0.010)
        clock.now = 0.010
        d = q.decide(1)
        assert (names(d.requests), d.reason) == (["a", "b"], DispatchReason.DELAY)

    def test_wait_at_until_always_dispatches(self, clock):
        # until_s and the "delay passed" test share one expression, so an awkward float cannot make the driver spin
        q = make(clock, dynamic_batching=DynamicBatching(max_queue_delay_us=100))
        clock.now = 0.3
        enqueue_all(q, req("a"), req("b"))
        wait = q.decide(1)
        assert isinstance(wait, Wait)
        clock.now = wait.until_s
        assert isinstance(q.decide(1), Dispatch)

    def test_wait_is_earlier_for_a_deadline(self, clock):
        policy = QueuePolicy(default_timeout_us=3_000)
        q = make(clock, dynamic_batching=DynamicBatching(max_queue_delay_us=10_000, default_queue_policy=policy))
        enqueue_all(q, req("a"), req("b"))
        assert q.decide(1) == Wait(until_s=0.003)  # min(0 + 10 ms, 0 + 3 ms)

    def test_zero_delay_dispatches_what_is_there(self, clock):
        q = make(clock, dynamic_batching=DynamicBatching())  # Triton's `dynamic_batching { }`
        enqueue_all(q, req("a"), req("b"), req("c"))
        d = q.decide(1)
        assert (d.rows, d.reason) == (3, DispatchReason.DELAY)


class TestLoneRequest:
    DB = DynamicBatching(max_queue_delay_us=100_000, preferred_batch_sizes=(4,))

    def test_only_request_goes_at_once(self, clock):
        q = make(clock, dynamic_batching=self.DB)
        q.enqueue(req("a"))
        d = q.decide(1)
        assert (names(d.requests), d.reason) == (["a"], DispatchReason.LONE)

    def test_two_requests_wait(self, clock):
        q = make(clock, dynamic_batching=self.DB)
        enqueue_all(q, req("a"), req("b"))
        assert q.decide(1) == Wait(until_s=0.1)  # 0 + 100 ms

    def test_no_instance_no_dispatch(self, clock):
        q = make(clock, dynamic_batching=self.DB)
        q.enqueue(req("a"))
        assert q.decide(0) == Idle()

    def test_triton_behaviour_when_disabled(self, clock):
        q = make(clock, dynamic_batching=self.DB, dispatch_lone_request=False)
        q.enqueue(req("a"))
        assert q.decide(1) == Wait(until_s=0.1)


class TestPriorities:
    DB = DynamicBatching(priority_levels=3, default_priority_level=2, max_queue_delay_us=0)

    def test_higher_level_first_fifo_within(self, clock):
        q = make(clock, max_batch_size=1, dynamic_batching=self.DB)  # batches of one show the order
        enqueue_all(
            q,
            req("lo", priority=3),
            req("mid1", priority=0),  # 0 -> default level 2
            req("hi", priority=1),
            req("mid2", priority=2),
            req("mid3", priority=7),  # 7 > 3 levels -> default level 2
        )
        order = [q.decide(1).requests[0].payload for _ in range(5)]
        assert order == ["hi", "mid1", "mid2", "mid3", "lo"]

    def test_batch_spans_levels_in_priority_order(self, clock):
        q = make(clock, dynamic_batching=self.DB)
        enqueue_all(q, req("lo", priority=3), req("hi", priority=1), req("mid", priority=2))
        d = q.decide(1)
        assert names(d.requests) == ["hi", "mid", "lo"]

    def test_higher_level_of_another_shape_goes_first_alone(self, clock):
        q = make(clock, dynamic_batching=self.DB)
        enqueue_all(q, req("lo1", priority=3), req("lo2", priority=3), req("hi", key="x", priority=1))
        assert names(q.decide(2).requests) == ["hi"]
        assert names(q.decide(1).requests) == ["lo1", "lo2"]


class TestTimeouts:
    def test_reject_expires_at_deadline(self, clock):
        q = make(clock, dynamic_batching=DynamicBatching(default_queue_policy=QueuePolicy(default_timeout_us=1_000)))
        a = req("a")
        q.enqueue(a)  # deadline 0.001
        clock.now = 0.0009
        assert q.expire() == []
        clock.now = 0.001
        assert q.expire() == [a]
        assert (len(q), q.pending_rows, a in q) == (0, 0, False)
        assert q.expire() == []  # once only
        assert timeout_error().message == REQUEST_TIMEOUT_MESSAGE
        assert timeout_error().kind is ErrorKind.UNAVAILABLE

    def test_decide_never_dispatches_a_timed_out_request(self, clock):
        policy = QueuePolicy(default_timeout_us=1_000)
        q = make(clock, dynamic_batching=DynamicBatching(default_queue_policy=policy))
        a = req("a")
        q.enqueue(a)
        clock.now = 0.002
        # the driver forgot expire(): decide asks to be run again now (until 0.001 <= now 0.002)
        assert q.decide(1) == Wait(until_s=0.001)
        assert q.expire() == [a]
        assert q.decide(1) == Idle()

    def test_timed_out_request_is_skipped_not_blocking(self, clock):
        policy = QueuePolicy(default_timeout_us=5_000, allow_timeout_override=True)
        q = make(clock, dynamic_batching=DynamicBatching(default_queue_policy=policy))
        enqueue_all(q, req("a", timeout_us=1_000), req("b"), req("c"))
        clock.now = 0.002  # a passed 0.001; b, c have until 0.005
        assert names(q.decide(1).requests) == ["b", "c"]
        assert names(q.expire()) == ["a"]

    def test_delay_action_moves_request_behind_its_level(self, clock):
        policy = QueuePolicy(default_timeout_us=5_000, allow_timeout_override=True, timeout_action="DELAY")
        q = make(clock, max_batch_size=1, dynamic_batching=DynamicBatching(default_queue_policy=policy))
        a, b, c = enqueue_all(q, req("a", timeout_us=1_000), req("b"), req("c"))
        clock.now = 0.001  # a's deadline 0 + 1 ms
        assert q.expire() == []  # DELAY: not returned
        assert (a.delayed, a in q, len(q)) == (True, True, 3)
        order = [q.decide(1).requests[0].payload for _ in range(3)]
        assert order == ["b", "c", "a"]

    def test_delayed_request_no_longer_sets_a_deadline(self, clock):
        policy = QueuePolicy(default_timeout_us=1_000, timeout_action="DELAY")
        q = make(clock, dynamic_batching=DynamicBatching(max_queue_delay_us=50_000, default_queue_policy=policy))
        enqueue_all(q, req("a"), req("b"))
        assert q.decide(1) == Wait(until_s=0.001)  # min(0.050, 0.001)
        clock.now = 0.001
        q.expire()
        assert q.decide(1) == Wait(until_s=0.050)  # both delayed: only the batching delay remains

    def test_delayed_stays_within_its_level(self, clock):
        db = DynamicBatching(
            priority_levels=2,
            default_priority_level=2,
            priority_queue_policy={1: QueuePolicy(default_timeout_us=1_000, timeout_action="DELAY")},
        )
        q = make(clock, max_batch_size=1, dynamic_batching=db)
        enqueue_all(q, req("hi_late", priority=1), req("lo", priority=2))
        clock.now = 0.001
        q.expire()
        # delayed only behind level 1's undelayed requests: still ahead of level 2
        assert [q.decide(1).requests[0].payload for _ in range(2)] == ["hi_late", "lo"]

    def test_reject_and_delay_per_level(self, clock):
        db = DynamicBatching(
            priority_levels=2,
            default_priority_level=1,
            priority_queue_policy={
                1: QueuePolicy(default_timeout_us=1_000, timeout_action="REJECT"),
                2: QueuePolicy(default_timeout_us=1_000, timeout_action="DELAY"),
            },
        )
        q = make(clock, dynamic_batching=db)
        r1, r2 = enqueue_all(q, req("r1", priority=1), req("r2", priority=2))
        clock.now = 0.001
        assert q.expire() == [r1]
        assert (r2 in q, r2.delayed) == (True, True)

    def test_requeued_request_gets_a_fresh_deadline(self, clock):
        q = make(clock, dynamic_batching=DynamicBatching(default_queue_policy=QueuePolicy(default_timeout_us=1_000)))
        a = req("a")
        q.enqueue(a)  # deadline 0 + 1 ms = 0.001
        assert names(q.decide(1).requests) == ["a"]
        clock.now = 0.0005
        q.enqueue(a)  # the driver retries it: deadline 0.0005 + 1 ms = 0.0015
        clock.now = 0.001
        assert q.expire() == []  # the first deadline belongs to the earlier stay
        clock.now = 0.0015
        assert q.expire() == [a]

    def test_no_dynamic_batching_means_no_timeouts(self, clock):
        q = make(clock, dynamic_batching=None)
        q.enqueue(req("a", timeout_us=1))
        assert q.decide(0) == Idle()
        clock.now = 10.0
        assert q.expire() == []


class TestNonBatching:
    def test_no_dynamic_batching_one_request_per_batch_fifo(self, clock):
        q = make(clock, max_batch_size=8, dynamic_batching=None)
        enqueue_all(q, req("a", priority=1), req("b"), req("c"))  # no levels: priority is ignored
        ds = [q.decide(1) for _ in range(3)]
        assert [names(d.requests) for d in ds] == [["a"], ["b"], ["c"]]
        assert {d.reason for d in ds} == {DispatchReason.UNBATCHED}
        assert q.decide(1) == Idle()

    def test_model_that_does_not_batch_keeps_queue_policy(self, clock):
        db = DynamicBatching(
            max_queue_delay_us=100_000,
            priority_levels=2,
            default_priority_level=2,
            default_queue_policy=QueuePolicy(max_queue_size=2),
        )
        q = make(clock, max_batch_size=0, dynamic_batching=db)
        enqueue_all(q, req("lo"), req("hi", priority=1))
        d = q.decide(2)  # no waiting for a delay: a batch of one cannot grow
        assert (names(d.requests), d.rows, d.reason) == (["hi"], 1, DispatchReason.UNBATCHED)
        q.enqueue(req("lo2"))
        with pytest.raises(InferenceError):
            q.enqueue(req("lo3"))  # level 2 holds 2 of 2


class TestRemoveAndDrain:
    def test_remove_is_idempotent(self, clock):
        q = make(clock, dynamic_batching=DynamicBatching(max_queue_delay_us=100_000))
        a, b = enqueue_all(q, req("a", rows=2), req("b", rows=3))
        assert q.remove(a) is True
        assert q.remove(a) is False
        assert (len(q), q.pending_rows, q.oldest_enqueue_time_s) == (1, 3, 0.0)
        d = q.decide(1)
        assert names(d.requests) == ["b"]
        assert q.remove(b) is False  # dispatched: no longer queued

    def test_removed_request_with_deadline_sets_no_timer(self, clock):
        q = make(clock, dynamic_batching=DynamicBatching(default_queue_policy=QueuePolicy(default_timeout_us=1_000)))
        a = req("a")
        q.enqueue(a)
        q.remove(a)
        assert q.decide(0) == Idle()
        clock.now = 1.0
        assert q.expire() == []

    def test_drain_returns_everything_in_dispatch_order(self, clock):
        db = DynamicBatching(priority_levels=2, default_priority_level=2, max_queue_delay_us=100_000)
        q = make(clock, dynamic_batching=db)
        enqueue_all(q, req("lo"), req("hi", priority=1), req("lo2"))
        assert names(q.drain()) == ["hi", "lo", "lo2"]
        assert (len(q), q.pending_rows, q.oldest_enqueue_time_s, q.decide(1)) == (0, 0, None, Idle())

    def test_oldest_follows_removals(self, clock):
        q = make(clock, dynamic_batching=DynamicBatching(max_queue_delay_us=100_000))
        a = req("a")
        q.enqueue(a)  # t = 0
        clock.now = 0.05
        q.enqueue(req("b"))  # t = 0.05
        q.remove(a)
        assert q.oldest_enqueue_time_s == 0.05
        clock.now = 0.06
        q.enqueue(req("c"))
        assert wait_until(q.decide(1)) == pytest.approx(0.15)  # 0.05 + 100 ms


class TestReconfigure:
    def test_applies_from_next_decision(self, clock):
        q = make(clock, max_batch_size=8, dynamic_batching=DynamicBatching(max_queue_delay_us=0))
        enqueue_all(q, *(req(f"r{i}") for i in range(6)))
        q.reconfigure(max_batch_size=4, dynamic_batching=DynamicBatching(max_queue_delay_us=0))
        assert q.decide(1).rows == 4  # 6 queued, now capped at 4
        assert q.decide(1).rows == 2  # 6 - 4

    def test_request_larger_than_new_limit_leaves_alone(self, clock):
        q = make(clock, max_batch_size=8, dynamic_batching=DynamicBatching())
        enqueue_all(q, req("big", rows=6), req("small"))
        q.reconfigure(max_batch_size=4, dynamic_batching=DynamicBatching())
        assert names(q.decide(1).requests) == ["big"]  # the model rejects it; it must not block the queue

    def test_the_daemons_default_queue_bound_survives_a_reconfigure(self, clock):
        q = BatchQueue(max_batch_size=8, dynamic_batching=DynamicBatching(), clock=clock, default_max_queue_size=1)
        q.reconfigure(max_batch_size=4, dynamic_batching=DynamicBatching())
        q.enqueue(req("a"))
        with pytest.raises(InferenceError, match="--default-max-queue-size"):
            q.enqueue(req("b"))

    def test_invalid_reconfigure_keeps_old(self, clock):
        q = make(clock)
        with pytest.raises(ValueError):
            q.reconfigure(max_batch_size=-1, dynamic_batching=None)
        assert q.max_batch_size == 8


class TestDriverLoop:
    """The loop the asyncio driver runs, played with a fake clock: arrivals, timers, instances."""

    def test_load_burst(self, clock):
        db = DynamicBatching(max_queue_delay_us=2_000, preferred_batch_sizes=(4, 8))
        q = make(clock, dynamic_batching=db)
        free = 2

        def step():
            nonlocal free
            sent = []
            while True:
                d = q.decide(free)
                if not isinstance(d, Dispatch):
                    return sent, d
                sent.append(names(d.requests))
                free -= 1

        q.enqueue(req("r0"))
        assert step() == ([["r0"]], Idle())  # lone request, instance free: no waiting (gpud rule)
        for i in range(1, 11):
            q.enqueue(req(f"r{i}"))  # 10 arrive at t=0 while one instance is busy
        sent, d = step()
        assert sent == [[f"r{i}" for i in range(1, 9)]]  # cumulative 8 = preferred 8 (longest prefix)
        assert d == Idle()  # r9, r10 queued but no instance free: nothing to time
        free = 1  # an instance comes back at t = 0.001
        clock.now = 0.001
        sent, d = step()
        assert (sent, d) == ([], Wait(until_s=0.002))  # 2 rows, delay from r9's enqueue at 0: 0 + 2 ms
        clock.now = 0.002
        assert step() == ([["r9", "r10"]], Idle())


# ---------------------------------------------------------------------------------------------------------------
# Property: nothing lost, nothing duplicated, no batch too large, no spin
# ---------------------------------------------------------------------------------------------------------------


@st.composite
def configs(draw):
    mbs = draw(st.integers(0, 8))
    if draw(st.booleans()):
        return mbs, None
    levels = draw(st.integers(0, 3))
    policies = st.builds(
        QueuePolicy,
        max_queue_size=st.integers(0, 4),
        default_timeout_us=st.sampled_from([0, 1_000, 5_000]),
        timeout_action=st.sampled_from(["REJECT", "DELAY"]),
        allow_timeout_override=st.booleans(),
    )
    preferred = draw(st.lists(st.integers(1, mbs), max_size=3, unique=True)) if mbs else []
    db = DynamicBatching(
        preferred_batch_sizes=tuple(preferred),
        max_queue_delay_us=draw(st.sampled_from([0, 500, 2_000, 10_000])),
        priority_levels=levels,
        default_priority_level=draw(st.integers(1, levels)) if levels else 0,
        default_queue_policy=draw(policies),
        priority_queue_policy=(
            draw(st.dictionaries(st.integers(1, levels), policies, max_size=levels)) if levels else {}
        ),
    )
    return mbs, db


class BatchQueueMachine(RuleBasedStateMachine):
    @initialize(config=configs())
    def setup(self, config):
        self.mbs, self.db = config
        self.clock = FakeClock()
        self.q = BatchQueue(max_batch_size=self.mbs, dynamic_batching=self.db, clock=self.clock)
        self.accepted: list[QueuedRequest] = []
        self.state: dict[int, str] = {}  # id(request) -> queued | dispatched | expired | removed
        self.n = 0

    def queued(self) -> list[QueuedRequest]:
        return [r for r in self.accepted if self.state[id(r)] == "queued"]

    def _mark(self, r: QueuedRequest, new: str) -> None:
        assert self.state[id(r)] == "queued", f"{r.payload} was {self.state[id(r)]}, now {new}"
        self.state[id(r)] = new

    @rule(rows=st.integers(1, 4), key=st.sampled_from(["a", "b"]), priority=st.integers(0, 4),
          timeout_us=st.sampled_from([0, 500, 3_000]))
    def enqueue(self, rows, key, priority, timeout_us):
        self.n += 1
        r = req(f"r{self.n}", rows=rows, key=key, priority=priority, timeout_us=timeout_us)
        before = (len(self.q), self.q.pending_rows)
        try:
            self.q.enqueue(r)
        except InferenceError:
            assert (len(self.q), self.q.pending_rows) == before  # a refused request changes nothing
            return
        self.accepted.append(r)
        self.state[id(r)] = "queued"

    @rule(seconds=st.sampled_from([0.0, 0.0005, 0.001, 0.003, 0.01]))
    def advance(self, seconds):
        self.clock.advance(seconds)

    def _check_and_record(self, d, free: int) -> None:
        if not isinstance(d, Dispatch):
            return
        assert free > 0
        assert len({id(r) for r in d.requests}) == len(d.requests)
        assert d.rows == sum(r.batch_rows for r in d.requests)
        assert d.rows <= max(self.mbs, 1)
        assert len({r.shape_key for r in d.requests}) == 1
        if self.mbs == 0 or self.db is None:
            assert len(d.requests) == 1
        for r in d.requests:
            # a REJECT request is never dispatched once its deadline has passed
            if r.deadline_s is not None and not r.delayed:
                assert self.db.queue_policy(r.level).timeout_action == "DELAY" or self.clock.now < r.deadline_s
            self._mark(r, "dispatched")

    @rule(free=st.integers(0, 3))
    def decide(self, free):
        self._check_and_record(self.q.decide(free), free)

    @rule(free=st.integers(0, 3))
    def sleep_until_timer(self, free):
        # The driver's timer wakes exactly at until_s: the instant where an off-by-one between Wait and the
        # "has it passed" tests would make it spin.
        d = self.q.decide(free)
        self._check_and_record(d, free)
        if isinstance(d, Wait) and d.until_s > self.clock.now:
            self.clock.now = d.until_s

    @rule(free=st.integers(0, 3))
    def expire_then_decide_makes_progress(self, free):
        for r in self.q.expire():
            self._mark(r, "expired")
        d = self.q.decide(free)
        if isinstance(d, Wait):
            assert d.until_s > self.clock.now  # after expire() a timer is always in the future: no spin
        self._check_and_record(d, free)

    @precondition(lambda self: self.accepted)
    @rule(i=st.integers(0, 1_000))
    def remove(self, i):
        r = self.accepted[i % len(self.accepted)]
        was_queued = self.state[id(r)] == "queued"
        assert self.q.remove(r) is was_queued
        if was_queued:
            self._mark(r, "removed")

    @rule()
    def drain(self):
        for r in self.q.drain():
            self._mark(r, "removed")

    @invariant()
    def every_request_accounted_for_once(self):
        if not hasattr(self, "q"):
            return
        queued = self.queued()
        assert len(self.q) == len(queued)
        assert all(r in self.q for r in queued)
        assert self.q.pending_rows == sum(r.batch_rows for r in queued)
        expected_oldest = min((r.enqueue_time_s for r in queued), default=None)
        assert self.q.oldest_enqueue_time_s == expected_oldest

    def teardown(self):
        if hasattr(self, "q"):
            self.q.drain()


BatchQueueMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBatchQueueProperties = BatchQueueMachine.TestCase


arrivals = st.lists(
    st.tuples(
        st.sampled_from([0, 0, 100, 500, 1_000, 4_000]),  # gap before it, us: bursts (0) and spread arrivals
        st.integers(1, 4),  # rows
        st.sampled_from(["a", "a", "b"]),  # shape key
        st.integers(0, 3),  # priority
        st.sampled_from([0, 0, 700, 3_000]),  # timeout_us
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(config=configs(), arrivals=arrivals, instances=st.integers(1, 3),
       service_us=st.sampled_from([100, 1_000, 5_000]))
def test_driver_simulation_drains_and_never_spins(config, arrivals, instances, service_us):
    """Play the asyncio driver on a fake clock: every clock instant is an arrival, an instance coming back or the
    timer the queue asked for, taken exactly. The queue must empty (nothing stuck, nothing lost), timeouts must fire
    on time, and at any one instant the step must finish (no Wait at or before now once expire() ran: a spin)."""
    mbs, db = config
    clock = FakeClock()
    q = BatchQueue(max_batch_size=mbs, dynamic_batching=db, clock=clock)
    pending = []  # (arrival_s, request)
    t_us = 0
    for i, (gap_us, rows, key, priority, timeout_us) in enumerate(arrivals):
        t_us += gap_us
        pending.append((t_us / 1e6, req(f"r{i}", rows=rows, key=key, priority=priority, timeout_us=timeout_us)))
    busy_until: list[float] = []  # one entry per busy instance
    timer_s: float | None = None
    outcome: dict[int, str] = {}

    for _ in range(10_000):
        # Events at this instant.
        while pending and pending[0][0] <= clock.now:
            _, r = pending.pop(0)
            try:
                q.enqueue(r)
                outcome[id(r)] = "queued"
            except InferenceError:
                outcome[id(r)] = "refused"
        busy_until = [t for t in busy_until if t > clock.now]
        # The step.
        for r in q.expire():
            assert outcome[id(r)] == "queued"
            assert r.deadline_s == clock.now  # on time: every deadline was a timer the queue asked for
            outcome[id(r)] = "expired"
        while True:
            free = instances - len(busy_until)
            d = q.decide(free)
            if isinstance(d, Dispatch):
                assert free > 0 and d.rows <= max(mbs, 1)
                for r in d.requests:
                    assert outcome[id(r)] == "queued"
                    outcome[id(r)] = "dispatched"
                busy_until.append(clock.now + service_us / 1e6)
                continue
            if isinstance(d, Wait):
                assert d.until_s > clock.now, "the driver would spin"
                timer_s = d.until_s
            else:
                # Idle with requests queued is only right when every instance is busy (its return is the event).
                assert len(q) == 0 or free == 0, "requests stuck: no timer and a free instance"
                timer_s = None
            break
        # The next instant.
        candidates = [t for t in (pending[0][0] if pending else None, timer_s, min(busy_until, default=None))
                      if t is not None]
        if not candidates:
            break
        clock.now = max(clock.now, min(candidates))
    else:
        pytest.fail("simulation did not finish")

    assert len(q) == 0 and not pending
    assert set(outcome.values()) <= {"refused", "expired", "dispatched"}
    assert len(outcome) == len(arrivals)


class TestQuietDispatch:
    """gpud rule 7: with an instance free, a batch goes once arrivals have gone quiet for quiet_factor x the typical
    gap, instead of waiting out max_queue_delay for requests that are not coming."""

    DB = DynamicBatching(max_queue_delay_us=10_000, preferred_batch_sizes=(16,))

    def quiet(self, clock, **kw):
        return make(clock, max_batch_size=16, dynamic_batching=self.DB, quiet_dispatch=True, quiet_factor=4.0,
                    min_quiet_s=50e-6, gap_smoothing=0.5, **kw)

    def test_burst_then_silence_dispatches_after_the_quiet_time(self, clock):
        q = self.quiet(clock)
        q.enqueue(req("a"))
        clock.advance(100e-6)
        q.enqueue(req("b"))     # gap 100 us -> ewma 100 us
        clock.advance(100e-6)
        q.enqueue(req("c"))     # gap 100 us -> ewma 0.5 * 100 + 0.5 * 100 = 100 us
        # quiet after 4 * 100 us = 400 us from the last arrival at 200 us -> 600 us (< 10 ms delay)
        assert wait_until(q.decide(1)) == pytest.approx(600e-6)
        clock.advance(399e-6)
        assert isinstance(q.decide(1), Wait)
        clock.advance(1e-6)
        d = q.decide(1)
        assert (names(d.requests), d.reason) == (["a", "b", "c"], DispatchReason.QUIET)

    def test_a_new_arrival_restarts_the_quiet_time(self, clock):
        q = self.quiet(clock)
        q.enqueue(req("a"))
        clock.advance(100e-6)
        q.enqueue(req("b"))     # ewma 100 us
        clock.advance(300e-6)
        q.enqueue(req("c"))     # gap 300 us -> ewma 0.5 * 100 + 0.5 * 300 = 200 us
        # quiet time 4 * 200 = 800 us after c's arrival at 400 us -> 1200 us
        assert wait_until(q.decide(1)) == pytest.approx(1200e-6)

    def test_gaps_across_an_empty_queue_do_not_count(self, clock):
        q = self.quiet(clock)
        enqueue_all(q, req("a"))
        clock.advance(100e-6)
        q.enqueue(req("b"))     # ewma 100 us
        clock.advance(100e-6)
        q.enqueue(req("c"))     # ewma 100 us
        clock.advance(5e-3)
        d = q.decide(1)         # 5 ms of silence >= 400 us: all three go
        assert d.reason is DispatchReason.QUIET and d.rows == 3
        clock.advance(1.0)      # a long idle gap, but the queue was empty: not a gap inside a burst
        q.enqueue(req("d"))
        clock.advance(100e-6)
        q.enqueue(req("e"))     # gap 100 us -> ewma still 100 us; 2 rows < the previous batch's 3
        # d arrived at 0.0002 + 0.005 + 1.0 = 1.0052 s, e at 1.0053 s; quiet 400 us later
        assert wait_until(q.decide(1)) == pytest.approx(1.0053 + 400e-6)

    def test_as_many_rows_as_the_previous_batch_go_at_once(self, clock):
        q = self.quiet(clock)
        enqueue_all(q, req("a"), req("b"))
        clock.advance(1e-3)
        assert q.decide(1).rows == 2  # quiet: 1 ms > 4 * 0 us gap (both arrived at once, min 50 us)
        q.enqueue(req("c"))
        assert q.decide(0) == Idle()   # nothing free
        q.enqueue(req("d"))            # 2 rows queued >= the previous batch's 2: those clients are all back
        d = q.decide(1)
        assert (names(d.requests), d.reason) == (["c", "d"], DispatchReason.QUIET)

    def test_the_delay_still_bounds_the_wait(self, clock):
        q = self.quiet(clock)
        q.enqueue(req("a"))
        clock.advance(4e-3)
        q.enqueue(req("b"))     # gap 4 ms -> quiet time 16 ms > the 10 ms delay
        assert wait_until(q.decide(1)) == pytest.approx(10e-3)  # oldest (0) + 10 ms

    def test_no_free_instance_never_dispatches(self, clock):
        q = self.quiet(clock)
        enqueue_all(q, req("a"), req("b"))
        clock.advance(1.0)
        assert q.decide(0) == Idle()

    def _full_batch_in_a_stream(self, q, clock):
        """a, b 100 us apart, then c with 14 rows at once: gap EWMA 50 us, a batch of 16 (preferred) leaves."""
        q.enqueue(req("a"))
        clock.advance(100e-6)
        q.enqueue(req("b"))               # gap 100 us -> ewma 100 us
        q.enqueue(req("c", rows=14))      # gap 0 -> ewma 50 us
        d = q.decide(1)
        assert (d.rows, d.reason) == (16, DispatchReason.PREFERRED)

    def test_a_request_arriving_in_a_stream_does_not_go_alone(self, clock):
        # Under a flood the queue empties for a moment after each batch; the next arrival must not take the free
        # instance alone (a batch of one) while the rest of the stream queues behind it.
        q = self.quiet(clock)
        self._full_batch_in_a_stream(q, clock)
        clock.advance(50e-6)
        q.enqueue(req("d"))               # 50 us after c: less than the quiet time, max(50 us, 4 x 50 us) = 200 us
        assert wait_until(q.decide(1)) == pytest.approx(150e-6 + 200e-6)
        clock.advance(200e-6)
        d = q.decide(1)                   # nobody came: it goes alone after all, within the quiet time
        assert (names(d.requests), d.reason) == (["d"], DispatchReason.QUIET)

    def test_a_request_after_a_pause_still_goes_alone_at_once(self, clock):
        q = self.quiet(clock)
        self._full_batch_in_a_stream(q, clock)
        clock.advance(1.0)
        q.enqueue(req("d"))               # a second after the last arrival: rule 6 as before
        d = q.decide(1)
        assert (names(d.requests), d.reason) == (["d"], DispatchReason.LONE)

    def test_one_small_batch_does_not_set_the_size_of_the_next(self, clock):
        # Rule 7a compares with recent batches' rows smoothed (weight 0.2 for the newest), not the last batch alone:
        # after batches of 16, one batch of 1 leaves the bar at 13, so two queued rows wait for quiet or more rows.
        q = self.quiet(clock)
        self._full_batch_in_a_stream(q, clock)
        clock.advance(1.0)
        q.enqueue(req("d"))
        assert q.decide(1).reason is DispatchReason.LONE   # bar: 16 + 0.2 * (1 - 16) = 13
        q.enqueue(req("e"))
        assert q.decide(0) == Idle()
        q.enqueue(req("f"))
        assert isinstance(q.decide(1), Wait)               # 2 rows < 13: not "everyone is back"
        for name in "ghijklmnopq":
            q.enqueue(req(name))
        d = q.decide(1)                                    # 13 rows queued: those clients are back
        assert (d.rows, d.reason) == (13, DispatchReason.QUIET)

    def test_the_smoothed_bar_reaches_a_new_steady_batch_size(self, clock):
        # From batches of 16 down to a steady 8 the average approaches 8 from above and never equals it; compared
        # rounded, 8 queued rows go at once again after a dozen batches instead of waiting for quiet each time.
        q = self.quiet(clock)
        self._full_batch_in_a_stream(q, clock)
        waited = []
        for _ in range(15):
            clock.advance(1.0)
            for i in range(8):
                q.enqueue(req(f"r{i}"))
            d = q.decide(1)
            if isinstance(d, Wait):
                waited.append(True)
                clock.advance(d.until_s - clock())
                d = q.decide(1)
            assert d.rows == 8
        assert waited and len(waited) < 15
        clock.advance(1.0)
        for i in range(8):
            q.enqueue(req(f"s{i}"))
        assert q.decide(1).rows == 8  # at once

    @staticmethod
    def _drain(q, clock) -> list[Dispatch]:
        """Decide with an instance free until the queue is empty, waiting where told."""
        out = []
        while q:
            d = q.decide(1)
            if isinstance(d, Wait):
                clock.advance(max(0.0, d.until_s - clock()))
                continue
            out.append(d)
        return out

    def test_a_lone_request_waits_while_requests_come_faster_than_a_batch_runs(self, clock):
        # A front end that hands over one request at a time under load (the core's loop) made each go alone: the
        # instance ran batch after batch of one (measured: 4 rows a batch, half of Triton's batcher's requests/s).
        q = self.quiet(clock)
        q.note_run(1e-3)  # the driver's: a batch takes 1 ms from dispatch to its answers
        q.enqueue(req("a"))
        assert q.decide(1).reason is DispatchReason.LONE  # no gap seen yet
        clock.advance(300e-6)
        q.enqueue(req("b"))  # 0.3 ms after a: it would come while b's batch of one ran
        # not at once, and not by rule 7a's bar of one row either: it waits for the next arrival, two gaps at most
        assert wait_until(q.decide(1)) == pytest.approx(300e-6 + 2 * 300e-6)
        clock.advance(300e-6)
        q.enqueue(req("c"))
        d = q.decide(1)
        assert wait_until(d) == pytest.approx(600e-6 + 2 * 300e-6)  # two gaps from c (rule 7b's four: later)
        clock.advance(d.until_s - clock())
        d = q.decide(1)
        assert (names(d.requests), d.reason) == (["b", "c"], DispatchReason.QUIET)

    def test_one_slow_batch_does_not_hold_back_a_lone_clients_next_request(self, clock):
        # A lone client's requests come a little slower than a batch runs; one batch 30x slower (a hiccup) must not
        # make the next ones wait: rule 6's run time errs short (the objective's errs long).
        q = self.quiet(clock)
        for name in "abcd":
            q.enqueue(req(name))
            assert q.decide(1).reason is DispatchReason.LONE
            q.note_run(0.1e-3 if name != "b" else 3e-3)
            clock.advance(0.5e-3)
        assert q.expected_run_s > 1e-3 > q.typical_run_s == pytest.approx(0.1e-3)

    def test_a_lone_request_goes_at_once_when_requests_come_slower_than_a_batch_runs(self, clock):
        q = self.quiet(clock)
        q.note_run(1e-3)
        for name in "abcdef":  # one every 5 ms: the instance would be idle between them
            q.enqueue(req(name))
            assert q.decide(1).reason is DispatchReason.LONE
            clock.advance(5e-3)

    def test_after_a_flood_a_lone_request_goes_at_once_within_a_few_arrivals(self, clock):
        # Each gap counts up to twice the run time, so a long pause brings the average over it within a few.
        q = make(clock, max_batch_size=16, dynamic_batching=self.DB, quiet_dispatch=True)  # smoothing 0.2
        q.note_run(1e-3)
        q.enqueue(req("a"))
        q.decide(1)
        for i in range(48):  # a flood: one every 10 us
            clock.advance(10e-6)
            q.enqueue(req(f"f{i}"))
        self._drain(q, clock)
        reasons = []
        for name in "wxyz":
            clock.advance(10.0)
            q.enqueue(req(name))
            reasons += [d.reason for d in self._drain(q, clock)]
        # average gap 1: 0.2 x 2 ms + 0.8 x ~10 us, under 1 ms; after 4 pauses 2 ms x (1 - 0.8^4) = 1.18 ms
        assert reasons[0] is not DispatchReason.LONE and reasons[-1] is DispatchReason.LONE

    def test_rule_6_is_unconditional_without_quiet_dispatch(self, clock):
        q = make(clock, max_batch_size=16, dynamic_batching=self.DB)
        self._full_batch_in_a_stream(q, clock)
        clock.advance(50e-6)
        q.enqueue(req("d"))
        assert q.decide(1).reason is DispatchReason.LONE

    def test_off_by_default_for_tritons_semantics(self, clock):
        q = make(clock, max_batch_size=16, dynamic_batching=self.DB)
        q.enqueue(req("a"))
        clock.advance(100e-6)
        q.enqueue(req("b"))
        clock.advance(5e-3)
        assert wait_until(q.decide(1)) == pytest.approx(10e-3)


@st.composite
def fast_path_configs(draw):
    """Dynamic batching where decide's fast path applies often: room for many rows, mostly no preferred sizes."""
    mbs = draw(st.integers(2, 16))
    policy = QueuePolicy(max_queue_size=draw(st.sampled_from([0, 0, 6])),
                         default_timeout_us=draw(st.sampled_from([0, 0, 2_000])),
                         timeout_action=draw(st.sampled_from(["REJECT", "DELAY"])),
                         allow_timeout_override=draw(st.booleans()))
    levels = draw(st.sampled_from([0, 0, 2]))
    return mbs, DynamicBatching(
        preferred_batch_sizes=tuple(draw(st.sampled_from([[], [], [], [mbs // 2 or 1]]))),
        max_queue_delay_us=draw(st.sampled_from([0, 500, 2_000, 10_000])),
        priority_levels=levels, default_priority_level=levels and 1, default_queue_policy=policy)


_enqueue_op = st.tuples(st.just("enqueue"), st.integers(1, 4), st.sampled_from(["a", "a", "a", "b"]),
                        st.integers(0, 3), st.sampled_from([0, 0, 0, 700, 3_000]))
operations = st.lists(
    st.one_of(
        _enqueue_op, _enqueue_op, _enqueue_op,
        st.tuples(st.just("advance"), st.sampled_from([0.0, 0.00005, 0.0002, 0.001, 0.004])),
        st.tuples(st.just("decide"), st.integers(0, 2)),
        st.tuples(st.just("expire")),
        st.tuples(st.just("remove"), st.integers(0, 1_000)),
        st.tuples(st.just("ran"), st.sampled_from([0.0001, 0.0005, 0.002])),
    ),
    min_size=8,
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(config=fast_path_configs(), quiet=st.booleans(), ops=operations)
@example(config=(8, DynamicBatching()), quiet=False,  # a second key: the candidate stops before it
         ops=[("enqueue", 1, "a", 0, 0), ("enqueue", 1, "b", 0, 0), ("decide", 1)])
@example(config=(8, DynamicBatching(max_queue_delay_us=10_000,  # a deadline passed: not in the batch
                                     default_queue_policy=QueuePolicy(allow_timeout_override=True))), quiet=False,
         ops=[("enqueue", 1, "a", 0, 700), ("enqueue", 1, "a", 0, 0), ("advance", 0.001), ("decide", 1)])
@example(config=(8, DynamicBatching(preferred_batch_sizes=(4,))), quiet=False,  # a preferred prefix goes first
         ops=[("enqueue", 2, "a", 0, 0), ("enqueue", 2, "a", 0, 0), ("enqueue", 1, "a", 0, 0), ("decide", 1)])
def test_decisions_without_listing_the_queue_are_the_decisions_that_list_it(config, quiet, ops):
    """decide's fast path (one shape key, no deadline, rows under the largest batch: the candidate is the whole queue)
    against the same queue made to list its candidate every time: every decision the same."""
    mbs, db = config
    clock = FakeClock()
    fast = BatchQueue(max_batch_size=mbs, dynamic_batching=db, clock=clock, quiet_dispatch=quiet)
    listing = BatchQueue(max_batch_size=mbs, dynamic_batching=db, clock=clock, quiet_dispatch=quiet)
    twins: list[tuple[QueuedRequest, QueuedRequest]] = []
    for n, op in enumerate(ops):
        if op[0] == "enqueue":
            a, b = (req(f"r{n}", rows=op[1], key=op[2], priority=op[3], timeout_us=op[4]) for _ in range(2))
            outcomes = []
            for q, r in ((fast, a), (listing, b)):
                try:
                    q.enqueue(r)
                    outcomes.append("queued")
                except InferenceError as e:
                    outcomes.append(e.message)
            assert outcomes[0] == outcomes[1]
            if outcomes[0] == "queued":
                twins.append((a, b))
        elif op[0] == "advance":
            clock.advance(op[1])
        elif op[0] == "expire":
            assert names(fast.expire()) == names(listing.expire())
        elif op[0] == "remove" and twins:
            a, b = twins[op[1] % len(twins)]
            assert fast.remove(a) == listing.remove(b)
        elif op[0] == "ran":
            fast.note_run(op[1])
            listing.note_run(op[1])
        elif op[0] == "decide":
            listing._shared_key = batcher_module._MIXED  # as if two keys were queued: the candidate is listed
            d1, d2 = fast.decide(op[1]), listing.decide(op[1])
            assert type(d1) is type(d2)
            if isinstance(d1, Dispatch):
                assert (names(d1.requests), d1.rows, d1.reason) == (names(d2.requests), d2.rows, d2.reason)
            elif isinstance(d1, Wait):
                assert d1.until_s == d2.until_s
