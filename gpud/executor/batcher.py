"""The dynamic batcher's queue and dispatch decisions: a synchronous, deterministic state machine.

It knows nothing of HTTP, asyncio, processes or tensors. Time comes from an injected monotonic clock (seconds), so
every decision can be replayed in a test by advancing a fake clock. A driver (asyncio) owns one `BatchQueue` per
model and calls it on three events:

    request arrives       q.enqueue(req)                   # may raise InferenceError: fail that request at once
    instance becomes free  (nothing to tell the queue)
    timer fires            (nothing to tell the queue)

and after each event runs the same step:

    for req in q.expire():                                  # REJECT timeouts, removed from the queue
        fail(req, timeout_error())                          # UNAVAILABLE "Request timeout expired"
    while True:
        d = q.decide(free_instances)
        if isinstance(d, Dispatch):                         # requests already removed from the queue
            send(d.requests); free_instances -= 1; continue
        arm_timer(d.until_s) if isinstance(d, Wait) else disarm_timer()   # Idle: wait for the next event
        break

`decide()` never dispatches a request whose REJECT deadline has passed, even when `expire()` was not called first;
such a request makes `decide()` answer `Wait(until_s <= now)`, i.e. "run the step again now", which collects it.

Decision rules (Triton's dynamic batcher, `core/src/dynamic_batch_scheduler.cc`, plus one gpud rule):
  1. No free instance: no dispatch. `Wait(earliest deadline)` so timeouts still fire, else `Idle()`.
  2. Candidate batch: requests in priority order (level 1 before 2 ...; within a level FIFO, and requests delayed
     by a DELAY timeout after the others), from the head, taking following requests with the same `shape_key` while
     the rows fit in max_batch_size; the first request that does not fit or has another key ends it ("blocked").
     A model that does not batch (max_batch_size 0) or has no dynamic_batching: each batch is one request, at once.
  3. Preferred sizes: while the queue delay has not run out, dispatch the longest prefix of the candidate whose
     rows equal a preferred size (with max_queue_delay 0 too, as Triton does).
  4. Full: dispatch the whole candidate if it is blocked or its rows reach the largest preferred size
     (max_batch_size when none is configured, which is what Triton normalizes an empty list to).
  5. Delay: dispatch the whole candidate when max_queue_delay_us is 0, or once the OLDEST queued request has
     waited max_queue_delay_us (Ray Serve and Triton both time the window from the first request, not the last).
  6. gpud, no pointless waiting: when the queue holds this one request only and an instance is free, dispatch it
     (nothing can join it sooner than a new request arrives; at low load we must not pay the batching delay).
     With quiet_dispatch, not when it arrived in a stream (less than rule 7b's quiet time after the previous
     arrival): under a flood the queue empties for a moment between batches, and dispatching the first newcomer
     alone would occupy the instance with a batch of one while the rest of the stream queues behind it; rule 7
     then dispatches it within the quiet time, or with the others. Nor while requests arrive "busy": faster than
     a batch runs (the smoothed gap between arrivals, each gap counted up to twice the run time, is shorter than
     the driver's batch run time, `note_run`, averaged erring short). Then the next request comes while the
     instance would run this one alone, and a front end that hands over requests one at a time (the core's loop
     under load) made the instance run batch after batch of one, each paying a batch's fixed cost: 4 rows a batch
     and half the requests per second of Triton's batcher at 64 clients (docs/benchmarks.md). Held back so, it
     (and whatever queues behind it) waits for the next arrival: at most two typical gaps after the last one
     (then the queue goes, reason QUIET), or rule 7b's quiet time if sooner.
  7. gpud, nobody else is coming soon (only with quiet_dispatch=True), with an instance free: dispatch instead of
     waiting out the delay when (a) the queue holds at least as many rows as recent batches had (smoothed, the
     newest weighing 0.2: in a closed loop, the clients answered by those batches have all come back; not while
     arrivals are busy as rule 6 says, where batches of one would keep the bar at one), or (b) no
     request has arrived for `quiet_factor` times the typical gap between arrivals that queued behind others (an
     EWMA). Closed-loop clients fewer than the preferred batch size would otherwise pay the full max_queue_delay on
     every batch.
  8. Otherwise `Wait(until_s = min(oldest enqueue + max_queue_delay, quiet time, earliest deadline))`.

Queue policy (Triton's ModelQueuePolicy, per priority level, `core/src/scheduler_utils.cc`):
  - max_queue_size counts the level's queued requests, delayed ones included, a group (`QueuedRequest.members`) as
    its members; 0 = the daemon's default bound (`default_max_queue_size`; itself 0 = unbounded, Triton's
    behaviour). A request over it (a group that does not fit whole) is refused at once with UNAVAILABLE "Exceeds
    maximum queue size" and leaves the queue unchanged.
  - deadline = enqueue + default_timeout_us; with allow_timeout_override a request's own nonzero timeout_us applies
    when it is shorter (it may shorten the timeout, never lengthen it). 0 = no timeout.
  - timeout_action REJECT: `expire()` removes the request, the driver fails it with "Request timeout expired"
    (UNAVAILABLE). DELAY: `expire()` marks it delayed; it stays queued, behind its level's undelayed requests.
  - priority 0 or above priority_levels -> default_priority_level, as Triton's InferenceRequest::SetPriority does.

Where gpud differs from Triton on purpose:
  - a deadline passes at `now >= deadline_s` (Triton: `>`), so that `Wait(until_s=deadline)` always makes progress;
  - allow_timeout_override with default_timeout_us 0 lets a request set a timeout (Triton's code then ignores it;
    its documentation says a request may set a timeout shorter than the default, and "no timeout" is the longest);
  - rule 6 above.

`max_batch_size` and the dynamic-batching policy are read once per decision (`reconfigure()` replaces both).
"""
from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpud.executor.objective import delay_budget_s
from gpud.executor.model_config import DynamicBatching, QueuePolicy
from gpud.executor.types import ErrorKind, InferenceError

# Triton's exact texts: clients and Triton's own tests match on them.
QUEUE_FULL_MESSAGE = "Exceeds maximum queue size"
REQUEST_TIMEOUT_MESSAGE = "Request timeout expired"

_TIMEOUT_ACTIONS = ("REJECT", "DELAY")
_BUSY_WAIT_GAPS = 2.0  # rule 6: while arrivals are busy, what is queued waits at most this many typical gaps
_RUN_SMOOTHING = 0.2  # EWMA weight of the newest batch's run time (note_run)
_RUN_RISE = 0.05  # ... of a slower one in the average that errs short: a sustained rise, not one slow batch
_MIXED = object()  # BatchQueue._shared_key where queued requests differ in shape (or none was queued yet)
_BATCH_ROWS_SMOOTHING = 0.2  # EWMA weight of the newest batch in rule 7a's "rows of recent batches"


def timeout_error() -> InferenceError:
    """The error a driver fails an expired (REJECT) request with."""
    return InferenceError(ErrorKind.UNAVAILABLE, REQUEST_TIMEOUT_MESSAGE)


class QueuedRequest:
    """One request in the queue. Identity semantics: two requests with equal fields are still two requests.
    A plain class, not a dataclass: compiled (gpud.compiled), a dataclass's generated __init__ stays interpreted,
    and one is made per request."""
    __slots__ = ("payload", "batch_rows", "shape_key", "priority", "timeout_us", "members", "enqueue_time_s",
                 "deadline_s", "level", "delayed", "shed", "_deadline_seq")

    def __init__(self, payload: Any, batch_rows: int, shape_key: Hashable, priority: int = 0, timeout_us: int = 0,
                 members: int = 1) -> None:
        self.payload = payload  # opaque to the batcher (the driver's request + future)
        self.batch_rows = batch_rows  # rows this request contributes (its batch dim; 1 for a model that does not batch)
        self.shape_key = shape_key  # requests batch together only with the same key (non-batch dims / dtypes)
        self.priority = priority  # 0 = default level; else 1..priority_levels, 1 highest
        self.timeout_us = timeout_us  # 0 = the level's default_timeout_us
        self.members = members  # the requests it stands for (a group's rows concatenated); max_queue_size counts them
        # Set by the batcher on enqueue:
        self.enqueue_time_s = 0.0
        self.deadline_s: float | None = None  # None = no timeout
        self.level = 0  # the priority level it is queued at (0 when levels are off)
        self.delayed = False  # its DELAY timeout passed: it now goes after the others
        self.shed = False  # its deadline is the latency objective's: rejected when passed
        self._deadline_seq = -1  # matches its live deadline-heap entry

    def __repr__(self) -> str:
        return (f"QueuedRequest(payload={self.payload!r}, batch_rows={self.batch_rows}, priority={self.priority}, "
                f"level={self.level}, deadline_s={self.deadline_s})")


class DispatchReason(enum.Enum):
    UNBATCHED = "unbatched"  # the model does not batch, or has no dynamic batching
    PREFERRED = "preferred"  # the rows reached a preferred batch size
    FULL = "full"  # blocked (next request does not fit / other shape) or reached the largest preferred size
    DELAY = "delay"  # the oldest request waited max_queue_delay (or the delay is 0)
    LONE = "lone"  # the only queued request and an instance is free (gpud rule)
    QUIET = "quiet"  # no arrival for several typical gaps while an instance is free (gpud rule)


@dataclass(frozen=True)
class Dispatch:
    """Send these requests, in this order, as one batch. They are already removed from the queue."""

    requests: tuple[QueuedRequest, ...]
    rows: int
    reason: DispatchReason


class Wait:
    """Nothing to send now; call decide() again at `until_s` (clock seconds) or on the next event. (Not a
    dataclass: one is made per decision, and a compiled dataclass's __init__ stays interpreted.) Read only."""
    __slots__ = ("until_s",)

    def __init__(self, until_s: float) -> None:
        self.until_s = until_s

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Wait) and other.until_s == self.until_s

    def __hash__(self) -> int:
        return hash(self.until_s)

    def __repr__(self) -> str:
        return f"Wait(until_s={self.until_s!r})"


@dataclass(frozen=True)
class Idle:
    """Nothing to send and no timer needed: wait for the next event."""


Decision = Dispatch | Wait | Idle


# ---------------------------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------------------------


def resolve_level(priority: int, priority_levels: int, default_priority_level: int) -> int:
    """The level a request queues at. Out-of-range priorities get the default level, as in Triton."""
    if priority < 0:
        raise InferenceError(ErrorKind.INVALID_ARGUMENT, f"priority must be >= 0, got {priority}")
    if priority_levels == 0:
        return 0
    if priority == 0 or priority > priority_levels:
        return default_priority_level
    return priority


def effective_timeout_us(request_timeout_us: int, policy: QueuePolicy) -> int:
    """The queue timeout a request gets (0 = none): the level's default, or the request's own if shorter and allowed."""
    if request_timeout_us < 0:
        raise InferenceError(ErrorKind.INVALID_ARGUMENT, f"timeout must be >= 0 microseconds, got {request_timeout_us}")
    timeout_us = policy.default_timeout_us
    if policy.allow_timeout_override and request_timeout_us > 0:
        # A request may shorten its timeout, never lengthen it; "no default" counts as the longest.
        if timeout_us == 0 or request_timeout_us < timeout_us:
            timeout_us = request_timeout_us
    return timeout_us


def take_candidate(ordered: Iterable[QueuedRequest], max_rows: int) -> tuple[list[QueuedRequest], bool]:
    """The candidate batch from requests in dispatch order, and whether it is blocked.

    Takes the head and the following requests with the head's shape_key while the rows fit in max_rows. Blocked:
    a next request exists that cannot join (too many rows or another key), so the batch cannot grow any more, since
    Triton keeps order and never reaches past it. The head is taken even if it alone exceeds max_rows (possible only
    after reconfigure() shrank max_batch_size): it must leave the queue somehow, and the model will reject it.
    """
    batch: list[QueuedRequest] = []
    rows = 0
    for req in ordered:
        if batch and (req.shape_key != batch[0].shape_key or rows + req.batch_rows > max_rows):
            return batch, True
        batch.append(req)
        rows += req.batch_rows
    return batch, False


def preferred_prefix_len(rows: Sequence[int], preferred_batch_sizes: Iterable[int]) -> int:
    """How many leading requests form the longest prefix whose cumulative rows is a preferred size (0 = none)."""
    preferred = frozenset(preferred_batch_sizes)
    best = 0
    cumulative = 0
    for i, r in enumerate(rows, start=1):
        cumulative += r
        if cumulative in preferred:
            best = i
    return best


def choose_dispatch(
    rows: Sequence[int],
    *,
    blocked: bool,
    max_batch_size: int,
    preferred_batch_sizes: Sequence[int],
    max_queue_delay_us: int,
    delay_exceeded: bool,
    lone: bool,
    quiet: bool = False,
) -> tuple[int, DispatchReason] | None:
    """How many leading candidate requests to dispatch now and why, or None to wait. Rules 3-6 of the module doc.

    The order follows Triton's GetDynamicBatch: a preferred prefix wins while the delay has not run out; once it
    has, the whole candidate goes (a late batch should be as large as it can be, not cut back to a preferred size).
    """
    if not delay_exceeded and preferred_batch_sizes:
        n = preferred_prefix_len(rows, preferred_batch_sizes)
        if n:
            return n, DispatchReason.PREFERRED
    # (not max(..., default=): a keyword call goes through a dict, on every request)
    largest_preferred = max(preferred_batch_sizes) if preferred_batch_sizes else max_batch_size
    if blocked or sum(rows) >= largest_preferred:
        return len(rows), DispatchReason.FULL
    if delay_exceeded or max_queue_delay_us == 0:
        return len(rows), DispatchReason.DELAY
    if lone:
        return len(rows), DispatchReason.LONE
    if quiet:
        return len(rows), DispatchReason.QUIET
    return None


def quiet_wait_s(gap_ewma_s: float | None, quiet_factor: float, min_quiet_s: float) -> float | None:
    """How long without an arrival means "nobody else is coming" (None: no gap observed yet)."""
    if gap_ewma_s is None:
        return None
    return max(min_quiet_s, quiet_factor * gap_ewma_s)


# ---------------------------------------------------------------------------------------------------------------
# Configuration snapshot
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Config:
    max_batch_size: int
    dynamic_batching: DynamicBatching | None
    dispatch_lone_request: bool
    default_max_queue_size: int = 0  # the bound where the model's queue policy sets none (0: none either)
    # Derived once (every request reads them): see __post_init__.
    batches_dynamically: bool = field(init=False)
    priority_levels: int = field(init=False)
    default_level: int = field(init=False)  # where priority 0 queues
    max_rows: int = field(init=False)  # a model that does not batch takes one "row": the whole request
    # What a request with neither a priority nor a timeout of its own gets (most requests): its level, the level's
    # policy, its timeout and the level's size limit, worked out here instead of on each of them.
    plain: tuple[int, QueuePolicy, int, int] = field(init=False)

    def __post_init__(self) -> None:
        db = self.dynamic_batching
        object.__setattr__(self, "batches_dynamically", self.max_batch_size > 0 and db is not None)
        object.__setattr__(self, "priority_levels", db.priority_levels if db else 0)
        object.__setattr__(self, "default_level", db.default_priority_level if db else 0)
        object.__setattr__(self, "max_rows", max(1, self.max_batch_size))
        level = resolve_level(0, self.priority_levels, self.default_level)
        policy = self.policy(level)
        object.__setattr__(self, "plain", (level, policy, effective_timeout_us(0, policy),
                                           policy.max_queue_size or self.default_max_queue_size))

    def policy(self, level: int) -> QueuePolicy:
        # Without dynamic batching Triton has no queue policy: no size limit, no timeouts.
        return self.dynamic_batching.queue_policy(level) if self.dynamic_batching else _NO_POLICY


_NO_POLICY = QueuePolicy()


def _validate(max_batch_size: int, db: DynamicBatching | None) -> None:
    """ValueError at once for a configuration Triton would refuse to load."""
    if max_batch_size < 0:
        raise ValueError(f"max_batch_size must be >= 0, got {max_batch_size}")
    if db is None:
        return
    if db.max_queue_delay_us < 0:
        raise ValueError(f"max_queue_delay_us must be >= 0, got {db.max_queue_delay_us}")
    if max_batch_size > 0:
        bad = [s for s in db.preferred_batch_sizes if not 1 <= s <= max_batch_size]
        if bad:
            raise ValueError(f"preferred_batch_sizes {bad} outside 1..max_batch_size ({max_batch_size})")
    if db.priority_levels < 0:
        raise ValueError(f"priority_levels must be >= 0, got {db.priority_levels}")
    if db.priority_levels > 0 and not 1 <= db.default_priority_level <= db.priority_levels:
        raise ValueError(
            f"default_priority_level must be in 1..{db.priority_levels} when priority_levels is set, "
            f"got {db.default_priority_level}"
        )
    bad_levels = sorted(lvl for lvl in db.priority_queue_policy if not 1 <= lvl <= db.priority_levels)
    if bad_levels:
        raise ValueError(f"priority_queue_policy levels {bad_levels} outside 1..priority_levels ({db.priority_levels})")
    for policy in (db.default_queue_policy, *db.priority_queue_policy.values()):
        if policy.timeout_action not in _TIMEOUT_ACTIONS:
            raise ValueError(f"timeout_action must be one of {_TIMEOUT_ACTIONS}, got {policy.timeout_action!r}")
        if policy.max_queue_size < 0 or policy.default_timeout_us < 0:
            raise ValueError(f"max_queue_size and default_timeout_us must be >= 0: {policy}")


class _Level:
    """One priority level: undelayed requests FIFO, then delayed ones in the order their timeouts passed.

    dicts keyed by request (identity hash) are ordered sets: O(1) removal of a cancelled request, ordered iteration.
    """

    __slots__ = ("waiting", "delayed", "members")

    def __init__(self) -> None:
        self.waiting: dict[QueuedRequest, None] = {}
        self.delayed: dict[QueuedRequest, None] = {}
        self.members = 0  # the requests queued here, a group's members each (max_queue_size counts these)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.delayed)

    def __iter__(self) -> Iterator[QueuedRequest]:
        yield from self.waiting
        yield from self.delayed

    def discard(self, req: QueuedRequest) -> None:
        if self.waiting.pop(req, 0) is None or self.delayed.pop(req, 0) is None:
            self.members -= req.members


# ---------------------------------------------------------------------------------------------------------------
# The queue
# ---------------------------------------------------------------------------------------------------------------


class BatchQueue:
    """One model's request queue and dispatch decisions. Not thread-safe: one driver (one event loop) owns it."""

    def __init__(
        self,
        *,
        max_batch_size: int,
        dynamic_batching: DynamicBatching | None,
        clock: Callable[[], float],
        dispatch_lone_request: bool = True,
        quiet_dispatch: bool = False,
        default_max_queue_size: int = 0,
        quiet_factor: float = 4.0,
        min_quiet_s: float = 50e-6,
        gap_smoothing: float = 0.2,
        latency_budget_s: float | None = None,
        shed: bool = False,
    ):
        """dispatch_lone_request: gpud's rule 6; quiet_dispatch: rule 7. Both False give Triton's behaviour.
        latency_budget_s: the model's latency objective (gpud.executor.objective): the delay never keeps the oldest
        request past what it leaves once the batch's expected run time (`expected_run_s`, the driver's) is taken.
        shed: a request still queued when it has waited latency_budget_s is rejected (expire() returns it, `shed`
        set), whatever its level's timeout action."""
        _validate(max_batch_size, dynamic_batching)
        if default_max_queue_size < 0:
            raise ValueError(f"default_max_queue_size must be >= 0, got {default_max_queue_size}")
        self._config = _Config(max_batch_size, dynamic_batching, dispatch_lone_request, default_max_queue_size)
        self._clock = clock
        self.latency_budget_s = latency_budget_s
        self.shed = shed and latency_budget_s is not None
        self.expected_run_s = 0.0  # how long a batch is expected to take once dispatched (the driver keeps it)
        self.typical_run_s = 0.0  # the same, erring short (rule 6's "busy"): note_run keeps both
        self._quiet_dispatch = quiet_dispatch
        self._quiet_factor = quiet_factor
        self._min_quiet_s = min_quiet_s
        self._gap_smoothing = gap_smoothing
        self._last_arrival_s: float | None = None
        self._gap_ewma_s: float | None = None  # typical gap between arrivals that found others queued
        self._lone_gap_s: float | None = None  # gap between the latest arrival and the one before it
        self._arrival_gap_ewma_s: float | None = None  # typical gap between any two arrivals (rule 6), each at
        # most twice typical_run_s: the rule asks only whether it is shorter, and a long idle pause counted in
        # full would keep the average high through the next flood's first dozens of requests
        self._last_batch_rows = 0.0  # rows of recent batches, smoothed (rule 7a); 0 = none yet
        self._levels: dict[int, _Level] = {}
        self._all: dict[QueuedRequest, None] = {}  # every queued request in enqueue order: first = oldest
        self._pending_rows = 0
        # The shape key every queued request has (_MIXED: not one key, or not known since; read only while some are
        # queued: the first one queued sets it).
        # With one key, no deadline and the rows under the largest batch, the candidate is the whole queue and
        # not blocked: a decision need not list it (decide's fast path: each arrival decides, O(1) then).
        self._shared_key: object = _MIXED
        # (deadline_s, seq, request) of undelayed requests with a timeout. Lazy deletion: entries of requests that
        # left the queue or were delayed stay until they reach the top (or a compaction), and are skipped there.
        self._deadlines: list[tuple[float, int, QueuedRequest]] = []
        self._seq = itertools.count()

    # -- configuration ---------------------------------------------------------------------------------------

    @property
    def max_batch_size(self) -> int:
        return self._config.max_batch_size

    @property
    def dynamic_batching(self) -> DynamicBatching | None:
        return self._config.dynamic_batching

    def reconfigure(self, *, max_batch_size: int, dynamic_batching: DynamicBatching | None) -> None:
        """New limits for the next decisions. Queued requests keep their level and deadline."""
        _validate(max_batch_size, dynamic_batching)
        old = self._config
        self._config = _Config(max_batch_size, dynamic_batching, old.dispatch_lone_request, old.default_max_queue_size)

    def note_run(self, seconds: float) -> None:
        """A batch took `seconds` from dispatch to its answers (the driver tells each). Two averages: one that takes
        a slower batch at once (the objective's delay errs towards going early), one that takes a faster batch at
        once (rule 6 errs towards going alone: one slow batch must not hold back a lone client's next requests)."""
        prev = self.expected_run_s
        self.expected_run_s = seconds if seconds > prev else prev + _RUN_SMOOTHING * (seconds - prev)
        prev = self.typical_run_s
        self.typical_run_s = seconds if seconds < prev or prev <= 0 else prev + _RUN_RISE * (seconds - prev)

    # -- state -------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[QueuedRequest]:
        """The queued requests, oldest first (not the dispatch order: see drain)."""
        return iter(self._all)

    def __contains__(self, req: object) -> bool:
        return req in self._all

    @property
    def watches_deadlines(self) -> bool:
        """Whether a queued request may have a deadline (False: expire() has nothing to do, and with no free
        instance decide() is Idle)."""
        return bool(self._deadlines)

    @property
    def pending_rows(self) -> int:
        return self._pending_rows

    @property
    def oldest_enqueue_time_s(self) -> float | None:
        return next(iter(self._all)).enqueue_time_s if self._all else None

    def level_sizes(self) -> dict[int, int]:
        """Queued requests per priority level (for metrics and `gpudctl inspect`)."""
        return {lvl: len(q) for lvl, q in sorted(self._levels.items()) if len(q)}

    # -- events ------------------------------------------------------------------------------------------------

    def enqueue(self, req: QueuedRequest) -> None:
        """Queue a request, or raise InferenceError and change nothing."""
        cfg = self._config
        if req in self._all:
            raise ValueError("request is already queued")
        if req.batch_rows < 1:
            raise InferenceError(
                ErrorKind.INVALID_ARGUMENT, f"inference request batch-size must be >= 1, got {req.batch_rows}"
            )
        max_rows = cfg.max_rows
        if req.batch_rows > max_rows:
            raise InferenceError(
                ErrorKind.INVALID_ARGUMENT, f"inference request batch-size must be <= {max_rows}, got {req.batch_rows}"
            )
        if req.priority == 0 and req.timeout_us == 0:
            level, policy, timeout_us, limit = cfg.plain
        else:
            level = resolve_level(req.priority, cfg.priority_levels, cfg.default_level)
            policy = cfg.policy(level)
            timeout_us = effective_timeout_us(req.timeout_us, policy)
            limit = policy.max_queue_size or cfg.default_max_queue_size
        queue = self._levels.get(level)
        if limit:
            queued_at_level = queue.members if queue is not None else 0
            if queued_at_level + req.members > limit:  # a group fits whole or not at all
                raise InferenceError(
                    ErrorKind.UNAVAILABLE,
                    f"{QUEUE_FULL_MESSAGE} (queue full: {queued_at_level} of {limit} requests at priority level "
                    f"{level}" + ("" if policy.max_queue_size else "; the daemon's --default-max-queue-size") + ")",
                )

        now_s = self._clock()
        self._lone_gap_s = None if self._last_arrival_s is None else now_s - self._last_arrival_s
        if self._lone_gap_s is not None and self._quiet_dispatch and self.typical_run_s > 0:  # 0: none ran yet
            gap_s = min(max(0.0, self._lone_gap_s), 2 * self.typical_run_s)
            prev = self._arrival_gap_ewma_s
            self._arrival_gap_ewma_s = gap_s if prev is None else prev + self._gap_smoothing * (gap_s - prev)
        if self._all and self._last_arrival_s is not None:
            # Only gaps inside a burst (others still queued) say how fast requests join a forming batch.
            gap_s = max(0.0, now_s - self._last_arrival_s)
            a = self._gap_smoothing
            self._gap_ewma_s = gap_s if self._gap_ewma_s is None else (1 - a) * self._gap_ewma_s + a * gap_s
        self._last_arrival_s = now_s
        req.enqueue_time_s = now_s
        req.level = level
        req.delayed = False
        req.deadline_s = now_s + timeout_us / 1e6 if timeout_us else None
        req.shed = False
        if self.shed:
            assert self.latency_budget_s is not None
            shed_s = now_s + self.latency_budget_s
            if req.deadline_s is None or shed_s < req.deadline_s:
                req.deadline_s, req.shed = shed_s, True
        if queue is None:
            queue = self._levels[level] = _Level()
        queue.waiting[req] = None
        queue.members += req.members
        if not self._all:
            self._shared_key = req.shape_key
        elif self._shared_key is not _MIXED and req.shape_key != self._shared_key:
            self._shared_key = _MIXED
        self._all[req] = None
        self._pending_rows += req.batch_rows
        req._deadline_seq = next(self._seq)
        if req.deadline_s is not None:
            heapq.heappush(self._deadlines, (req.deadline_s, req._deadline_seq, req))

    def remove(self, req: QueuedRequest) -> bool:
        """Take out a cancelled request (client went away). False if it is not queued (any more): idempotent."""
        if req not in self._all:
            return False
        self._forget(req)
        return True

    def drain(self) -> list[QueuedRequest]:
        """Everything queued, in dispatch order, removed (shutdown / model unload)."""
        out = list(self._ordered(now_s=None))
        self._levels.clear()
        self._all.clear()
        self._deadlines.clear()
        self._pending_rows = 0
        return out

    def expire(self) -> list[QueuedRequest]:
        """Apply the timeout action to every request whose deadline has passed (now >= deadline_s).

        REJECT: removed and returned; the driver fails them with timeout_error(). DELAY: marked delayed and moved
        behind the undelayed requests of their level; they stay queued and are not returned.
        """
        now_s = self._clock()
        cfg = self._config
        rejected: list[QueuedRequest] = []
        while self._deadlines and self._deadlines[0][0] <= now_s:
            entry = heapq.heappop(self._deadlines)
            req = entry[2]
            if not self._is_live(entry):
                continue  # stale entry: dispatched, removed or already delayed
            if cfg.policy(req.level).timeout_action == "DELAY" and not req.shed:
                level = self._levels[req.level]
                del level.waiting[req]
                level.delayed[req] = None
                req.delayed = True
            else:
                self._forget(req)
                rejected.append(req)
        return rejected

    def decide(self, free_instances: int) -> Decision:
        """What to do now: dispatch one batch (already dequeued), wait until a time, or wait for an event."""
        cfg = self._config  # read once: a concurrent reconfigure() applies from the next decision
        now_s = self._clock()
        if not self._all:
            return Idle()
        if free_instances <= 0:
            return self._wait_for_deadline()

        if not cfg.batches_dynamically:
            head = next(self._ordered(now_s), None)
            if head is None:  # only timed-out requests left: expire() must collect them
                return self._wait_for_deadline()
            return self._dispatch([head], DispatchReason.UNBATCHED)

        db = cfg.dynamic_batching
        assert db is not None
        candidate: list[QueuedRequest] | None
        if self._shared_key is not _MIXED and not self._deadlines and not db.preferred_batch_sizes \
                and self._pending_rows < cfg.max_batch_size:
            # The candidate is every queued request, not blocked: rules 4-7 need only its rows in all, and a
            # request that goes takes the whole queue (choose_dispatch's n is then 1 of these 1 "rows").
            candidate, blocked, rows = None, False, [self._pending_rows]
        else:
            candidate, blocked = take_candidate(self._ordered(now_s), cfg.max_batch_size)
            if not candidate:
                return self._wait_for_deadline()
            rows = [r.batch_rows for r in candidate]
        # Rule 5 times the window from the oldest request in the whole queue. A candidate that is not blocked holds
        # every dispatchable request, so this equals Triton's "oldest request in the pending batch" whenever it
        # matters (a blocked candidate goes at once anyway).
        delay_ends_s = self._delay_ends_s(db)
        delay_exceeded = db.max_queue_delay_us > 0 and now_s >= delay_ends_s
        quiet_ends_s = None
        lone = cfg.dispatch_lone_request and len(self._all) == 1
        # requests come faster than a batch runs (rules 6 and 7a): whoever is next comes while this batch would run
        busy = self._arrival_gap_ewma_s is not None and self._arrival_gap_ewma_s < self.typical_run_s
        if self._quiet_dispatch and self._last_arrival_s is not None:
            wait_s = quiet_wait_s(self._gap_ewma_s, self._quiet_factor, self._min_quiet_s)
            if wait_s is not None:
                quiet_ends_s = self._last_arrival_s + wait_s
                if lone and self._lone_gap_s is not None and self._lone_gap_s < wait_s:
                    lone = False  # it came in a stream: rule 7 decides
            if busy:  # what it waits for is the next arrival: two typical gaps without one, and the queue goes
                assert self._arrival_gap_ewma_s is not None
                busy_ends_s = self._last_arrival_s + _BUSY_WAIT_GAPS * self._arrival_gap_ewma_s
                quiet_ends_s = busy_ends_s if quiet_ends_s is None else min(quiet_ends_s, busy_ends_s)
                lone = False
        choice = choose_dispatch(
            rows,
            blocked=blocked,
            max_batch_size=cfg.max_batch_size,
            preferred_batch_sizes=db.preferred_batch_sizes,
            max_queue_delay_us=db.max_queue_delay_us,
            delay_exceeded=delay_exceeded,
            lone=lone,
            quiet=(quiet_ends_s is not None and now_s >= quiet_ends_s)
            or (self._quiet_dispatch and not busy and 0 < round(self._last_batch_rows) <= self._pending_rows),
        )
        if choice is not None:
            n, reason = choice
            return self._dispatch(list(self._ordered(None)) if candidate is None else candidate[:n], reason)
        until_s = delay_ends_s if quiet_ends_s is None else min(delay_ends_s, quiet_ends_s)
        deadline_s = self._earliest_deadline_s()
        return Wait(until_s=until_s if deadline_s is None else min(until_s, deadline_s))

    # -- internals ---------------------------------------------------------------------------------------------

    def _ordered(self, now_s: float | None) -> Iterator[QueuedRequest]:
        """Queued requests in dispatch order. With now_s, skips those whose REJECT deadline has passed: they are
        expire()'s to return, never a batch's (Triton's ApplyPolicy does the same while it forms a batch)."""
        levels = self._levels
        # The usual queue, one level and no request with a deadline (none in the heap: nothing to skip), read
        # straight from its dicts (a decision reads the queue on each arrival while an instance is free)
        if len(levels) == 1 and (now_s is None or not self._deadlines):
            level = next(iter(levels.values()))
            return itertools.chain(level.waiting, level.delayed) if level.delayed else iter(level.waiting)
        return self._ordered_levels(now_s)

    def _ordered_levels(self, now_s: float | None) -> Iterator[QueuedRequest]:
        cfg = self._config
        for level_no in sorted(self._levels):
            rejects = cfg.policy(level_no).timeout_action == "REJECT"
            for req in self._levels[level_no]:
                if now_s is not None and (rejects or req.shed) and req.deadline_s is not None \
                        and now_s >= req.deadline_s:
                    continue
                yield req

    def _delay_ends_s(self, db: DynamicBatching) -> float:
        # One expression for both the comparison and Wait.until_s, so waking at until_s always dispatches
        # (computing "waited >= delay" by subtraction could round the other way and spin).
        oldest_s = next(iter(self._all)).enqueue_time_s
        ends_s = oldest_s + db.max_queue_delay_us / 1e6
        if self.latency_budget_s is not None:  # the objective's room for waiting, once the run is taken
            ends_s = min(ends_s, oldest_s + delay_budget_s(self.latency_budget_s, self.expected_run_s))
        return ends_s

    def _dispatch(self, requests: list[QueuedRequest], reason: DispatchReason) -> Dispatch:
        for req in requests:
            self._remove(req)
        self._compact_deadlines()  # once for the batch
        rows = sum(r.batch_rows for r in requests)
        # Smoothed, not the last batch alone: one small batch (a lone request between bursts) must not make every
        # following batch leave as soon as it is that small, which ratchets a flood down to batches of one or two.
        # Compared rounded: approaching a steady size from above, the average stays a fraction over it for long.
        prev = self._last_batch_rows
        self._last_batch_rows = rows if prev <= 0 else prev + _BATCH_ROWS_SMOOTHING * (rows - prev)
        return Dispatch(requests=tuple(requests), rows=rows, reason=reason)

    def _forget(self, req: QueuedRequest) -> None:
        self._remove(req)
        self._compact_deadlines()

    def _remove(self, req: QueuedRequest) -> None:
        """Out of its level and the queue; its deadline's heap entry goes stale (see _compact_deadlines)."""
        level = self._levels[req.level]
        level.discard(req)
        if not level.waiting and not level.delayed:
            del self._levels[req.level]
        del self._all[req]
        self._pending_rows -= req.batch_rows

    def _compact_deadlines(self) -> None:
        # Heap entries of requests gone are stale; compact when stale entries dominate so a burst of dispatched
        # requests with long timeouts does not keep the heap large.
        if self._deadlines and len(self._deadlines) > 2 * len(self._all) + 64:
            self._deadlines = [e for e in self._deadlines if self._is_live(e)]
            heapq.heapify(self._deadlines)

    def _is_live(self, entry: tuple[float, int, QueuedRequest]) -> bool:
        # The seq check catches a request that left and was enqueued again (a retry): its old entry is stale.
        _, seq, req = entry
        return req in self._all and not req.delayed and req._deadline_seq == seq

    def _earliest_deadline_s(self) -> float | None:
        while self._deadlines and not self._is_live(self._deadlines[0]):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def _wait_for_deadline(self) -> Decision:
        deadline_s = self._earliest_deadline_s()
        return Idle() if deadline_s is None else Wait(until_s=deadline_s)
