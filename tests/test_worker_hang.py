"""The hang watch on device workers (gpud.executor.supervisor): a batch left unanswered for hang_s kills its worker, so
the requests in it fail with an error that says so instead of waiting forever. Driven with a fake clock over a
socket pair; tests/test_e2e_lifecycle.py stops a real worker with SIGSTOP."""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest

from gpud.executor.device import WorkerDevice
from gpud.executor.protocol import Done, Infer
from gpud.executor.supervisor import CrashLoop, WorkerSupervisor, in_crash_loop, seconds_until_hung
from gpud.executor.types import ErrorKind, InferenceError


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.mark.parametrize("now_s, sent_s, hang_s, left_s", [
    (10.0, 10.0, 5.0, 5.0),
    (13.0, 10.0, 5.0, 2.0),
    (15.0, 10.0, 5.0, None),  # exactly hang_s: hung
    (99.0, 10.0, 5.0, None),
])
def test_seconds_until_hung(now_s, sent_s, hang_s, left_s):
    assert seconds_until_hung(now_s, sent_s, hang_s) == left_s


def _batch() -> Infer:
    return Infer("m/1/0", "in", "out", (), ("y",), ("FP32",))


def _handle(clock: Clock, hang_s: float) -> tuple[WorkerSupervisor, socket.socket, list[str]]:
    ours, theirs = socket.socketpair()
    handle = WorkerSupervisor(WorkerDevice("cpu", "cpu", "", True), clock=clock, hang_s=hang_s)
    handle._open_channel(ours)
    kills: list[str] = []
    handle._kill = lambda: kills.append("killed")  # no process here: record instead
    return handle, theirs, kills


def _close(handle: WorkerSupervisor, theirs: socket.socket) -> None:
    handle._disconnect()
    theirs.close()


def test_a_batch_unanswered_for_hang_s_kills_the_worker_and_its_requests_fail_saying_hung():
    async def run():
        clock = Clock()
        handle, theirs, kills = _handle(clock, hang_s=5.0)
        handle.alive = True
        restarts = []

        async def restart():
            restarts.append("restart")
        handle._restart = restart  # no real worker here
        channel = handle.channel
        results = []
        try:
            handle.submit(_batch(), results.append)
            clock.now_s += 2.0
            handle.submit(_batch(), results.append)
            timer = handle._hang_timer
            assert timer is not None
            assert handle._hang_timer is timer, "one timer per worker, not one per batch"
            clock.now_s += 2.9
            handle._check_hang()  # the oldest batch is 4.9 s old: not yet
            assert not kills and handle._hang_timer is not None and not results
            assert handle._hang_timer.when() - asyncio.get_running_loop().time() == pytest.approx(0.1, abs=0.05)
            clock.now_s += 0.1
            handle._check_hang()
            # Killed, and handled as dead at once: a process stuck in the driver may never close its pipe.
            assert kills == ["killed"] and handle._hung_after_s == pytest.approx(5.0)
            assert len(results) == 2 and all(isinstance(r, InferenceError) for r in results)
            assert "hung: a batch unanswered for 5 s, so gpud killed it" in results[0].message
            assert "restarting" in results[0].message
            assert handle.failures == {"died": 0, "hung": 1}
            assert handle.channel is None and handle._hang_timer is None and not channel.sent_s
            await handle._starting
            assert restarts == ["restart"]
        finally:
            _close(handle, theirs)
    asyncio.run(run())


def test_a_death_during_a_restarts_reload_does_not_start_a_second_restart():
    async def run():
        handle, theirs, kills = _handle(Clock(), hang_s=5.0)
        handle.alive = True
        release = asyncio.Event()

        async def running_restart():
            await release.wait()
        handle._starting = asyncio.create_task(running_restart())
        running = handle._starting
        try:
            handle._on_death()
            assert handle._starting is running and handle.failures == {"died": 1, "hung": 0}
        finally:
            release.set()
            await running
            _close(handle, theirs)
    asyncio.run(run())


def test_a_death_while_starting_is_not_a_lost_worker():
    async def run():
        handle, theirs, kills = _handle(Clock(), hang_s=5.0)
        handle.alive = False  # no hello yet
        try:
            handle._on_death()
            assert handle._starting is None and handle.failures == {"died": 0, "hung": 0}
        finally:
            _close(handle, theirs)
    asyncio.run(run())


def test_restarts_that_cannot_start_the_worker_count_towards_the_crash_loop(monkeypatch):
    """A broken device often kills its worker at CUDA init, before hello: those failed restarts are deaths too, so
    the device is given up on instead of being restarted forever."""
    monkeypatch.setattr("gpud.executor.supervisor.RESTART_BACKOFF_S", (0.0,))

    async def run():
        ours, theirs = socket.socketpair()
        handle = WorkerSupervisor(WorkerDevice("cpu", "cpu", "", True), clock=Clock(), crash_loop=CrashLoop(3, 60.0))
        handle._open_channel(ours)
        handle._kill = lambda: None
        handle.alive = True
        starts = []

        async def failing_start() -> None:
            starts.append(1)
            raise InferenceError(ErrorKind.UNAVAILABLE, "the worker died before it said hello")
        handle.start = failing_start
        try:
            handle._on_death()  # the serving worker is lost: death 1, a restart begins
            await handle._starting
            assert len(starts) == 2 and handle.failures == {"died": 3, "hung": 0}  # deaths 2 and 3: the restarts
            assert handle.unhealthy_reason == ("crash loop: its worker died 3 times within 60 s (last: restart "
                                               "failed: the worker died before it said hello)")
        finally:
            theirs.close()
    asyncio.run(run())


def test_a_start_that_times_out_is_neither_a_death_nor_a_second_restart():
    async def run():
        handle = WorkerSupervisor(WorkerDevice("cpu", "cpu", "", True), start_timeout_s=0.001)
        with pytest.raises(InferenceError, match="did not start within"):
            await handle.start()
        assert handle.channel is None and handle.proc.poll() is not None  # killed, disconnected and reaped
        await asyncio.sleep(0)  # a stray end-of-file callback would run here
        assert handle._starting is None and handle.failures == {"died": 0, "hung": 0}
    asyncio.run(run())


def test_exit_code_does_not_wait_for_a_process_that_outlives_its_kill():
    handle = WorkerSupervisor(WorkerDevice("cpu", "cpu", "", True))
    handle.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert handle._exit_code() is None  # still running: handed to a reaper thread, not waited for
    finally:
        handle.proc.kill()
        assert handle.proc.wait(timeout=30) < 0
    handle.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    handle.proc.wait(timeout=30)
    assert handle._exit_code() == 3


def test_answered_batches_leave_the_worker_alone_and_the_age_is_the_oldest_unanswered_batchs():
    async def run():
        clock = Clock()
        handle, theirs, kills = _handle(clock, hang_s=5.0)
        try:
            handle.submit(_batch(), lambda r: None)  # seq 0
            clock.now_s += 3.0
            handle.submit(_batch(), lambda r: None)  # seq 1
            handle.channel._handle(Done(0, (), "", 0, 0, 0))
            clock.now_s += 3.0  # 6 s after the first batch, 3 s after the second
            handle._check_hang()
            assert not kills and handle._hang_timer is not None
            handle.channel._handle(Done(1, (), "", 0, 0, 0))
            clock.now_s += 100.0
            handle._check_hang()  # nothing in flight: nothing to watch, and no timer left behind
            assert not kills and handle._hang_timer is None
            handle.submit(_batch(), lambda r: None)  # the next batch arms it again
            assert handle._hang_timer is not None
        finally:
            _close(handle, theirs)
    asyncio.run(run())


def test_hang_watch_off_arms_no_timer():
    async def run():
        handle, theirs, kills = _handle(Clock(), hang_s=0.0)
        try:
            handle.submit(_batch(), lambda r: None)
            assert handle._hang_timer is None and not handle.channel.sent_s
        finally:
            _close(handle, theirs)
    asyncio.run(run())


class TestCrashLoop:
    """in_crash_loop: N deaths within the window (pure; the supervisor keeps the times)."""

    @pytest.mark.parametrize("deaths_ago_s, looping", [
        ([], False),
        ([5.0, 3.0], False),  # 2 < 3 deaths
        ([100.0, 50.0, 1.0], True),  # 3 within 120 s
        ([130.0, 50.0, 1.0], False),  # the first is 130 s ago: outside the 120 s window, 2 left
        ([119.9, 0.1, 0.0], True),
    ])
    def test_deaths_in_the_window(self, deaths_ago_s, looping):
        now = 1000.0
        assert in_crash_loop([now - a for a in deaths_ago_s], now, CrashLoop(3, 120.0)) is looping

    def test_refused_policies(self):
        with pytest.raises(ValueError, match="crash loop needs deaths >= 1"):
            CrashLoop(0, 10)
        with pytest.raises(ValueError, match="window > 0"):
            CrashLoop(3, 0)
