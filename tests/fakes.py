"""Small fakes shared by the unit tests."""
from __future__ import annotations


class FakeClock:
    """A clock (seconds) that moves only when told: set `now`, call `advance()`, or give a `step` that every read
    adds first, so time limits are reached without sleeping."""

    def __init__(self, now: float = 0.0, step: float = 0.0) -> None:
        self.now = now
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
