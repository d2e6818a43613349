"""Shared-memory segments that carry tensors between the front end and the device workers.

Plain files in /dev/shm mapped with mmap: the front end creates and owns every segment it hands to a worker (so it
can always unlink them, whatever happened to the worker); a worker only attaches. We do not use
multiprocessing.shared_memory because its resource tracker unlinks segments behind the owner's back when a worker
exits (Python < 3.13 has no track=False).
"""
from __future__ import annotations

import errno
import itertools
import mmap
import os
import secrets

import numpy as np

from gpud.executor import shm_owners

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
ALIGN_BYTES = 64  # cache-line aligned tensor starts: numpy/onnxruntime read them without penalties
_counter = itertools.count()


def _dir() -> str:
    if _SHM_DIR is None:
        import tempfile

        return tempfile.gettempdir()
    return _SHM_DIR


def shm_dir() -> str:
    """Where segments are (/dev/shm, or the temporary directory where there is none)."""
    return _dir()


def shm_free_bytes() -> int | None:
    """Bytes free where segments are (None: not known)."""
    try:
        st = os.statvfs(_dir())
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def segment_path(name: str) -> str:
    """The file a segment's name stands for (how another process opens it)."""
    return os.path.join(_dir(), name)


def align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def new_segment_name(tag: str) -> str:
    """A name for a segment this process is about to make (it holds its owner's lock from now on: shm_owners)."""
    shm_owners.claim(_dir())
    return f"gpud-{os.getpid()}-{tag}-{next(_counter)}-{secrets.token_hex(3)}"


# What to do when shared memory is full, in every error that says so.
SHM_FULL_ADVICE = ("give gpud more shared memory (a container's --shm-size, e.g. docker run --shm-size=1g; "
                   "Kubernetes: an emptyDir with medium Memory mounted at /dev/shm)")


class ShmFull(OSError):
    """Shared memory has no room for a segment's pages. A write through a mapping into a full tmpfs is a SIGBUS that
    kills the writing process (a container's /dev/shm is 64 MiB unless told otherwise), so pages are reserved before
    they are written (`Segment.create`, `Segment.reserve`) and this is raised instead: the one request, batch or
    load fails, saying what to do."""

    def __str__(self) -> str:
        return str(self.strerror)


def _reserve(fd: int, start: int, length: int) -> None:
    """Back [start, start + length) of a segment's file with pages now (posix_fallocate)."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:
        return  # (not Linux: pages come as they are written)
    try:
        fallocate(fd, start, length)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):  # (ENOMEM: a memory cgroup's limit, e.g. a pod's emptyDir)
            raise ShmFull(errno.ENOSPC, f"no room in shared memory ({_dir()}) for {length} more bytes ("
                                        f"{shm_free_bytes() or 0} free): {SHM_FULL_ADVICE}") from None
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # a filesystem that cannot reserve: pages come as they are written, as before
        raise


class Segment:
    """One mapped segment. `create` makes (and owns) it; `attach` maps an existing one."""

    def __init__(self, name: str, size_bytes: int, mm: mmap.mmap, owner: bool, reserved_bytes: int = 0):
        self.name = name
        self.size_bytes = size_bytes
        self._mm = mm
        self.owner = owner
        self.buf = memoryview(mm)
        self.reserved_bytes = reserved_bytes  # how much of it, from its start, is backed by pages (reserve)

    @classmethod
    def create(cls, name: str, size_bytes: int, *, reserve: bool = True) -> Segment:
        """A new segment, its pages reserved (ShmFull when there is no room) unless `reserve` is False: then the
        owner reserves what it writes (`reserve`) before writing it."""
        size_bytes = max(ALIGN_BYTES, align(size_bytes))
        path = os.path.join(_dir(), name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:  # (no inode left: as full as no page left)
                raise
            raise ShmFull(errno.ENOSPC, f"no room in shared memory ({_dir()}) for another segment (no inode "
                                        f"left): {SHM_FULL_ADVICE}") from None
        try:
            os.ftruncate(fd, size_bytes)
            if reserve:
                _reserve(fd, 0, size_bytes)
            mm = mmap.mmap(fd, size_bytes)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return cls(name, size_bytes, mm, owner=True, reserved_bytes=size_bytes if reserve else 0)

    def reserve(self, nbytes: int) -> None:
        """Back the segment's first `nbytes` with pages before they are written (ShmFull when there is no room).
        Only the part past what is reserved already costs a call."""
        nbytes = min(nbytes, self.size_bytes)
        if nbytes <= self.reserved_bytes:
            return
        try:
            fd = os.open(os.path.join(_dir(), self.name), os.O_RDWR)
        except FileNotFoundError:
            return  # removed by its owner meanwhile (an instance unloaded mid-batch): nobody reads what is written
        try:
            _reserve(fd, self.reserved_bytes, nbytes - self.reserved_bytes)
        finally:
            os.close(fd)
        self.reserved_bytes = nbytes

    @classmethod
    def attach(cls, name: str) -> Segment:
        path = os.path.join(_dir(), name)
        fd = os.open(path, os.O_RDWR)
        try:
            size_bytes = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size_bytes)
        finally:
            os.close(fd)
        return cls(name, size_bytes, mm, owner=False)  # (what it writes, it reserves first)

    def release_pages(self) -> None:
        """Give the segment's memory back (tmpfs pages are the machine's memory, charged to the owner's cgroup):
        its bytes read as zero afterwards, and pages come back as they are written again. No-op where the kernel
        cannot (no MADV_REMOVE)."""
        advice = getattr(mmap, "MADV_REMOVE", None)
        if advice is not None:
            try:
                self._mm.madvise(advice, 0, self.size_bytes)
            except OSError:
                return  # a filesystem that cannot punch holes: the pages stay, as before
            self.reserved_bytes = 0

    def ndarray(self, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A zero-copy view of part of the segment."""
        return np.ndarray(shape, dtype=dtype, buffer=self.buf, offset=offset)

    def close(self) -> None:
        """Unmap; the owner also removes the file. Views still alive keep the mapping until they go."""
        try:
            self.buf.release()
            self._mm.close()
        except (BufferError, ValueError):
            pass  # a numpy view still references it; the mapping goes with the last view
        if self.owner:
            unlink(self.name)


def unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(_dir(), name))
    except FileNotFoundError:
        pass
