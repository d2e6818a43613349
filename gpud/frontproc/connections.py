"""The open connections of the processes that accept on one port, counted together: each process's count in a slot
of one shared page (a memfd the host makes and hands down), so that a process checks the port's connection cap
(`--http-max-connections`, `--grpc-max-connections`) against them all, as the front end on the core's loop does.

Each slot has one writer: its process (after each connection made or lost), or the host, which zeroes the slot of a
process that ended (its connections ended with it). Reads add the slots up unlocked: two processes accepting at the
same instant may both see room for one, so the port may hold up to (processes - 1) connections over its cap for as
long as those connections last; a cap is a bound on descriptors, not an exact quota.
"""
from __future__ import annotations

import mmap
import os

_SLOT_BYTES = 8  # one aligned 64-bit count: written and read whole


class SharedConnections:
    def __init__(self, fd: int, slots: int, index: int = -1):
        """`fd`: the page's memfd (the host's `create`, or inherited); `index`: this process's slot (-1: the host,
        which writes none of its own)."""
        self.fd = fd
        self.slots = slots
        self.index = index
        self._map = mmap.mmap(fd, slots * _SLOT_BYTES)
        self._counts = memoryview(self._map).cast("q")

    @classmethod
    def create(cls, slots: int) -> SharedConnections:
        """The host's page, its slots zero; a child process is given its fd in `pass_fds`."""
        fd = os.memfd_create("gpud-connections", os.MFD_CLOEXEC)
        os.ftruncate(fd, slots * _SLOT_BYTES)
        return cls(fd, slots)

    def total(self) -> int:
        """The connections open on the port now, every process's."""
        return sum(self._counts)

    def set(self, count: int) -> None:
        """This process's connections open now."""
        self._counts[self.index] = count

    def clear(self, index: int) -> None:
        """A process that ended has no connections (the host's call; none once closed)."""
        if not self._map.closed:
            self._counts[index] = 0

    def close(self) -> None:
        if self._map.closed:
            return
        self._counts.release()
        self._map.close()
        os.close(self.fd)
