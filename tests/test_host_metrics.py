"""HostCollector: host CPU/load/memory and per-worker CPU and RSS, against a fake psutil (and once the real one)."""
from __future__ import annotations

import contextlib
import os
from collections import namedtuple
from types import SimpleNamespace

import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpud.telemetry.host_metrics import CpuTimes, HostCollector, busy_ratio, cpu_times_split
from tests.promtool_check import promtool_check

ScpuTimes = namedtuple("scputimes", "user nice system idle iowait irq softirq steal guest guest_nice")


class FakeProcess:
    def __init__(self, ps: FakePsutil, pid: int):
        if pid not in ps.processes:
            raise ps.NoSuchProcess(pid)
        self.ps, self.pid = ps, pid
        ps.created += 1

    @contextlib.contextmanager
    def oneshot(self):
        yield

    def cpu_times(self):
        if self.pid not in self.ps.processes:
            raise self.ps.NoSuchProcess(self.pid)
        user, system, _ = self.ps.processes[self.pid]
        return SimpleNamespace(user=user, system=system)

    def memory_info(self):
        return SimpleNamespace(rss=self.ps.processes[self.pid][2])


class FakePsutil:
    """The psutil calls HostCollector makes, with values a test sets."""

    NoSuchProcess = type("NoSuchProcess", (Exception,), {})
    AccessDenied = type("AccessDenied", (Exception,), {})
    ZombieProcess = type("ZombieProcess", (Exception,), {})

    def __init__(self) -> None:
        self.times = ScpuTimes(100.0, 0.0, 50.0, 800.0, 50.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        self.processes: dict[int, tuple[float, float, int]] = {}  # pid -> (user s, system s, rss bytes)
        self.created = 0

    def cpu_times(self):
        return self.times

    def cpu_count(self, logical=True):
        return 64

    def getloadavg(self):
        return (3.5, 2.25, 1.0)

    def virtual_memory(self):
        return SimpleNamespace(total=512 * 2**30, available=384 * 2**30)

    def Process(self, pid):  # noqa: N802 - psutil's name
        return FakeProcess(self, pid)


def samples(registry):
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class TestCpuArithmetic:
    def test_split_counts_iowait_as_idle_and_guest_once(self):
        t = ScpuTimes(100.0, 10.0, 50.0, 800.0, 40.0, 5.0, 5.0, 0.0, 20.0, 0.0)
        # total = 1030 - guest 20 = 1010; idle = 800 + 40 = 840; busy = 1010 - 840 = 170
        assert cpu_times_split(t) == CpuTimes(170.0, 1010.0)

    @pytest.mark.parametrize("previous, current, expected", [
        (CpuTimes(100, 1000), CpuTimes(150, 1200), 0.25),  # (150 - 100) / (1200 - 1000) = 0.25
        (CpuTimes(100, 1000), CpuTimes(100, 1000), None),  # no time passed
        (CpuTimes(100, 1000), CpuTimes(50, 1100), None),  # counters went backwards
    ])
    def test_busy_ratio(self, previous, current, expected):
        assert busy_ratio(previous, current) == (pytest.approx(expected) if expected is not None else None)


class TestHostCollector:
    def test_host_series(self):
        ps = FakePsutil()
        registry = CollectorRegistry()
        HostCollector(registry=registry, psutil_module=ps)
        s = samples(registry)
        assert ("gpud_host_cpu_utilization_ratio", ()) not in s  # first scrape: no interval yet, no fake 0
        assert s[("gpud_host_cpus", ())] == 64
        assert (s[("gpud_host_load1", ())], s[("gpud_host_load5", ())], s[("gpud_host_load15", ())]) == (
            3.5, 2.25, 1.0)
        assert s[("gpud_host_memory_total_bytes", ())] == 512 * 2**30
        assert s[("gpud_host_memory_used_bytes", ())] == 128 * 2**30  # 512 - 384 available
        ps.times = ps.times._replace(user=130.0, idle=870.0)
        # busy 150 -> 180 (+30), total 1000 -> 1100 (+100): 0.3
        assert samples(registry)[("gpud_host_cpu_utilization_ratio", ())] == pytest.approx(0.3)

    def test_workers_follow_the_pid_source(self):
        ps = FakePsutil()
        ps.processes = {101: (12.0, 3.0, 700 * 2**20), 102: (1.0, 0.5, 300 * 2**20)}
        workers = {"gpu0": 101, "gpu1/mig1.0": 102, "cpu": 0}  # pid 0: not started
        registry = CollectorRegistry()
        HostCollector(lambda: dict(workers), registry=registry, psutil_module=ps)
        s = samples(registry)
        assert s[("gpud_worker_cpu_seconds_total", (("device", "gpu0"),))] == 15.0  # 12 user + 3 system
        assert s[("gpud_worker_resident_memory_bytes", (("device", "gpu1/mig1.0"),))] == 300 * 2**20
        assert ("gpud_worker_cpu_seconds_total", (("device", "cpu"),)) not in s
        samples(registry)
        assert ps.created == 2  # Process objects are kept between scrapes
        del ps.processes[101]  # the gpu0 worker died; the pool restarts it as 103
        ps.processes[103] = (0.1, 0.0, 500 * 2**20)
        s = samples(registry)
        # the source still lists the dead pid: it cannot be read, so no sample (never a stale value)
        assert ("gpud_worker_cpu_seconds_total", (("device", "gpu0"),)) not in s
        workers["gpu0"] = 103
        s = samples(registry)
        assert s[("gpud_worker_resident_memory_bytes", (("device", "gpu0"),))] == 500 * 2**20
        workers.pop("gpu1/mig1.0")  # device gone: its series go too
        assert not any(dict(ls).get("device") == "gpu1/mig1.0" for (_, ls) in samples(registry))

    def test_a_failing_pid_source_keeps_host_series(self):
        def broken():
            raise RuntimeError("pool gone")

        registry = CollectorRegistry()
        HostCollector(broken, registry=registry, psutil_module=FakePsutil())
        s = samples(registry)
        assert s[("gpud_host_cpus", ())] == 64
        assert not any(n.startswith("gpud_worker_") for (n, _) in s)

    def test_real_psutil_and_promtool(self):
        registry = CollectorRegistry()
        HostCollector(lambda: {"cpu": os.getpid()}, registry=registry)
        generate_latest(registry)
        s = samples(registry)
        assert s[("gpud_worker_resident_memory_bytes", (("device", "cpu"),))] == pytest.approx(
            psutil.Process().memory_info().rss, rel=0.5)
        assert 0.0 <= s.get(("gpud_host_cpu_utilization_ratio", ()), 0.0) <= 1.0
        promtool_check(generate_latest(registry))
