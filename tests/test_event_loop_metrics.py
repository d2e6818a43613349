"""The event loops' lag, stalls and CPU (gpud.telemetry.event_loop): the policy as pure functions, the monitor driven
with clocks of the test's own, a real loop held by a callback, the Prometheus series, and a front-end process's
report reaching the core's metrics through the host."""
from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpud.telemetry.event_loop import (BUCKETS_S, BUSY_INTERVAL_S, IDLE_INTERVAL_S, REPORT_INTERVAL_S, Histogram,
                                       LoopCollector, LoopCounts, LoopMonitor, bucket_index, next_interval_s, stall_s)


# --- the policy ----------------------------------------------------------------------------------------------------
def test_a_stall_is_the_cpu_beyond_the_loops_usual_work_and_never_more_than_the_lag():
    # a callback of 300 ms on a loop that idled: the tick is 280 ms late, all of it the loop's own
    assert stall_s(0.02, 0.28, 0.30, 0.0) == pytest.approx(0.28)
    # the process kept from a core for 300 ms: the tick is as late, the loop ran 1 ms
    assert stall_s(0.02, 0.30, 0.001, 0.0) == pytest.approx(0.001)
    # a loop busy half the time, then the kernel holds it 60 ms: its usual work is not a stall
    assert stall_s(0.02, 0.06, 0.01, 0.5) == 0.0
    # a busy loop with a 100 ms callback: the callback, as far as it held the tick up
    assert stall_s(0.02, 0.09, 0.11, 0.5) == pytest.approx(0.09)
    assert stall_s(0.02, 0.0, 0.02, 1.0) == 0.0  # on time: no stall however busy


def test_the_timer_ticks_often_while_the_loop_works_and_rarely_while_it_idles():
    assert next_interval_s(0.0) == IDLE_INTERVAL_S
    assert next_interval_s(0.005) == IDLE_INTERVAL_S
    assert next_interval_s(0.01) == BUSY_INTERVAL_S
    assert next_interval_s(1.0) == BUSY_INTERVAL_S


def test_histogram_buckets_are_prometheus_upper_bounds():
    assert bucket_index(0.0) == 0
    assert bucket_index(BUCKETS_S[0]) == 0  # le: inclusive
    assert bucket_index(0.0011) == 1
    assert bucket_index(99.0) == len(BUCKETS_S)  # +Inf
    h = Histogram()
    for value in (0.0005, 0.03, 0.03, 7.0):
        h.observe(value)
    assert h.count == 4 and h.sum_s == pytest.approx(7.0605)
    assert h.count_over(0.05) == 1 and h.count_over(0.025) == 3
    cumulative = dict(h.cumulative())
    assert cumulative["0.001"] == 1 and cumulative["0.05"] == 3 and cumulative["+Inf"] == 4


# --- the monitor, on the test's clocks -----------------------------------------------------------------------------
def test_the_monitor_counts_lag_and_stalls_tick_by_tick():
    reports: list[tuple] = []
    m = LoopMonitor(on_report=lambda counts: reports.append(counts.wire()))
    m.begin(100.0, 5.0)
    assert m.due_s == pytest.approx(100.0 + BUSY_INTERVAL_S)
    m.tick(m.due_s, 5.0)  # on time, no CPU: the loop idles, the next tick a while off
    assert m.counts.lag.counts[0] == 1 and m.counts.stall.counts[0] == 1
    assert m.due_s == pytest.approx(100.02 + IDLE_INTERVAL_S)
    due = m.due_s
    m.tick(due + 0.4, 5.0 + 0.45)  # a 450 ms callback held it 400 ms past due
    assert m.counts.stall.count_over(0.25) == 1 and m.counts.stall.sum_s == pytest.approx(0.4)
    assert m.counts.lag.count_over(0.25) == 1
    assert m.due_s == pytest.approx(due + 0.4 + BUSY_INTERVAL_S)  # busy now
    due = m.due_s
    m.tick(due + 0.3, 5.45 + 0.002)  # 300 ms late, the loop ran 2 ms: the kernel's doing, not a stall of its own
    assert m.counts.lag.count_over(0.25) == 2
    assert m.counts.stall.count_over(0.0025) == 1  # the first stall only
    assert m.counts.cpu_s == pytest.approx(0.452)
    assert m.counts.lag.count == m.counts.stall.count == 3
    assert len(reports) == 0  # reports come from start() and every REPORT_INTERVAL_S
    m.tick(100.0 + REPORT_INTERVAL_S + 1.0, 5.46)
    assert len(reports) == 1 and LoopCounts.of_wire(reports[0]).lag.count == 4


def test_a_report_reads_back_as_it_was_and_a_malformed_one_is_refused():
    counts = LoopCounts()
    counts.lag.observe(0.003)
    counts.stall.observe(0.2)
    counts.cpu_s = 1.5
    back = LoopCounts.of_wire(counts.wire())
    assert back == counts
    with pytest.raises(ValueError, match="buckets"):
        LoopCounts.of_wire(((1, 2), 0.0, (1, 2), 0.0, 0.0, 0.0))
    with pytest.raises(ValueError):
        LoopCounts.of_wire(((1, 2), 0.0))
    with pytest.raises(ValueError):  # refused here, not at a scrape
        LoopCounts.of_wire((("x",) * (len(BUCKETS_S) + 1), 0.0, (0,) * (len(BUCKETS_S) + 1), 0.0, 0.0, 0.0))


def test_busy_is_the_loops_share_of_about_the_last_second():
    m = LoopMonitor()
    m.begin(0.0, 0.0)
    m.tick(0.02, 0.01)  # half the time
    assert m.counts.busy_ratio == 0.0  # not a second yet
    m.tick(REPORT_INTERVAL_S, 0.25)
    assert m.counts.busy_ratio == pytest.approx(0.25 / REPORT_INTERVAL_S)
    m.tick(2 * REPORT_INTERVAL_S + 0.5, 0.25 + 1.5 * 0.9)
    assert m.counts.busy_ratio == pytest.approx(0.9)


def test_a_stall_is_logged_once_a_minute_with_how_many_there_were(caplog):
    m = LoopMonitor("http-1")
    m.begin(0.0, 0.0)
    cpu = 0.0
    with caplog.at_level(logging.WARNING, logger="gpud.event_loop"):
        for at_s in (1.0, 2.0, 3.0, 70.0):  # a 420 ms stall each
            m.tick(at_s, cpu)  # a tick with no work since the last: no stall
            cpu += 0.42
            m.tick(m.due_s + 0.4, cpu)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert "http-1 process's event loop was held 400 ms" in warnings[0] and "more" not in warnings[0]
    assert "(2 more such stall(s) since the last warning)" in warnings[1]
    assert m.counts.stall.count_over(0.25) == 4


# --- on a real loop --------------------------------------------------------------------------------------------------
def _burn_cpu(seconds: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def test_a_callback_that_holds_a_real_loop_is_a_stall():
    async def run() -> LoopCounts:
        reports: list[int] = []
        monitor = LoopMonitor(on_report=lambda counts: reports.append(counts.lag.count))
        monitor.start()  # reports at once
        assert monitor.running and reports == [0]
        # 150 ms of the loop thread's CPU in one callback, begun before the first tick is due (20 ms): the tick
        # waits at least 130 ms, and the loop ran all of it, however loaded the machine
        _burn_cpu(0.15)
        await asyncio.sleep(0)  # the late tick runs now
        done = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(BUSY_INTERVAL_S * 2, done.set_result, None)
        await done
        monitor.stop()
        assert not monitor.running
        return monitor.counts

    counts = asyncio.run(run())
    assert counts.stall.count_over(0.1) >= 1, counts
    assert counts.lag.count_over(0.1) >= 1, counts
    assert counts.cpu_s >= 0.15


def test_stopping_cancels_the_timer():
    async def run() -> int:
        monitor = LoopMonitor()
        monitor.start()
        monitor.start()  # no second timer
        monitor.stop()
        done = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(BUSY_INTERVAL_S * 3, done.set_result, None)
        await done
        return monitor.counts.lag.count

    assert asyncio.run(run()) == 0


# --- the Prometheus series ---------------------------------------------------------------------------------------
def _families(registry: CollectorRegistry) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def test_the_collector_exports_each_process_loop():
    core, http0 = LoopCounts(), LoopCounts()
    core.lag.observe(0.002)
    core.stall.observe(0.0)
    core.cpu_s = 2.5
    http0.lag.observe(0.3)
    http0.stall.observe(0.3)
    registry = CollectorRegistry()
    LoopCollector([lambda: {"core": core}, lambda: {"http-0": http0}], registry=registry)
    families = _families(registry)
    lag = families["gpud_event_loop_lag_seconds"]
    buckets = {(s.labels["process"], s.labels["le"]): s.value for s in lag.samples if s.name.endswith("_bucket")}
    assert buckets[("core", "0.001")] == 0 and buckets[("core", "0.0025")] == 1 and buckets[("core", "+Inf")] == 1
    assert buckets[("http-0", "0.25")] == 0 and buckets[("http-0", "0.5")] == 1
    stall = families["gpud_event_loop_stall_seconds"]
    sums = {s.labels["process"]: s.value for s in stall.samples if s.name.endswith("_sum")}
    assert sums == {"core": 0.0, "http-0": pytest.approx(0.3)}
    cpu = {s.labels["process"]: s.value for s in families["gpud_event_loop_cpu_seconds"].samples}
    assert cpu == {"core": 2.5, "http-0": 0.0}


def test_a_front_end_processs_report_reaches_the_cores_metrics(caplog):
    from gpud.api.admin import AdminAuth
    from gpud.frontproc.host import FrontendHost, FrontendProcess

    host = FrontendHost(object(), AdminAuth(), 2, socket.socket(), {"kind": "grpc"})  # type: ignore[arg-type]
    counts = LoopCounts()
    counts.stall.observe(0.07)
    counts.cpu_s = 0.5
    host._on_message(FrontendProcess(1, None, socket.socket()), ("loop", counts.wire()))  # type: ignore[arg-type]
    assert host.loop_reports == {"grpc-1": counts}
    with caplog.at_level(logging.WARNING, logger="gpud.frontend"):
        host._on_message(FrontendProcess(0, None, socket.socket()), ("loop", ("garbage",)))  # type: ignore[arg-type]
    assert "cannot be read" in caplog.text and set(host.loop_reports) == {"grpc-1"}
    registry = CollectorRegistry()
    LoopCollector([lambda: dict(host.loop_reports)], registry=registry)
    cpu = {s.labels["process"]: s.value for s in _families(registry)["gpud_event_loop_cpu_seconds"].samples}
    assert cpu == {"grpc-1": 0.5}


def test_gpudctl_inspect_lists_each_loop():
    from gpud.cli.inspect import render_inspect
    from tests.test_ctl_workers import BASE

    core, http0 = LoopCounts(), LoopCounts()
    core.busy_ratio, core.cpu_s = 0.97, 1234.5
    http0.stall.observe(0.3)
    http0.lag.observe(0.3)
    collector = LoopCollector([lambda: {"core": core, "http-0": http0}])
    text = render_inspect(BASE | {"event_loops": collector.inspect()})
    lines = text.splitlines()
    at = lines.index("EVENT LOOPS (busy: the last second; late and stalls: over 50 ms, since start)")
    assert lines[at + 2].split() == ["core", "97%", "1234.5", "0", "0"]
    assert lines[at + 3].split() == ["http-0", "0%", "0.0", "1", "1"]
    assert "EVENT LOOPS" not in render_inspect(BASE)
