"""How one gpud is put together: the components the daemon (gpud.main) and the in-process server (gpud.inprocess)
both run, built one way from the checked settings, started and stopped one way.

What is not here belongs to one face only: the daemon's signals, reload, systemd notification and network front
ends; the in-process server's thread and call adapters. Both may serve the metrics endpoint (`start_metrics`).
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, ProcessCollector

from gpud.executor.pool import ExecutorPool
from gpud.executor.process_log import LogSettings
from gpud.executor.supervisor import CrashLoop
from gpud.scaling.sampler import HintsSampler
from gpud.scaling.controller import ScalingController
from gpud.core import GpudCore
from gpud.inspect_view import InspectView
from gpud.model_control import RepositoryPoller, poll_models
from gpud.placing.inputs import has_gpus
from gpud.executor.client_shm import ClientRegions
from gpud.placing.service import PlacementService
from gpud.registry import Registry
from gpud.scheduling import version_maker
from gpud.settings import Prepared
from gpud.repository.layout import ModelRepository
from gpud.placement.solver import EXACT_SOLVER
from gpud.telemetry.device_metrics import DeviceCollector
from gpud.telemetry.devices import DeviceBackend
from gpud.telemetry.discovery import discover
from gpud.telemetry.event_loop import LoopCollector, LoopMonitor
from gpud.scaling.hints import DeviceFree
from gpud.telemetry.host_metrics import HostCollector
from gpud.telemetry.model_metrics import ModelMetrics
from gpud.telemetry.worker_metrics import WorkerCollector

log = logging.getLogger("gpud")


@dataclass
class Components:
    """One gpud: what serves (pool, devices, registry, placement, core) and what watches it (metrics, hints, the
    controller, the repository poller). Built by `build`; lives in one event loop."""

    repo_path: str
    pool: ExecutorPool
    devices: DeviceBackend
    metrics_registry: CollectorRegistry  # Prometheus: process, devices, host, workers, hints, controller
    model_metrics: ModelMetrics  # not registered: exported after the registry's text (its fast exposition)
    registry: Registry
    placement: PlacementService
    hints: HintsSampler
    controller: ScalingController | None
    core: GpudCore
    poller: RepositoryPoller
    # The core's event loop watched (gpud.telemetry.event_loop); the daemon adds its front-end processes' reports
    # to the collector's sources.
    loop_monitor: LoopMonitor
    loop_collector: LoopCollector
    _tasks: list[asyncio.Task] = field(default_factory=list)

    async def start(self) -> None:
        """Load the repository (every model it holds that the model control mode loads at start), then run the
        hints, the controller and, in poll mode, the repository poller."""
        await self.core.start()
        # The poller knows the repository as start-up loaded it: poll mode applies its changes every interval, and
        # a reload (SIGHUP) applies them in every mode.
        self.poller.start()
        self._tasks.append(asyncio.create_task(self.hints.run(), name="autoscaling-hints"))
        if self.controller is not None:
            self._tasks.append(asyncio.create_task(self.controller.run(), name="placement-control"))
        if self.core.control.mode == "poll":
            self._tasks.append(asyncio.create_task(self.poller.run(), name="repository-poll"))

    def serving(self) -> None:
        """Everything is up (the daemon's front ends too): the event loop is watched from now on (start-up's
        loading and imports are not serving)."""
        self.loop_monitor.start()

    async def shutdown(self, drain_timeout_s: float) -> None:
        """Stop changing anything, refuse new requests, finish the accepted ones (up to `drain_timeout_s`), stop
        the workers (their shared memory is removed), release the device inventory. Safe after a failed start."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self.core.shutdown(drain_timeout_s)
        self.loop_monitor.stop()
        self.core.client_shm.close()  # the clients' regions gpud kept open
        self.core.repository.overrides.close()  # the files of loads with overrides (gpud.repository.overrides)
        self.devices.close()

    def text_sources(self) -> tuple[ModelMetrics, ...]:
        return (self.model_metrics,)


def repository_path(configured: str | None) -> str:
    """The model repository to serve: the configured one (ValueError unless it is a directory), or, with none, the
    generated example models."""
    if configured is None:
        from gpud.examples import default_example_repository, write_served_examples

        path = default_example_repository()
        write_served_examples(path)
        log.info("no model repository given: serving the generated example models in %s", path)
        return path
    if not os.path.isdir(configured):
        raise ValueError(f"model repository {configured} is not a directory")
    return configured


def build(prepared: Prepared, *, views: Mapping[str, InspectView] | None = None,
          worker_log_settings: LogSettings | None = None, models_in_process: bool = False) -> Components:
    """Every component, each from what exists before it; starts nothing. `views`: more sections of inspect (the
    daemon's reload). `worker_log_settings`: what the device workers log (the daemon's settings; None: this
    process's level, an application's). ValueError for a repository or node description it cannot use."""
    settings = prepared.settings
    repo_path = repository_path(settings.model_repository)
    crash_loop = CrashLoop(settings.worker_crash_loop_deaths, settings.worker_crash_loop_seconds)
    # The pool reports what its instances hold and how busy its workers are: the simulated devices' and the CPU's
    # readings. It is described each device by the first instance placed there, so it comes first.
    if worker_log_settings is None:
        worker_log_settings = LogSettings.of_level(logging.getLogger().level)
    pool = ExecutorPool(worker_log_settings=worker_log_settings,
                        worker_hang_s=settings.worker_hang_seconds, crash_loop=crash_loop,
                        in_process=models_in_process)
    devices = discover(settings.node, pool)
    leaves = devices.leaf_devices()
    metrics_registry = CollectorRegistry()
    ProcessCollector(registry=metrics_registry, namespace="gpud")
    DeviceCollector(devices, registry=metrics_registry)
    # Instances run in this process (the in-process server's option) have no worker process of their own to report.
    HostCollector(lambda: {w["device"]: w["pid"] for w in pool.worker_info()
                           if w["alive"] and w["pid"] and not w["in_process"]},
                  registry=metrics_registry)
    WorkerCollector(pool.worker_info, registry=metrics_registry)
    # The registry and the placement service, the readers of the registry's snapshot (model metrics at scrape time,
    # the hints on their tick), then the core that routes over it.
    registry = Registry(has_gpus(leaves), version_maker(unready_wait_s=settings.unready_wait_seconds,
                                                        default_max_queue_size=settings.default_max_queue_size,
                                                        bounds_defaults=prepared.bounds_defaults,
                                                        objective_defaults=prepared.objective_defaults))
    placement = PlacementService(devices, pool, registry, device_reserve_bytes=settings.device_reserve_bytes,
                                 strategy=settings.placement_strategy,
                                 time_limit_s=settings.placement_time_limit_seconds)
    if EXACT_SOLVER is None:
        log.warning("no exact solver (scipy / HiGHS cannot be imported): placements are heuristic and unproven; "
                    "install gpud's dependencies (pip install .) to prove them optimal")
    model_metrics = ModelMetrics(registry.snapshot, triton_names=settings.triton_metrics, devices=devices)
    hints = HintsSampler(registry.snapshot, lambda: [DeviceFree(r.device_id, r.kind, r.free_bytes)
                                                     for r in placement.rooms()],
                         prepared.hint_policy, interval_s=settings.hints_interval_seconds,
                         rate_window_s=settings.hints_rate_window_seconds, registry=metrics_registry)
    loop_monitor = LoopMonitor("core")
    loop_collector = LoopCollector([lambda: {"core": loop_monitor.counts}], registry=metrics_registry)
    all_views: dict[str, InspectView] = {"hints": hints, "event_loops": loop_collector}
    controller = None
    if settings.placement_control != "off":
        controller = ScalingController(registry.snapshot, hints.decisions, placement, prepared.scaling_policy,
                                 prepared.scaling_mode, registry=metrics_registry, standings=hints.standings)
        placement.spare_source = controller.spare_now
        hints.after_tick = controller.wake_if_urgent
        all_views["controller"] = controller
    all_views.update(views or {})
    core = GpudCore(ModelRepository(repo_path, default_max_batch_size=settings.default_max_batch_size), registry,
                    placement, pool, views=all_views, control=prepared.model_control,
                    client_shm=ClientRegions(allowed=settings.allow_client_shm,
                                             max_request_bytes=settings.max_request_bytes,
                                             has_gpu=any(d.kind in ("gpu", "mig") and not d.simulated
                                                         for d in leaves),
                                             forget=pool.forget_everywhere))
    read = lambda: poll_models(core.repository.model_names, lambda n: os.path.join(repo_path, n))  # noqa: E731
    poller = RepositoryPoller(read, core.load_model, core.unload_model, settings.repository_poll_seconds)
    return Components(repo_path, pool, devices, metrics_registry, model_metrics, registry, placement, hints,
                      controller, core, poller, loop_monitor, loop_collector)


async def start_metrics(components: Components, address: str, port: int):
    """Serve the Prometheus endpoint (the registry, then the model metrics' text) on `address:port` (0: any free
    port). Returns the aiohttp runner (cleanup() stops it) and the bound port."""
    from gpud.api.metrics_server import start_metrics_server

    return await start_metrics_server(components.metrics_registry, address, port,
                                      text_sources=components.text_sources())
