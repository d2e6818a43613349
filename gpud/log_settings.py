"""Triton's logging extension over gpud's logs: which levels are written, the verbose level and the timestamp
format, read and changed while gpud runs (`GET`/`POST /v2/logging`, gRPC `LogSettings`).

The rules of a request (`updated`) and the daemon's control (LogControl): it keeps the settings, and every process
of gpud follows them, the daemon itself, its front-end processes and its device workers (gpud.executor.process_log
applies them in each). The settings file gives those gpud starts with (gpud.settings.log_settings_of); a reload
that changed them there sets them again.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace

from gpud.executor.errors import ErrorKind, InferenceError
from gpud.executor.process_log import FORMATS, LogSettings, apply

log = logging.getLogger("gpud")

# Triton's names, in the order it answers them (LogSettings.wire). log_file is read-only: gpud writes to standard
# error (under systemd, the journal), and Triton too refuses to move its log over the network.
NAMES = tuple(LogSettings().wire())
_ALIASES = {"log_warnings": "log_warning", "log_errors": "log_error"}  # the extension document's spelling
_MAX_VERBOSE_LEVEL = 2**32 - 1  # a uint32, as Triton's protocol


def _invalid(message: str) -> InferenceError:
    return InferenceError(ErrorKind.INVALID_ARGUMENT, message)


def updated(current: LogSettings, changes: Mapping[str, object]) -> LogSettings:
    """`current` with a log setting request's `changes` (Triton's names; a None value leaves its setting as it is).
    InferenceError for anything wrong, and then nothing changes: an unknown name, a value of the wrong type, an
    unknown format, a new log file."""
    fields: dict[str, object] = {}
    for given, value in changes.items():
        name = _ALIASES.get(given, given)
        if name not in NAMES:
            raise _invalid(f"unknown log setting '{given}' (known: {', '.join(NAMES)})")
        if value is None:
            continue
        if name == "log_file":
            if value != "":
                raise InferenceError(ErrorKind.UNSUPPORTED,
                                     "log file location can not be updated through network protocol: gpud writes "
                                     "its log to standard error (the journal under systemd)")
        elif name in ("log_info", "log_warning", "log_error"):
            if not isinstance(value, bool):
                raise _invalid(f"expect boolean for '{given}', got {value!r}")
            fields[name[len("log_"):]] = value
        elif name == "log_verbose_level":
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_VERBOSE_LEVEL:
                raise _invalid(f"expect an integer from 0 to {_MAX_VERBOSE_LEVEL} for '{given}', got {value!r}")
            fields["verbose_level"] = value
        elif name == "log_format":
            if value not in FORMATS:
                raise _invalid(f"invalid argument for log_format, got: {value!r} (choose from "
                               f"{', '.join(FORMATS)})")
            fields["format"] = value
    return replace(current, **fields)  # type: ignore[arg-type]


class LogControl:
    """The daemon's log settings: applied to its own process, and told to its other processes (`listeners`, each
    called with the new settings: the front-end hosts, the executor pool)."""

    def __init__(self, settings: LogSettings, apply_here: Callable[[LogSettings], None] = apply):
        self.settings = settings
        self._apply_here = apply_here
        self.listeners: list[Callable[[LogSettings], None]] = []

    def update(self, changes: Mapping[str, object]) -> LogSettings:
        """Apply a log setting request (`updated`'s errors change nothing); the settings now."""
        self.set(updated(self.settings, changes))
        return self.settings

    def set(self, settings: LogSettings) -> None:
        if settings == self.settings:
            return
        before = self.settings.wire()
        changed = ", ".join(f"{k} {before[k]} -> {v}" for k, v in settings.wire().items() if before[k] != v)
        # written with the settings before (a log turned off says so; one turned on starts after it)
        log.info("log settings: %s", changed)
        self.settings = settings
        self._apply_here(settings)
        for listener in self.listeners:
            try:
                listener(settings)
            except Exception:  # noqa: BLE001 - one process that cannot hear it must not stop the others
                log.exception("log settings: telling %r failed", listener)
