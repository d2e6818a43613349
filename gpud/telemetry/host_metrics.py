"""Host metrics (psutil), read at scrape time: the node's CPU, load and memory, and gpud's device workers.

Worker pids come from a callable (`worker_pids() -> {device_id: pid}`; the executor pool knows them), so a
restarted worker shows up under its device with its new process at the next scrape and a gone one disappears.
`psutil` is injectable like client_python's ProcessCollector(proc=...): tests pass a fake module.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

log = logging.getLogger(__name__)

WorkerPids = Callable[[], dict[str, int]]


class CpuTimes(NamedTuple):
    busy_s: float  # every mode except idle and iowait, seconds summed over all CPUs
    total_s: float


def cpu_times_split(times: Any) -> CpuTimes:
    """psutil.cpu_times() -> (busy, total). iowait is waiting, not working: counted as idle, as top does."""
    fields = times._asdict()
    total = sum(fields.values())
    # guest and guest_nice are already inside user and nice on Linux: do not count them twice
    total -= fields.get("guest", 0.0) + fields.get("guest_nice", 0.0)
    idle = fields.get("idle", 0.0) + fields.get("iowait", 0.0)
    return CpuTimes(total - idle, total)


def busy_ratio(previous: CpuTimes, current: CpuTimes) -> float | None:
    """Share of CPU time spent working between two readings, 0..1; None if no time passed (or the counters went
    backwards, which a suspend or a counter reset can do)."""
    total = current.total_s - previous.total_s
    busy = current.busy_s - previous.busy_s
    if total <= 0 or busy < 0:
        return None
    return min(1.0, busy / total)


class HostCollector(Collector):
    def __init__(self, worker_pids: WorkerPids | None = None, registry: CollectorRegistry | None = None,
                 psutil_module: Any = None):
        if psutil_module is None:
            import psutil as psutil_module  # lazy like gpud.telemetry.devices: importing this module stays cheap
        self._psutil = psutil_module
        self._worker_pids = worker_pids
        self._lock = threading.Lock()
        self._cpu_previous: CpuTimes | None = None
        self._processes: dict[int, Any] = {}  # pid -> psutil.Process, kept so cpu_times stay cheap per scrape
        if registry is not None:
            registry.register(self)

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def _families(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        return [
            GaugeMetricFamily("gpud_host_cpu_utilization_ratio", "Share of the host's CPU time spent working "
                              "(not idle, not iowait) since the previous scrape, 0..1, all CPUs together."),
            GaugeMetricFamily("gpud_host_cpus", "Logical CPUs of the host."),
            GaugeMetricFamily("gpud_host_load1", "Load average over 1 minute."),
            GaugeMetricFamily("gpud_host_load5", "Load average over 5 minutes."),
            GaugeMetricFamily("gpud_host_load15", "Load average over 15 minutes."),
            GaugeMetricFamily("gpud_host_memory_total_bytes", "Host RAM, bytes."),
            GaugeMetricFamily("gpud_host_memory_used_bytes", "Host RAM in use (total - available), bytes."),
            GaugeMetricFamily("gpud_host_memory_available_bytes", "Host RAM available to start new work without "
                              "swapping, bytes (the kernel's MemAvailable)."),
            CounterMetricFamily("gpud_worker_cpu_seconds", "CPU time (user + system) of gpud's worker process "
                                "for the device, seconds.", labels=("device",)),
            GaugeMetricFamily("gpud_worker_resident_memory_bytes", "Resident memory of gpud's worker process for "
                              "the device, bytes.", labels=("device",)),
        ]

    def collect(self) -> Iterable[Metric]:
        (cpu_util, cpu_count, load1, load5, load15, mem_total, mem_used, mem_avail, worker_cpu,
         worker_rss) = fams = self._families()
        ps = self._psutil
        with self._lock:
            current = cpu_times_split(ps.cpu_times())
            ratio = busy_ratio(self._cpu_previous, current) if self._cpu_previous is not None else None
            self._cpu_previous = current
        if ratio is not None:  # the first scrape has no interval to measure over: no sample, not a 0
            cpu_util.add_metric([], ratio)
        cpu_count.add_metric([], float(ps.cpu_count(logical=True) or 0))
        for fam, value in zip((load1, load5, load15), ps.getloadavg()):
            fam.add_metric([], float(value))
        vm = ps.virtual_memory()
        mem_total.add_metric([], float(vm.total))
        mem_used.add_metric([], float(vm.total - vm.available))
        mem_avail.add_metric([], float(vm.available))
        workers = self._workers()
        with self._lock:  # forget the processes of workers that are gone (or were restarted under a new pid)
            for pid in set(self._processes) - set(workers.values()):
                del self._processes[pid]
        for device, pid in sorted(workers.items()):
            read = self._read_process(pid)
            if read is not None:
                cpu_s, rss = read
                worker_cpu.add_metric([device], cpu_s)
                worker_rss.add_metric([device], rss)
        return fams

    def _workers(self) -> dict[str, int]:
        if self._worker_pids is None:
            return {}
        try:
            return {device: pid for device, pid in self._worker_pids().items() if pid}
        except Exception:  # noqa: BLE001 - a failing source must not take the host metrics down
            log.exception("reading the worker pids failed")
            return {}

    def _read_process(self, pid: int) -> tuple[float, float] | None:
        """(cpu seconds, rss bytes), or None for a process that is gone or not ours to read."""
        ps = self._psutil
        gone = (ps.NoSuchProcess, ps.AccessDenied, ps.ZombieProcess)
        with self._lock:
            proc = self._processes.get(pid)
        try:
            if proc is None:
                # psutil.Process remembers the start time: a reused pid is detected, not misread
                proc = ps.Process(pid)
                with self._lock:
                    self._processes[pid] = proc
            with proc.oneshot():  # one /proc read for both values
                t = proc.cpu_times()
                mem = proc.memory_info()
        except gone:
            with self._lock:
                self._processes.pop(pid, None)
            return None
        return float(t.user + t.system), float(mem.rss)
