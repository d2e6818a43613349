"""Shared memory left by a gpud process that was killed (gpud.executor.shm_owners): found by its free lock and
removed, at the daemon's start and when a new process is given a dead one's pid; what a live process owns, and
what has no lock file, is never touched."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from gpud.executor import shm_owners
from gpud.executor.shm import shm_dir
from tests.daemon_harness import ROOT, start_daemon

# A process that claims `directory`, makes two segment files there the way gpud names them, says their names, and
# waits to be killed (or, told "exit", removes one and exits normally, keeping the other).
OWNER = """
import os, sys
from gpud.executor import shm_owners
directory = sys.argv[1]
shm_owners.claim(directory)
names = [f"gpud-{os.getpid()}-fe-{i}-abc" for i in range(2)]
for n in names:
    with open(os.path.join(directory, n), "wb") as f:
        f.write(b"x" * 4096)
print(" ".join(names), flush=True)
if sys.stdin.readline().strip() == "exit-clean":
    for n in names:
        os.unlink(os.path.join(directory, n))
elif True:
    os.unlink(os.path.join(directory, names[0]))
"""


def owner(directory) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(directory)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    names = proc.stdout.readline().split()
    assert len(names) == 2
    return proc, names


def killed(directory) -> tuple[int, list[str]]:
    proc, names = owner(directory)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    return proc.pid, names


def test_the_segments_of_a_killed_process_are_swept_with_its_lock(tmp_path):
    pid, names = killed(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted(names + [f"gpud-{pid}.lock"])
    assert shm_owners.sweep(str(tmp_path)) == [shm_owners.Swept(pid, 2, 8192)]
    assert os.listdir(tmp_path) == []


def test_a_live_process_keeps_its_segments(tmp_path):
    proc, names = owner(tmp_path)
    try:
        assert shm_owners.sweep(str(tmp_path)) == []
        assert set(names) <= set(os.listdir(tmp_path))
    finally:
        proc.kill()
        proc.wait(30)


def test_segments_without_a_lock_file_are_left_alone(tmp_path):
    pid, names = killed(tmp_path)
    os.unlink(shm_owners.lock_path(str(tmp_path), pid))  # as an older gpud leaves them
    other = tmp_path / "client-region"
    other.write_bytes(b"y")
    assert shm_owners.sweep(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == sorted(names + ["client-region"])


def test_a_clean_exit_removes_the_lock_with_the_last_segment(tmp_path):
    proc, names = owner(tmp_path)
    proc.communicate("exit-clean\n", timeout=30)
    assert proc.returncode == 0 and os.listdir(tmp_path) == []


def test_an_exit_that_leaves_a_segment_keeps_the_lock_for_a_later_sweep(tmp_path):
    proc, names = owner(tmp_path)
    proc.communicate("exit\n", timeout=30)
    assert sorted(os.listdir(tmp_path)) == sorted([names[1], f"gpud-{proc.pid}.lock"])
    assert shm_owners.sweep(str(tmp_path)) == [shm_owners.Swept(proc.pid, 1, 4096)]


def test_a_new_process_given_a_dead_ones_pid_removes_what_it_left(tmp_path):
    pid = os.getpid()  # this process stands for the new one: a dead process of the same pid left these
    stale = [f"gpud-{pid}-in-0-old", f"gpud-{pid}-out-1-old"]
    for n in stale:
        (tmp_path / n).write_bytes(b"z")
    (tmp_path / f"gpud-{pid}.lock").write_bytes(b"")
    shm_owners.claim(str(tmp_path))
    assert os.listdir(tmp_path) == [f"gpud-{pid}.lock"]  # held now, by this process
    assert shm_owners.sweep(str(tmp_path)) == []  # its own: never swept


def test_the_daemon_removes_what_a_killed_process_left_before_serving(tmp_path):
    pid, names = killed(shm_dir())
    try:
        d = start_daemon(None, tmp_path, node=None)
        try:
            assert not [n for n in os.listdir(shm_dir()) if n.startswith(f"gpud-{pid}")]
            assert (f"removed 2 shared-memory segment(s) (0.0 MiB) that gpud process {pid} left in {shm_dir()}"
                    in d.log())
        finally:
            assert d.stop() == 0
    finally:
        shm_owners.remove_owned_by(shm_dir(), pid)
