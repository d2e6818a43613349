"""How one of gpud's processes logs (the daemon, a front-end process, a device worker): the settings of Triton's
logging extension (`LogSettings`) and applying them to the process's logging. The daemon keeps the settings and
tells its other processes when they change (gpud.log_settings.LogControl)."""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import asdict, dataclass

FORMATS = ("default", "ISO8601")  # Triton's log formats: local time, or UTC


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
