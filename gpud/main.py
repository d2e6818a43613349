"""`gpud`: the daemon. Flags follow tritonserver's where they overlap (--model-repository, --http-port, ...)."""
from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import asdict, replace

from gpud import __version__, compiled
from gpud.api.http_server import HttpServer
from gpud.ports import Listener, check_ports_free
from gpud.cpus import usable_cpus
from gpud.tracing.settings import parse_trace_config
from gpud.tracing.output import unwritable
from gpud.tracing.tracer import Tracer
from gpud.settings import (AUTO, LOG_LEVELS, Settings, check_settings, frontend_processes, grpc_keepalive,
                           load_settings_file, log_settings_of, prepare_settings, trace_settings_of)
from gpud.api.admin import AdminAuth
from gpud.executor.process_log import FORMATS as LOG_FORMATS
from gpud.executor.process_log import configure
from gpud.log_settings import LogControl
from gpud.reload import Reloader, ReloadTargets
from gpud.systemd_notify import notify, watchdog, watchdog_interval_s
from gpud.api import GRPC_SERVERS
from gpud.scaling.rules import SCALING_MODES

log = logging.getLogger("gpud")
TRACE_WRITE_INTERVAL_S = 1.0  # how soon a trace is in the trace file (without a log frequency)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpud",
        description="Node daemon for GPU servers: serves a Triton-layout model repository (KServe v2 over HTTP and "
                    "gRPC), places model instances on GPUs and MIG instances by memory, exports Prometheus metrics. "
                    "Without an NVIDIA driver it runs on a simulated node and computes on the CPU.")
    p.add_argument("--version", action="version",
                   version=f"gpud {__version__} (request path {compiled.status().reason})")
    p.add_argument("--model-repository", "--model-store", dest="model_repository", metavar="DIR",
                   help="Triton-layout model repository (<DIR>/<model>/<version>/model.onnx [+ config.pbtxt]). "
                        "Default: generate the example models and serve them")
    p.add_argument("--config", metavar="FILE", help="YAML file of settings (keys as the long flags, with _)")
    p.add_argument("--node", metavar="FILE", help="simulated node description (config/nodes/*.yaml) instead of NVML")
    p.add_argument("--address", metavar="HOST", help="bind all three endpoints to HOST (default 0.0.0.0)")
    p.add_argument("--http-address", metavar="HOST")
    p.add_argument("--http-port", type=int, metavar="PORT", help="KServe v2 HTTP (default 8000; 0 = any free port)")
    p.add_argument("--grpc-address", metavar="HOST")
    p.add_argument("--grpc-port", type=int, metavar="PORT", help="KServe v2 gRPC (default 8001)")
    p.add_argument("--metrics-address", metavar="HOST")
    p.add_argument("--metrics-port", type=int, metavar="PORT", help="Prometheus metrics (default 8002)")
    for name in ("http", "grpc", "metrics"):
        p.add_argument(f"--allow-{name}", type=_bool, metavar="BOOL", help=f"serve {name} (default true)")
    p.add_argument("--device-reserve-bytes", type=int, metavar="N",
                   help="memory kept free on each GPU / MIG instance for the CUDA context (default 512 MiB)")
    p.add_argument("--default-max-batch-size", type=int, metavar="N",
                   help="max_batch_size given to auto-completed models that can batch (default 4)")
    p.add_argument("--placement-strategy", choices=["pack", "spread"],
                   help="pack: instances on the fewest devices (default); spread: balanced over devices")
    p.add_argument("--placement-time-limit", dest="placement_time_limit_seconds", type=float, metavar="S",
                   help="how long the placement engine may search for a better plan (default 2)")
    p.add_argument("--exit-timeout-secs", dest="exit_timeout_seconds", type=float, metavar="S",
                   help="on SIGTERM, how long to wait for accepted requests (default 30)")
    p.add_argument("--worker-hang-secs", dest="worker_hang_seconds", type=float, metavar="S",
                   help="a batch unanswered this long means its device worker is hung (a stuck kernel or driver): "
                        "the worker is killed, its batches fail with an error saying so, and it is restarted "
                        "(default 300; 0 = never; raise it where TensorRT builds engines for new shapes at run "
                        "time, which can take minutes)")
    p.add_argument("--worker-crash-loop-deaths", type=int, metavar="N",
                   help="a device whose worker dies N times within --worker-crash-loop-seconds is in a crash loop: "
                        "its worker is not restarted again, the device reads unhealthy and the placement controller "
                        "moves its instances to other devices (default 3)")
    p.add_argument("--worker-crash-loop-seconds", type=float, metavar="S", help="(default 120)")
    p.add_argument("--unready-wait-seconds", type=float, metavar="S",
                   help="while no instance of a model is ready (its worker restarting, or its instances being "
                        "placed on another device), requests wait in its queue this long, then fail with the reason "
                        "(default 30)")
    p.add_argument("--model-control-mode", choices=["none", "explicit", "poll"],
                   help="none (default): every model in the repository is loaded at start and the load/unload API "
                        "answers 503 (UNAVAILABLE, as Triton); explicit: --load-model names the models loaded at start "
                        "and the API loads and unloads; poll: as none, then changes in the repository are applied "
                        "every --repository-poll-secs (as Triton)")
    p.add_argument("--load-model", action="append", metavar="NAME",
                   help="explicit mode: a model to load at start-up (repeat it; '*' loads all)")
    p.add_argument("--repository-poll-secs", dest="repository_poll_seconds", type=float, metavar="S",
                   help="poll mode: how often the repository is read again (default 15)")
    p.add_argument("--admin-token-file", metavar="FILE",
                   help="a file holding a token (16+ characters); loading, unloading and POST /v2/gpud/placement "
                        "then need 'Authorization: Bearer <token>' (gpudctl: --token-file); read again at each "
                        "reload (SIGHUP)")
    p.add_argument("--admin-socket", metavar="PATH",
                   help="also serve the HTTP API on a unix socket at PATH (mode 0660: gpud's user and group) where "
                        "loading, unloading and POST /v2/gpud/placement need no token (gpudctl --socket); over TCP "
                        "they are then refused unless --admin-token-file is set too (systemd: /run/gpud/admin.sock)")
    p.add_argument("--admin-open", action="store_true", default=None,
                   help="with neither --admin-token-file nor --admin-socket, take loading, unloading and "
                        "POST /v2/gpud/placement from any address without a token (default: from this machine's "
                        "loopback address only; a placement can move or remove every instance)")
    p.add_argument("--allow-client-shm", type=_bool, nargs="?", const=True, metavar="BOOL",
                   help="let clients register shared-memory regions and pass tensors through them (Triton's "
                        "shared-memory extension, system and CUDA; default false, as Triton). Registering follows "
                        "the admin rules of loading a model: gpud then reads and writes that /dev/shm file, or "
                        "that device allocation, with its own rights (docs/security.md)")
    p.add_argument("--default-max-queue-size", type=int, metavar="N",
                   help="requests queued per model (and priority level) when its config.pbtxt sets no "
                        "max_queue_size; more are refused at once with 503 / UNAVAILABLE, so overload does not grow "
                        "the queue and memory without bound (default 512; 0 = unbounded, as Triton)")
    p.add_argument("--http-request-timeout-secs", dest="http_request_timeout_seconds", type=float, metavar="S",
                   help="an HTTP request's head and body must arrive within S seconds, else 408 and the connection "
                        "is closed (slow clients, slowloris; default 30)")
    p.add_argument("--http-max-connections", type=int, metavar="N",
                   help="HTTP connections beyond N are answered 503 and closed (default 10000)")
    p.add_argument("--max-request-bytes", type=int, metavar="N",
                   help="largest request body / gRPC message accepted; more is 413 / RESOURCE_EXHAUSTED "
                        "(default 64 MiB)")
    p.add_argument("--max-header-bytes", type=int, metavar="N",
                   help="largest HTTP request line and headers together (more: 431 and the connection closed) and "
                        "gRPC request metadata (more: RESOURCE_EXHAUSTED) (default 65536)")
    p.add_argument("--max-tensor-elements", type=int, metavar="N",
                   help="an input whose declared shape spans more elements is refused (400 / INVALID_ARGUMENT) "
                        "before anything is allocated for it; zero dimensions count as one (default 268435456)")
    p.add_argument("--latency-objective-ms", type=float, metavar="MS",
                   help="the latency objective of models whose config.pbtxt sets no gpud_latency_objective_ms: "
                        "--latency-objective-share of their requests within MS milliseconds inside gpud (queue + "
                        "compute); counted (gpud_model_requests_within/over_objective_total) and the batch delay "
                        "kept within it (default: none)")
    p.add_argument("--latency-objective-share", type=float, metavar="SHARE",
                   help="the share of requests the node's latency objective covers (default 0.99)")
    p.add_argument("--http-processes", type=_count_or_auto, metavar="N|auto",
                   help="serve HTTP from N front-end processes of their own, which parse requests and place their "
                        "tensors in shared memory, so that the core's event loop only batches and answers; 0: on "
                        "the core's event loop (default auto: 0 below 8 usable CPUs, those of its affinity within "
                        "its cgroup's CPU quota; else one per 8, at most 4)")
    p.add_argument("--grpc-processes", type=_count_or_auto, metavar="N|auto",
                   help="serve gRPC from N front-end processes of their own, which parse requests and place their "
                        "tensors in shared memory; 0: on the core's event loop (default auto, as --http-processes)")
    p.add_argument("--grpc-max-connections", type=int, metavar="N",
                   help="more gRPC connections than this are closed at once with GOAWAY (default 10000; gpud's "
                        "gRPC server, not grpcio's)")
    p.add_argument("--grpc-server", choices=GRPC_SERVERS,
                   help="the gRPC server: gpud's own HTTP/2 server (default; about a quarter of grpcio's CPU per "
                        "call) or grpcio's (the reference implementation, for a client that needs what only it has)")
    keepalive = p.add_argument_group("gRPC keepalive (Triton's flags and defaults, gRPC core's rules; both gRPC "
                                     "servers)")
    keepalive.add_argument("--grpc-keepalive-time", "--grpc-keepalive-time-ms", dest="grpc_keepalive_time_ms",
                           type=int, metavar="MS",
                           help="the server PINGs a connection this often while it has a call open (any connection "
                                "with --grpc-keepalive-permit-without-calls) (default 7200000: 2 hours)")
    keepalive.add_argument("--grpc-keepalive-timeout", "--grpc-keepalive-timeout-ms",
                           dest="grpc_keepalive_timeout_ms", type=int, metavar="MS",
                           help="a PING not acknowledged within this closes the connection: a dead or half-open "
                                "client no longer holds it and its calls (default 20000)")
    keepalive.add_argument("--grpc-keepalive-permit-without-calls", type=_bool, nargs="?", const=True,
                           metavar="BOOL",
                           help="keepalive PINGs on connections without calls too, and clients' PINGs on them "
                                "judged by --grpc-http2-min-recv-ping-interval-without-data instead of 2 hours "
                                "(default false)")
    keepalive.add_argument("--grpc-http2-max-pings-without-data", type=int, metavar="N",
                           help="keepalive PINGs sent while the server sends no HEADERS or DATA: no more go until "
                                "it does (default 2; 0 = no limit)")
    keepalive.add_argument("--grpc-http2-min-recv-ping-interval-without-data",
                           "--grpc-http2-min-recv-ping-interval-without-data-ms",
                           dest="grpc_http2_min_recv_ping_interval_without_data_ms", type=int, metavar="MS",
                           help="a client's PING sooner than this after its previous one, while the server sends "
                                "no data, is a strike (2 hours while it has no call open, unless "
                                "--grpc-keepalive-permit-without-calls) (default 300000)")
    keepalive.add_argument("--grpc-http2-max-ping-strikes", type=int, metavar="N",
                           help="more strikes and the connection gets GOAWAY ENHANCE_YOUR_CALM \"too_many_pings\" "
                                "and is closed; data sent forgives them (default 2; 0 = no limit)")
    keepalive.add_argument("--grpc-max-connection-idle-ms", type=int, metavar="MS",
                           help="gpud's own (gRPC core's GRPC_ARG_MAX_CONNECTION_IDLE_MS; Triton has no flag): a "
                                "connection without a call open this long (up to twice it) is closed with GOAWAY "
                                "NO_ERROR, freeing its slot of --grpc-max-connections (default 0 = never)")
    p.add_argument("--json-processes", type=int, metavar="N",
                   help="child processes that decode large JSON inference bodies and encode large JSON answers, so "
                        "that none holds up other requests (orjson holds the GIL: a thread would not do); at most 4 "
                        "per process wait, more bodies are answered 503 (default 2; 0 = all on the event loop)")
    p.add_argument("--json-offload-bytes", type=int, metavar="N",
                   help="JSON inference bodies (or binary requests' JSON headers) and JSON answers of about this "
                        "many bytes or more go to those processes (default 1048576)")
    p.add_argument("--log-level", choices=LOG_LEVELS,
                   help="what gpud logs when it starts: this level and those above (default INFO); `gpudctl log` "
                        "(Triton's logging extension, /v2/logging) changes it while gpud runs")
    p.add_argument("--log-verbose", type=int, metavar="N", help="tritonserver-style: >0 means DEBUG")
    for level in ("info", "warning", "error"):
        p.add_argument(f"--log-{level}", type=_bool, metavar="BOOL",
                       help=f"tritonserver-style: false switches {level.upper()} records off (default true)")
    p.add_argument("--log-format", choices=LOG_FORMATS,
                   help="tritonserver-style: the timestamp, default (local time) or ISO8601 (UTC)")
    p.add_argument("--ready-file", metavar="FILE", help="write the bound ports as JSON to FILE once serving")
    trace = p.add_argument_group("tracing (Triton's trace extension: docs/tracing.md; `gpudctl trace` changes the "
                                 "level, rate and count while gpud runs)")
    trace.add_argument("--trace-config", action="append", metavar="[triton,]SETTING=VALUE",
                       help="tritonserver's: triton,file=PATH (where traces go), level=TIMESTAMPS|TENSORS|OFF "
                            "(repeatable), rate=N (every N-th request; default 1000), count=N (then stop; default "
                            "-1, no limit), triton,log-frequency=N (N traces per file PATH.0, PATH.1, ...; "
                            "default 0, all in PATH), mode=triton")
    trace.add_argument("--trace-file", metavar="PATH", help="tritonserver's deprecated form of triton,file=")
    trace.add_argument("--trace-level", action="append", metavar="LEVEL",
                       help="tritonserver's deprecated form of level=")
    trace.add_argument("--trace-rate", type=int, metavar="N", help="tritonserver's deprecated form of rate=")
    trace.add_argument("--trace-count", type=int, metavar="N", help="tritonserver's deprecated form of count=")
    trace.add_argument("--trace-log-frequency", type=int, metavar="N",
                       help="tritonserver's deprecated form of triton,log-frequency=")
    # --- model metrics and autoscaling hints (docs/model-metrics.md, docs/autoscaling.md) ---
    p.add_argument("--triton-metrics", type=_bool, nargs="?", const=True, metavar="BOOL",
                   help="also export Triton's metric names (nv_inference_*, nv_gpu_*) so Triton dashboards work "
                        "(default false)")
    hints = p.add_argument_group("autoscaling hints (advice exported as metrics and in gpudctl inspect)")
    hints.add_argument("--hints-interval-seconds", type=float, metavar="S", help="sampling interval (default 5)")
    hints.add_argument("--hints-rate-window-seconds", type=float, metavar="S",
                       help="window of the arrival rate, throughput and queue time (default 30)")
    hints.add_argument("--hints-target-queue-seconds", type=float, metavar="S",
                       help="mean queue time above which a model needs more instances (default 0.010)")
    hints.add_argument("--hints-target-utilization-ratio", type=float, metavar="R",
                       help="share of an instance's measured throughput to plan for (default 0.8)")
    hints.add_argument("--hints-tolerance", type=float, metavar="R", help="HPA tolerance (default 0.1)")
    hints.add_argument("--hints-scale-up-stabilization-seconds", type=float, metavar="S", help="(default 30)")
    hints.add_argument("--hints-scale-down-stabilization-seconds", type=float, metavar="S", help="(default 300)")
    control = p.add_argument_group("placement control (instances follow load; per model: config.pbtxt parameters "
                                   "gpud_min_instances, gpud_max_instances)")
    control.add_argument("--min-instances", "--hints-min-instances", dest="min_instances", type=int, metavar="N",
                         help="instances a model runs at least where its config.pbtxt sets no gpud_min_instances "
                              "(default: its instance_group count; 0 lets idle models scale to zero)")
    control.add_argument("--max-instances", "--hints-max-instances", dest="max_instances", type=int, metavar="N",
                         help="instances a model runs at most where its config.pbtxt sets no gpud_max_instances "
                              "(default: as many as the node has room for); the hints and the controller both "
                              "keep to these bounds")
    control.add_argument("--placement-control", choices=SCALING_MODES,
                         help="on: add, remove and move instances as the hints say (default); advise: log and "
                              "export what it would do, change nothing; off: placements change only on request")
    control.add_argument("--control-interval-seconds", type=float, metavar="S",
                         help="how often the controller re-plans (default 10)")
    control.add_argument("--control-max-steps-per-interval", type=int, metavar="N",
                         help="instance loads, unloads and moves per interval; the rest waits (default 4)")
    control.add_argument("--idle-unload-seconds", type=float, metavar="S",
                         help="a model with gpud_min_instances 0 that has had no request this long is unloaded; "
                              "its next request loads it again (a cold start; default 300)")
    return p


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _count_or_auto(text: str) -> int | str:
    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of processes or '{AUTO}', got {text!r}") from None


def resolve_settings(args: argparse.Namespace) -> Settings:
    overrides = load_settings_file(args.config) if args.config else {}
    flags = {k: v for k, v in vars(args).items() if v is not None and k in Settings.__dataclass_fields__}
    if args.address:
        for k in ("http_address", "grpc_address", "metrics_address"):
            flags.setdefault(k, args.address)
    if args.log_verbose:
        flags["log_level"] = "DEBUG"
    if args.trace_level:
        flags["trace_level"] = tuple(args.trace_level)
    flags.update(parse_trace_config(args.trace_config or ()))
    settings = Settings(**(overrides | flags))
    if args.load_model:
        settings = replace(settings, load_model=tuple(args.load_model))
    check_settings(settings)
    return settings


async def serve(settings: Settings, stop: asyncio.Event | None = None, *,
                read_settings: Callable[[], Settings] | None = None, settings_file: str | None = None) -> int:
    """Run gpud until `stop` (SIGTERM, SIGINT). SIGHUP reloads (gpud.reload): `read_settings` reads the settings
    again (default: the same ones, so a reload re-reads only the model repository). The components are
    gpud.wiring's (as the in-process server's); this adds the signals, the reload, systemd and the front ends."""
    from gpud import wiring
    from gpud.frontproc.host import FrontendHost

    prepared = prepare_settings(settings)  # refuse bad settings before starting anything
    admin = AdminAuth(prepared.admin_token, socket_path=settings.admin_socket, open_to_network=settings.admin_open)
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloader = Reloader(read_settings or (lambda: settings), prepare_settings, prepared,
                        lambda: sum(1 for v in parts.registry.versions() if v.ready), source=settings_file)
    loop.add_signal_handler(signal.SIGHUP, reloader.request)  # from now on: SIGHUP's default would end gpud

    try:  # before anything loads: a port in use is found at once
        check_ports_free(_listeners(settings))
    except OSError as exc:
        log.error("cannot start serving: %s", exc.strerror or exc)
        return 1
    if settings.trace_file and (why := unwritable(settings.trace_file)):
        log.error("cannot write traces to %s: %s (trace_file, --trace-config triton,file=PATH)", settings.trace_file,
                  why)
        return 2
    _sweep_segments()
    started_with = log_settings_of(settings)  # what every process of gpud logs from the start (main's own too)
    try:
        parts = wiring.build(prepared, views={"reload": reloader}, worker_log_settings=started_with)
    except ValueError as exc:  # the repository is not a directory, a bad node description
        log.error("%s", exc)
        return 2
    core = parts.core
    # Triton's logging extension: the settings gpud started with, changed over HTTP or gRPC; every process follows
    core.log_control = log_control = LogControl(started_with)
    log_control.listeners.append(parts.pool.set_log_settings)
    # Triton's trace extension: the settings gpud started with, changed over HTTP or gRPC
    core.tracer = tracer = Tracer(trace_settings_of(settings))
    runners, ports, grpc_server = [], {}, None
    try:
        notify("STATUS=loading the model repository")
        await parts.start()
        cpus = usable_cpus()
        http_processes = frontend_processes(settings.http_processes, cpus)
        grpc_processes = frontend_processes(settings.grpc_processes, cpus)
        if settings.allow_http and http_processes:
            runners.append(await _start_frontends(core, admin, settings, "http", http_processes, log_control))
            ports["http"] = runners[-1].listen.getsockname()[1]
            log.info("HTTP (KServe v2) on %s:%d, in %d front-end process(es)%s", settings.http_address, ports["http"],
                     http_processes, _chosen(settings.http_processes, cpus))
        elif settings.allow_http:
            from gpud.api.http_api import start_http_server
            from gpud.api.json_codec import JsonCodecPool

            json_codec = JsonCodecPool(settings.json_processes, settings.json_offload_bytes) \
                if settings.json_processes else None
            runner, ports["http"] = await start_http_server(core, settings.http_address, settings.http_port,
                                                            max_body_bytes=settings.max_request_bytes,
                                                            request_timeout_s=settings.http_request_timeout_seconds,
                                                            max_connections=settings.http_max_connections,
                                                            max_head_bytes=settings.max_header_bytes,
                                                            max_tensor_elements=settings.max_tensor_elements,
                                                            json_codec=json_codec,
                                                            admin=admin)
            runners.append(runner)
            log.info("HTTP (KServe v2) on %s:%d, on the core's event loop%s", settings.http_address, ports["http"],
                     _chosen(settings.http_processes, cpus))
        if settings.admin_socket:
            from gpud.api.http_api import start_http_unix_server

            runners.append(await start_http_unix_server(core, settings.admin_socket,
                                                        max_body_bytes=settings.max_request_bytes,
                                                        request_timeout_s=settings.http_request_timeout_seconds,
                                                        max_connections=settings.http_max_connections,
                                                        max_head_bytes=settings.max_header_bytes,
                                                        max_tensor_elements=settings.max_tensor_elements))
            log.info("admin socket (the HTTP API; admin actions need no token there) on %s, mode 0660",
                     settings.admin_socket)
        if settings.allow_grpc and grpc_processes:
            runners.append(await _start_frontends(core, admin, settings, "grpc", grpc_processes, log_control))
            ports["grpc"] = runners[-1].listen.getsockname()[1]
            log.info("gRPC (KServe v2) on %s:%d, in %d front-end process(es)%s", settings.grpc_address, ports["grpc"],
                     grpc_processes, _chosen(settings.grpc_processes, cpus))
        elif settings.allow_grpc:
            from gpud.api.grpc_api import start_grpc_server

            grpc_server = await start_grpc_server(core, settings.grpc_address, settings.grpc_port,
                                                  max_message_bytes=settings.max_request_bytes,
                                                  max_metadata_bytes=settings.max_header_bytes,
                                                  max_tensor_elements=settings.max_tensor_elements, admin=admin,
                                                  implementation=settings.grpc_server,
                                                  max_connections=settings.grpc_max_connections,
                                                  keepalive=grpc_keepalive(settings))
            ports["grpc"] = grpc_server.bound_port
            log.info("gRPC (KServe v2) on %s:%d, on the core's event loop%s", settings.grpc_address, ports["grpc"],
                     _chosen(settings.grpc_processes, cpus))
        if settings.allow_metrics:
            runner, ports["metrics"] = await wiring.start_metrics(parts, settings.metrics_address,
                                                                  settings.metrics_port)
            runners.append(runner)
            log.info("metrics on http://%s:%d/metrics", settings.metrics_address, ports["metrics"])
    except OSError as exc:
        log.error("cannot start serving: %s", exc)
        await _close(runners, grpc_server, 0)
        await parts.shutdown(0)
        return 1
    except Exception:  # re-raised: only the clean-up (workers, their shared memory) is added
        await _close(runners, grpc_server, 0)
        await parts.shutdown(0)
        raise
    if settings.ready_file:
        tmp = settings.ready_file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"pid": os.getpid(), **ports}, f)
        os.replace(tmp, settings.ready_file)
    # What start-up built (modules, configs, protobuf descriptors) lives as long as the daemon: keep it out of the
    # cyclic collector's scans, so collections triggered by per-request garbage stay cheap.
    gc.collect()
    gc.freeze()
    parts.serving()
    ready = sum(1 for v in parts.registry.versions() if v.ready)
    notify(f"READY=1\nSTATUS=serving {ready} model version(s)")
    log.info("gpud %s ready: serving; request path %s", __version__, compiled.status().reason)

    watchdog_s = watchdog_interval_s(os.environ, os.getpid())
    watchdog_task = asyncio.create_task(watchdog(watchdog_s), name="systemd-watchdog") if watchdog_s else None
    trace_task = asyncio.create_task(_write_traces(tracer), name="trace-writer")
    if tracer.on:
        log.info("tracing %s", tracer.describe())
    elif settings.trace_file:
        log.info("traces go to %s once switched on (gpudctl trace --level TIMESTAMPS)", settings.trace_file)
    log.info("model control: %s; over TCP, load, unload and placement %s", prepared.model_control.mode,
             admin.describe())
    hosts = [r for r in runners if isinstance(r, FrontendHost)]
    if hosts:  # gpudctl inspect's FRONT ENDS
        core.views["frontends"] = _FrontendsView(hosts)
    for host in hosts:  # their event loops' lag and stalls, beside the core's (gpud_event_loop_*)
        parts.loop_collector.sources.append(functools.partial(dict, host.loop_reports))
    from gpud.api.grpcwire.server import GrpcServer

    http_hosts = [r for r in runners if isinstance(r, HttpServer) or
                  isinstance(r, FrontendHost) and r.options["kind"] == "http"]
    grpc_hosts = [r for r in runners if isinstance(r, FrontendHost) and r.options["kind"] == "grpc"]
    reloader.serving(ReloadTargets(core, admin, parts.hints, parts.poller, parts.controller, http_hosts,
                                   grpc_hosts + ([grpc_server] if isinstance(grpc_server, GrpcServer) else []),
                                   log_control))

    await stop.wait()
    reloader.stop()
    if watchdog_task is not None:
        watchdog_task.cancel()
    log.info("stopping: no new requests; finishing the accepted ones (up to %.0f s)", settings.exit_timeout_seconds)
    notify("STOPPING=1\nSTATUS=draining: finishing the accepted requests")
    await parts.shutdown(settings.exit_timeout_seconds)
    trace_task.cancel()
    tracer.close()  # every request answered: every trace written
    await _close(runners, grpc_server, settings.exit_timeout_seconds)
    log.info("stopped")
    return 0


async def _write_traces(tracer: Tracer, every_s: float = TRACE_WRITE_INTERVAL_S) -> None:
    """The traces collected so far written every `every_s` (the trace file stays a valid JSON array of them)."""
    while True:
        await asyncio.sleep(every_s)
        try:
            tracer.flush()
        except Exception:  # noqa: BLE001 - a bug here must not end the writing, nor the daemon
            log.exception("writing traces failed")


class _FrontendsView:
    """The front-end processes of every protocol, as one section of `gpudctl inspect`."""

    def __init__(self, hosts: list) -> None:
        self.hosts = hosts

    def inspect(self) -> dict:
        return {"processes": [p for host in self.hosts for p in host.inspect()]}


def _sweep_segments() -> None:
    """Shared memory left by gpud processes that were killed (gpud.executor.shm_owners): removed before serving."""
    from gpud.executor import shm_owners
    from gpud.executor.shm import shm_dir

    for gone in shm_owners.sweep(shm_dir()):
        log.warning("removed %d shared-memory segment(s) (%.1f MiB) that gpud process %d left in %s: it was killed "
                    "before it could remove them", gone.segments, gone.bytes / 2**20, gone.pid, shm_dir())


def _chosen(configured: int | str, cpus: int) -> str:
    """What the log says of a count gpud chose."""
    return f" (auto: {cpus} usable CPUs)" if configured == AUTO else ""


async def _start_frontends(core, admin: AdminAuth, settings: Settings, kind: str, n: int, log_control: LogControl):
    """HTTP or gRPC front ends in processes of their own (--http-processes, --grpc-processes): they accept on one
    listening socket bound here. gRPC on grpcio (--grpc-server grpcio) cannot take a socket, so each binds the port
    with SO_REUSEPORT, which this process holds bound meanwhile (port 0 becomes one port for all)."""
    import socket

    from gpud.frontproc.host import FrontendHost

    http = kind == "http"
    address = settings.http_address if http else settings.grpc_address
    port = settings.http_port if http else settings.grpc_port
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    if http or settings.grpc_server == "gpud":
        listen = socket.create_server((address, port), backlog=1024, family=family)
    else:
        listen = socket.socket(family, socket.SOCK_STREAM)
        listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listen.bind((address, port))
    options = {"kind": kind, "address": address, "port": listen.getsockname()[1],
               "max_body_bytes": settings.max_request_bytes, "max_head_bytes": settings.max_header_bytes,
               "request_timeout_s": settings.http_request_timeout_seconds,
               # the port's cap: each process counts every process's connections against it
               "max_connections": settings.http_max_connections if http else settings.grpc_max_connections,
               "max_tensor_elements": settings.max_tensor_elements, "grpc_server": settings.grpc_server,
               "grpc_keepalive": asdict(grpc_keepalive(settings)),
               "json_processes": settings.json_processes, "json_offload_bytes": settings.json_offload_bytes}
    host = FrontendHost(core, admin, n, listen, options, log_control.settings)
    log_control.listeners.append(host.set_log_settings)  # its processes follow a change
    try:
        await host.start()
    except OSError:
        listen.close()
        raise
    return host


def _listeners(settings: Settings) -> list[Listener]:
    """The TCP ports the daemon will serve on."""
    out = []
    if settings.allow_http:
        out.append(Listener("HTTP", settings.http_address, settings.http_port, "--http-port"))
    if settings.allow_grpc:
        out.append(Listener("gRPC", settings.grpc_address, settings.grpc_port, "--grpc-port"))
    if settings.allow_metrics:
        out.append(Listener("metrics", settings.metrics_address, settings.metrics_port, "--metrics-port"))
    return out


async def _close(runners, grpc_server, grace_s: float) -> None:
    from gpud.frontproc.host import FrontendHost

    if grpc_server is not None:
        await grpc_server.stop(grace_s)
    for runner in runners:
        if isinstance(runner, FrontendHost):
            await runner.stop(grace_s)
            runner.listen.close()
        elif isinstance(runner, HttpServer):
            await runner.close(grace_s)
        else:
            await runner.cleanup()


def _run(coro) -> int:
    """uvloop when it is installed (a faster event loop: fewer microseconds per request), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = resolve_settings(args)
    except ValueError as exc:
        print(f"gpud: {exc}", file=sys.stderr)
        return 2
    configure(log_settings_of(settings), "%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        # A reload reads the settings file again, with the command-line flags over it, as here.
        return _run(serve(settings, read_settings=functools.partial(resolve_settings, args),
                          settings_file=args.config))
    except ValueError as exc:  # e.g. a bad node file: a clear message, not a traceback
        log.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
