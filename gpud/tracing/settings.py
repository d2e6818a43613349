"""Triton's trace settings (its trace extension and `--trace-config`): what they are, how a request changes them, and
how the command line gives them. Pure: gpud.tracing.tracer keeps and applies them.

A setting is the trace level (none = OFF; TIMESTAMPS, TENSORS), the sampling rate (every rate-th request), the
count of traces still to take (-1: no limit), the log frequency (traces per indexed file; 0: one file) and the file.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from gpud.executor.errors import ErrorKind, InferenceError

LEVELS = ("TIMESTAMPS", "TENSORS")
OFF = "OFF"
# Triton's names, in its answer's order, and which field of TraceSettings each is.
FIELDS = {"trace_level": "level", "trace_rate": "rate", "trace_count": "count", "log_frequency": "log_frequency",
          "trace_file": "file"}
NAMES = tuple(FIELDS)
MODE = "triton"  # Triton's trace API and file format; gpud has no OpenTelemetry mode
_UINT32_MAX = 2**32 - 1
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class TraceSettings:
    level: tuple[str, ...] = ()  # of LEVELS, in that order; () = OFF
    rate: int = 1000  # every rate-th request is traced
    count: int = -1  # traces still to take; -1: no limit
    log_frequency: int = 0  # traces per indexed file (file.0, file.1, ...); 0: all in `file`
    file: str = ""

    def wire(self) -> dict[str, str | list[str]]:
        """Triton's answer: every value a string, the level a list of them."""
        return {"trace_level": list(self.level) or [OFF], "trace_rate": str(self.rate),
                "trace_count": str(self.count), "log_frequency": str(self.log_frequency), "trace_file": self.file,
                "trace_mode": MODE}

    def why_not_tracing(self) -> str:
        """Why these settings trace nothing ("" when they do). Triton's reasons."""
        if not self.level:
            return "tracing is disabled"
        if self.rate == 0:
            return "sample rate must be non-zero"
        if not self.file:
            return "trace file name is not given"
        return ""


def _invalid(message: str) -> InferenceError:
    return InferenceError(ErrorKind.INVALID_ARGUMENT, message)


def parse_level(values: Iterable[str]) -> tuple[str, ...]:
    """A list of levels as Triton takes it: OFF alone, or any of LEVELS (each once, in LEVELS' order)."""
    given = [str(v).upper() for v in values]
    if OFF in given:
        if len(given) != 1:
            raise _invalid("Expect only one trace level 'OFF' is specified")
        return ()
    unknown = [v for v in given if v not in LEVELS]
    if unknown:
        raise _invalid(f"unknown trace level {unknown[0]!r} (choose OFF, or any of {', '.join(LEVELS)})")
    return tuple(level for level in LEVELS if level in given)


def _parse_int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise _invalid(f"Unable to parse '{name}', expecting a number as a string, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise _invalid(f"Unable to parse '{name}', got: {value}") from None
    if not low <= number <= high:
        raise _invalid(f"Unable to parse '{name}', value is out of range [ {low}, {high} ], got: {value}")
    return number


_LIMITS = {"trace_rate": (0, _UINT32_MAX), "trace_count": (-1, _INT32_MAX), "log_frequency": (0, _UINT32_MAX)}


def parse_request(request: Mapping[str, object]) -> dict[str, object | None]:
    """A trace setting request (Triton's names) as changes by field: a value, or None to clear the setting (a model's
    then follows the global one again, the global one goes back to what gpud started with). InferenceError for an
    unknown name, a value it cannot read, or a trace file (UNSUPPORTED: the file is set when gpud starts, as Triton,
    which refuses to move it over the network)."""
    changes: dict[str, object | None] = {}
    for name, value in request.items():
        field = FIELDS.get(name)
        if field is None:
            raise _invalid(f"unknown trace setting '{name}' (known: {', '.join(NAMES)})")
        if name == "trace_file":
            raise InferenceError(ErrorKind.UNSUPPORTED,
                                 "trace file location can not be updated through network protocol: it is set when "
                                 "gpud starts (--trace-config triton,file=PATH)")
        if value is None:
            changes[field] = None
        elif name == "trace_level":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise _invalid(f"expect an array of strings for 'trace_level', got {value!r}")
            changes[field] = parse_level(value)
        else:
            low, high = _LIMITS[name]
            changes[field] = _parse_int(name, value, low, high)
    return changes


def with_changes(base: TraceSettings, changes: Mapping[str, object]) -> TraceSettings:
    return replace(base, **changes)  # type: ignore[arg-type]


# --- the command line: tritonserver's --trace-config and its deprecated flags -------------------------------------
_CONFIG_KEYS = {"rate": "trace_rate", "level": "trace_level", "count": "trace_count", "file": "trace_file",
                "log-frequency": "trace_log_frequency"}
_TRITON_ONLY = ("file", "log-frequency")  # --trace-config triton,<key>=<value>


def parse_trace_config(values: Sequence[str]) -> dict[str, object]:
    """tritonserver's `--trace-config` values (`rate=100`, `level=TIMESTAMPS` (repeatable), `count=100`,
    `mode=triton`, `triton,file=/tmp/trace.json`, `triton,log-frequency=50`) as gpud's settings (trace_rate,
    trace_level, ...). ValueError naming the value it cannot take, OpenTelemetry's mode and settings among them."""
    out: dict[str, object] = {}
    levels: list[str] = []
    for text in values:
        mode, _, rest = text.partition(",") if "," in text else ("", "", text)
        key, eq, value = rest.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--trace-config {text!r}: expected [triton,]<setting>=<value>")
        if mode and mode != MODE:
            raise ValueError(f"--trace-config {text!r}: gpud traces in Triton's mode only (no {mode!r})")
        if key == "mode":
            if value != MODE:
                raise ValueError(f"--trace-config {text!r}: gpud traces in Triton's mode only (mode=triton)")
            continue
        if key in _TRITON_ONLY and not mode:
            raise ValueError(f"--trace-config {text!r}: '{key}' is a setting of the triton mode "
                             f"(--trace-config triton,{key}={value})")
        if key not in _CONFIG_KEYS or (mode and key not in _TRITON_ONLY):
            raise ValueError(f"--trace-config {text!r}: unknown setting '{key}' (known: rate, level, count, mode, "
                             "triton,file, triton,log-frequency)")
        if key == "level":
            levels.append(value)
        elif key == "file":
            out["trace_file"] = value
        else:
            try:
                out[_CONFIG_KEYS[key]] = int(value)
            except ValueError:
                raise ValueError(f"--trace-config {text!r}: '{key}' must be a number") from None
    if levels:
        out["trace_level"] = tuple(levels)
    return out


def settings_of(level: Sequence[str], rate: int, count: int, log_frequency: int, file: str) -> TraceSettings:
    """The settings gpud starts with, from its own (gpud.settings: trace_level, ...); ValueError for one it cannot
    take, named as the setting."""
    try:
        parsed_level = parse_level(level)
    except InferenceError as exc:
        raise ValueError(f"trace_level: {exc.message}") from None
    for name, value, (low, high) in (("trace_rate", rate, _LIMITS["trace_rate"]),
                                     ("trace_count", count, _LIMITS["trace_count"]),
                                     ("trace_log_frequency", log_frequency, _LIMITS["log_frequency"])):
        if not low <= value <= high:
            raise ValueError(f"{name} must be from {low} to {high}, got {value}")
    settings = TraceSettings(parsed_level, rate, count, log_frequency, file)
    why = settings.why_not_tracing()
    if settings.level and why:
        raise ValueError(f"trace_level {'+'.join(settings.level)}: {why} (--trace-config triton,file=PATH)")
    return settings
