"""What `gpudctl check` is doing, said as it goes: each step when it starts (and each part of it, a device's worker,
load, outputs, throughput) and when it ends, with its outcome and time, so that a minute of checks does not read as
a hang. For a person at a terminal only: with --json, or when stdout is not a terminal (a pipe, a file, CI), the
report is all the output. Written to stderr, so that stdout holds the report alone either way."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TextIO

from gpud.cli.check.report import Row, Status


def wants_progress(json_output: bool, out: TextIO) -> bool:
    """Progress is for a terminal: not with --json, not when the report goes to a pipe or a file."""
    isatty = getattr(out, "isatty", None)
    return not json_output and callable(isatty) and bool(isatty())


def outcome(rows: Iterable[Row]) -> str:
    """A step's rows in a word or two: "pass", "1 failed", "2 warnings", "skipped"."""
    statuses = [r.status for r in rows]
    failed = statuses.count(Status.FAIL)
    warned = statuses.count(Status.WARN)
    if failed:
        return f"{failed} failed"
    if warned:
        return f"{warned} warning{'s' if warned > 1 else ''}"
    if statuses and all(s is Status.SKIP for s in statuses):
        return "skipped"
    return "pass"


class Progress:
    """Says each step on `stream` as it starts and ends (None: says nothing). One line per step:
    `gpudctl check: serving on gpu0: worker, load, outputs, throughput ... pass (12.3 s)`."""

    def __init__(self, stream: TextIO | None, clock: Callable[[], float] = time.monotonic):
        self.stream = stream
        self.clock = clock
        self._started_s: float | None = None
        self._parts = 0

    def start(self, step: str) -> None:
        self._started_s = self.clock()
        self._parts = 0
        self._write(f"gpudctl check: {step}")

    def part(self, name: str) -> None:
        """A part of the current step begins."""
        self._write(f"{':' if self._parts == 0 else ','} {name}")
        self._parts += 1

    def end(self, result: str) -> None:
        took = "" if self._started_s is None else f" ({self.clock() - self._started_s:.1f} s)"
        self._write(f" ... {result}{took}\n")
        self._started_s = None

    def _write(self, text: str) -> None:
        if self.stream is not None:
            self.stream.write(text)
            self.stream.flush()


QUIET = Progress(None)
