"""gpud.Server leaves nothing behind: after stop(), a with block that raised, async with, or an application that
exits without stopping it or is interrupted by Ctrl-C, its worker processes are gone and its shared-memory segments
removed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest

from gpud.executor.shm import _dir as shm_dir
from gpud.examples import write_example_repository
from tests.daemon_harness import ROOT

pytestmark = pytest.mark.slow
NODE = str(ROOT / "config/nodes/dgx-a100-2gpu-mig.yaml")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_example_repository(repo)
    return repo


def _worker_alive(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and "gpud.executor.worker" in " ".join(proc.cmdline())
    except psutil.NoSuchProcess:
        return False


def _run_child(repo, mode: str) -> tuple[int, str, str]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.inprocess_child", str(repo), NODE, mode], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        first = proc.stdout.readline()  # its report: it serves now
        if mode == "ctrl-c" and first:
            os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the application and its workers
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, first + out, err


@pytest.mark.parametrize("mode", ["stop", "with-error", "async", "ctrl-c", "atexit"])
def test_nothing_is_left_behind(repo, mode):
    returncode, stdout, stderr = _run_child(repo, mode)
    done = subprocess.CompletedProcess([], returncode, stdout, stderr)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # While it served there were workers and segments (so the checks below are not vacuous) ...
    assert seen["workers"] and seen["segments"], seen
    assert all(s.startswith(f"gpud-{seen['pid']}-") for s in seen["segments"])
    # ... and once the application has ended, none is left.
    assert not [pid for pid in seen["workers"] if _worker_alive(pid)], done.stderr
    left = [n for n in os.listdir(shm_dir()) if n.startswith(f"gpud-{seen['pid']}-")]
    assert left == [], left
    assert "Traceback" not in done.stderr, done.stderr
