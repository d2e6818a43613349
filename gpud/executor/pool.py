"""The executor pool: one worker process per device, and the model instances loaded on them.

Workers are started when the first instance is placed on their device, each under its own supervisor
(gpud.executor.supervisor: restart with back-off when it dies, kill when it hangs; other devices are untouched). The
pool lives in the daemon's event loop; it is also the source of the simulated devices' memory use and utilization.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any
from collections.abc import Callable

from gpud.executor.device import WorkerDevice
from gpud.executor.instance import DeviceWorker, InstanceHandle
from gpud.executor.local_worker import LocalWorker
from gpud.executor.supervisor import DEFAULT_WORKER_HANG_S, CrashLoop, WorkerSupervisor
from gpud.executor.types import InferenceError
from gpud.executor.process_log import LogSettings


log = logging.getLogger("gpud.executor")


class ExecutorPool:
    """All device workers and every model instance on them. Also the UsageSource of the simulated devices and the
    CPU (what the instances it loaded hold, how long its workers were busy). It needs no device list: a device is
    described by the first load placed on it, so the device inventory can be built on the pool's usage."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 worker_start_timeout_s: float = 60.0,
                 worker_log_settings: LogSettings = LogSettings(),
                 worker_hang_s: float = DEFAULT_WORKER_HANG_S, crash_loop: CrashLoop = CrashLoop(),
                 in_process: bool = False):
        """`in_process`: devices without CUDA (the CPU, simulated GPUs) run their instances in this process
        (gpud.executor.local_worker) instead of a worker process: the in-process server's option."""
        self.in_process = in_process
        self.crash_loop = crash_loop  # deaths within a window after which a device's worker is given up on
        self.clock = clock
        self.worker_start_timeout_s = worker_start_timeout_s
        self.worker_hang_s = worker_hang_s  # 0: never treat a silent worker as hung
        self.worker_log_settings = worker_log_settings  # what its worker processes log (set_log_settings: now)
        self.workers: dict[str, DeviceWorker] = {}
        self._start_locks: dict[str, asyncio.Lock] = {}

    async def _worker(self, device: WorkerDevice) -> DeviceWorker:
        lock = self._start_locks.setdefault(device.id, asyncio.Lock())
        async with lock:
            running = self.workers.get(device.id)
            if running is not None:
                return running
            worker: DeviceWorker
            if self.in_process and not device.has_cuda:
                worker = LocalWorker(device, clock=self.clock)
            else:
                worker = WorkerSupervisor(device, clock=self.clock, start_timeout_s=self.worker_start_timeout_s,
                                          hang_s=self.worker_hang_s, log_settings=self.worker_log_settings,
                                          crash_loop=self.crash_loop)
            await worker.start()
            self.workers[device.id] = worker
            return worker

    def set_log_settings(self, settings: LogSettings) -> None:
        """The daemon's log settings changed (a LogControl listener): every worker process follows them, and a
        worker started later starts with them."""
        self.worker_log_settings = settings
        for worker in self.workers.values():
            if isinstance(worker, WorkerSupervisor):
                worker.set_log_settings(settings)

    async def start_worker(self, device: WorkerDevice) -> DeviceWorker:
        """`device`'s worker, started first if it is not running (InferenceError when it cannot start)."""
        return await self._worker(device)

    async def load_instance(self, inst: InstanceHandle, device: WorkerDevice) -> InstanceHandle:
        """Start `device`'s worker if needed and load the instance there. On failure `inst.error` says why."""
        if inst.device_id != device.id:
            raise ValueError(f"instance {inst.key} is for device {inst.device_id!r}, not {device.id!r}")
        try:
            inst.open_segments()
        except OSError as exc:  # shm.ShmFull: no room for one full batch's inputs and outputs
            inst.error = f"cannot make its shared memory: {exc}"
            log.error("instance %s on %s: not loaded: %s", inst.key, device.id, inst.error)
            inst.close_segments()
            return inst
        worker = None
        try:
            worker = await self._worker(device)
            worker.instances[inst.key] = inst
            inst.worker = worker
            await worker.load(inst)
        except (InferenceError, OSError) as exc:  # the worker cannot start, or was gone before the load was sent
            inst.error = exc.message if isinstance(exc, InferenceError) else f"cannot start its worker: {exc}"
            log.error("instance %s on %s: not loaded: %s", inst.key, device.id, inst.error)
        finally:  # also when cancelled: an instance that is not ready keeps no shared memory
            if not inst.ready:
                if worker is not None:
                    worker.instances.pop(inst.key, None)
                inst.close_segments()
        return inst

    def instance_keys(self, device_id: str) -> set[str]:
        """The keys of the instances on the device's worker (a key names one instance there)."""
        worker = self.workers.get(device_id)
        return set(worker.instances) if worker is not None else set()

    async def unload_instance(self, inst: InstanceHandle) -> None:
        inst.ready = False
        worker = inst.worker
        if worker is not None and worker.instances.pop(inst.key, None) is not None:
            await worker.unload(inst.key)
        inst.close_segments()

    def forget_everywhere(self, names: list[str]) -> None:
        """Tell every device worker to drop these segments or regions (a client's CUDA region unregistered and
        unused: the workers that mapped it close it)."""
        for worker in self.workers.values():
            try:
                worker.forget_segments(names)
            except (InferenceError, OSError):  # a worker gone or restarting has nothing mapped: the others go on
                pass

    # --- UsageSource for simulated devices and the CPU --------------------------------------------------------
    def memory_used_bytes(self, device_id: str) -> int | None:
        worker = self.workers.get(device_id)
        if worker is None:
            return 0  # nothing loaded there yet
        return sum(i.footprint_bytes for i in worker.instances.values() if i.ready)

    def utilization_ratio(self, device_id: str) -> float | None:
        worker = self.workers.get(device_id)
        if worker is None:
            return 0.0
        return worker.busy.utilization_ratio()

    def unhealthy_reason(self, device_id: str) -> str | None:
        """Why gpud gave up on the device's worker (a crash loop), or None."""
        worker = self.workers.get(device_id)
        return None if worker is None else worker.unhealthy_reason

    def worker_info(self) -> list[dict[str, Any]]:
        return [{"device": w.device.id, "pid": w.pid, "alive": w.alive, "restarts": w.restarts,
                 "failures": dict(w.failures), "unhealthy_reason": w.unhealthy_reason,
                 "in_process": w.in_process}
                for w in self.workers.values()]

    async def shutdown(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers.values()), return_exceptions=True)
        for w in self.workers.values():
            for inst in w.instances.values():
                inst.close_segments()
