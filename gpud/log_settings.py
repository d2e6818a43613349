"""Triton's logging extension over gpud's logs: which levels are written, the verbose level and the timestamp
format, read and changed while gpud runs (`GET`/`POST /v2/logging`, gRPC `LogSettings`).

The daemon keeps the settings (LogControl) and every process of it follows them: the daemon itself, its front-end
processes and its device workers (`apply` in each). `--log-level` gives the settings gpud starts with; a reload
whose `log_level` changed sets them again.
"""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace

from gpud.executor.errors import ErrorKind, InferenceError

log = logging.getLogger("gpud")

FORMATS = ("default", "ISO8601")
# Triton's names, in the order it answers them. log_file is read-only: gpud writes to standard error (under systemd,
# the journal), and Triton too refuses to move its log over the network.
NAMES = ("log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format")
_ALIASES = {"log_warnings": "log_warning", "log_errors": "log_error"}  # the extension document's spelling
_MAX_VERBOSE_LEVEL = 2**32 - 1  # a uint32, as Triton's protocol


@dataclass(frozen=True)
class LogSettings:
    """What gpud writes to its log. Each level is switched on its own, as Triton's: `info`, `warning`, `error`
    (CRITICAL counts as an error); `verbose_level` > 0 adds DEBUG. `format`: "default" (local time) or "ISO8601"
    (UTC, `2026-11-28T09:30:01.123Z`)."""

    info: bool = True
    warning: bool = True
    error: bool = True
    verbose_level: int = 0
    format: str = "default"

    @classmethod
    def of_level(cls, level: str | int) -> LogSettings:
        """The settings a `--log-level` means: that level and those above it."""
        number = level if isinstance(level, int) else logging.getLevelName(level.upper())
        if not isinstance(number, int):
            raise ValueError(f"unknown log level {level!r}")
        return cls(info=number <= logging.INFO, warning=number <= logging.WARNING, error=number <= logging.ERROR,
                   verbose_level=1 if number <= logging.DEBUG else 0)

    def writes(self, level: int) -> bool:
        """Whether a record of `level` is written."""
        if level >= logging.ERROR:
            return self.error
        if level >= logging.WARNING:
            return self.warning
        if level >= logging.INFO:
            return self.info
        return self.verbose_level > 0

    def threshold(self) -> int:
        """The lowest level written (loggers' level: what is below is not even formatted)."""
        if self.verbose_level > 0:
            return logging.DEBUG
        for level, on in ((logging.INFO, self.info), (logging.WARNING, self.warning), (logging.ERROR, self.error)):
            if on:
                return level
        return logging.CRITICAL + 1

    def wire(self) -> dict[str, bool | int | str]:
        """As Triton answers them (HTTP's JSON; gRPC's map), every setting."""
        return {"log_file": "", "log_info": self.info, "log_warning": self.warning, "log_error": self.error,
                "log_verbose_level": self.verbose_level, "log_format": self.format}

    def plain(self) -> dict[str, bool | int | str]:
        """For another process (JSON or pickle): LogSettings(**plain) is these settings."""
        return asdict(self)


def _invalid(message: str) -> InferenceError:
    return InferenceError(ErrorKind.INVALID_ARGUMENT, message)


def updated(current: LogSettings, changes: Mapping[str, object]) -> LogSettings:
    """`current` with a log setting request's `changes` (Triton's names; a None value leaves its setting as it is).
    InferenceError for anything wrong, and then nothing changes: an unknown name, a value of the wrong type, an
    unknown format, a new log file."""
    fields: dict[str, object] = {}
    for given, value in changes.items():
        name = _ALIASES.get(given, given)
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
        else:
            raise _invalid(f"unknown log setting '{given}' (known: {', '.join(NAMES)})")
    return replace(current, **fields)  # type: ignore[arg-type]


# --- one process's logging -----------------------------------------------------------------------------------------
class LogFormatter(logging.Formatter):
    """gpud's formatter: its timestamp in the settings' format."""

    iso8601 = False

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's
        if self.iso8601:
            return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        return super().formatTime(record, datefmt)


class _LevelFilter(logging.Filter):
    """Drops the records of the levels switched off (a logger's level is one threshold: it cannot drop WARNING
    and keep ERROR)."""

    def __init__(self, settings: LogSettings):
        super().__init__()
        self.settings = settings

    def filter(self, record: logging.LogRecord) -> bool:
        return self.settings.writes(record.levelno)


def configure(settings: LogSettings, fmt: str, root: logging.Logger | None = None) -> None:
    """A gpud process's logging: to standard error, in `fmt` (a `%`-style format), as `settings` say. As
    logging.basicConfig, a root logger that has handlers already keeps them (and gets no second)."""
    root = root or logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(LogFormatter(fmt))
        root.addHandler(handler)
    apply(settings, root)


def apply(settings: LogSettings, root: logging.Logger | None = None) -> None:
    """This process's logging follows `settings`: `root`'s level (the root logger's by default) and, on each of its
    handlers, the levels written and the timestamp format (gpud's formatters)."""
    root = root or logging.getLogger()
    root.setLevel(settings.threshold())
    for handler in root.handlers:
        ours = next((f for f in handler.filters if isinstance(f, _LevelFilter)), None)
        if ours is None:
            handler.addFilter(_LevelFilter(settings))
        else:
            ours.settings = settings
        if isinstance(handler.formatter, LogFormatter):
            handler.formatter.iso8601 = settings.format == "ISO8601"


def follow(settings: LogSettings, logger: logging.Logger, root: logging.Logger | None = None) -> None:
    """`apply` in one of the daemon's other processes, which then says so at DEBUG (with a verbose level, each
    process's line shows that it follows)."""
    apply(settings, root)
    logger.debug("log settings now: %s", ", ".join(f"{k} {v}" for k, v in settings.wire().items() if k != "log_file"))


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
