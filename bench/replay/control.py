"""gpud's real control plane on the simulated node: the registry, the placement service (plans, make-before-break
steps, evictions, cold starts), the autoscaling hints and the placement controller are gpud's own objects, run in the
model's time. Only the executor pool is the model's: a load lets `load_seconds` of model time pass (requests go on
being served meanwhile), then the instance serves; an unload drains it (des rules 2 and 5).

How the two meet: the serving model (des.Serving) owns time. Hint ticks and controller ticks are events in it; a
controller tick or a cold start runs as asyncio tasks on a private loop until they are all done. A load waits for model
time to pass (ModelWaits.sleep) instead of running the serving model itself: the driver runs the tasks until each one
waits, then runs the serving model to the earliest end of those waits and wakes them. So loads the service gathers
(a wave of adds on different devices) overlap in model time as the daemon's do, and loads one after another (a
device's, or a tick's steps in turn) take their load times one after another.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import tempfile
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from gpud.executor.device import WorkerDevice
from gpud.executor.instance import InstanceHandle
from gpud.executor.dynamic_scheduler import DynamicScheduler
from gpud.scaling.controller import ScalingController
from gpud.scaling.rules import ScalingPolicy
from gpud.scaling.plan import NO_CLAIMS, Claims, ScalingPlan
from gpud.placing.service import PlacementService
from gpud.registry import RegisteredVersion, Registry
from gpud.repository.layout import ModelEntry
from gpud.executor.objective import objective_of
from gpud.scaling.bounds import instance_bounds
from gpud.repository.layout import ModelRepository
from gpud.telemetry.devices import DeviceBackend
from gpud.scaling.hints import DeviceFree, HintPolicy

from .des import Serving, SimInstance, SimModel

if TYPE_CHECKING:
    import onnx

GIB = 2**30
P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class ModelSpec:
    """One model of the replay."""

    name: str
    kind: str
    memory_bytes: int  # one instance's GPU footprint
    load_seconds: float  # from the start of a load to the instance serving
    max_batch_size: int = 4  # the measured kinds take 4 rows in about the time of 1, 8 in twice that
    device_kind: str = "KIND_GPU"  # its instance_group kind
    threads: int = 0  # intra_op_thread_count (0: onnxruntime's default); the real-serving check sets 1
    compute_fraction: float = 0.0  # gpud_compute_fraction
    min_instances: int = 0  # gpud_min_instances
    max_instances: int | None = None  # gpud_max_instances
    objective_ms: float | None = None  # gpud_latency_objective_ms (the "objectives" policy sets it)


class SimScheduler(DynamicScheduler):
    """The real scheduler object (instances, statistics record); its queue is the serving model's."""

    sim: SimModel
    serving: Serving

    @property
    def pending_requests(self) -> int:
        return self.sim.pending(self.serving.now_s)


class ModelWaits:
    """Coroutines waiting for model time to pass (instance loads): the control plane's driver lets it pass, by running
    the serving model, once no task can run (ControlPlane._drive)."""

    def __init__(self, serving: Serving):
        self.serving = serving
        self._waits: list[tuple[float, int, asyncio.Future[None]]] = []  # (end, order, woken at the end), a heap
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._waits)

    async def sleep(self, seconds: float) -> None:
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waits, (self.serving.now_s + seconds, next(self._order), woken))
        await woken

    def advance(self) -> None:
        """Serve up to the earliest end (ticks and cold starts falling due meanwhile are queued: ControlPlane._run),
        then wake every wait that ends by then."""
        self.serving.run_until(self._waits[0][0])
        while self._waits and self._waits[0][0] <= self.serving.now_s:
            woken = heapq.heappop(self._waits)[2]
            if not woken.done():  # its task may have been cancelled
                woken.set_result(None)


class SimPool:
    """The executor pool as the placement service uses it, in the serving model's time."""

    def __init__(self, serving: Serving, specs: Mapping[str, ModelSpec], waits: ModelWaits):
        self.serving = serving
        self.specs = specs
        self.waits = waits
        self.instant = False  # loads take no time (the start-up placement, before the replay's time starts)
        self.load_compute = 0.0  # of its device's compute a load takes while it runs (a CPU node's: 1 core)
        self.live: dict[int, tuple[InstanceHandle, SimInstance]] = {}  # id(handle) ->
        self.loads = 0
        self.unloads = 0

    async def load_instance(self, inst: InstanceHandle, device: WorkerDevice) -> InstanceHandle:
        spec = self.specs[inst.model]
        sim = self.serving.add_instance(inst.key, self.serving.models[(inst.model, inst.version)], inst.device_id,
                                        spec.memory_bytes)
        self.live[id(inst)] = (inst, sim)
        if not self.instant:
            self.serving.take(inst.device_id, self.load_compute)
            try:
                await self.waits.sleep(spec.load_seconds)  # serving (and other devices' loads) go on meanwhile
            finally:
                self.serving.take(inst.device_id, -self.load_compute)
            self.loads += 1
        inst.ready, inst.memory_bytes, inst.measured_by = True, spec.memory_bytes, "simulated"
        inst.load_seconds = spec.load_seconds
        self.serving.ready(sim)
        return inst

    async def unload_instance(self, inst: InstanceHandle) -> None:
        entry = self.live.pop(id(inst), None)
        inst.ready = False
        if entry is not None:
            self.serving.remove_instance(entry[1])
            self.unloads += 1

    def instance_keys(self, device_id: str) -> set[str]:
        return {h.key for h, s in self.live.values() if h.device_id == device_id}

    def memory_used_bytes(self, device_id: str) -> int:
        """Loaded instances and the removed ones still draining (those loading are the service's reservation)."""
        held = [s for m in self.serving.models.values() for s in m.instances if s.device.id == device_id]
        return sum(s.memory_bytes for s in held if s.ready)


def config_pbtxt(spec: ModelSpec) -> str:
    """The model's config.pbtxt: its batching, instance group and gpud's per-model parameters."""
    params = {"gpud_min_instances": spec.min_instances, "gpud_max_instances": spec.max_instances,
              "gpud_compute_fraction": spec.compute_fraction or None, "intra_op_thread_count": spec.threads or None,
              "gpud_latency_objective_ms": spec.objective_ms}
    lines = [f"max_batch_size: {spec.max_batch_size}", "dynamic_batching { }",
             f"instance_group [ {{ count: 1, kind: {spec.device_kind} }} ]"]
    lines += [f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items()
              if v is not None]
    return "\n".join(lines) + "\n"


def write_repository(root: Path, specs: Mapping[str, ModelSpec],
                     models: Mapping[str, onnx.ModelProto] | None = None) -> ModelRepository:
    """A Triton-layout repository of the specs' models: `models[name]` where given (the real-serving check), else a
    one-node stand-in (the registry reads the file; the model's footprint and batch times are the specs')."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "replay",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    stand_in = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    stand_in.ir_version = 8
    for spec in specs.values():
        (root / spec.name / "1").mkdir(parents=True)
        onnx.save((models or {}).get(spec.name, stand_in), root / spec.name / "1" / "model.onnx")
        (root / spec.name / "config.pbtxt").write_text(config_pbtxt(spec))
    return ModelRepository(str(root))


@dataclass(frozen=True)
class ControlSettings:
    hints: HintPolicy
    control: ScalingPolicy
    hints_interval_s: float
    rate_window_s: float
    device_reserve_bytes: int = 512 * 2**20
    time_limit_s: float = 2.0
    incremental: bool = True  # False: policy (d), re-plan from scratch every interval
    max_steps: int | None = None  # None: the policy's max_steps_per_interval
    ranked: bool = True  # False: no claims (room in the planner's order, no spare instances taken): the comparison


class InlineExecutor(ThreadPoolExecutor):
    """The private loop's default executor: runs what it is given at once, on the loop's thread. The placement
    service plans in `asyncio.to_thread`; planning takes no model time, and with no other thread the loop has nothing
    to wait for but its tasks, so the driver can tell when they all wait (ControlPlane._settle)."""

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        done: Future[T] = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - the awaiting task gets it, as from a thread
            done.set_exception(exc)
        return done


class FromScratch:
    """The controller's placer for policy (d): the same targets, each interval planned from scratch and every step
    of the way there taken (no cap)."""

    def __init__(self, service: PlacementService):
        self.service = service

    async def rescale(self, totals, *, max_steps: int, apply: bool, evict_idle_s: float | None = None,
                      claims: Claims = NO_CLAIMS) -> ScalingPlan:
        return await self.service.rescale(totals, max_steps=10**6, apply=apply, evict_idle_s=evict_idle_s,
                                          incremental=False, claims=claims)

    def instances_on_unhealthy_devices(self) -> int:
        return self.service.instances_on_unhealthy_devices()


class ControlPlane:
    """Wires gpud's registry, placement service, hints and controller to the serving model."""

    def __init__(self, serving: Serving, backend: DeviceBackend, specs: Mapping[str, ModelSpec],
                 settings: ControlSettings, workdir: Path):
        self.serving = serving
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(InlineExecutor())
        self._driving = False
        self._due: list[Callable[[], Coroutine[Any, Any, object]]] = []  # fell due while driving: started after
        self._tick_gen = 0  # the controller's scheduled tick (an early one replaces it)
        self._ticking = False
        self._tick_soon = False  # a sample woke the controller while it ticked: the next tick at once
        self.registry = Registry(any(d.kind != "cpu" for d in backend.leaf_devices()), self._make_version)
        self.waits = ModelWaits(serving)
        self.pool = SimPool(serving, specs, self.waits)
        self.service = PlacementService(backend, self.pool, self.registry,
                                        device_reserve_bytes=settings.device_reserve_bytes,
                                        time_limit_s=settings.time_limit_s, clock=serving.clock,
                                        wall_clock=serving.wall_clock)
        from gpud.scaling.sampler import HintsSampler

        self.hints = HintsSampler(self.registry.snapshot,
                                  lambda: [DeviceFree(r.device_id, r.kind, r.free_bytes) for r in self.service.rooms()],
                                  settings.hints, clock=serving.clock, interval_s=settings.hints_interval_s,
                                  rate_window_s=settings.rate_window_s)
        placer = self.service if settings.incremental else FromScratch(self.service)
        self.controller = ScalingController(self.registry.snapshot, self.hints.decisions, placer, settings.control,
                                            "on", clock=serving.clock, wall_clock=serving.wall_clock, history=10**6,
                                            standings=self.hints.standings if settings.ranked else dict)
        if settings.ranked:
            self.service.spare_source = self.controller.spare_now
        repo = write_repository(workdir, specs)
        self.versions: list[RegisteredVersion] = []
        for name, entry in repo.scan().items():
            for vs in self.registry.register(name, entry):
                vs.estimate_bytes = specs[name].memory_bytes
                self.versions.append(vs)
        serving.on_no_instance = self._on_no_instance

    def _make_version(self, registry: Registry, entry: ModelEntry, version: str) -> RegisteredVersion:
        """gpud's version record around the real scheduler object, whose queue is the serving model's."""
        sched = SimScheduler(entry.config, version, objective=objective_of(entry.config.options))
        sched.sim, sched.serving = self.serving.models[(entry.name, version)], self.serving
        sched.sim.stats = sched.stats  # one record: the model writes it, the hints read it
        return RegisteredVersion(entry.name, version, entry, sched, instance_bounds(entry.config))

    # --- running coroutines in the model's time -----------------------------------------------------------------
    def _run(self, make: Callable[[], Coroutine[Any, Any, object]]) -> None:
        """Run a control-plane coroutine (and the tasks it starts) to the end, in the model's time. Called while the
        driver lets model time pass (a tick or a cold start falls due during loads), it starts when that wait ends,
        after the tasks the wait wakes: a tick never runs in the middle of a load."""
        if self._driving:
            self._due.append(make)
            return
        self._driving = True
        try:
            self.loop.run_until_complete(self._drive(make))
        finally:
            self._driving = False

    async def _drive(self, make: Callable[[], Coroutine[Any, Any, object]]) -> None:
        """Run the tasks until each one waits; if some wait for model time, let it pass to the earliest end of those
        waits (serving goes on) and go on; done when no task is left."""
        me = asyncio.current_task()
        self._due.append(make)
        started: list[asyncio.Task[object]] = []
        while True:
            started += [asyncio.create_task(m()) for m in self._due]
            self._due.clear()
            await self._settle()
            for task in [t for t in started if t.done()]:
                task.result()  # a tick's or a cold start's error is the run's
            started = [t for t in started if not t.done()]
            live = [t for t in asyncio.all_tasks() if t is not me]
            if self._due:  # queued while the tasks ran: start those first
                continue
            if not live:
                return
            if not self.waits:
                raise RuntimeError(f"control-plane tasks wait, none for model time (a deadlock): {live}")
            self.waits.advance()

    async def _settle(self) -> None:
        """Let the other tasks run until each one waits (for model time, a lock, another task). Whether any is
        ready to run is the loop's queue of ready callbacks, `_ready` (CPython's; no public API says it): a fixed
        number of `sleep(0)`s could stop before a chain of wake-ups (a lock handed on, a gather's parent) is done.
        With the planner on InlineExecutor, nothing runs on another thread, so an empty queue means every task
        waits."""
        while self.loop._ready:  # type: ignore[attr-defined]
            await asyncio.sleep(0)  # the others ready before it run first

    def start(self) -> None:
        """Place the configured instances (loads take no time: the node before the replay starts), then tick."""
        self.pool.instant = True
        self._run(lambda: self.service.place(self.versions))
        self.pool.instant = False
        self.serving.at(0.0, self._hints_tick)
        self._schedule_tick(self.settings.control.interval_seconds)

    def _hints_tick(self) -> None:
        self.hints.tick()
        if self.controller.wake_if_urgent():  # as the daemon's sampler: the controller ticks now, or after this tick
            if self._ticking:
                self._tick_soon = True
            else:
                self._schedule_tick(self.serving.now_s)
        self.serving.at(self.serving.now_s + self.settings.hints_interval_s, self._hints_tick)

    def _schedule_tick(self, at_s: float) -> None:
        """The controller's next tick at `at_s`, in place of the one scheduled before (an early tick replaces it)."""
        self._tick_gen += 1
        gen = self._tick_gen
        self.serving.at(at_s, lambda: self._control_tick(gen))

    def _control_tick(self, gen: int) -> None:
        if gen != self._tick_gen:
            return  # an early tick took its place

        async def tick() -> None:
            self._ticking = True
            try:
                await self.controller.tick()
            finally:
                self._ticking = False
            # as ScalingController.run: the next interval starts when this tick (and its loads) is done, or at once
            # when a sample woke the controller meanwhile
            soon, self._tick_soon = self._tick_soon, False
            self._schedule_tick(self.serving.now_s + (0.0 if soon else self.settings.control.interval_seconds))

        self._run(tick)

    def _on_no_instance(self, model: SimModel) -> None:
        vs = self.registry.version(model.name, model.version)
        if not vs.scaled_to_zero:
            return

        async def demand() -> None:
            self.service.demand(vs)  # gpud's load on demand: a task that loads one instance, evicting if it must

        self.serving.at(self.serving.now_s, lambda: self._run(demand))

    # --- what happened -----------------------------------------------------------------------------------------
    def cold_starts(self) -> int:
        return sum(vs.scheduler.stats.cold_starts for vs in self.registry.versions())

    def evictions(self) -> int:
        return sum(vs.scheduler.stats.evictions for vs in self.registry.versions())

    def flaps(self, window_s: float) -> int:
        """Instances removed (scale-down, idle) within `window_s` of an add of the same model version."""
        adds: dict[tuple[str, str], list[float]] = {}
        count = 0
        for d in self.controller.decisions:
            key = (d.model, d.version)
            if not d.applied:
                continue
            if d.action == "add":
                adds.setdefault(key, []).append(d.time_unix_s)
            elif d.action == "remove" and d.reason in ("scale_down", "idle"):
                count += any(0 <= d.time_unix_s - t < window_s for t in adds.get(key, []))
        return count

    def close(self) -> None:
        self.loop.close()


def instances_needed(rate_per_s: float, throughput_per_s: float, target_utilization: float) -> int:
    """The hints' load rule for a rate: ceil(rate / (throughput x target)), at least 1."""
    return max(1, math.ceil(round(rate_per_s / (throughput_per_s * target_utilization), 9)))


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="gpud-replay-"))
