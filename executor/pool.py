"""The executor pool: one worker process per device, supervised, and the model instances loaded on them.

Workers are started when the first instance is placed on their device. A worker that dies is restarted with
back-off and its instances are reloaded; the batches it held fail at once with a clear error. A worker that hangs
(a batch unanswered for worker_hang_s) is killed, and is then a worker that died. Other devices are untouched.
The pool lives in the daemon's event loop; workers talk to it over a socket pair.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

from executor.busy import BusyTracker
from executor.device import WorkerDevice
from executor.model_config import ModelConfig
from executor.protocol import (DEFAULT_SEGMENT_BYTES, Done, Exit, Failed, ForgetSegments, FromWorker, Hello, Infer,
                               Load, Loaded, LoadFailed, ToWorker, Unload, Unloaded, dumps, loads,
                               tensor_region_bytes)
from executor.shm import Segment, new_segment_name
from executor.types import ErrorKind, InferenceError

log = logging.getLogger("gpud.executor")

_READ_CHUNK = 1 << 18
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
DEFAULT_WORKER_HANG_S = 300.0


def seconds_until_hung(now_s: float, oldest_sent_s: float, hang_s: float) -> float | None:
    """Seconds left before a worker whose oldest unanswered batch was sent at `oldest_sent_s` counts as hung, or
    None when it already does. A batch's age is its run time: an instance is sent its next batch only once the
    previous one is answered, so batches do not queue inside a worker."""
    age_s = now_s - oldest_sent_s
    return None if age_s >= hang_s else hang_s - age_s


@dataclass(eq=False)
class InstanceHandle:
    """One model instance on one device, as the front end sees it. Owns its shared-memory regions."""

    key: str
    model: str
    version: str
    index: int
    device_id: str
    model_path: str
    config: ModelConfig
    estimate_bytes: int
    worker: "WorkerHandle | None" = None
    ready: bool = False
    memory_bytes: int | None = None  # measured at load
    measured_by: str = ""
    load_seconds: float = 0.0
    provider: str = ""
    error: str = ""
    in_seg: Segment | None = None
    out_seg: Segment | None = None
    on_ready_change: Callable[["InstanceHandle"], None] | None = None
    _load_future: "asyncio.Future | None" = None

    @property
    def footprint_bytes(self) -> int:
        return self.memory_bytes if self.memory_bytes is not None else self.estimate_bytes

    def ensure_capacity(self, input_bytes: int) -> Segment:
        """The input region, grown first when a batch does not fit (variable-size inputs; the worker drops the old
        one)."""
        if self.in_seg is not None and self.in_seg.size_bytes >= input_bytes:
            return self.in_seg
        old = self.in_seg
        size = max(input_bytes, 2 * old.size_bytes if old else DEFAULT_SEGMENT_BYTES)
        self.in_seg = Segment.create(new_segment_name("in"), size)
        if old is not None:
            old.close()
            if self.worker is not None:
                self.worker.forget_segments([old.name])
        return self.in_seg

    def close_segments(self) -> None:
        for seg in (self.in_seg, self.out_seg):
            if seg is not None:
                seg.close()
        self.in_seg = self.out_seg = None


class WorkerHandle:
    """The daemon's side of one device worker process."""

    def __init__(self, device: WorkerDevice, pool: "ExecutorPool"):
        self.device = device
        self.pool = pool
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self._rsock: socket.socket | None = None
        self._rbuf = bytearray()
        self._reading = False  # in _on_readable: a callback's poll() must not re-enter it
        self.pid: int | None = None
        self.alive = False
        self.restarts = 0  # restart attempts
        self.failures = {"died": 0, "hung": 0}  # times the worker was lost while serving, by cause
        self.instances: dict[str, InstanceHandle] = {}
        self.busy = BusyTracker(pool.clock)
        self._seq = itertools.count()
        self._inflight: dict[int, Callable[[Done | Failed | InferenceError], None]] = {}
        self._hello: asyncio.Future | None = None
        self._unloads: dict[str, asyncio.Future] = {}
        self._stopping = False
        self._starting: asyncio.Task | None = None
        # Hang watch: when each unanswered batch was sent (oldest first), the one timer that checks them, and the
        # age of the batch that made gpud kill the worker.
        self._sent_s: dict[int, float] = {}
        self._hang_timer: asyncio.TimerHandle | None = None
        self._hung_after_s: float | None = None

    # --- process lifecycle -------------------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.device.kind in ("gpu", "mig") and not self.device.simulated:
            # One CUDA device per process: a CUDA process can use only one MIG instance, and the worker for a
            # MIG instance must see exactly that instance.
            env["CUDA_VISIBLE_DEVICES"] = self.device.uuid
        elif self.device.kind == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PROJECT_ROOT, env.get("PYTHONPATH", "")) if p)
        return env

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        parent_sock, child_sock = socket.socketpair()
        cmd = [sys.executable, "-m", "executor.worker", "--fd", str(child_sock.fileno()),
               "--device", json.dumps(dataclasses.asdict(self.device)), "--log-level", str(self.pool.worker_log_level)]
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=[child_sock.fileno()], env=self._env(), cwd=_PROJECT_ROOT)
        finally:
            child_sock.close()
        self.pid = self.proc.pid
        self._hung_after_s = None
        self.conn = Connection(parent_sock.detach())
        # A second descriptor on the same socket, for non-blocking reads (the Connection keeps blocking sends).
        self._rsock = socket.socket(fileno=os.dup(self.conn.fileno()))
        self._rbuf = bytearray()
        self._hello = loop.create_future()
        loop.add_reader(self.conn.fileno(), self._on_readable)
        try:
            hello = await asyncio.wait_for(self._hello, timeout=self.pool.worker_start_timeout_s)
        except asyncio.TimeoutError:
            self._kill()
            self._disconnect()  # this attempt is over: its pipe's end of file must not count as a lost worker
            self._exit_code()
            raise InferenceError(ErrorKind.UNAVAILABLE,
                                 f"worker for device {self.device.id} did not start within "
                                 f"{self.pool.worker_start_timeout_s:.0f} s") from None
        self.alive = True
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

    def _on_readable(self) -> None:
        """Read what the worker sent, without blocking, and handle every complete message. Messages are
        multiprocessing.Connection frames (a 4-byte big-endian length, or -1 and an 8-byte one, then a pickle),
        read here with one non-blocking recv instead of Connection.poll (a selector per call) and recv."""
        conn, rsock = self.conn, self._rsock
        if conn is None or rsock is None or self._reading:
            return
        self._reading = True
        try:
            self._read(conn, rsock)
        finally:
            self._reading = False

    def _read(self, conn: Connection, rsock: socket.socket) -> None:
        dead = False
        try:
            while True:
                try:
                    data = rsock.recv(_READ_CHUNK, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                if not data:
                    raise EOFError
                self._rbuf += data
                if len(data) < _READ_CHUNK:
                    break
        except (EOFError, OSError):
            dead = True  # but first the replies that arrived before the end: a finished batch is not a failed one
        self._handle_frames(conn)
        if dead and self.conn is conn:
            self._on_death()

    def _handle_frames(self, conn: Connection) -> None:
        buf = self._rbuf
        while len(buf) >= 4:
            size = int.from_bytes(buf[:4], "big", signed=True)
            head = 4
            if size == -1:
                if len(buf) < 12:
                    return
                size = int.from_bytes(buf[4:12], "big")
                head = 12
            end = head + size
            if end > len(buf):
                return
            msg = loads(buf[head:end])
            del buf[:end]  # before handling: a handler that raises must not get its message again
            try:
                self._handle(msg)
            except Exception:  # a callback's bug must not strand the replies behind it
                log.exception("device %s: handling the worker's %s message failed", self.device.id,
                              type(msg).__name__)
            if self.conn is not conn:  # the handler stopped or replaced the worker
                return

    def poll(self) -> None:
        """Handle replies already waiting on the pipe, without blocking. Under a flood of requests the event loop
        runs every readable socket's callback before it gets to this pipe's; a scheduler calls this while taking
        requests in, so a finished batch is answered, and its instance fed, within one request's time."""
        if self._inflight and self.conn is not None:
            self._on_readable()

    def _handle(self, msg: FromWorker) -> None:
        if isinstance(msg, (Done, Failed)):
            self._sent_s.pop(msg.seq, None)
            cb = self._inflight.pop(msg.seq, None)
            self.busy.end()
            if cb is not None:
                cb(msg)
        elif isinstance(msg, (Loaded, LoadFailed)):
            inst = self.instances.get(msg.key)
            if inst is not None and inst._load_future is not None and not inst._load_future.done():
                inst._load_future.set_result(msg)
        elif isinstance(msg, Unloaded):
            fut = self._unloads.pop(msg.key, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif isinstance(msg, Hello):
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(msg)

    def _on_death(self) -> None:
        loop = asyncio.get_running_loop()
        was_up = self.alive  # False: it died while starting, and the start itself reports that
        self._disconnect()
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
        for inst in self.instances.values():
            if inst._load_future is not None and not inst._load_future.done():
                inst._load_future.set_result(LoadFailed(inst.key, f"worker died ({how})"))
            if inst.ready:
                inst.ready = False
                if inst.on_ready_change:
                    inst.on_ready_change(inst)
        inflight, self._inflight = self._inflight, {}
        self._sent_s.clear()
        self.busy.reset_running()
        for cb in inflight.values():
            cb(err)
        for fut in self._unloads.values():
            if not fut.done():
                fut.set_result(None)
        self._unloads.clear()
        if self._hello is not None and not self._hello.done():
            self._hello.set_exception(err)
        if self._stopping or not was_up:
            return
        self.failures["hung" if self._hung_after_s is not None else "died"] += 1
        log.error("device %s: worker pid %s died (%s); %d batch(es) failed; restarting", self.device.id, self.pid,
                  how, len(inflight))
        if self._starting is not None and not self._starting.done():
            return  # it died while a restart was reloading its models: that restart sees it and goes round again
        self._starting = loop.create_task(self._restart())

    async def _restart(self) -> None:
        while not self._stopping:
            delay_s = RESTART_BACKOFF_S[min(self.restarts, len(RESTART_BACKOFF_S) - 1)]
            self.restarts += 1
            if delay_s:
                await asyncio.sleep(delay_s)
            try:
                await self.start()
            except Exception as exc:
                log.error("device %s: restarting the worker failed: %s", self.device.id, exc)
                continue
            try:
                for inst in list(self.instances.values()):
                    await self.pool._load_on_worker(inst, self)
            except InferenceError as exc:  # the new worker is gone already (send on a closed pipe)
                log.error("device %s: reloading the models on the restarted worker failed: %s", self.device.id,
                          exc.message)
            if self.alive:
                return

    # --- messages ----------------------------------------------------------------------------------------------
    def send(self, msg: ToWorker) -> None:
        if self.conn is None:
            raise InferenceError(ErrorKind.UNAVAILABLE, f"the worker for device {self.device.id} is not running")
        self.conn.send_bytes(dumps(msg))

    def submit(self, msg: Infer, callback: Callable[[Done | Failed | InferenceError], None]) -> None:
        seq = next(self._seq)
        self.send(msg.numbered(seq))
        if self.pool.worker_hang_s > 0:
            self._sent_s[seq] = self.pool.clock()
            if self._hang_timer is None:
                self._arm_hang_timer(self.pool.worker_hang_s)
        self._inflight[seq] = callback
        self.busy.begin()

    # --- hang watch ------------------------------------------------------------------------------------------------
    # A worker stuck in a kernel or the driver (a GPU fallen off the bus, a deadlock in a backend) holds its batches
    # forever and never dies. One timer per worker, armed while it holds batches: a batch unanswered for
    # worker_hang_s means hung, and a hung worker is killed, which fails its batches with a clear error and
    # restarts it.
    def _arm_hang_timer(self, delay_s: float) -> None:
        self._hang_timer = asyncio.get_running_loop().call_later(delay_s, self._check_hang)

    def _check_hang(self) -> None:
        # Ages are read on pool.clock and the timer runs on the loop's clock: both are time.monotonic in the
        # daemon (a test's fake clock only matters when it calls this directly).
        self._hang_timer = None
        if not self._sent_s or self.conn is None or self._stopping:
            return  # idle again (the next submit re-arms), or already dead / stopping
        now_s = self.pool.clock()
        oldest_sent_s = next(iter(self._sent_s.values()))
        left_s = seconds_until_hung(now_s, oldest_sent_s, self.pool.worker_hang_s)
        if left_s is not None:
            self._arm_hang_timer(left_s)
            return
        self._hung_after_s = now_s - oldest_sent_s
        log.error("device %s: worker pid %s has left a batch unanswered for %.0f s (--worker-hang-secs %g), "
                  "%d batch(es) in flight; killing it", self.device.id, self.pid, self._hung_after_s,
                  self.pool.worker_hang_s, len(self._inflight))
        self._kill()
        # Not waiting for the pipe's end of file: a process stuck in the driver may not exit, and its pipe stays
        # open. Its batches fail and a new worker starts now.
        self._on_death()

    def forget_segments(self, names: list[str]) -> None:
        if self.conn is not None:
            self.send(ForgetSegments(tuple(names)))

    async def unload(self, key: str) -> None:
        loop = asyncio.get_running_loop()
        fut = self._unloads[key] = loop.create_future()
        try:
            self.send(Unload(key))
        except InferenceError:
            self._unloads.pop(key, None)
            return
        await fut

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        if self._starting is not None:
            self._starting.cancel()
        if self.conn is not None:
            try:
                self.conn.send_bytes(dumps(Exit()))
            except OSError:
                pass
        if self.proc is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout_s)
            except asyncio.TimeoutError:
                self._kill()
                self.proc.wait()
        self._disconnect()

    def _disconnect(self) -> None:
        """Stop reading the worker's pipe and close both descriptors on it."""
        if self._hang_timer is not None:
            self._hang_timer.cancel()
            self._hang_timer = None
        if self.conn is not None:
            try:
                asyncio.get_running_loop().remove_reader(self.conn.fileno())
            except (ValueError, OSError):
                pass
            self.conn.close()
            self.conn = None
        self._close_reader()
        self.alive = False

    def _close_reader(self) -> None:
        if self._rsock is not None:
            self._rsock.close()
            self._rsock = None
        self._rbuf = bytearray()


class ExecutorPool:
    """All device workers and every model instance on them. Also the UsageSource of the simulated devices."""

    def __init__(self, devices: list[WorkerDevice], *, clock: Callable[[], float] = time.monotonic,
                 worker_start_timeout_s: float = 60.0, worker_log_level: int = logging.INFO,
                 worker_hang_s: float = DEFAULT_WORKER_HANG_S):
        self.devices = {d.id: d for d in devices}
        self.clock = clock
        self.worker_start_timeout_s = worker_start_timeout_s
        self.worker_hang_s = worker_hang_s  # 0: never treat a silent worker as hung
        self.worker_log_level = worker_log_level
        self.workers: dict[str, WorkerHandle] = {}
        self._start_locks: dict[str, asyncio.Lock] = {}

    async def _worker(self, device_id: str) -> WorkerHandle:
        lock = self._start_locks.setdefault(device_id, asyncio.Lock())
        async with lock:
            worker = self.workers.get(device_id)
            if worker is None:
                worker = WorkerHandle(self.devices[device_id], self)
                await worker.start()
                self.workers[device_id] = worker
            return worker

    async def load_instance(self, inst: InstanceHandle) -> InstanceHandle:
        """Start the device's worker if needed and load the instance there. On failure `inst.error` says why."""
        if inst.device_id not in self.devices:
            raise ValueError(f"unknown device {inst.device_id!r}")
        inst.in_seg = Segment.create(new_segment_name("in"), tensor_region_bytes(inst.config, inst.config.inputs))
        inst.out_seg = Segment.create(new_segment_name("out"), tensor_region_bytes(inst.config, inst.config.outputs))
        try:
            worker = await self._worker(inst.device_id)
        except InferenceError as exc:
            inst.error = exc.message
            inst.close_segments()
            return inst
        worker.instances[inst.key] = inst
        inst.worker = worker
        await self._load_on_worker(inst, worker)
        if not inst.ready:
            worker.instances.pop(inst.key, None)
            inst.close_segments()
        return inst

    async def _load_on_worker(self, inst: InstanceHandle, worker: WorkerHandle) -> None:
        loop = asyncio.get_running_loop()
        inst._load_future = loop.create_future()
        worker.send(Load(inst.key, inst.model_path, inst.config))
        reply = await inst._load_future
        inst._load_future = None
        if isinstance(reply, Loaded):
            inst.memory_bytes = reply.memory_bytes
            inst.measured_by = reply.measured_by
            inst.load_seconds = reply.load_seconds
            inst.provider = reply.provider
            inst.error = ""
            inst.ready = True
            log.info("instance %s on %s: loaded in %.2f s with %s, footprint %.1f MiB (%s)", inst.key, inst.device_id,
                     inst.load_seconds, inst.provider, inst.footprint_bytes / 2**20, inst.measured_by)
        else:
            inst.error = reply.error
            inst.ready = False
            log.error("instance %s on %s: load failed: %s", inst.key, inst.device_id, inst.error)
        if inst.on_ready_change:
            inst.on_ready_change(inst)

    async def unload_instance(self, inst: InstanceHandle) -> None:
        inst.ready = False
        worker = inst.worker
        if worker is not None and worker.instances.pop(inst.key, None) is not None:
            await worker.unload(inst.key)
        inst.close_segments()

    # --- UsageSource for simulated devices and the CPU --------------------------------------------------------
    def memory_used_bytes(self, device_id: str) -> int | None:
        worker = self.workers.get(device_id)
        if worker is None:
            return 0 if device_id in self.devices else None
        return sum(i.footprint_bytes for i in worker.instances.values() if i.ready)

    def utilization_ratio(self, device_id: str) -> float | None:
        worker = self.workers.get(device_id)
        if worker is None:
            return 0.0 if device_id in self.devices else None
        return worker.busy.utilization_ratio()

    def worker_info(self) -> list[dict[str, Any]]:
        return [{"device": w.device.id, "pid": w.pid, "alive": w.alive, "restarts": w.restarts,
                 "failures": dict(w.failures)} for w in self.workers.values()]

    async def shutdown(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers.values()), return_exceptions=True)
        for w in self.workers.values():
            for inst in w.instances.values():
                inst.close_segments()
