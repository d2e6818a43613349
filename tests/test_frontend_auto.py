"""How many front-end processes gpud starts when none are configured ("auto", issue 25): the rule, the settings
file and flags that take it, and a daemon started without the flags, whose processes and log follow the rule."""
from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

import psutil
import pytest

from gpud.main import build_parser, resolve_settings
from gpud.cpus import cgroup_cpu_limit, usable_cpus
from gpud.settings import AUTO, Settings, check_settings, frontend_processes, load_settings_file
from tests.daemon_harness import ROOT, start_daemon


@pytest.mark.parametrize("cpus, expected", [(1, 0), (2, 0), (7, 0), (8, 1), (15, 1), (16, 2), (31, 3), (32, 4),
                                            (128, 4)])
def test_auto_is_none_on_small_machines_then_one_per_8_cpus_at_most_4(cpus, expected):
    assert frontend_processes(AUTO, cpus) == expected


def test_a_configured_count_is_kept_whatever_the_cpus():
    assert frontend_processes(0, 128) == 0
    assert frontend_processes(3, 2) == 3


def test_usable_cpus_is_this_process_affinity_without_a_quota(tmp_path):
    assert usable_cpus(str(tmp_path / "no-cgroup-file")) == len(os.sched_getaffinity(0))
    assert 1 <= usable_cpus() <= (psutil.cpu_count(logical=True) or 1)  # this machine's, whatever its cgroup says


def cgroup_v2(tmp_path, path: str, limits: dict[str, str]) -> tuple[str, str]:
    """A fake /proc/self/cgroup naming `path` in a v2 tree whose cpu.max files are `limits` (relative dir -> text)."""
    root = tmp_path / "cgroup"
    (root / path.lstrip("/")).mkdir(parents=True)
    for rel, text in limits.items():
        (root / rel).mkdir(parents=True, exist_ok=True)
        (root / rel / "cpu.max").write_text(text)
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"0::{path}\n")
    return str(proc), str(root)


@pytest.mark.parametrize("limits, expected", [
    ({"system.slice/gpud.service": "max 100000"}, None),  # no quota
    ({"system.slice/gpud.service": "250000 100000"}, 2.5),  # CPUQuota=250%
    ({"system.slice": "100000 100000", "system.slice/gpud.service": "400000 100000"}, 1.0),  # the parent's is tighter
    ({}, None),  # no cpu controller files at all
])
def test_the_cgroup_v2_quota_is_the_tightest_up_the_tree(tmp_path, limits, expected):
    proc, root = cgroup_v2(tmp_path, "/system.slice/gpud.service", limits)
    assert cgroup_cpu_limit(proc, root) == expected


def test_the_cgroup_v1_quota(tmp_path):
    node = tmp_path / "cgroup" / "cpu,cpuacct" / "kubepods" / "pod1"
    node.mkdir(parents=True)
    (node / "cpu.cfs_quota_us").write_text("300000\n")
    (node / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("4:cpu,cpuacct:/kubepods/pod1\n3:memory:/kubepods/pod1\n")
    assert cgroup_cpu_limit(str(proc), str(tmp_path / "cgroup")) == 3.0


def test_a_container_cpu_limit_bounds_the_usable_cpus(tmp_path):
    # a pod limited to 1.5 CPUs on a node of many: 2 usable (rounded up), so "auto" starts no front-end process
    proc, root = cgroup_v2(tmp_path, "/", {".": "150000 100000"})
    assert usable_cpus(proc, root) == min(2, usable_cpus("/nonexistent", root))
    assert frontend_processes(AUTO, usable_cpus(proc, root)) == 0


def test_the_default_is_auto_in_flags_and_file(tmp_path):
    s = resolve_settings(build_parser().parse_args([]))
    assert s.http_processes == s.grpc_processes == AUTO
    f = tmp_path / "gpud.yaml"
    f.write_text("http_processes: 2\ngrpc_processes: auto\n")
    s = resolve_settings(build_parser().parse_args(["--config", str(f)]))
    assert (s.http_processes, s.grpc_processes) == (2, AUTO)
    s = resolve_settings(build_parser().parse_args(["--config", str(f), "--http-processes", "auto",
                                                    "--grpc-processes", "1"]))
    assert (s.http_processes, s.grpc_processes) == (AUTO, 1)  # a flag wins over the file, "auto" too
    example = load_settings_file(str(ROOT / "config" / "gpud.yaml"))
    assert example["http_processes"] == example["grpc_processes"] == AUTO


@pytest.mark.parametrize("text", ["http_processes: many\n", "http_processes: -1\n", "http_processes: true\n",
                                  "http_processes: 1.5\n", "grpc_processes: [1]\n"])
def test_a_bad_count_in_the_file_names_the_key(tmp_path, text):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=r"_processes': expected int or 'auto'"):
        load_settings_file(str(f))


def test_a_count_out_of_range_is_refused():
    with pytest.raises(ValueError, match="http_processes must be 'auto' or 0"):
        check_settings(Settings(http_processes=257))
    with pytest.raises(ValueError, match="grpc_processes must be 'auto' or 0"):
        check_settings(Settings(grpc_processes="some"))


@pytest.mark.parametrize("value", ["many", "-1"])
def test_gpud_refuses_a_bad_count_flag_with_exit_2(value):
    out = subprocess.run([sys.executable, "-m", "gpud.main", "--http-processes", value], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2
    assert ("--http-processes" in out.stderr or "http_processes" in out.stderr) and "'auto'" in out.stderr


def test_a_daemon_on_16_cpus_starts_two_front_end_processes_of_each(tmp_path):
    # gpud's main with the CPU count it reads made 16 (set before gpud.main imports it)
    launch = ("-c", "import sys, gpud.cpus as c; c.usable_cpus = lambda: 16; import gpud.main as m; "
                    "sys.argv[0] = 'gpud'; sys.exit(m.main())")
    d = start_daemon(None, tmp_path, "--http-processes", AUTO, "--grpc-processes", AUTO, node=None, launch=launch)
    try:
        kinds = [c.cmdline() for c in psutil.Process(d.proc.pid).children()
                 if "gpud.frontproc.child" in " ".join(c.cmdline())]
        assert sorted('"kind": "http"' in " ".join(k) for k in kinds) == [False, False, True, True]
        assert "in 2 front-end process(es) (auto: 16 usable CPUs)" in d.log()
        with urllib.request.urlopen(f"http://{d.http_url}/v2/health/ready", timeout=10) as r:
            assert r.status == 200
    finally:
        assert d.stop() == 0


def test_a_daemon_told_auto_starts_what_the_rule_says_for_this_machine(tmp_path):
    # the harness passes 0 to every daemon; the flags given last win, so "auto" is what gpud chooses here
    d = start_daemon(None, tmp_path, "--http-processes", AUTO, "--grpc-processes", AUTO, node=None)
    try:
        n = frontend_processes(AUTO, usable_cpus())
        children = [c for c in psutil.Process(d.proc.pid).children()
                    if "gpud.frontproc.child" in " ".join(c.cmdline())]
        assert len(children) == 2 * n  # HTTP's and gRPC's
        log = d.log()
        where = f"in {n} front-end process(es)" if n else "on the core's event loop"
        assert f"HTTP (KServe v2) on 127.0.0.1:{d.ports['http']}, {where} (auto: {usable_cpus()} usable CPUs)" in log
        assert f"gRPC (KServe v2) on 127.0.0.1:{d.ports['grpc']}, {where} (auto: " in log
    finally:
        assert d.stop() == 0
