"""A discrete-event model of gpud serving: requests queue per model version, free instances take batches from the head
of the queue, and the batches on one device share its compute.

Rules (the model's spec; tests/test_replay_des.py checks each):
1. Requests of a model arrive at the times given (an array per model version). They queue in arrival order.
2. A ready instance that is not running a batch takes the next batch as soon as one request waits: the queued requests,
   oldest first, up to the model's max_batch_size (Triton's dynamic batcher with no queue delay). An instance that is
   draining (removed by a placement step) finishes its batch and takes no other.
3. A batch of `rows` needs `kind.seconds(rows)` of work: the time it took when measured alone on a whole device. One
   batch can use at most `kind.share` of a whole GPU's compute (a small model leaves SMs idle); a leaf device offers
   `capacity` (1.0 for a whole GPU, slices / 7 for a MIG instance). The batches running on a device share it fairly,
   none above its own cap (water-filling), so a batch runs at speed min(share, fair part) / share of its measured
   speed: two small models overlap on a whole GPU at full speed, and a 1g MIG slice runs a model that needs half a GPU
   at (1/7) / 0.5 = 0.29 of its speed. Other work may hold part of a device's capacity for a while (`take`,
   `set_capacity`: an instance load, or the front end and other processes on a CPU node); the batches share what is
   left, never less than MIN_CAPACITY of it.
4. A request waits at most `timeout_s` in the queue: older ones fail when an instance would next take them (gpud's
   --unready-wait-secs while no instance is ready; under overload they stand for the requests a bounded queue sheds).
5. An instance holds its memory from the start of its load until its last batch is done after it was removed.
Each finished batch is written to the version's statistics record (gpud.executor.stats.ModelStats, the record the real
scheduler writes) with its queue and compute times, so gpud's hints read the simulation exactly as they read serving.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gpud.executor.stats import ModelStats

NS = 1_000_000_000
MIN_CAPACITY = 0.1  # of a device's, left to its batches however much other work takes (the OS shares, never stops)


@dataclass(frozen=True)
class Kind:
    """A model kind's measured batch times: rows -> seconds alone on a whole device."""

    name: str
    batch_seconds: tuple[tuple[int, float], ...]  # (rows, seconds), rows ascending
    share: float = 1.0  # the most of a whole GPU's compute one batch can use

    def seconds(self, rows: int) -> float:
        """Linear between the measured batch sizes; beyond the largest, proportional to rows."""
        pts = self.batch_seconds
        if rows <= pts[0][0]:
            return pts[0][1]
        for (r0, s0), (r1, s1) in zip(pts, pts[1:]):
            if rows <= r1:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        r, s = pts[-1]
        return s * rows / r


@dataclass(eq=False)
class Batch:
    instance: SimInstance
    rows: int
    start_s: float
    work_s: float  # left, in seconds at full speed
    queue_ns: list[int]
    speed: float = 1.0  # fraction of full speed it runs at now


@dataclass(eq=False)
class SimDevice:
    id: str
    capacity: float  # share of a whole GPU's compute (MIG: slices / 7)
    gpu_memory: bool  # counts towards GPU memory-hours (GPUs and MIG instances, not the CPU)
    running: list[Batch] = field(default_factory=list)
    taken: float = 0.0  # of the capacity, by work other than batches (instance loads on a CPU node)
    updated_s: float = 0.0
    epoch: int = 0  # bumped at every change: completion events of an older epoch are stale


@dataclass(eq=False)
class SimInstance:
    key: str
    model: SimModel
    device: SimDevice
    memory_bytes: int
    ready: bool = False
    draining: bool = False
    batch: Batch | None = None


@dataclass(eq=False)
class SimModel:
    name: str
    version: str
    kind: Kind
    max_batch_size: int
    arrivals_s: np.ndarray  # ascending
    stats: ModelStats = field(default_factory=ModelStats)
    head: int = 0  # first request not yet taken or failed
    instances: list[SimInstance] = field(default_factory=list)
    wake_at_s: float | None = None  # a wake-up is scheduled for this arrival
    # outcome counters (requests arriving at or after the measurement start)
    served: int = 0
    within_slo: int = 0
    failed: int = 0
    queue_s_total: float = 0.0
    objective_s: float | None = None  # its latency objective (queue + compute), for every policy's accounting
    within_objective: int = 0  # measured requests answered within it

    @property
    def objective_attainment(self) -> float:
        total = self.served + self.failed
        return self.within_objective / total if total else math.nan

    def arrived(self, now_s: float) -> int:
        """Index one past the last request arrived by now."""
        return int(np.searchsorted(self.arrivals_s, now_s, side="right"))

    def pending(self, now_s: float) -> int:
        return self.arrived(now_s) - self.head + sum(i.batch.rows for i in self.instances if i.batch)


class Serving:
    """The event loop of the model. `on_no_instance(model)` is called when a request of a model with no instance
    arrives (gpud's load on demand); `on_tick(now_s)` hooks run at the times they ask for (`at`)."""

    def __init__(self, devices: Sequence[SimDevice], models: Sequence[SimModel], *, slo_queue_s: float,
                 timeout_s: float = 30.0, measure_from_s: float = 0.0, epoch_unix_s: float = 1.7e9):
        self.devices = {d.id: d for d in devices}
        self.models = {(m.name, m.version): m for m in models}
        self.slo_queue_s = slo_queue_s
        self.timeout_s = timeout_s
        self.measure_from_s = measure_from_s
        self.epoch_unix_s = epoch_unix_s
        self.now_s = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.on_no_instance: Callable[[SimModel], None] = lambda m: None
        self.memory_bytes = 0  # GPU memory held by instances now
        self.memory_byte_seconds = 0.0  # its integral over the measured time
        self._memory_since_s = 0.0
        for m in models:
            self.dispatch(m)  # a wake-up at its first arrival

    # --- time ---------------------------------------------------------------------------------------------------
    def wall_clock(self) -> float:
        return self.epoch_unix_s + self.now_s

    def clock(self) -> float:
        return self.now_s

    def at(self, t_s: float, fn: Callable[[], None]) -> None:
        """Run `fn` at `t_s` (after the serving events of that instant)."""
        heapq.heappush(self._events, (t_s, 1, next(self._seq), "call", fn, 0))

    def run_until(self, t_s: float) -> None:
        """Process every event up to `t_s`, then stand at `t_s`. Re-entrant: a hook may call it to let time pass
        (a controller tick whose loads take time: control.ControlPlane), as long as it asks for a time not before
        now."""
        while self._events and self._events[0][0] <= t_s:
            when, _, _, what, obj, epoch = heapq.heappop(self._events)
            self._advance(when)
            if what == "done":
                if obj.epoch == epoch:
                    self._complete(obj)
            elif what == "wake":
                if obj.wake_at_s == when:
                    obj.wake_at_s = None
                    self.dispatch(obj)
            else:
                obj()
        self._advance(max(t_s, self.now_s))

    def _advance(self, t_s: float) -> None:
        if t_s > self.now_s:
            start = max(self._memory_since_s, self.measure_from_s)
            if t_s > start:
                self.memory_byte_seconds += self.memory_bytes * (t_s - start)
            self._memory_since_s = t_s
            self.now_s = t_s

    # --- instances ----------------------------------------------------------------------------------------------
    def add_instance(self, key: str, model: SimModel, device_id: str, memory_bytes: int) -> SimInstance:
        """An instance starts loading: it holds memory from now, and serves once `ready()` is called."""
        inst = SimInstance(key, model, self.devices[device_id], memory_bytes)
        model.instances.append(inst)
        self._hold(inst, +1)
        return inst

    def ready(self, inst: SimInstance) -> None:
        inst.ready = True
        self.dispatch(inst.model)

    def remove_instance(self, inst: SimInstance) -> None:
        """No new batch goes to it; it is gone (and its memory free) once its batch is done."""
        inst.draining = True
        if inst.batch is None:
            self._drop(inst)

    def _drop(self, inst: SimInstance) -> None:
        if inst in inst.model.instances:
            inst.model.instances.remove(inst)
            self._hold(inst, -1)
            self.dispatch(inst.model)  # its last instance gone: the next arrival asks for one

    def _hold(self, inst: SimInstance, sign: int) -> None:
        if inst.device.gpu_memory:
            self.memory_bytes += sign * inst.memory_bytes

    def set_capacity(self, device_id: str, capacity: float) -> None:
        """The device's compute changes from now (rule 3 re-shares it): on a CPU node the front end, the clients and
        other processes take part of the cores, more the more requests arrive."""
        device = self.devices[device_id]
        self._progress(device)
        device.capacity = capacity
        self._reshare(device)

    def take(self, device_id: str, amount: float) -> None:
        """`amount` of the device's compute goes to other work from now (negative: it comes back), as an instance
        load on a CPU node, whose session building runs on the same cores as the batches."""
        device = self.devices[device_id]
        self._progress(device)
        device.taken += amount
        self._reshare(device)

    # --- requests and batches -----------------------------------------------------------------------------------
    def dispatch(self, model: SimModel) -> None:
        """Start batches on the model's free ready instances while requests wait (rule 2); else wake at the next
        arrival when one would be taken or would find no instance."""
        now = self.now_s
        arrived = model.arrived(now)
        free = [i for i in model.instances if i.ready and not i.draining and i.batch is None]
        for inst in free:
            self._expire(model, now)
            if model.head >= arrived:
                break
            rows = min(model.max_batch_size, arrived - model.head)
            waited = now - model.arrivals_s[model.head:model.head + rows]
            model.head += rows
            self._count(model, waited)
            batch = Batch(inst, rows, now, inst.model.kind.seconds(rows), (waited * NS).astype(np.int64).tolist())
            inst.batch = batch
            self._start(inst.device, batch)
        waiting = model.head < arrived
        if waiting and not model.instances:
            self.on_no_instance(model)  # gpud loads one on demand; each new arrival asks again (below)
        elif waiting:
            return  # requests wait: a batch's end or an instance's readiness dispatches again
        if (free or not model.instances) and arrived < len(model.arrivals_s):
            nxt = float(model.arrivals_s[arrived])
            if model.wake_at_s is None or model.wake_at_s > nxt:
                model.wake_at_s = nxt
                heapq.heappush(self._events, (nxt, 0, next(self._seq), "wake", model, 0))

    def _expire(self, model: SimModel, now_s: float) -> None:
        """Rule 4: requests queued longer than timeout_s fail."""
        oldest = int(np.searchsorted(model.arrivals_s, now_s - self.timeout_s, side="left"))
        if oldest > model.head:
            expired = model.arrivals_s[model.head:oldest]
            model.failed += int((expired >= self.measure_from_s).sum())
            for waited_s in now_s - expired:
                model.stats.record_failure(round(waited_s * NS))
            model.head = oldest

    def _count(self, model: SimModel, waited_s: np.ndarray) -> None:
        if self.now_s - float(waited_s[-1]) < self.measure_from_s:  # the newest arrived before the measurement
            return
        model.served += len(waited_s)
        model.within_slo += int((waited_s <= self.slo_queue_s).sum())
        model.queue_s_total += float(waited_s.sum())

    def _start(self, device: SimDevice, batch: Batch) -> None:
        self._progress(device)
        device.running.append(batch)
        self._reshare(device)

    def _complete(self, device: SimDevice) -> None:
        self._progress(device)
        done = [b for b in device.running if b.work_s <= 1e-12]
        device.running = [b for b in device.running if b.work_s > 1e-12]
        self._reshare(device)
        for b in done:
            self._finish(b)

    def _finish(self, b: Batch) -> None:
        inst, model = b.instance, b.instance.model
        inst.batch = None
        compute_ns = round((self.now_s - b.start_s) * NS)
        request_ns = [q + compute_ns for q in b.queue_ns]
        if model.objective_s is not None:
            bound_ns = model.objective_s * NS
            start_ns = b.start_s * NS
            model.within_objective += sum(1 for q, r in zip(b.queue_ns, request_ns)
                                          if r <= bound_ns and start_ns - q >= self.measure_from_s * NS)
        model.stats.record_batch(b.rows, b.queue_ns, request_ns, 0, compute_ns, 0,
                                 int(self.wall_clock() * 1000))
        if inst.draining:
            self._drop(inst)
        self.dispatch(model)

    def _progress(self, device: SimDevice) -> None:
        elapsed = self.now_s - device.updated_s
        if elapsed > 0:
            for b in device.running:
                b.work_s -= elapsed * b.speed
        device.updated_s = self.now_s

    def _reshare(self, device: SimDevice) -> None:
        """Rule 3: water-filling of the device's capacity over its running batches, each capped at its share."""
        device.epoch += 1
        if not device.running:
            return
        left, n = max(MIN_CAPACITY * device.capacity, device.capacity - device.taken), len(device.running)
        for b in sorted(device.running, key=lambda b: b.instance.model.kind.share):
            cap = b.instance.model.kind.share
            rate = min(cap, left / n)
            b.speed = rate / cap
            left -= rate
            n -= 1
        end = min(self.now_s + b.work_s / b.speed for b in device.running)
        heapq.heappush(self._events, (end, 0, next(self._seq), "done", device, device.epoch))

    # --- results ------------------------------------------------------------------------------------------------
    def finish(self, end_s: float) -> None:
        """Stand at the end: requests still queued count as failed."""
        self.run_until(end_s)
        for m in self.models.values():
            left = m.arrivals_s[m.head:m.arrived(end_s)]
            m.failed += int((left >= self.measure_from_s).sum())
            m.head = m.arrived(end_s)


def poisson_arrivals(rate_per_s: Sequence[float], step_s: float, rng: np.random.Generator,
                     start_s: float = 0.0) -> np.ndarray:
    """Arrival times of a Poisson process whose rate is `rate_per_s[k]` during step k (each `step_s` long)."""
    chunks = []
    for k, rate in enumerate(rate_per_s):
        n = rng.poisson(max(0.0, rate) * step_s)
        if n:
            chunks.append(np.sort(rng.uniform(start_s + k * step_s, start_s + (k + 1) * step_s, n)))
    return np.concatenate(chunks) if chunks else np.zeros(0)


def memory_hours(byte_seconds: float) -> float:
    """GiB-hours."""
    return byte_seconds / 2**30 / 3600


def slo_attainment(models: Sequence[SimModel]) -> float:
    total = sum(m.served + m.failed for m in models)
    return sum(m.within_slo for m in models) / total if total else math.nan
