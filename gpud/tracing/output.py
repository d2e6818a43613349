"""Where traces go: Triton's JSON trace file. Each trace is some JSON objects (gpud.tracing.tracer.Trace.text) in one
array per file: `path` itself, a valid array after every write (Triton's is valid only once it stops), or indexed
files `path.0`, `path.1`, ... one array each (the log frequency)."""
from __future__ import annotations

import logging
import os

log = logging.getLogger("gpud")


def unwritable(path: str) -> str:
    """Why gpud could not write traces to `path` ("" when it can): its directory missing or read-only, or the file
    itself read-only. Checked when gpud starts, so a typo is an error then rather than lost traces later."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return f"no directory {directory}"
    if os.path.isdir(path):
        return "it is a directory"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return "the file is not writable"
    if not os.path.exists(path) and not os.access(directory, os.W_OK | os.X_OK):
        return f"directory {directory} is not writable"
    return ""


class TraceFile:
    """One trace file and its indexed files. Writes are small (sampled traces, a second's worth at a time); one
    that fails is logged and its traces dropped: tracing never stops serving."""

    def __init__(self, path: str):
        self.path = path
        self.next_index = 0  # the next indexed file (Triton's: from 0 for each file name, for as long as gpud runs)
        self._started = False  # `path` written to since gpud started (the first write truncates it)
        self._failed = False  # logged once, until a write works again

    def append(self, traces: list[str]) -> None:
        """`traces` added to `path`'s array."""
        if not traces:
            return
        body = ",".join(traces).encode()
        try:
            self._append(body)
        except OSError as exc:
            self._failed_write(self.path, exc, len(traces))
        else:
            self._failed = False

    def _append(self, body: bytes) -> None:
        if self._started:
            try:
                with open(self.path, "r+b") as f:
                    if f.seek(0, os.SEEK_END) > 0:
                        f.seek(-1, os.SEEK_END)  # over the closing bracket
                        f.write(b"," + body + b"]")
                        return
            except FileNotFoundError:
                pass  # moved away (rotated) or removed: a new array
        with open(self.path, "wb") as f:
            f.write(b"[" + body + b"]")
        self._started = True

    def write_indexed(self, traces: list[str]) -> None:
        """`traces` as the next indexed file's array."""
        if not traces:
            return
        path = f"{self.path}.{self.next_index}"
        self.next_index += 1
        try:
            with open(path, "wb") as f:
                f.write(b"[" + ",".join(traces).encode() + b"]")
        except OSError as exc:
            self._failed_write(path, exc, len(traces))
        else:
            self._failed = False

    def _failed_write(self, path: str, exc: OSError, count: int) -> None:
        if not self._failed:
            log.error("trace file %s: cannot write %d trace(s): %s (traces are dropped until a write works)",
                      path, count, exc.strerror or exc)
        self._failed = True
