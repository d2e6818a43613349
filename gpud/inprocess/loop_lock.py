"""The in-process server's loop lock: held by the server's thread except while its event loop waits for events.

A thread that takes it (without blocking: if the loop is busy, the caller goes the loop's way) may touch what the
loop owns, as if it ran on the loop, until it lets go: gpud.executor.direct runs an idle model's request in its caller's
thread that way, with no thread hand-off. asyncio's own loop (not uvloop) is used, because the lock is let go and
taken again around its selector's wait: every callback, task step and timer of the loop runs with it held.
"""
from __future__ import annotations

import asyncio
import selectors
import threading


class LockingSelector(selectors.DefaultSelector):
    """The default selector, letting go of `lock` while it waits for events."""

    def __init__(self, lock: threading.Lock):
        super().__init__()
        self._gpud_lock = lock

    def select(self, timeout: float | None = None):
        self._gpud_lock.release()
        try:
            return super().select(timeout)
        finally:
            self._gpud_lock.acquire()


def new_locked_loop(lock: threading.Lock) -> asyncio.AbstractEventLoop:
    """An event loop for a thread that holds `lock` from before it runs the loop until after it closes it."""
    return asyncio.SelectorEventLoop(LockingSelector(lock))
