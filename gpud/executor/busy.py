"""Busy-time accounting for a device: utilization from the executor's real busy time, not a guess."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable


class BusyTracker:
    """Counts the time during which at least one batch is executing on a device.

    `utilization_ratio(now)` is the busy fraction over roughly the last `window_s` seconds. Overlapping batches
    (several instances on one device) count once: the device is busy, not busier.
    """

    def __init__(self, clock: Callable[[], float], window_s: float = 1.0):
        self._clock = clock
        self.window_s = window_s
        self._running = 0
        self._busy_since_s: float | None = None
        self._busy_total_s = 0.0
        start = clock()
        self._history: deque[tuple[float, float]] = deque([(start, 0.0)])

    def begin(self) -> None:
        if self._running == 0:
            self._busy_since_s = self._clock()
        self._running += 1

    def end(self) -> None:
        if self._running == 0:
            return
        self._running -= 1
        if self._running == 0 and self._busy_since_s is not None:
            self._busy_total_s += self._clock() - self._busy_since_s
            self._busy_since_s = None

    def reset_running(self) -> None:
        """The device's worker died: whatever was running is not running any more."""
        while self._running:
            self.end()

    def busy_total_s(self, now_s: float) -> float:
        ongoing = now_s - self._busy_since_s if self._busy_since_s is not None else 0.0
        return self._busy_total_s + ongoing

    def utilization_ratio(self, now_s: float | None = None) -> float:
        now_s = self._clock() if now_s is None else now_s
        busy_now = self.busy_total_s(now_s)
        # Keep a short history so that any reader (scrape, inspect) sees the last window, whoever read before.
        if now_s - self._history[-1][0] >= self.window_s / 4:
            self._history.append((now_s, busy_now))
        while len(self._history) > 2 and self._history[1][0] <= now_s - self.window_s:
            self._history.popleft()
        t0, busy0 = self._history[0]
        if now_s <= t0:
            return 0.0
        return min(1.0, max(0.0, (busy_now - busy0) / (now_s - t0)))
