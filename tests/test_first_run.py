"""What a new user meets on a first run (issue 24): an empty repository is said so at start; a failed start says
why once and leaves no shared memory behind."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from gpud.examples import write_example_repository
from tests.daemon_harness import ROOT, start_daemon

pytestmark = pytest.mark.slow


def test_an_empty_repository_is_reported_at_start(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    daemon = start_daemon(repo, tmp_path)
    try:
        assert f"the model repository {repo} holds no model: nothing is served" in daemon.log()
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_a_port_in_use_fails_the_start_once_and_leaves_nothing_behind(tmp_path):
    repo = tmp_path / "repo"
    write_example_repository(repo, ["mlp"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "gpud.main", "--model-repository", str(repo), "--address",
                                 "127.0.0.1", "--http-port", str(port), "--grpc-port", "0", "--metrics-port", "0",
                                 "--node", "config/nodes/dgx-a100-2gpu-mig.yaml"],
                                cwd=ROOT, stderr=subprocess.PIPE, text=True)
        _, err = proc.communicate(timeout=180)
    assert proc.returncode == 1, err
    # Found before any model loads (the port is checked first), said once, with the port and how to choose another.
    said = [line for line in err.splitlines() if "cannot start serving" in line]
    assert len(said) == 1 and f"HTTP port 127.0.0.1:{port} is in use" in said[0] and "--http-port" in said[0], err
    assert err.count(str(port)) == 1, err
    assert "placement:" not in err and "-> device" not in err and "still running after" not in err, err
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"gpud-{proc.pid}-")]  # its shared memory
    assert left == []


def test_the_same_port_for_two_servers_is_refused_at_once(tmp_path):
    repo = tmp_path / "repo"
    write_example_repository(repo, ["mlp"])
    out = subprocess.run([sys.executable, "-m", "gpud.main", "--model-repository", str(repo), "--address",
                          "127.0.0.1", "--http-port", "0", "--grpc-port", "18555", "--metrics-port", "18555",
                          "--node", "config/nodes/dgx-a100-2gpu-mig.yaml"],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 1, out.stderr
    assert ("cannot start serving: metrics and gRPC are both set to port 127.0.0.1:18555 (--grpc-port, "
            "--metrics-port)") in out.stderr
    assert "-> device" not in out.stderr


def test_a_worker_that_cannot_start_is_named_and_leaves_no_shared_memory(tmp_path):
    # The workers exit as they start (a site hook that only they run): a broken driver or environment.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text('import os, sys\n'
                                           'if "gpud.executor.worker" in sys.orig_argv:\n'
                                           '    os._exit(3)\n')
    repo = tmp_path / "repo"
    write_example_repository(repo, ["mlp", "cnn"])
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    daemon = start_daemon(repo, tmp_path, "--placement-control", "off", env={"PYTHONPATH": path})
    pid = daemon.proc.pid
    try:
        models = {m["name"]: m for m in daemon.inspect()["models"]}
        assert {n: m["state"] for n, m in models.items()} == {"mlp": "UNAVAILABLE", "cnn": "UNAVAILABLE"}
        assert "exited while starting (exit code 3)" in models["mlp"]["reason"], models["mlp"]
        said = [line for line in daemon.log().splitlines() if "not loaded" in line]
        assert len(said) == 2 and all("exited while starting (exit code 3)" in line for line in said), said
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"gpud-{pid}-")] == []  # none kept while up
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"gpud-{pid}-")] == []
