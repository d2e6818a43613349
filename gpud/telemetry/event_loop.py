"""How well an event loop keeps up: its lag, its own stalls, and its CPU time, for the core's loop and each front-end
process's (gpud.frontproc), exported to Prometheus.

Everything a request costs in gpud's front end runs on an event loop, one per process. A loop that falls behind
delays every request behind it, and the processes' loops are what `--http-processes` / `--grpc-processes` scale.

A timer fires every 20 ms while the loop works, every 0.25 s while it idles (few wake-ups: they cost idle CPU):
- **lag**: how late it fired (wall time). What any callback waiting on the loop waited extra, whatever the cause: a
  callback of the loop's own that ran long, the process waiting for a CPU (a busy or shared machine), or another
  thread holding the GIL.
- **stall**: the part of that lateness the loop's own thread spent running: its CPU time between two ticks (from
  `time.thread_time`) beyond what its recent rate of work accounts for, never more than the lateness. A callback that
  holds the loop (a large body decoded on it) shows here; the kernel keeping the process from a core does not. So
  a stall is the daemon's own doing, steady from one machine to the next, where lag also says how loaded the node is.
- **CPU**: the loop thread's CPU seconds: its rate is how busy the loop is, 1.0 at saturation (then more front-end
  processes help, when the node has the cores).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

BUSY_INTERVAL_S = 0.02
IDLE_INTERVAL_S = 0.25
IDLE_BELOW_RATIO = 0.01  # a loop busy less than 1% of the time idles: its timer wakes it 4 times a second
# Upper bounds of the histograms' buckets, seconds (and +Inf). A loop's turn is normally well under a millisecond.
BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REPORT_INTERVAL_S = 1.0  # a front-end process reports its counts to the core about once a second
STALL_LOG_S = 0.1  # a stall this long is logged (a warning at most once a minute, with how many there were)
STALL_LOG_EVERY_S = 60.0

log = logging.getLogger("gpud.event_loop")


def stall_s(interval_s: float, late_s: float, cpu_s: float, busy_ratio: float) -> float:
    """The loop's own part of a tick's lateness: of the `interval_s + late_s` between two ticks its thread ran `cpu_s`,
    of which its recent rate of work (`busy_ratio`, 0..1) accounts for `busy_ratio * interval_s` before the tick was
    due; the rest held the tick up, as far as it was late."""
    return max(0.0, min(late_s, cpu_s - busy_ratio * interval_s))


def next_interval_s(busy_ratio: float) -> float:
    """How long until the next tick: often while the loop works, rarely while it idles."""
    return BUSY_INTERVAL_S if busy_ratio >= IDLE_BELOW_RATIO else IDLE_INTERVAL_S


def bucket_index(value_s: float) -> int:
    """The first bucket whose upper bound holds `value_s` (len(BUCKETS_S): +Inf)."""
    for i, bound in enumerate(BUCKETS_S):
        if value_s <= bound:
            return i
    return len(BUCKETS_S)


@dataclass
class Histogram:
    """Counts per bucket (not cumulative; the last is +Inf) and the sum of the values observed."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))
    sum_s: float = 0.0

    def observe(self, value_s: float) -> None:
        self.counts[bucket_index(value_s)] += 1
        self.sum_s += value_s

    @property
    def count(self) -> int:
        return sum(self.counts)

    def count_over(self, bound_s: float) -> int:
        """Observations in buckets above `bound_s` (one of BUCKETS_S)."""
        return sum(self.counts[BUCKETS_S.index(bound_s) + 1:])

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' buckets: (le, observations <= le), +Inf last."""
        out, total = [], 0
        for bound, n in zip((*[repr(b) for b in BUCKETS_S], "+Inf"), self.counts):
            total += n
            out.append((bound, total))
        return out


@dataclass
class LoopCounts:
    """What a loop's monitor has counted since it started."""

    lag: Histogram = field(default_factory=Histogram)
    stall: Histogram = field(default_factory=Histogram)
    cpu_s: float = 0.0  # the loop thread's CPU time while monitored
    busy_ratio: float = 0.0  # the share of about the last second the loop's thread ran (gpudctl inspect)

    def wire(self) -> tuple:
        """As plain data (a front-end process's report over its link)."""
        return (tuple(self.lag.counts), self.lag.sum_s, tuple(self.stall.counts), self.stall.sum_s, self.cpu_s,
                self.busy_ratio)

    @classmethod
    def of_wire(cls, wire: tuple) -> LoopCounts:
        lag_counts, lag_sum, stall_counts, stall_sum, cpu_s, busy_ratio = wire
        if len(lag_counts) != len(BUCKETS_S) + 1 or len(stall_counts) != len(BUCKETS_S) + 1:
            raise ValueError(f"a loop report with {len(lag_counts)} buckets, not {len(BUCKETS_S) + 1}")
        return cls(Histogram([int(n) for n in lag_counts], float(lag_sum)),
                   Histogram([int(n) for n in stall_counts], float(stall_sum)), float(cpu_s), float(busy_ratio))

    def inspect(self) -> dict[str, float | int]:
        """For `gpudctl inspect` (EVENT LOOPS)."""
        return {"busy_ratio": self.busy_ratio, "cpu_s": self.cpu_s, "ticks": self.lag.count,
                "lag_over_50ms": self.lag.count_over(0.05), "stalls_over_50ms": self.stall.count_over(0.05),
                "stall_s": self.stall.sum_s}


class LoopMonitor:
    """Ticks on the running loop from `start()` to `stop()`, counting each tick's lag and stall (`counts`).
    `on_report(counts)` is called about every `report_interval_s` (a front-end process sends them to the core).
    `cpu_clock` is the calling thread's CPU time (the loop's thread: ticks run on it); tests drive `begin` and `tick`
    with clocks of their own."""

    def __init__(self, name: str = "core", *, cpu_clock: Callable[[], float] = time.thread_time,
                 on_report: Callable[[LoopCounts], None] | None = None,
                 report_interval_s: float = REPORT_INTERVAL_S):
        self.name = name  # the process's, as its metrics label it ("core", "http-0", ...): for the log
        self.counts = LoopCounts()
        self._cpu_clock = cpu_clock
        self._on_report = on_report
        self._report_interval_s = report_interval_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_s = 0.0  # when the last tick came (or monitoring began)
        self._due_s = 0.0  # when the next is due
        self._cpu_last_s = 0.0
        self._busy_ratio = 0.0  # the loop thread's share of the last gap between ticks
        self._reported_s = 0.0
        self._cpu_reported_s = 0.0
        self._stalls_unlogged = 0  # stalls of STALL_LOG_S or more since the last warning
        self._stall_logged_s: float | None = None  # when the last warning was written

    def start(self) -> None:
        """Start ticking on the running loop (again after `stop()`: the counts go on), and report."""
        if self._timer is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.begin(self._loop.time(), self._cpu_clock())
        self._timer = self._loop.call_at(self._due_s, self._tick)
        if self._on_report is not None:  # at once: the series exist from the start
            self._on_report(self.counts)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def running(self) -> bool:
        return self._timer is not None

    @property
    def due_s(self) -> float:
        return self._due_s

    def begin(self, now_s: float, cpu_now_s: float) -> None:
        """Monitoring begins at `now_s`, the loop thread's CPU clock at `cpu_now_s`: the first tick is due soon."""
        self._last_s = self._reported_s = now_s
        self._cpu_last_s = self._cpu_reported_s = cpu_now_s
        self._due_s = now_s + BUSY_INTERVAL_S

    def _tick(self) -> None:
        assert self._loop is not None
        self.tick(self._loop.time(), self._cpu_clock())
        self._timer = self._loop.call_at(self._due_s, self._tick)

    def tick(self, now_s: float, cpu_now_s: float) -> None:
        """Count the tick that came at `now_s`, the loop thread's CPU clock at `cpu_now_s`, and set when the next is
        due (`due_s`)."""
        interval_s = self._due_s - self._last_s
        late_s = max(0.0, now_s - self._due_s)
        gap_s = now_s - self._last_s
        cpu_s = max(0.0, cpu_now_s - self._cpu_last_s)
        counts = self.counts
        counts.lag.observe(late_s)
        stalled_s = stall_s(interval_s, late_s, cpu_s, self._busy_ratio)
        counts.stall.observe(stalled_s)
        counts.cpu_s += cpu_s
        self._busy_ratio = min(1.0, cpu_s / gap_s) if gap_s > 0 else 0.0
        self._last_s = now_s
        self._cpu_last_s = cpu_now_s
        self._due_s = now_s + next_interval_s(self._busy_ratio)
        if stalled_s >= STALL_LOG_S:
            self._stall_seen(now_s, stalled_s)
        if now_s - self._reported_s >= self._report_interval_s:
            counts.busy_ratio = min(1.0, (cpu_now_s - self._cpu_reported_s) / (now_s - self._reported_s))
            self._reported_s = now_s
            self._cpu_reported_s = cpu_now_s
            if self._on_report is not None:
                self._on_report(counts)

    def _stall_seen(self, now_s: float, stalled_s: float) -> None:
        """A warning that says what happened, at most once a minute (the others counted in the next one)."""
        self._stalls_unlogged += 1
        if self._stall_logged_s is not None and now_s - self._stall_logged_s < STALL_LOG_EVERY_S:
            return
        more = self._stalls_unlogged - 1
        log.warning("the %s process's event loop was held %.0f ms by work of gpud's own%s: requests on it waited "
                    "that long (gpud_event_loop_stall_seconds). Please report it, with this log.", self.name,
                    stalled_s * 1e3, f" ({more} more such stall(s) since the last warning)" if more else "")
        self._stalls_unlogged = 0
        self._stall_logged_s = now_s


LoopSource = Callable[[], Mapping[str, LoopCounts]]


class LoopCollector(Collector):
    """The loops' counts as Prometheus series, by `process` ("core", "http-0", "grpc-1", ...), from sources read at
    scrape time (the core's monitor; each front-end host's processes' last reports)."""

    def __init__(self, sources: Iterable[LoopSource] = (), registry: CollectorRegistry | None = None):
        self.sources: list[LoopSource] = list(sources)
        if registry is not None:
            registry.register(self)

    def describe(self) -> Iterable[Metric]:
        return self._families()

    @staticmethod
    def _families() -> tuple[HistogramMetricFamily, HistogramMetricFamily, CounterMetricFamily]:
        return (
            HistogramMetricFamily("gpud_event_loop_lag_seconds", "How late the event loop's timer fired (every 20 "
                                  "ms while it works): what every callback waiting on the loop waited extra (the "
                                  "loop busy, the process waiting for a CPU, another thread holding the GIL).",
                                  labels=("process",)),
            HistogramMetricFamily("gpud_event_loop_stall_seconds", "The part of each lag the loop's own thread spent "
                                  "running beyond its recent rate of work: a callback that held the loop. Not the "
                                  "kernel's scheduling.", labels=("process",)),
            CounterMetricFamily("gpud_event_loop_cpu_seconds", "CPU time of the event loop's thread, seconds: its "
                                "rate is how busy the loop is (1 = saturated).", labels=("process",)),
        )

    def loops(self) -> dict[str, LoopCounts]:
        merged: dict[str, LoopCounts] = {}
        for source in self.sources:
            merged.update(source())
        return merged

    def inspect(self) -> dict[str, Any]:
        """`gpudctl inspect`'s EVENT LOOPS: each process's loop."""
        return {"loops": [{"process": p, **c.inspect()} for p, c in sorted(self.loops().items())]}

    def collect(self) -> Iterable[Metric]:
        lag, stall, cpu = fams = self._families()
        for process, counts in sorted(self.loops().items()):
            lag.add_metric([process], counts.lag.cumulative(), counts.lag.sum_s)
            stall.add_metric([process], counts.stall.cumulative(), counts.stall.sum_s)
            cpu.add_metric([process], counts.cpu_s)
        return fams
