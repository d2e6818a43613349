"""Which process owns gpud's shared-memory segments, so that those of a process that is gone can be removed.

A process killed outright (SIGKILL, the kernel's OOM killer) cannot remove its segments, and files in /dev/shm hold
memory until someone does. So each process that makes segments (gpud.executor.shm: named `gpud-<pid>-...`) first
holds an exclusive flock on its lock file, `gpud-<pid>.lock` beside them, for as long as it lives (`claim`). A lock
that can be taken belongs to a process that is gone: `sweep` (the daemon's start) removes its segments and the lock
file, and so does `claim` when a new process is given the pid of one that died.

Never touched: segments whose lock is held (their process lives), and segments with no lock file (an older gpud's,
or a process whose pid another process in a different pid namespace holds the lock of: that second process takes no
lock, so its segments are only ever removed by itself).
"""
from __future__ import annotations

import atexit
import fcntl
import os
import re
import threading
from dataclasses import dataclass

_NAME = re.compile(r"gpud-(\d+)(-.+|\.lock)$")

_claim_lock = threading.Lock()
_claimed: dict[str, int] = {}  # directory -> the process that claimed there (a forked child claims again)


@dataclass(frozen=True)
class Swept:
    """What was removed of one process that is gone."""

    pid: int
    segments: int
    bytes: int


def lock_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"gpud-{pid}.lock")


def claim(directory: str) -> None:
    """Hold this process's lock file before it makes its first segment: once per process, cheap after. Segments of
    this pid found then are a dead process's (this one has made none yet): removed."""
    pid = os.getpid()
    if _claimed.get(directory) == pid:
        return
    with _claim_lock:
        if _claimed.get(directory) == pid:
            return
        fd = _take(lock_path(directory, pid), create=True)
        if fd is not None:
            _remove_segments(directory, pid)
            atexit.register(_release, directory, pid, fd)
        _claimed[directory] = pid


def sweep(directory: str) -> list[Swept]:
    """Remove the segments and lock files of gpud processes that are gone (their lock can be taken)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    own = os.getpid()
    pids = sorted({int(m.group(1)) for m in map(_NAME.match, names) if m and m.group(2) == ".lock"})
    out = []
    for pid in pids:
        if pid == own:
            continue
        fd = _take(lock_path(directory, pid), create=False)
        if fd is None:  # held: the process lives (or the file went meanwhile)
            continue
        try:
            count, nbytes = _remove_segments(directory, pid)
            _unlink(lock_path(directory, pid))
        finally:
            os.close(fd)
        if count:
            out.append(Swept(pid, count, nbytes))
    return out


def remove_owned_by(directory: str, pid: int) -> None:
    """Remove the segments and lock file of a process known to be gone (its parent has reaped it)."""
    _remove_segments(directory, pid)
    _unlink(lock_path(directory, pid))


def _take(path: str, *, create: bool) -> int | None:
    """An open descriptor holding the exclusive lock on `path`, or None where another process holds it."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    for _ in range(3):
        try:
            fd = os.open(path, flags, 0o600)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except OSError:
            same = False
        if same:
            return fd
        os.close(fd)  # a sweep removed the file between the open and the lock: take the one there now
        if not create:
            return None
    return None


def _remove_segments(directory: str, pid: int) -> tuple[int, int]:
    prefix = f"gpud-{pid}-"
    count = nbytes = 0
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix)]
    except OSError:
        return 0, 0
    for name in names:
        path = os.path.join(directory, name)
        try:
            size = os.stat(path, follow_symlinks=False).st_size
            os.unlink(path)
        except OSError:
            continue
        count += 1
        nbytes += size
    return count, nbytes


def _release(directory: str, pid: int, fd: int) -> None:
    """At exit: the lock file goes with the last segment; one still there keeps it, so a later sweep finds it."""
    if os.getpid() != pid:  # a forked child runs its parent's exit handlers
        return
    try:
        left = any(n.startswith(f"gpud-{pid}-") for n in os.listdir(directory))
    except OSError:
        left = True
    if not left:
        _unlink(lock_path(directory, pid))
    os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
