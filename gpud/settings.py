"""Daemon settings: defaults, the optional YAML config file and command-line flags (flags win), their checks, and
what is built from them (`prepare_settings`). The one module that checks settings: the daemon (gpud.main), a reload
(gpud.reload) and the in-process server (gpud.inprocess) all use it.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, cast

import yaml

from gpud.api import GRPC_SERVERS
from gpud.api.admin import read_token_file
from gpud.api.grpcwire.keepalive import MAX_MS, Keepalive
from gpud.executor.process_log import FORMATS as LOG_FORMATS
from gpud.executor.process_log import LogSettings
from gpud.model_control import ModelControl, ModelControlMode
from gpud.executor.objective import (DEFAULT_SHARE, MAX_OBJECTIVE_MS, ObjectiveDefaults, parse_objective_ms,
                                     parse_objective_share)
from gpud.scaling.bounds import BoundsDefaults
from gpud.scaling.hints import HintPolicy
from gpud.scaling.rules import SCALING_MODES, ScalingMode, ScalingPolicy
from gpud.tracing.settings import TraceSettings
from gpud.tracing.settings import settings_of as tracing_settings_of

log = logging.getLogger("gpud")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
AUTO = "auto"  # a front-end process count chosen from the CPUs (frontend_processes)
MAX_FRONTEND_PROCESSES = 256
_KEEPALIVE = Keepalive()  # the defaults: Triton's (gRPC core's), and gpud's idle timeout off


@dataclass
class Settings:
    model_repository: str | None = None  # None: generate the example models and serve them
    node: str | None = None  # simulated node description; None: NVML, or the default simulated node without GPUs
    http_address: str = "0.0.0.0"
    http_port: int = 8000
    grpc_address: str = "0.0.0.0"
    grpc_port: int = 8001
    metrics_address: str = "0.0.0.0"
    metrics_port: int = 8002
    allow_http: bool = True
    allow_grpc: bool = True
    allow_metrics: bool = True
    device_reserve_bytes: int = 512 * 2**20  # CUDA context and workspace kept free on every GPU / MIG instance
    default_max_batch_size: int = 4  # for auto-completed models that can batch (Triton's default)
    placement_strategy: str = "pack"  # "pack": fewest devices; "spread": balanced over devices
    placement_time_limit_seconds: float = 2.0  # how long the placement engine may search for a better plan
    exit_timeout_seconds: float = 30.0  # how long SIGTERM waits for accepted requests
    worker_hang_seconds: float = 300.0  # a batch unanswered this long means its worker is hung: kill, restart; 0: off
    worker_crash_loop_deaths: int = 3  # a device's worker lost this many times ...
    worker_crash_loop_seconds: float = 120.0  # ... within this long: not restarted; its instances go elsewhere
    idle_unload_seconds: float = 300.0  # a model with gpud_min_instances 0 and no request this long is unloaded
    unready_wait_seconds: float = 30.0  # requests wait this long for an instance while none is ready (restarts)
    model_control_mode: str = "none"  # none | explicit | poll (gpud.model_control), as Triton's
    load_model: tuple[str, ...] = ()  # explicit mode: the models loaded at start-up ("*": all)
    repository_poll_seconds: float = 15.0  # poll mode: how often the repository is read again
    admin_token_file: str | None = None  # load/unload/placement need "Authorization: Bearer <the token>"
    admin_socket: str | None = None  # the HTTP API on a unix socket (mode 0660), admin actions without a token there;
    # over TCP they are then refused unless admin_token_file is set
    admin_open: bool = False  # neither token nor socket: admin actions from any address (else loopback only)
    allow_client_shm: bool = False  # clients may register shared-memory regions (Triton's flag and default)
    default_max_queue_size: int = 512  # requests queued per model and priority level where its config sets no
    # max_queue_size; over it a request gets UNAVAILABLE at once (0: unbounded, as Triton)
    http_request_timeout_seconds: float = 30.0  # a request's head and body must arrive within this, else 408
    http_max_connections: int = 10000  # more HTTP connections are answered 503 and closed
    max_request_bytes: int = 64 * 2**20
    max_header_bytes: int = 64 * 1024  # an HTTP request's line and headers (more: 431), gRPC metadata
    max_tensor_elements: int = 2**28  # a declared input shape spanning more is refused before any allocation
    http_processes: int | str = AUTO  # HTTP front ends in processes of their own (gpud.frontproc); 0: on the core's
    # loop; "auto": from the usable CPUs (frontend_processes)
    grpc_processes: int | str = AUTO  # gRPC front ends in processes of their own (sharing the port); as http_processes
    grpc_max_connections: int = 10000  # more gRPC connections are closed at once (GOAWAY); gpud's server only
    grpc_server: str = "gpud"  # "gpud": gpud's own HTTP/2 server (gpud.api.grpcwire); "grpcio": grpcio's aio server
    # gRPC keepalive, Triton's flags and defaults (gpud.api.grpcwire.keepalive; both gRPC servers)
    grpc_keepalive_time_ms: int = _KEEPALIVE.time_ms  # the server PINGs a connection with a call open this often
    grpc_keepalive_timeout_ms: int = _KEEPALIVE.timeout_ms  # no PING ACK within this: the connection is closed
    grpc_keepalive_permit_without_calls: bool = _KEEPALIVE.permit_without_calls  # PINGs either way without calls
    grpc_http2_max_pings_without_data: int = _KEEPALIVE.max_pings_without_data  # keepalive PINGs while the
    # server sends nothing else (0: no limit)
    grpc_http2_min_recv_ping_interval_without_data_ms: int = _KEEPALIVE.min_recv_ping_interval_without_data_ms
    # a client PING sooner after its last while no data flows is a strike
    grpc_http2_max_ping_strikes: int = _KEEPALIVE.max_ping_strikes  # more: GOAWAY "too_many_pings" (0: no limit)
    grpc_max_connection_idle_ms: int = _KEEPALIVE.max_connection_idle_ms  # gpud's own: a connection without a
    # call this long is closed, GOAWAY NO_ERROR (0: never)
    json_processes: int = 2  # child processes that decode large JSON bodies and encode large JSON answers (0: none)
    json_offload_bytes: int = 2**20  # JSON bodies (and answers) at least this long go to those processes
    log_level: str = "INFO"  # DEBUG | INFO | WARNING | ERROR: that level and those above (gpudctl log changes it)
    # tritonserver's --log-info, --log-warning, --log-error: a level switched off on its own; --log-format
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_format: str = "default"  # default (local time) | ISO8601 (UTC)
    ready_file: str | None = None  # written (JSON: bound ports) once serving
    # --- tracing (Triton's trace extension and its --trace-config; docs/tracing.md) ---
    trace_file: str = ""  # where traces are written (a JSON array); set only here, as Triton's
    trace_level: tuple[str, ...] = ()  # TIMESTAMPS and/or TENSORS; none: OFF
    trace_rate: int = 1000  # every rate-th request is traced
    trace_count: int = -1  # traces to take, then no more; -1: no limit
    trace_log_frequency: int = 0  # traces per indexed file (trace_file.0, .1, ...); 0: all in trace_file
    # --- model metrics and autoscaling hints (docs/model-metrics.md, docs/autoscaling.md) ---
    triton_metrics: bool = False  # also export Triton's nv_inference_* / nv_gpu_* names for Triton dashboards
    hints_interval_seconds: float = 5.0  # how often the hints sample the executor
    hints_rate_window_seconds: float = 30.0  # arrival rate, throughput and queue time are averaged over this window
    hints_target_queue_seconds: float = 0.010  # mean queue time above which a model needs more instances
    hints_target_utilization_ratio: float = 0.8  # share of an instance's measured throughput to plan for
    hints_tolerance: float = 0.1  # HPA's: metric/target within 1 +- tolerance changes nothing
    hints_scale_up_stabilization_seconds: float = 30.0
    hints_scale_down_stabilization_seconds: float = 300.0
    # --- the placement controller (README, "Placement that follows load") ---
    # Instance bounds for models whose config.pbtxt sets no gpud_min_instances / gpud_max_instances
    # (gpud.scaling.bounds)
    min_instances: int | None = None  # None: the model's instance_group count
    max_instances: int | None = None  # None: as many as the node has room for
    placement_control: str = "on"  # "on": apply; "advise": log and export what it would do; "off": no controller
    control_interval_seconds: float = 10.0  # how often the controller re-plans
    control_max_steps_per_interval: int = 4  # adds, removals and moves applied per interval; the rest waits
    # --- latency objectives (gpud.executor.objective) for models whose config.pbtxt sets none ---
    latency_objective_ms: float | None = None  # None: such models have no objective
    latency_objective_share: float = DEFAULT_SHARE  # of requests within it


_FIELDS = {f.name: f for f in fields(Settings)}
# Settings renamed: the old name still works, with a warning (configs written for an older gpud keep working).
RENAMED = {"hints_min_instances": "min_instances", "hints_max_instances": "max_instances"}


@dataclass(frozen=True)
class Prepared:
    """Settings and what is built from them, all checked: what start-up and a reload use."""

    settings: Settings
    hint_policy: HintPolicy
    scaling_policy: ScalingPolicy
    scaling_mode: ScalingMode  # placement_control, checked
    bounds_defaults: BoundsDefaults
    objective_defaults: ObjectiveDefaults
    model_control: ModelControl
    admin_token: str | None


def load_settings_file(path: str) -> dict[str, Any]:
    """The YAML config file as overrides. Errors name the file and the key."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    out = coerce_settings(data, path)
    if "model_repository" in out and out["model_repository"] and not os.path.isabs(out["model_repository"]):
        out["model_repository"] = os.path.join(os.path.dirname(os.path.abspath(path)), out["model_repository"])
    return out


def coerce_settings(data: Mapping[Any, Any], where: str) -> dict[str, Any]:
    """Settings by name (dashes or underscores), each converted to its field's type; ValueError naming `where` (a
    file, or the in-process server's arguments) and the key for an unknown setting or a value of the wrong type."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in RENAMED:
            log.warning("%s: setting '%s' is now '%s' (it bounds the controller's instances too)", where, key,
                        RENAMED[name])
            name = RENAMED[name]
        f = _FIELDS.get(name)
        if f is None:
            raise ValueError(f"{where}: unknown setting '{key}'; known: {', '.join(sorted(_FIELDS))}")
        out[name] = _coerce(where, key, f.type, value)
    return out


def _coerce(path: str, key: str, type_name: Any, value: Any) -> Any:
    t = str(type_name)
    if value is None and "None" in t:
        return None
    if t == "int | str":  # a count or "auto" (the front-end processes)
        if value == AUTO:
            return AUTO
        t = f"int or '{AUTO}'"
        if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
            raise ValueError(f"{path}: setting '{key}': expected {t}, got {value!r}")
        return int(value)
    try:
        if t.startswith("int"):
            if isinstance(value, bool):
                raise TypeError
            return int(value)
        if t.startswith("float"):
            return float(value)
        if t.startswith("tuple"):  # a list of names (load_model): one name alone is a list of one
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
                raise TypeError
            return tuple(items)
        if t.startswith("bool"):
            if not isinstance(value, bool):
                raise TypeError
            return value
        return str(value)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: setting '{key}': expected {t}, got {value!r}") from None


def check_settings(settings: Settings) -> None:
    """ValueError for a value no part of gpud can use (the daemon exits 2; the in-process server raises it)."""
    if str(settings.log_level).upper() not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {settings.log_level!r}")
    if settings.log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {settings.log_format!r}")
    trace_settings_of(settings)
    if not settings.http_request_timeout_seconds > 0 or settings.http_max_connections < 1:
        raise ValueError("http_request_timeout_seconds must be > 0 and http_max_connections >= 1, got "
                         f"{settings.http_request_timeout_seconds} and {settings.http_max_connections}")
    for key in ("max_request_bytes", "max_header_bytes", "max_tensor_elements"):
        if getattr(settings, key) < 1:
            raise ValueError(f"{key} must be >= 1, got {getattr(settings, key)}")
    for key in ("http_processes", "grpc_processes"):
        value = getattr(settings, key)
        if value != AUTO and not (isinstance(value, int) and 0 <= value <= MAX_FRONTEND_PROCESSES):
            raise ValueError(f"{key} must be '{AUTO}' or 0 (served on the core's loop) to {MAX_FRONTEND_PROCESSES}, "
                             f"got {value!r}")
    if settings.grpc_max_connections < 1:
        raise ValueError(f"grpc_max_connections must be >= 1, got {settings.grpc_max_connections}")
    for key in ("grpc_keepalive_time_ms", "grpc_keepalive_timeout_ms"):
        if not 1 <= getattr(settings, key) <= MAX_MS:
            raise ValueError(f"{key} must be 1 to {MAX_MS} (milliseconds), got {getattr(settings, key)}")
    for key in ("grpc_http2_max_pings_without_data", "grpc_http2_min_recv_ping_interval_without_data_ms",
                "grpc_http2_max_ping_strikes", "grpc_max_connection_idle_ms"):
        if not 0 <= getattr(settings, key) <= MAX_MS:
            raise ValueError(f"{key} must be 0 to {MAX_MS}, got {getattr(settings, key)}")
    if settings.grpc_server not in GRPC_SERVERS:
        raise ValueError(f"grpc_server must be one of {', '.join(GRPC_SERVERS)}, got {settings.grpc_server!r}")
    if settings.json_processes < 0 or settings.json_offload_bytes < 0:
        raise ValueError("json_processes and json_offload_bytes must be >= 0, got "
                         f"{settings.json_processes} and {settings.json_offload_bytes}")
    if settings.default_max_queue_size < 0:
        raise ValueError(f"default_max_queue_size must be >= 0 (0 = unbounded), got {settings.default_max_queue_size}")
    if not settings.repository_poll_seconds > 0:  # also refuses NaN
        raise ValueError(f"repository_poll_seconds must be > 0, got {settings.repository_poll_seconds}")
    if not settings.unready_wait_seconds > 0:  # also refuses NaN
        raise ValueError(f"unready_wait_seconds must be > 0, got {settings.unready_wait_seconds}")
    if not settings.worker_hang_seconds >= 0:  # also refuses NaN
        raise ValueError(f"worker_hang_seconds must be >= 0 (0 = never), got {settings.worker_hang_seconds}")


def prepare_settings(settings: Settings) -> Prepared:
    """Everything built from the settings, checked (ValueError: refused), at start and at each reload."""
    if not 0 < settings.hints_interval_seconds <= settings.hints_rate_window_seconds:
        raise ValueError("need 0 < hints_interval_seconds <= hints_rate_window_seconds, got "
                         f"{settings.hints_interval_seconds} and {settings.hints_rate_window_seconds}")
    return Prepared(settings, hint_policy(settings), scaling_policy(settings),
                    cast(ScalingMode, settings.placement_control),  # scaling_policy checked it
                    BoundsDefaults(settings.min_instances, settings.max_instances),
                    objective_defaults(settings),
                    # ModelControl checks the mode
                    ModelControl(cast(ModelControlMode, settings.model_control_mode), tuple(settings.load_model)),
                    read_token_file(settings.admin_token_file) if settings.admin_token_file else None)


# "auto": no front-end processes below this many usable CPUs. There a lone request is answered sooner on the core's
# loop (one process fewer to wake: +0.19 ms over HTTP, +0.4 ms over gRPC on a 2-core VM, docs/benchmarks.md), and
# the processes would take CPU from the device workers.
AUTO_MIN_CPUS = 8
AUTO_CPUS_PER_PROCESS = 8  # then one process per this many CPUs (the rest for workers, their threads and clients)
AUTO_MAX_PROCESSES = 4  # and at most this many: four HTTP processes' requests (~35 µs each) fill the core's
# loop (~7-12 µs a request with processes)


def frontend_processes(configured: int | str, cpus: int) -> int:
    """Pure: the number of front-end processes for a setting (a count, or "auto") on `cpus` usable CPUs."""
    if configured != AUTO:
        return int(configured)
    if cpus < AUTO_MIN_CPUS:
        return 0
    return min(AUTO_MAX_PROCESSES, cpus // AUTO_CPUS_PER_PROCESS)


def grpc_keepalive(settings: Settings) -> Keepalive:
    """The gRPC servers' keepalive, ping policy and idle timeout (checked by check_settings)."""
    return Keepalive(time_ms=settings.grpc_keepalive_time_ms, timeout_ms=settings.grpc_keepalive_timeout_ms,
                     permit_without_calls=settings.grpc_keepalive_permit_without_calls,
                     max_pings_without_data=settings.grpc_http2_max_pings_without_data,
                     min_recv_ping_interval_without_data_ms=settings.grpc_http2_min_recv_ping_interval_without_data_ms,
                     max_ping_strikes=settings.grpc_http2_max_ping_strikes,
                     max_connection_idle_ms=settings.grpc_max_connection_idle_ms)


def objective_defaults(settings: Settings) -> ObjectiveDefaults:
    """The node's latency objective for models that set none; ValueError (exit 2) for values it refuses."""
    ms, share = settings.latency_objective_ms, settings.latency_objective_share
    try:
        if ms is not None:
            parse_objective_ms(str(ms))
        parse_objective_share(str(share))
    except ValueError:
        raise ValueError(f"latency_objective_ms must be in (0, {MAX_OBJECTIVE_MS:g}] and latency_objective_share "
                         f"in (0, 1), got {ms} and {share}") from None
    return ObjectiveDefaults(ms, share)


def hint_policy(settings: Settings) -> HintPolicy:
    """The autoscaling policy from the settings; ValueError (exit 2) for values it refuses."""
    return HintPolicy(target_queue_seconds=settings.hints_target_queue_seconds,
                      target_utilization_ratio=settings.hints_target_utilization_ratio,
                      tolerance=settings.hints_tolerance,
                      scale_up_stabilization_seconds=settings.hints_scale_up_stabilization_seconds,
                      scale_down_stabilization_seconds=settings.hints_scale_down_stabilization_seconds)


def scaling_policy(settings: Settings) -> ScalingPolicy:
    """The controller's policy from the settings; ValueError (exit 2) for values it refuses. No removal of a
    version's instances within the hints' scale-down window of its last add: the controller cannot flap."""
    if settings.placement_control not in SCALING_MODES:
        quote = " (YAML reads bare on/off as booleans: quote it, \"on\")" \
            if settings.placement_control in ("True", "False") else ""
        raise ValueError(f"placement_control must be one of {', '.join(SCALING_MODES)}, "
                         f"got {settings.placement_control!r}{quote}")
    return ScalingPolicy(interval_seconds=settings.control_interval_seconds,
                         max_steps_per_interval=settings.control_max_steps_per_interval,
                         scale_down_cooldown_seconds=settings.hints_scale_down_stabilization_seconds,
                         idle_unload_seconds=settings.idle_unload_seconds)


def trace_settings_of(settings: Settings) -> TraceSettings:
    """The trace settings gpud starts with (gpud.tracing); ValueError naming a setting it cannot take."""
    return tracing_settings_of(settings.trace_level, settings.trace_rate, settings.trace_count,
                               settings.trace_log_frequency, settings.trace_file)


def log_settings_of(settings: Settings) -> LogSettings:
    """What gpud logs as its settings say: `log_level` and the levels above it, less those `log_info`,
    `log_warning` or `log_error` switch off, in `log_format` (gpud.executor.process_log)."""
    base = LogSettings.of_level(settings.log_level)
    return replace(base, info=base.info and settings.log_info, warning=base.warning and settings.log_warning,
                   error=base.error and settings.log_error, format=settings.log_format)
