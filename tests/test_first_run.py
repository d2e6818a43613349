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
    assert "cannot start serving" in err and "still running after" not in err
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"gpud-{proc.pid}-")]  # its shared memory
    assert left == []
