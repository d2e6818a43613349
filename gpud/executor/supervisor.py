"""Supervision of one device worker process: start, load and unload its instances, death, restart, hang watch.

A worker is started with a socket pair (`python -m gpud.executor.worker`, one CUDA device visible) and is up once it
says hello. A worker that dies (its pipe ends) fails the batches it held at once with a clear error, its instances go
unready, and it is restarted with back-off (RESTART_BACKOFF_S) and its instances reloaded; requests still queued wait
for that. A worker that hangs (a batch unanswered for hang_s) is killed and is then a worker that died. Deaths are
counted by cause. A worker that dies `crash_loop.deaths` times within `crash_loop.window_s` (a restart that cannot start
it counts as a death) is in a crash loop: it is not restarted again, and its device reports unhealthy with the reason
(`unhealthy_reason`), so the placement controller moves its instances to other devices. Talking to the process is the
channel's (gpud.executor.channel).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpud.executor.busy import BusyTracker
from gpud.executor.channel import Reply, WorkerChannel
from gpud.executor.device import WorkerDevice
from gpud.executor.instance import InstanceHandle, LentInstance
from gpud.executor.protocol import (Exit, ForgetSegments, FromWorker, Hello, Infer, Load, Loaded, LoadFailed,
                               SetLogging, ToWorker, Unload, Unloaded)
from gpud.executor.model_config import execution_config
from gpud.executor.types import ErrorKind, InferenceError
from gpud.executor.process_log import LogSettings

log = logging.getLogger("gpud.executor")

_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
DEFAULT_WORKER_HANG_S = 300.0


@dataclass(frozen=True)
class CrashLoop:
    """How many deaths within how long make a crash loop (a broken device or driver: restarting cannot help)."""

    deaths: int = 3
    window_s: float = 120.0

    def __post_init__(self) -> None:
        if self.deaths < 1 or not self.window_s > 0:
            raise ValueError(f"a crash loop needs deaths >= 1 and a window > 0 s, got {self.deaths} deaths "
                             f"in {self.window_s} s")


def in_crash_loop(death_times_s: list[float], now_s: float, policy: CrashLoop) -> bool:
    """Whether `policy.deaths` of the deaths happened within the last `policy.window_s` seconds (pure)."""
    recent = [t for t in death_times_s if now_s - t < policy.window_s]
    return len(recent) >= policy.deaths


def seconds_until_hung(now_s: float, oldest_sent_s: float, hang_s: float) -> float | None:
    """Seconds left before a worker whose oldest unanswered batch was sent at `oldest_sent_s` counts as hung, or
    None when it already does. A batch's age is its run time: an instance is sent its next batch only once the
    previous one is answered, so batches do not queue inside a worker."""
    age_s = now_s - oldest_sent_s
    return None if age_s >= hang_s else hang_s - age_s


def worker_env(device: WorkerDevice, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process that computes on `device` as its worker does (the worker, and `gpudctl check`'s
    raw onnxruntime baseline): exactly that one CUDA device visible, none for the CPU, the project importable."""
    env = dict(os.environ if base is None else base)
    if device.kind in ("gpu", "mig") and not device.simulated:
        # One CUDA device per process: a CUDA process can use only one MIG instance, and the worker for a
        # MIG instance must see exactly that instance.
        env["CUDA_VISIBLE_DEVICES"] = device.uuid
    elif device.kind == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PROJECT_ROOT, env.get("PYTHONPATH", "")) if p)
    return env


class WorkerSupervisor:
    """The daemon's side of one device worker process: what schedulers submit batches to (a DeviceWorker)."""

    in_process = False  # its instances run in the worker process

    def __init__(self, device: WorkerDevice, *, clock: Callable[[], float] = time.monotonic,
                 start_timeout_s: float = 60.0, hang_s: float = DEFAULT_WORKER_HANG_S,
                 log_settings: LogSettings = LogSettings(), crash_loop: CrashLoop = CrashLoop()):
        self.device = device
        self.clock = clock
        self.start_timeout_s = start_timeout_s
        self.hang_s = hang_s  # 0: never treat a silent worker as hung
        self.log_settings = log_settings  # what its worker process logs (gpud.log_settings)
        self.proc: subprocess.Popen | None = None
        self.channel: WorkerChannel | None = None  # None while no worker process is connected
        self.pid: int | None = None
        self.providers: tuple[str, ...] = ()  # the execution providers the worker's backends offer (its hello)
        self.alive = False
        self.restarts = 0  # restart attempts
        self.failures = {"died": 0, "hung": 0}  # times the worker was lost while serving, by cause
        self.crash_loop = crash_loop
        self._deaths_s: list[float] = []  # when it was lost while serving (the crash-loop window's)
        self.unhealthy_reason: str | None = None  # set when gpud gives up on the device (a crash loop)
        self.instances: dict[str, InstanceHandle] = {}
        self.busy = BusyTracker(clock)
        self._loads: dict[str, asyncio.Future[Loaded | LoadFailed]] = {}  # loads under way, by instance key
        self._hello: asyncio.Future | None = None
        self._unloads: dict[str, asyncio.Future[None]] = {}
        self._stopping = False
        self._starting: asyncio.Task | None = None
        # Hang watch: the one timer that checks the unanswered batches' ages (the channel keeps when each was
        # sent), and the age of the batch that made gpud kill the worker.
        self._hang_timer: asyncio.TimerHandle | None = None
        self._hung_after_s: float | None = None

    # --- process lifecycle -------------------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        return worker_env(self.device)

    def _open_channel(self, sock: socket.socket) -> WorkerChannel:
        self.channel = WorkerChannel(sock, name=self.device.id, on_message=self._on_message,
                                     on_closed=self._on_death, busy=self.busy,
                                     clock=self.clock if self.hang_s > 0 else None)
        return self.channel

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        parent_sock, child_sock = socket.socketpair()
        cmd = [sys.executable, "-m", "gpud.executor.worker", "--fd", str(child_sock.fileno()),
               "--device", json.dumps(dataclasses.asdict(self.device)),
               "--log-settings", json.dumps(self.log_settings.plain())]
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=[child_sock.fileno()], env=self._env(), cwd=_PROJECT_ROOT)
        finally:
            child_sock.close()
        self.pid = self.proc.pid
        self._hung_after_s = None
        self._hello = loop.create_future()
        self._open_channel(parent_sock).start_reading()
        try:
            hello = await asyncio.wait_for(self._hello, timeout=self.start_timeout_s)
        except TimeoutError:
            self._kill()
            self._disconnect()  # this attempt is over: its pipe's end of file must not count as a lost worker
            self._exit_code()
            raise InferenceError(ErrorKind.UNAVAILABLE,
                                 f"worker for device {self.device.id} did not start within "
                                 f"{self.start_timeout_s:.0f} s") from None
        self.alive = True
        self.providers = tuple(hello.providers)
        log.info("device %s: worker pid %d started (execution providers: %s)", self.device.id, self.pid,
                 ", ".join(hello.providers) or "none")

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def _exit_code(self) -> int | None:
        """The worker's exit status, or None if it has not exited yet. Never blocks the event loop for long: a
        process stuck in the driver can outlive SIGKILL, so it is then reaped by a thread whenever it ends."""
        proc = self.proc
        if proc is None:
            return None
        try:
            return proc.wait(timeout=0.05)  # usually at once: its pipe closed because it exited
        except subprocess.TimeoutExpired:
            threading.Thread(target=proc.wait, name=f"reap-{proc.pid}", daemon=True).start()
            return None

    def _on_message(self, msg: FromWorker) -> None:
        if isinstance(msg, (Loaded, LoadFailed)):
            fut = self._loads.get(msg.key)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, Unloaded):
            unloaded = self._unloads.pop(msg.key, None)
            if unloaded is not None and not unloaded.done():
                unloaded.set_result(None)
        elif isinstance(msg, Hello):
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(msg)

    def _on_death(self) -> None:
        loop = asyncio.get_running_loop()
        was_up = self.alive  # False: it died while starting, and the start itself reports that
        inflight = self._disconnect()
        code = self._exit_code()
        if self._hung_after_s is not None:
            how = f"hung: a batch unanswered for {self._hung_after_s:.0f} s, so gpud killed it"
        elif code is None:
            how = "its pipe closed; exit status not known yet"
        else:
            how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        err = InferenceError(ErrorKind.UNAVAILABLE,
                             f"the worker for device {self.device.id} (pid {self.pid}) died ({how}) while this "
                             f"request was running; gpud is restarting it")
        # Instances go unready first: failing the in-flight batches frees their instances, and a scheduler must not
        # hand the next queued batch to a dead worker. Queued requests wait for the restart instead.
        for key, fut in self._loads.items():
            if not fut.done():
                fut.set_result(LoadFailed(key, f"worker died ({how})"))
        for inst in self.instances.values():
            if inst.ready:
                inst.ready = False
                if inst.on_ready_change:
                    inst.on_ready_change(inst)
        self.busy.reset_running()
        for cb in inflight:
            cb(err)
        for unloaded in self._unloads.values():
            if not unloaded.done():
                unloaded.set_result(None)
        self._unloads.clear()
        if self._hello is not None and not self._hello.done():  # it died starting: its start fails with how
            self._hello.set_exception(InferenceError(ErrorKind.UNAVAILABLE, f"the worker for device "
                                                     f"{self.device.id} (pid {self.pid}) exited while starting "
                                                     f"({how})"))
        if self._stopping or not was_up:
            return
        if self._count_death("hung" if self._hung_after_s is not None else "died", how):
            log.error("device %s: worker pid %s died (%s); %d batch(es) failed; %s: not restarted again, the device "
                      "is unhealthy and its instances go elsewhere", self.device.id, self.pid, how, len(inflight),
                      self.unhealthy_reason)
            if self._starting is not None and not self._starting.done():
                self._starting.cancel()
            return
        log.error("device %s: worker pid %s died (%s); %d batch(es) failed; restarting", self.device.id, self.pid,
                  how, len(inflight))
        if self._starting is not None and not self._starting.done():
            return  # it died while a restart was reloading its models: that restart sees it and goes round again
        self._starting = loop.create_task(self._restart())

    def _count_death(self, cause: str, how: str) -> bool:
        """Count a lost worker; True when that makes a crash loop (and the device is then given up on)."""
        self.failures[cause] += 1
        now_s = self.clock()
        self._deaths_s = [t for t in self._deaths_s if now_s - t < self.crash_loop.window_s] + [now_s]
        if not in_crash_loop(self._deaths_s, now_s, self.crash_loop):
            return False
        self.unhealthy_reason = (f"crash loop: its worker died {len(self._deaths_s)} times within "
                                 f"{self.crash_loop.window_s:g} s (last: {how})")
        return True

    async def _restart(self) -> None:
        while not self._stopping and self.unhealthy_reason is None:
            delay_s = RESTART_BACKOFF_S[min(self.restarts, len(RESTART_BACKOFF_S) - 1)]
            self.restarts += 1
            if delay_s:
                await asyncio.sleep(delay_s)
            try:
                await self.start()
            except Exception as exc:  # noqa: BLE001 - a start that fails in any way counts as a death
                # A worker that cannot even start (dies at CUDA init on a broken device, or never says hello) is
                # lost like one that dies serving: it counts towards the crash loop.
                how = getattr(exc, "message", None) or str(exc)
                if self._stopping:
                    return
                if self._count_death("died", f"restart failed: {how}"):
                    log.error("device %s: restarting the worker failed: %s; %s: not restarted again, the device is "
                              "unhealthy and its instances go elsewhere", self.device.id, how, self.unhealthy_reason)
                    return
                log.error("device %s: restarting the worker failed: %s", self.device.id, how)
                continue
            try:
                for inst in list(self.instances.values()):
                    await self.load(inst)
            except InferenceError as exc:  # the new worker is gone already (send on a closed pipe)
                log.error("device %s: reloading the models on the restarted worker failed: %s", self.device.id,
                          exc.message)
            if self.alive:
                return

    # --- instances and batches ---------------------------------------------------------------------------------
    async def load(self, inst: InstanceHandle) -> None:
        """Load `inst` (one of self.instances) on the worker; it is ready after, or `inst.error` says why not."""
        fut = self._loads[inst.key] = asyncio.get_running_loop().create_future()
        try:
            self.send(Load(inst.key, inst.model_path, execution_config(inst.config)))  # a sequence model's controls too
            reply = await fut
        finally:
            self._loads.pop(inst.key, None)
        inst.apply_load_reply(reply)

    def set_log_settings(self, settings: LogSettings) -> None:
        """Its worker follows `settings` from now on; a worker started again starts with them."""
        self.log_settings = settings
        if self.channel is not None:
            try:
                self.channel.send(SetLogging(settings.info, settings.warning, settings.error, settings.verbose_level,
                                             settings.format))
            except (OSError, InferenceError):
                pass  # the worker is gone: the one started again starts with them

    def send(self, msg: ToWorker) -> None:
        if self.channel is None:
            raise InferenceError(ErrorKind.UNAVAILABLE, f"the worker for device {self.device.id} is not running")
        self.channel.send(msg)

    def submit(self, msg: Infer, callback: Callable[[Reply], None]) -> None:
        """Run a batch; `callback` gets the worker's Done or Failed, or an InferenceError if the worker is lost."""
        if self.channel is None:
            raise InferenceError(ErrorKind.UNAVAILABLE, f"the worker for device {self.device.id} is not running")
        self.channel.submit(msg, callback)
        if self.hang_s > 0 and self._hang_timer is None:
            self._arm_hang_timer(self.hang_s)

    def poll(self) -> None:
        """Handle the replies already waiting (WorkerChannel.poll)."""
        if self.channel is not None:
            self.channel.poll()

    def forget_segments(self, names: list[str]) -> None:
        if self.channel is not None:
            self.send(ForgetSegments(tuple(names)))

    def claim_direct(self, key: str, rows: int = 1, quick_only: bool = False) -> LentInstance | None:
        return None  # its instances run in another process: a caller's thread cannot run them

    def release_direct(self, lent: LentInstance) -> None:
        raise ValueError(f"device {self.device.id}: its instances are never lent (claim_direct)")

    async def unload(self, key: str) -> None:
        loop = asyncio.get_running_loop()
        fut = self._unloads[key] = loop.create_future()
        try:
            self.send(Unload(key))
        except InferenceError:
            self._unloads.pop(key, None)
            return
        await fut

    # --- hang watch ------------------------------------------------------------------------------------------------
    # A worker stuck in a kernel or the driver (a GPU fallen off the bus, a deadlock in a backend) holds its batches
    # forever and never dies. One timer per worker, armed while it holds batches: a batch unanswered for hang_s
    # means hung, and a hung worker is killed, which fails its batches with a clear error and restarts it.
    def _arm_hang_timer(self, delay_s: float) -> None:
        self._hang_timer = asyncio.get_running_loop().call_later(delay_s, self._check_hang)

    def _check_hang(self) -> None:
        # Ages are read on self.clock and the timer runs on the loop's clock: both are time.monotonic in the
        # daemon (a test's fake clock only matters when it calls this directly).
        self._hang_timer = None
        channel = self.channel
        oldest_sent_s = channel.oldest_sent_s() if channel is not None else None
        if channel is None or oldest_sent_s is None or self._stopping:
            return  # idle again (the next submit re-arms), or already dead / stopping
        now_s = self.clock()
        left_s = seconds_until_hung(now_s, oldest_sent_s, self.hang_s)
        if left_s is not None:
            self._arm_hang_timer(left_s)
            return
        self._hung_after_s = now_s - oldest_sent_s
        log.error("device %s: worker pid %s has left a batch unanswered for %.0f s (--worker-hang-secs %g), "
                  "%d batch(es) in flight; killing it", self.device.id, self.pid, self._hung_after_s,
                  self.hang_s, channel.inflight)
        self._kill()
        # Not waiting for the pipe's end of file: a process stuck in the driver may not exit, and its pipe stays
        # open. Its batches fail and a new worker starts now.
        self._on_death()

    # --- stop ----------------------------------------------------------------------------------------------------
    async def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        if self._starting is not None:
            self._starting.cancel()
        if self.channel is not None:
            try:
                self.channel.send(Exit())
            except OSError:
                pass
        if self.proc is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout_s)
            except TimeoutError:
                self._kill()
                self.proc.wait()
        # A batch it never answered (killed after the timeout) fails, so no request waits forever.
        err = InferenceError(ErrorKind.UNAVAILABLE, f"the worker for device {self.device.id} stopped before "
                                                    "answering: the server is shutting down")
        for callback in self._disconnect():
            callback(err)

    def _disconnect(self) -> list[Callable[[Reply], None]]:
        """Stop watching and reading the worker; returns the callbacks of its unanswered batches."""
        if self._hang_timer is not None:
            self._hang_timer.cancel()
            self._hang_timer = None
        inflight = self.channel.close() if self.channel is not None else []
        self.channel = None
        self.alive = False
        return inflight
