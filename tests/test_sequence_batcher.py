"""Deterministic tests of gpud.executor.sequence_batcher: a fake clock, events, no sleeps, no asyncio.

Times in comments are in seconds unless a name says otherwise; 1 ms = 1_000 us = 0.001 s.
"""
from __future__ import annotations

import random

import pytest

from gpud.executor.batcher import Idle, Wait
from gpud.executor.sequence_batcher import (BACKLOG_TIMEOUT_MESSAGE, QUEUE_FULL_MESSAGE, SequenceBatcher,
                                       SequenceDispatch, SequenceRequest)
from gpud.executor.sequence_config import DIRECT, OLDEST, SequenceBatching
from gpud.executor.types import ErrorKind, InferenceError
from tests.fakes import FakeClock


def r(cid, name: str = "", start: bool = False, end: bool = False, key: object = "k", timeout_us: int = 0):
    return SequenceRequest(payload=name or f"{cid}", correlation_id=cid, start=start, end=end, shape_key=key,
                           timeout_us=timeout_us)


def make(clock, strategy=DIRECT, max_batch_size: int = 2, instances=("a",), **policy) -> SequenceBatcher:
    policy.setdefault("max_sequence_idle_us", 1_000_000)
    sb = SequenceBatcher(SequenceBatching(strategy, **policy), model_name="m", max_batch_size=max_batch_size,
                         clock=clock, adaptive=False)
    for key in instances:
        sb.add_instance(key)
    return sb


def rows(d) -> list[tuple[int, str | None]]:
    """(slot, payload) per row; None for a null row."""
    assert isinstance(d, SequenceDispatch), d
    return [(row.slot, row.request.payload if row.request else None) for row in d.rows]


def where(sb, cid) -> tuple[str | None, int | None]:
    s = sb.sequence(cid)
    return (s.instance, s.slot) if s else (None, None)


def error_of(sb, req) -> InferenceError:
    with pytest.raises(InferenceError) as e:
        sb.enqueue(req)
    return e.value


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


class TestCorrelationIds:
    def test_missing_correlation_id(self, clock):
        sb = make(clock)
        for cid in (0, ""):
            e = error_of(sb, r(cid, start=True))
            assert e.kind is ErrorKind.INVALID_ARGUMENT
            assert e.message == "inference request to model 'm' must specify a non-zero or non-empty correlation ID"

    def test_first_request_without_start(self, clock):
        sb = make(clock)
        e = error_of(sb, r(7))
        assert e.kind is ErrorKind.INVALID_ARGUMENT
        assert e.message.startswith("inference request for sequence 7 to model 'm' must specify the START flag on "
                                    "the first request of the sequence")
        assert "no sequence with this id is live" in e.message
        assert sb.queued_requests == 0 and sb.live_sequences == 0  # nothing changed

    def test_string_and_integer_ids_are_different_sequences(self, clock):
        sb = make(clock)
        sb.enqueue(r(1, start=True))
        sb.enqueue(r("1", start=True))
        assert where(sb, 1) == ("a", 0) and where(sb, "1") == ("a", 1)
        assert "sequence '2'" in error_of(sb, r("2")).message  # string ids are quoted in messages

    def test_request_after_end_says_the_sequence_ended(self, clock):
        sb = make(clock)
        sb.enqueue(r(5, start=True))
        sb.enqueue(r(5, end=True))
        e = error_of(sb, r(5))
        assert "must specify the START flag" in e.message
        assert "sequence 5 ended: its last request set sequence_end" in e.message
        sb.enqueue(r(5, "again", start=True))  # a new sequence may reuse the id at once
        assert sb.live_sequences == 2  # the old one holds its slot until its END runs

    def test_start_while_live_continues_in_the_same_slot_with_a_warning(self, clock):
        sb = make(clock)
        sb.enqueue(r(3, "s1", start=True))
        warning = sb.enqueue(r(3, "s2", start=True))
        assert "has a conflict" in warning and "terminated early" in warning
        assert where(sb, 3) == ("a", 0) and sb.live_sequences == 1
        assert rows(sb.decide("a")) == [(0, "s1")]


class TestDirect:
    def test_slots_lowest_first_across_instances(self, clock):
        sb = make(clock, instances=("a", "b"))  # 2 slots each
        for cid in (1, 2, 3, 4):
            sb.enqueue(r(cid, start=True))
        assert [where(sb, c) for c in (1, 2, 3, 4)] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
        assert sb.instances_needed == 2

    def test_a_batch_has_one_row_per_slot_with_null_rows(self, clock):
        sb = make(clock, max_batch_size=4)
        for cid in (1, 2, 3):
            sb.enqueue(r(cid, f"{cid}a", start=True))
        d = sb.decide("a")
        assert rows(d) == [(0, "1a"), (1, "2a"), (2, "3a")]
        sb.complete(d)
        sb.enqueue(r(3, "3b"))  # only sequence 3 has a request: slots 0 and 1 are null rows
        d = sb.decide("a")
        assert rows(d) == [(0, None), (1, None), (2, "3b")]
        assert d.requests[0].payload == "3b"

    def test_one_request_of_a_sequence_at_a_time_in_order(self, clock):
        sb = make(clock)
        sb.enqueue(r(1, "x1", start=True))
        sb.enqueue(r(1, "x2"))
        sb.enqueue(r(2, "y1", start=True))
        d1 = sb.decide("a")
        assert rows(d1) == [(0, "x1"), (1, "y1")]
        assert isinstance(sb.decide("a"), Idle)  # x2 waits for x1's answer
        sb.complete(d1)
        assert rows(sb.decide("a")) == [(0, "x2")]

    def test_other_shapes_wait_for_a_batch_of_their_own(self, clock):
        sb = make(clock)
        sb.enqueue(r(1, "x", start=True, key="small"))
        sb.enqueue(r(2, "y", start=True, key="large"))
        d = sb.decide("a")
        assert rows(d) == [(0, "x"), (1, None)]
        sb.complete(d)
        assert rows(sb.decide("a")) == [(0, None), (1, "y")]

    def test_end_frees_the_slot_for_the_backlog(self, clock):
        sb = make(clock, max_batch_size=1)  # one slot
        sb.enqueue(r(1, "a1", start=True))
        sb.enqueue(r(2, "b1", start=True))
        sb.enqueue(r(2, "b2", end=True))
        assert where(sb, 1) == ("a", 0) and [s.correlation_id for s in sb.backlog] == [2]
        sb.enqueue(r(1, "a2", end=True))
        d = sb.decide("a")
        assert rows(d) == [(0, "a1")]
        sb.complete(d)
        d = sb.decide("a")
        assert rows(d) == [(0, "a2")]  # END: the slot goes to sequence 2 at dispatch
        assert sb.slots("a")[0].correlation_id == 2 and not sb.backlog
        sb.complete(d)
        assert rows(sb.decide("a")) == [(0, "b1")]

    def test_delay_and_minimum_slot_utilization(self, clock):
        sb = make(clock, max_batch_size=4, max_queue_delay_us=2000, minimum_slot_utilization=0.5)
        sb.enqueue(r(1, "x", start=True))
        assert sb.decide("a") == Wait(until_s=0.002)  # 1 of 4 slots ready < 0.5: wait up to 2 ms
        clock.advance(0.001)
        sb.enqueue(r(2, "y", start=True))
        assert rows(sb.decide("a")) == [(0, "x"), (1, "y")]  # 2 / 4 = 0.5 reaches the utilization

    def test_delay_runs_out(self, clock):
        sb = make(clock, max_batch_size=4, max_queue_delay_us=2000, minimum_slot_utilization=1.0)
        sb.enqueue(r(1, "x", start=True))
        assert isinstance(sb.decide("a"), Wait)
        clock.advance(0.002)  # the oldest ready request waited 2 ms
        assert rows(sb.decide("a")) == [(0, "x")]


class TestOldest:
    def test_batches_across_sequences_one_request_each(self, clock):
        sb = make(clock, OLDEST, max_batch_size=4, max_candidate_sequences=8)
        for cid in (1, 2, 3):
            sb.enqueue(r(cid, f"{cid}a", start=True))
            sb.enqueue(r(cid, f"{cid}b"))
        d = sb.decide("a")  # max_queue_delay 0: the three heads at once, no null rows
        assert rows(d) == [(0, "1a"), (1, "2a"), (2, "3a")]
        assert isinstance(sb.decide("a"), Idle)
        sb.complete(d)
        assert rows(sb.decide("a")) == [(0, "1b"), (1, "2b"), (2, "3b")]

    def test_preferred_batch_size_and_delay(self, clock):
        sb = make(clock, OLDEST, max_batch_size=4, max_candidate_sequences=8, preferred_batch_sizes=(2,),
                  max_queue_delay_us=1000)
        sb.enqueue(r(1, "x", start=True))
        assert sb.decide("a") == Wait(until_s=0.001)
        sb.enqueue(r(2, "y", start=True))
        assert rows(sb.decide("a")) == [(0, "x"), (1, "y")]  # preferred size 2 reached

    def test_max_candidate_sequences_is_the_slot_count(self, clock):
        sb = make(clock, OLDEST, max_batch_size=2, max_candidate_sequences=3)
        for cid in (1, 2, 3, 4):
            sb.enqueue(r(cid, start=True))
        assert sb.slots_per_instance == 3 and [s.correlation_id for s in sb.backlog] == [4]
        d = sb.decide("a")  # at most max_batch_size rows
        assert len(d.rows) == 2


class TestBacklog:
    def test_backlog_timeout(self, clock):
        sb = make(clock, max_batch_size=1)
        sb.enqueue(r(1, start=True))
        sb.enqueue(r(2, "b1", start=True, timeout_us=5000))
        sb.enqueue(r(2, "b2"))
        assert sb.next_deadline_s() == 0.005
        clock.advance(0.005)
        failed = sb.expire().failed
        assert [(q.payload, e.kind, e.message) for q, e in failed] == [
            ("b1", ErrorKind.UNAVAILABLE, BACKLOG_TIMEOUT_MESSAGE), ("b2", ErrorKind.UNAVAILABLE,
                                                                     BACKLOG_TIMEOUT_MESSAGE)]
        assert "timed out waiting in the backlog" in error_of(sb, r(2)).message
        assert sb.queued_requests == 1 and sb.live_sequences == 1

    def test_a_sequence_with_a_slot_does_not_time_out(self, clock):
        sb = make(clock)
        sb.enqueue(r(1, start=True, timeout_us=10))
        clock.advance(1.0)
        assert sb.expire() == ([], [])


class TestIdle:
    def test_idle_sequence_is_released_and_its_slot_freed(self, clock):
        sb = make(clock, max_batch_size=1, max_sequence_idle_us=1_000_000)
        sb.enqueue(r(1, "a1", start=True))
        sb.enqueue(r(2, "b1", start=True))  # backlog
        d = sb.decide("a")
        clock.advance(5.0)  # a running request is not idle time
        assert sb.next_deadline_s() is None
        sb.complete(d)  # idle from t = 5
        assert sb.next_deadline_s() == 6.0
        clock.advance(0.999)
        assert sb.expire() == ([], []) and where(sb, 1) == ("a", 0)
        clock.advance(0.001)
        assert sb.expire() == ([], [(1, "was released: it had no request for max_sequence_idle_microseconds "
                                        "(1000000 us)")])
        e = error_of(sb, r(1, "a2"))
        assert "sequence 1 was released: it had no request for max_sequence_idle_microseconds (1000000 us)" in \
            e.message
        assert where(sb, 2) == ("a", 0)  # the backlog took the freed slot
        assert rows(sb.decide("a")) == [(0, "b1")]

    def test_a_new_request_restarts_the_idle_time(self, clock):
        sb = make(clock, max_sequence_idle_us=1000)
        sb.enqueue(r(1, "x", start=True))
        sb.complete(sb.decide("a"))
        clock.advance(0.0009)
        sb.enqueue(r(1, "y"))
        clock.advance(0.0009)
        sb.expire()
        assert sb.sequence(1) is not None  # it had a request queued: not idle
        d = sb.decide("a")
        sb.complete(d)
        clock.advance(0.001)
        sb.expire()
        assert sb.sequence(1) is None and sb.live_sequences == 0


class TestInstances:
    def test_removed_instance_hands_its_sequences_on(self, clock):
        sb = make(clock, max_batch_size=2, instances=("a", "b"))
        for cid in (1, 2, 3):  # a0, b0, a1
            sb.enqueue(r(cid, f"{cid}x", start=True))
        running = sb.decide("a")  # sequences 1 and 3 run on a
        moved = sb.remove_instance("a")
        assert [s.correlation_id for s in moved] == [1, 3]
        assert where(sb, 1) == ("b", 1)  # b's free slot
        assert [s.correlation_id for s in sb.backlog] == [3]  # no room left: the backlog's front
        assert isinstance(sb.decide("a"), Idle)
        sb.enqueue(r(1, "1y"))
        assert rows(sb.decide("b")) == [(0, "2x")]  # 1y waits: 1x still runs on the removed instance
        sb.complete(running)
        sb.add_instance("c")
        assert where(sb, 3) == ("c", 0)

    def test_oldest_queue_goes_with_the_instance(self, clock):
        sb = make(clock, OLDEST, max_batch_size=2, instances=("a",), max_candidate_sequences=2,
                  preferred_batch_sizes=(2,), max_queue_delay_us=10_000)
        sb.enqueue(r(1, "x", start=True))  # issued to a's dynamic batcher, waiting for a second row
        sb.remove_instance("a")
        sb.add_instance("b")
        assert isinstance(sb.decide("b"), Wait)
        clock.advance(0.01)
        assert rows(sb.decide("b")) == [(0, "x")]

    def test_queue_bound_and_drain(self, clock):
        sb = SequenceBatcher(SequenceBatching(), model_name="m", max_batch_size=1, clock=clock, max_queued=2)
        sb.add_instance("a")
        sb.enqueue(r(1, "1", start=True))
        sb.enqueue(r(1, "2"))
        e = error_of(sb, r(1, "3"))
        assert e.kind is ErrorKind.UNAVAILABLE and e.message.startswith(QUEUE_FULL_MESSAGE)
        assert [q.payload for q in sb.drain()] == ["1", "2"]
        assert sb.queued_requests == 0 and sb.sequence(1) is not None  # the sequence lives on, with its state


def test_random_interleavings_keep_order_slots_and_one_in_flight():
    """Random arrivals, completions, idle time and instance churn: a sequence's requests run in order, one at a
    time, each sequence holds at most one slot and a slot one sequence, and every request is answered or failed."""
    rng = random.Random(16)
    for strategy in (DIRECT, OLDEST):
        clock = FakeClock()
        sb = make(clock, strategy, max_batch_size=3, instances=("i0", "i1"), max_sequence_idle_us=50_000,
                  max_candidate_sequences=2)
        next_n: dict[int, int] = {}
        ran: dict[object, list[int]] = {}
        running: list[SequenceDispatch] = []
        accepted = finished = 0
        instances = ["i0", "i1"]
        for step in range(3000):
            event = rng.random()
            if event < 0.45:
                cid = rng.randint(1, 12)
                start = cid not in next_n or rng.random() < 0.05
                n = 0 if start else next_n[cid]
                try:
                    sb.enqueue(r(cid, f"{cid}:{n}", start=start, end=rng.random() < 0.1))
                except InferenceError as e:
                    assert "START flag" in e.message  # released idle: the client starts again
                    next_n.pop(cid, None)
                    continue
                accepted += 1
                next_n[cid] = n + 1
            elif event < 0.75 and running:
                d = running.pop(rng.randrange(len(running)))
                sb.complete(d)
            elif event < 0.8:
                clock.advance(0.02)
            elif event < 0.82 and len(instances) > 1:
                sb.remove_instance(instances.pop(rng.randrange(len(instances))))
            elif event < 0.84:
                key = f"i{step}"
                instances.append(key)
                sb.add_instance(key)
            finished += len(sb.expire().failed)
            busy = {d.instance for d in running}
            for key in instances:
                if key in busy:
                    continue
                d = sb.decide(key)
                if isinstance(d, SequenceDispatch):
                    running.append(d)
                    for row in d.rows:
                        if row.request is None:
                            continue
                        n = int(row.request.payload.split(":")[1])
                        seen = ran.setdefault(row.sequence, [])  # per sequence (an id may start a new one)
                        assert n == 0 or not seen or n == seen[-1] + 1, (row.sequence.correlation_id, n, seen)
                        seen.append(n)
                        finished += 1
                    cids = [row.sequence.correlation_id for row in d.rows if row.sequence is not None]
                    assert len(cids) == len(set(id(row.sequence) for row in d.rows if row.sequence))
            in_flight = [row.sequence for d in running for row in d.rows if row.sequence is not None]
            assert len(in_flight) == len({id(s) for s in in_flight})  # one request of a sequence at a time
            held = [(k, i) for k in instances for i, s in enumerate(sb.slots(k)) if s is not None]
            seqs = [sb.slots(k)[i] for k, i in held]
            assert len(seqs) == len({id(s) for s in seqs})
            assert all(s.instance == k and s.slot == i for (k, i), s in zip(held, seqs))
        for d in running:
            sb.complete(d)
        finished += len(sb.drain())
        assert finished == accepted
