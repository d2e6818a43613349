"""Device busy time -> utilization (gpud.executor.busy), with a fake clock."""
from gpud.executor.busy import BusyTracker
from tests.fakes import FakeClock


def test_overlapping_batches_count_once_and_utilization_is_the_busy_fraction():
    clock = FakeClock(100.0)
    b = BusyTracker(clock, window_s=10.0)
    b.begin()            # t=100: busy
    clock.now = 101.0
    b.begin()            # a second instance overlaps: still one busy device
    clock.now = 102.0
    b.end()
    clock.now = 103.0
    b.end()              # busy 100..103 = 3 s
    clock.now = 104.0
    assert b.busy_total_s(clock.now) == 3.0
    assert b.utilization_ratio() == 0.75  # 3 s busy / 4 s elapsed


def test_a_dead_worker_stops_counting():
    clock = FakeClock(100.0)
    b = BusyTracker(clock)
    b.begin()
    clock.now = 100.5
    b.reset_running()
    clock.now = 101.0
    assert b.busy_total_s(clock.now) == 0.5
