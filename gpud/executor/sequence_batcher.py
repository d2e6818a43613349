"""The sequence batcher's decisions: which instance and slot each sequence holds, what a free instance runs next,
and when an abandoned sequence is released. A synchronous, deterministic state machine with an injected clock, as
gpud.executor.batcher: it knows nothing of HTTP, asyncio, processes or tensors, and a test replays every decision with
a fake clock. A driver (gpud.executor.sequence_scheduler) owns one per model version and calls it on these events:

    request arrives            sb.enqueue(req)              # raises InferenceError: fail that request, nothing changed
    instance ready             sb.add_instance(key)
    instance gone or down      sb.remove_instance(key)      # its sequences move to free slots, else the backlog
    batch answered (or failed) sb.complete(dispatch)
    timer fires                (nothing to tell)

and after each runs the same step:

    for req, error in sb.expire().failed: fail(req, error)  # backlog timeouts; idle sequences released
    for each free instance:
        d = sb.decide(key)                                  # Dispatch (rows already taken), Wait(until_s) or Idle
    arm a timer at the earliest Wait and sb.next_deadline_s()

Rules (Triton's sequence batcher, core/src/sequence_batch_scheduler/sequence_batch_scheduler.cc):
  1. Every request names its sequence by a correlation id (uint64 or string; 0 and "" mean none). The first request
     of a sequence sets START; a request that is not START for an id with no live sequence is refused
     (INVALID_ARGUMENT "... must specify the START flag on the first request of the sequence"; gpud adds why the id
     is unknown when it knows: ended, released idle, timed out). END is the last request: the id is free for a new
     sequence as soon as END is queued. A START for an id whose sequence is still live continues in that sequence's
     slot (Triton's "previous sequence will be terminated early": its queued requests run first; the driver resets
     the implicit state at the START); enqueue() returns a warning for the log.
  2. A new sequence takes a free slot: the lowest slot number first, then the instance added first (Triton's
     ready-slot queue); with none free it waits in the backlog (FIFO), and the first backlog sequence takes the next
     slot that frees. A sequence keeps its instance and slot for its life. An instance has
     SequenceBatching.slots_per_instance slots (direct: max(1, max_batch_size); oldest: max_candidate_sequences).
  3. A sequence runs one request at a time, in arrival order (`in_flight` until the driver's complete()).
  4. direct: a batch has one row per slot, slots 0 .. the highest slot with a request ready; a slot with none ready
     (or whose request's shapes differ from the first row's) is a null row, READY false, so every sequence stays in
     its row. With max_queue_delay_us and minimum_slot_utilization both set, a batch waits until the ready slots
     reach that share of the slots or the oldest ready request has waited the delay.
  5. oldest: the next request of each sequence with none in flight joins the instance's dynamic batcher
     (gpud.executor.batcher.BatchQueue: preferred_batch_size, max_queue_delay_microseconds), which forms the batches.
  6. The END request frees its slot when it is dispatched (Triton: direct at dispatch, oldest at completion; a slot
     is a name here, and a sequence's next request waits for the previous one's answer either way).
  7. Idle: a sequence with nothing queued or running for max_sequence_idle_us is released (its id then unknown:
     rule 1), and its slot freed. The docs' definition ("idle when it does not have any inference request queued");
     Triton's reaper measures from the last request's arrival, which also releases a sequence whose one request
     ran longer than the idle time.
  8. Backlog timeouts: a backlog sequence expires at the earliest arrival + timeout of its requests that set one;
     its queued requests fail UNAVAILABLE "timeout of the corresponding sequence has been expired".

Where gpud goes beyond Triton, which has no such case: an instance that goes away (removed by the controller, its
worker restarting, its device lost) hands its sequences to free slots of the other instances, else to the front of
the backlog, in slot order. The driver keeps each sequence's implicit state itself, so a sequence goes on from its
last answered request wherever it lands; a request that was running when its instance went fails, and does not
change the state.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gpud.executor.batcher import BatchQueue, Dispatch as BatchDispatch, Idle, QueuedRequest, Wait
from gpud.executor.model_config import DynamicBatching
from gpud.executor.sequence_config import DIRECT, SequenceBatching
from gpud.executor.types import ErrorKind, InferenceError

QUEUE_FULL_MESSAGE = "Exceeds maximum queue size"
BACKLOG_TIMEOUT_MESSAGE = "timeout of the corresponding sequence has been expired"
_FORGET_AFTER = 10_000  # ids remembered with why they ended, for the error of a late request
_REMEMBER_ID_CHARS = 256  # longer string ids are not remembered (so the memory this takes stays small)

CorrelationId = int | str


def describe_id(correlation_id: CorrelationId) -> str:
    return str(correlation_id) if isinstance(correlation_id, int) else f"'{correlation_id}'"


@dataclass(eq=False)
class SequenceRequest:
    payload: Any  # opaque to the batcher (the driver's request and callback)
    correlation_id: CorrelationId
    start: bool = False
    end: bool = False
    shape_key: Hashable = ()  # rows batch together only with the same key (shapes of inputs and state)
    timeout_us: int = 0  # 0: none; only a backlog sequence times out (rule 8)
    enqueue_time_s: float = field(default=0.0, init=False)


@dataclass(eq=False)
class Sequence:
    correlation_id: CorrelationId
    requests: deque[SequenceRequest] = field(default_factory=deque)  # queued, in arrival order
    instance: str | None = None
    slot: int | None = None
    in_flight: bool = False  # a request of it runs (or, oldest, waits in the instance's dynamic batcher)
    accepting: bool = True  # takes new requests: False once its END is queued or it was released
    idle_since_s: float | None = None  # None while it has requests queued or running
    backlog_deadline_s: float | None = None
    state: Any = None  # the driver's: its implicit state after its last answered request


class Row(NamedTuple):
    """One batch row: `slot` of the instance; a null row (direct's padding) has no sequence and no request."""

    slot: int
    sequence: Sequence | None
    request: SequenceRequest | None


@dataclass(frozen=True)
class SequenceDispatch:
    """Run these rows, in this order, as one batch on `instance`. The requests are already out of their queues."""

    instance: str
    rows: tuple[Row, ...]

    @property
    def requests(self) -> list[SequenceRequest]:
        return [r.request for r in self.rows if r.request is not None]


Decision = SequenceDispatch | Wait | Idle


class Expired(NamedTuple):
    failed: list[tuple[SequenceRequest, InferenceError]]  # backlog timeouts: fail each with its error
    released: list[tuple[CorrelationId, str]]  # sequences released (idle, timed out), and why


class _Instance:
    __slots__ = ("key", "order", "slots", "queue")

    def __init__(self, key: str, order: int, slots: int, queue: BatchQueue | None):
        self.key = key
        self.order = order
        self.slots: list[Sequence | None] = [None] * slots
        self.queue = queue  # oldest: its dynamic batcher; direct: None


class SequenceBatcher:
    """One sequence model version's sequences, slots and backlog. Not thread-safe: one driver owns it."""

    def __init__(self, policy: SequenceBatching, *, model_name: str, max_batch_size: int,
                 clock: Callable[[], float], max_queued: int = 0, adaptive: bool = True):
        """max_queued: the most requests queued at once, over all sequences (0: unbounded). adaptive: the oldest
        strategy's dynamic batcher also dispatches when waiting cannot help (gpud.executor.batcher rules 6, 7)."""
        if policy.max_sequence_idle_us <= 0:
            raise ValueError(f"max_sequence_idle_us must be > 0, got {policy.max_sequence_idle_us}")
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        self.policy = policy
        self.model_name = model_name
        self.max_batch_size = max_batch_size
        self.clock = clock
        self.max_queued = max_queued
        self.adaptive = adaptive
        self.slots_per_instance = policy.slots_per_instance(max_batch_size)
        self._idle_s = policy.max_sequence_idle_us / 1e6
        self._instances: dict[str, _Instance] = {}
        self._order = itertools.count()
        self._free: list[tuple[int, int, str]] = []  # (slot, instance order, key); stale entries skipped on pop
        self._active: dict[CorrelationId, Sequence] = {}  # sequences new requests of an id go to
        self._backlog: OrderedDict[Sequence, None] = OrderedDict()  # FIFO, with O(1) membership and removal
        self._ended: OrderedDict[CorrelationId, str] = OrderedDict()  # why an id has no live sequence
        self._idle: list[tuple[float, int, Sequence]] = []  # (idle deadline, seq, sequence); validated on pop
        self._deadlines: list[tuple[float, int, Sequence]] = []  # backlog deadlines, likewise
        self._seq = itertools.count()
        self._queued = 0
        self._holding = 0  # sequences holding a slot or waiting in the backlog

    # -- state ---------------------------------------------------------------------------------------------------

    @property
    def queued_requests(self) -> int:
        return self._queued

    @property
    def live_sequences(self) -> int:
        """Sequences holding a slot or waiting in the backlog for one."""
        return self._holding

    @property
    def instances_needed(self) -> int:
        """Instances whose slots hold the sequences that hold a slot now: with fewer, some would wait in the backlog
        (the backlog's own sequences are not counted: they are load, for the hints to scale up for)."""
        return -(-(self._holding - len(self._backlog)) // self.slots_per_instance)

    @property
    def backlog_sequences(self) -> int:
        return len(self._backlog)

    @property
    def backlog(self) -> tuple[Sequence, ...]:
        return tuple(self._backlog)

    def instance_keys(self) -> list[str]:
        return list(self._instances)

    def slots(self, key: str) -> tuple[Sequence | None, ...]:
        return tuple(self._instances[key].slots)

    def sequence(self, correlation_id: CorrelationId) -> Sequence | None:
        """The live sequence that takes this id's next request, if any."""
        return self._active.get(correlation_id)

    def sequences_on(self, key: str) -> int:
        inst = self._instances.get(key)
        return 0 if inst is None else sum(1 for s in inst.slots if s is not None)

    # -- instances -------------------------------------------------------------------------------------------------

    def add_instance(self, key: str) -> None:
        if key in self._instances:
            return
        queue = None
        if self.policy.strategy != DIRECT:
            queue = BatchQueue(max_batch_size=self.max_batch_size, clock=self.clock,
                               dynamic_batching=DynamicBatching(self.policy.preferred_batch_sizes,
                                                                self.policy.max_queue_delay_us,
                                                                self.policy.preserve_ordering),
                               dispatch_lone_request=self.adaptive, quiet_dispatch=self.adaptive)
        inst = self._instances[key] = _Instance(key, next(self._order), self.slots_per_instance, queue)
        for slot in range(len(inst.slots)):
            heapq.heappush(self._free, (slot, inst.order, key))
        while self._backlog and self._take_free_slot(next(iter(self._backlog))):
            self._backlog.popitem(last=False)

    def remove_instance(self, key: str) -> list[Sequence]:
        """The instance takes no more batches; its sequences move to free slots elsewhere, else to the front of the
        backlog (in slot order). Returns the sequences it held. Its running batch still completes (complete())."""
        inst = self._instances.pop(key, None)
        if inst is None:
            return []
        if inst.queue is not None:
            for q in inst.queue.drain():  # issued to its dynamic batcher, not running: they run elsewhere
                q.payload.in_flight = False
        moved = [s for s in inst.slots if s is not None]
        waiting = []
        for s in moved:
            s.instance = s.slot = None
            if not self._take_free_slot(s):
                waiting.append(s)
        for s in reversed(waiting):
            self._backlog[s] = None
            self._backlog.move_to_end(s, last=False)
        for s in waiting:
            self._arm_backlog_deadline(s)
        for s in moved:
            self._issue(s)
        return moved

    # -- requests --------------------------------------------------------------------------------------------------

    def enqueue(self, req: SequenceRequest) -> str:
        """Queue a request of a sequence, or raise InferenceError and change nothing. Returns a warning for the log
        ("" when none): a START for an id whose sequence is still live."""
        cid = req.correlation_id
        if cid == 0 or cid == "":
            raise InferenceError(ErrorKind.INVALID_ARGUMENT, f"inference request to model '{self.model_name}' must "
                                 "specify a non-zero or non-empty correlation ID")
        seq = self._active.get(cid)
        if seq is None and not req.start:
            why = self._ended.get(cid)
            raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                 f"inference request for sequence {describe_id(cid)} to model '{self.model_name}' must "
                                 "specify the START flag on the first request of the sequence"
                                 + (f" (sequence {describe_id(cid)} {why})" if why else
                                    " (no sequence with this id is live)"))
        if self.max_queued and self._queued >= self.max_queued:
            raise InferenceError(ErrorKind.UNAVAILABLE, f"{QUEUE_FULL_MESSAGE} (queue full: {self._queued} of "
                                 f"{self.max_queued} requests queued over all sequences; the daemon's "
                                 "--default-max-queue-size)")
        now_s = self.clock()
        warning = ""
        if seq is None:
            seq = self._active[cid] = Sequence(cid)
            self._ended.pop(cid, None)
            self._holding += 1
            if not self._take_free_slot(seq):
                self._backlog[seq] = None
        elif req.start:
            warning = (f"sequence {describe_id(cid)} for model '{self.model_name}' has a conflict. The previous "
                       "sequence did not end before this sequence start. Previous sequence will be terminated early.")
        req.enqueue_time_s = now_s
        seq.requests.append(req)
        seq.idle_since_s = None
        self._queued += 1
        if req.end:
            seq.accepting = False
            del self._active[cid]
            self._remember(cid, "ended: its last request set sequence_end")
        if seq.slot is None:
            if req.timeout_us:
                deadline_s = now_s + req.timeout_us / 1e6
                if seq.backlog_deadline_s is None or deadline_s < seq.backlog_deadline_s:
                    seq.backlog_deadline_s = deadline_s
                    heapq.heappush(self._deadlines, (deadline_s, next(self._seq), seq))
        else:
            self._issue(seq)
        return warning

    def complete(self, dispatch: SequenceDispatch) -> None:
        """The batch was answered (or failed): its sequences may run their next requests."""
        now_s = self.clock()
        for row in dispatch.rows:
            seq = row.sequence
            if seq is None:
                continue
            seq.in_flight = False
            if row.request is not None and row.request.end:
                continue  # the sequence is over (its slot went at dispatch)
            if seq.requests:
                self._issue(seq)
            elif seq.slot is not None or seq in self._backlog:  # still holds its place: idle from now
                self._go_idle(seq, now_s)

    def drain(self) -> list[SequenceRequest]:
        """Every queued request, taken out (shutdown, unload, a failed load on demand). Sequences stay, with their
        state; one with nothing left goes idle."""
        out: list[SequenceRequest] = []
        now_s = self.clock()
        for inst in self._instances.values():
            if inst.queue is not None:
                for q in inst.queue.drain():
                    q.payload.in_flight = False
        for seq in self._live():
            out.extend(seq.requests)
            seq.requests.clear()
            if not seq.in_flight:
                self._go_idle(seq, now_s)
        self._queued = 0
        return out

    # -- time ------------------------------------------------------------------------------------------------------

    def expire(self) -> Expired:
        """Release idle sequences (rule 7) and time out backlog sequences (rule 8): the requests to fail, and the
        sequences released (for the log)."""
        now_s = self.clock()
        failed: list[tuple[SequenceRequest, InferenceError]] = []
        released: list[tuple[CorrelationId, str]] = []
        while self._idle and self._idle[0][0] <= now_s:
            deadline_s, _, seq = heapq.heappop(self._idle)
            if seq.idle_since_s is None or seq.idle_since_s + self._idle_s != deadline_s:
                continue  # stale: it had a request since
            why = f"was released: it had no request for max_sequence_idle_microseconds " \
                  f"({self.policy.max_sequence_idle_us} us)"
            if self._release(seq, why):
                released.append((seq.correlation_id, why))
        while self._deadlines and self._deadlines[0][0] <= now_s:
            deadline_s, _, seq = heapq.heappop(self._deadlines)
            if seq.backlog_deadline_s != deadline_s:
                continue  # stale: it got a slot, or an earlier deadline
            error = InferenceError(ErrorKind.UNAVAILABLE, BACKLOG_TIMEOUT_MESSAGE)
            failed += [(r, error) for r in seq.requests]
            self._queued -= len(seq.requests)
            seq.requests.clear()
            why = "timed out waiting in the backlog for a free sequence slot"
            if self._release(seq, why):
                released.append((seq.correlation_id, why))
        return Expired(failed, released)

    def next_deadline_s(self) -> float | None:
        """When expire() next has something to do (None: nothing scheduled)."""
        while self._idle and (self._idle[0][2].idle_since_s is None
                              or self._idle[0][2].idle_since_s + self._idle_s != self._idle[0][0]):
            heapq.heappop(self._idle)
        while self._deadlines and (self._deadlines[0][2].backlog_deadline_s != self._deadlines[0][0]
                                   or self._deadlines[0][2].slot is not None):
            heapq.heappop(self._deadlines)
        times = [h[0][0] for h in (self._idle, self._deadlines) if h]
        return min(times) if times else None

    # -- decisions -------------------------------------------------------------------------------------------------

    def decide(self, key: str) -> Decision:
        """What the free instance `key` runs now (requests already taken out of their queues), or when to ask
        again."""
        inst = self._instances.get(key)
        if inst is None:
            return Idle()
        if inst.queue is not None:
            return self._decide_oldest(inst)
        return self._decide_direct(inst)

    def _decide_direct(self, inst: _Instance) -> Decision:
        ready = [(slot, s) for slot, s in enumerate(inst.slots)
                 if s is not None and s.requests and not s.in_flight]
        if not ready:
            return Idle()
        policy = self.policy
        if policy.max_queue_delay_us > 0 and policy.minimum_slot_utilization > 0:
            oldest_s = min(s.requests[0].enqueue_time_s for _, s in ready)
            until_s = oldest_s + policy.max_queue_delay_us / 1e6
            if self.clock() < until_s and len(ready) / len(inst.slots) < policy.minimum_slot_utilization:
                return Wait(until_s=until_s)
        key = ready[0][1].requests[0].shape_key
        by_slot = dict(ready)
        rows = []
        for slot in range(ready[-1][0] + 1):
            seq = by_slot.get(slot)
            if seq is None or seq.requests[0].shape_key != key:
                rows.append(Row(slot, None, None))  # null row: READY false; a request of other shapes waits
                continue
            rows.append(Row(slot, seq, self._take_head(seq)))
        return SequenceDispatch(inst.key, tuple(rows))

    def _decide_oldest(self, inst: _Instance) -> Decision:
        assert inst.queue is not None
        for q in inst.queue.expire():  # no queue policy: nothing expires; kept for the batcher's contract
            q.payload.in_flight = False
        d = inst.queue.decide(1)
        if not isinstance(d, BatchDispatch):
            return d
        rows = []
        for q in d.requests:
            seq: Sequence = q.payload
            rows.append(Row(seq.slot if seq.slot is not None else -1, seq, self._take_head(seq)))
        return SequenceDispatch(inst.key, tuple(rows))

    # -- internals ---------------------------------------------------------------------------------------------

    def _take_head(self, seq: Sequence) -> SequenceRequest:
        req = seq.requests.popleft()
        self._queued -= 1
        seq.in_flight = True
        if req.end:
            self._holding -= 1
            self._free_slot_of(seq)
            if seq.requests:  # nothing follows an END (its id went to a new sequence): never happens
                raise AssertionError(f"requests queued after the end of sequence {seq.correlation_id}")
        return req

    def _issue(self, seq: Sequence) -> None:
        """oldest: the sequence's next request joins its instance's dynamic batcher (rule 5)."""
        if seq.in_flight or not seq.requests or seq.instance is None:
            return
        inst = self._instances[seq.instance]
        if inst.queue is None:
            return
        head = seq.requests[0]
        inst.queue.enqueue(QueuedRequest(payload=seq, batch_rows=1, shape_key=head.shape_key))
        seq.in_flight = True

    def _take_free_slot(self, seq: Sequence) -> bool:
        while self._free:
            slot, _, key = heapq.heappop(self._free)
            inst = self._instances.get(key)
            if inst is None or inst.slots[slot] is not None:
                continue  # stale: its instance went, or the slot was taken through a re-add
            inst.slots[slot] = seq
            seq.instance, seq.slot = key, slot
            seq.backlog_deadline_s = None
            self._issue(seq)
            return True
        return False

    def _free_slot_of(self, seq: Sequence) -> None:
        if seq.slot is None:
            self._backlog.pop(seq, None)
            return
        assert seq.instance is not None  # a sequence in a slot is on an instance
        inst = self._instances[seq.instance]
        slot = seq.slot
        inst.slots[slot] = None
        seq.instance = seq.slot = None
        if self._backlog:
            nxt, _ = self._backlog.popitem(last=False)
            inst.slots[slot] = nxt
            nxt.instance, nxt.slot = inst.key, slot
            nxt.backlog_deadline_s = None
            self._issue(nxt)
        else:
            heapq.heappush(self._free, (slot, inst.order, inst.key))

    def _go_idle(self, seq: Sequence, now_s: float) -> None:
        seq.idle_since_s = now_s
        heapq.heappush(self._idle, (now_s + self._idle_s, next(self._seq), seq))

    def _release(self, seq: Sequence, why: str) -> bool:
        """The sequence takes no more requests and gives up its slot (or its place in the backlog). True when it
        still took requests (else it was over already and only its place goes)."""
        accepting = seq.accepting
        if seq.accepting:
            seq.accepting = False
            if self._active.get(seq.correlation_id) is seq:
                del self._active[seq.correlation_id]
                self._remember(seq.correlation_id, why)
        seq.idle_since_s = None
        seq.backlog_deadline_s = None
        if seq.slot is not None or seq in self._backlog:
            self._holding -= 1
            self._free_slot_of(seq)
        return accepting

    def _arm_backlog_deadline(self, seq: Sequence) -> None:
        timeouts = [r.enqueue_time_s + r.timeout_us / 1e6 for r in seq.requests if r.timeout_us]
        seq.backlog_deadline_s = min(timeouts) if timeouts else None
        if seq.backlog_deadline_s is not None:
            heapq.heappush(self._deadlines, (seq.backlog_deadline_s, next(self._seq), seq))

    def _remember(self, cid: CorrelationId, why: str) -> None:
        if isinstance(cid, str) and len(cid) > _REMEMBER_ID_CHARS:
            return
        self._ended[cid] = why
        self._ended.move_to_end(cid)
        while len(self._ended) > _FORGET_AFTER:
            self._ended.popitem(last=False)

    def _live(self) -> list[Sequence]:
        seen = [s for inst in self._instances.values() for s in inst.slots if s is not None]
        return seen + list(self._backlog)
