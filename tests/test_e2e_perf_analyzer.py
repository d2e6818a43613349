"""Triton's perf_analyzer against gpud (it reads /config and /stats). Skips unless perf_analyzer is installed:
`../shared/tools/install-perf-analyzer DIR` installs it; point GPUD_PERF_ANALYZER at DIR/perf_analyzer."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from gpud.examples import write_example_repository
from tests.daemon_harness import start_daemon

pytestmark = pytest.mark.slow
PERF_ANALYZER = os.environ.get("GPUD_PERF_ANALYZER") or shutil.which("perf_analyzer")


@pytest.mark.skipif(not PERF_ANALYZER, reason="perf_analyzer not installed (set GPUD_PERF_ANALYZER)")
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_gpud(tmp_path, protocol):
    repo = tmp_path / "repo"
    write_example_repository(repo, ["mlp", "two_input"])
    daemon = start_daemon(repo, tmp_path)
    try:
        url = daemon.http_url if protocol == "http" else daemon.grpc_url
        out = subprocess.run([PERF_ANALYZER, "-m", "two_input", "-i", protocol, "-u", url, "--concurrency-range", "2",
                              "--measurement-mode", "count_windows", "--measurement-request-count", "200",
                              "--stability-percentage", "1000"],
                             capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "Server:" in out.stdout and "Execution count" in out.stdout
    finally:
        assert daemon.stop() == 0


@pytest.mark.skipif(not PERF_ANALYZER, reason="perf_analyzer not installed (set GPUD_PERF_ANALYZER)")
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_with_system_shared_memory(tmp_path, protocol):
    """`--shared-memory system`: perf_analyzer makes its regions, registers them, and every request's inputs and
    outputs go through them; it checks that the regions it registered are gone at its end, and gpud's statistics
    count the requests."""
    repo = tmp_path / "repo"
    write_example_repository(repo, ["mlp", "two_input"])
    daemon = start_daemon(repo, tmp_path, "--allow-client-shm", "true")
    try:
        url = daemon.http_url if protocol == "http" else daemon.grpc_url
        out = subprocess.run([PERF_ANALYZER, "-m", "two_input", "-i", protocol, "-u", url, "--concurrency-range", "2",
                              "--shared-memory", "system", "--output-shared-memory-size", "4096",
                              "--measurement-mode", "count_windows", "--measurement-request-count", "200",
                              "--stability-percentage", "1000"],
                             capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "Server:" in out.stdout and "Execution count" in out.stdout
        assert daemon.get_json("/v2/systemsharedmemory/status") == []  # it unregistered what it registered
        stats = daemon.get_json("/v2/models/two_input/stats")["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] >= 200
        assert stats["inference_stats"]["fail"]["count"] == 0
    finally:
        assert daemon.stop() == 0
