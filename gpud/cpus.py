"""How many CPUs this process may use: its affinity (a cpuset, systemd's CPUAffinity=) within its cgroup's CPU quota
(a container's CPU limit, systemd's CPUQuota=). What "auto" counts go by (gpud.settings.frontend_processes)."""
from __future__ import annotations

import math
import os


def usable_cpus(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The CPUs this process may use: those it may run on (its affinity: a cpuset, systemd's CPUAffinity=), fewer
    where its cgroup's CPU quota allows less (a container's CPU limit, systemd's CPUQuota=), rounded up."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(proc_cgroup, cgroup_root)
    return max(1, min(cpus, math.ceil(round(limit, 6)))) if limit is not None else cpus


def cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> float | None:
    """The CPU quota of this process's cgroup, in CPUs: cgroup v2's `cpu.max` (quota / period), the tightest from its
    own cgroup up to the root; else v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`. None: no limit, or none readable."""
    try:
        with open(proc_cgroup, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    limits = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2
            node = os.path.join(cgroup_root, path.lstrip("/"))
            while True:
                limits.append(_v2_limit(os.path.join(node, "cpu.max")))
                if os.path.normpath(node) == os.path.normpath(cgroup_root):
                    break
                node = os.path.dirname(node)
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's hierarchy (mounted at cpu or cpu,cpuacct)
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                base = os.path.join(cgroup_root, mount)
                for node in (os.path.join(base, path.lstrip("/")), base):
                    limits.append(_v1_limit(node))
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def _v2_limit(path: str) -> float | None:
    try:
        with open(path, encoding="utf-8") as f:
            quota, _, period = f.read().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_limit(node: str) -> float | None:
    try:
        with open(os.path.join(node, "cpu.cfs_quota_us"), encoding="utf-8") as f:
            quota = int(f.read().strip())
        with open(os.path.join(node, "cpu.cfs_period_us"), encoding="utf-8") as f:
            period = int(f.read().strip())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None
