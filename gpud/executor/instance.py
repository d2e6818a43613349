"""A model instance on a device, as the daemon sees it (where it runs, whether it is ready, its shared memory), and
what runs it: a `DeviceWorker`, the interface that a worker process's supervisor (gpud.executor.supervisor) and the
in-process runner (gpud.executor.local_worker) both implement."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gpud.executor.busy import BusyTracker
from gpud.executor.channel import Reply
from gpud.executor.device import WorkerDevice
from gpud.executor.model_config import ModelConfig, execution_config
from gpud.executor.protocol import DEFAULT_SEGMENT_BYTES, Infer, Loaded, LoadFailed, tensor_region_bytes
from gpud.executor.shm import Segment, new_segment_name, shm_dir, shm_free_bytes

log = logging.getLogger("gpud.executor")


class LentInstance(Protocol):
    """A loaded instance lent to a caller's thread (gpud.executor.direct): it runs one request there."""

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> list[np.ndarray]: ...

    def note_run(self, seconds: float, rows: int) -> None:
        """A run of `rows` took `seconds` (what the next run's time is estimated from)."""
        ...


class DeviceWorker(Protocol):
    """What runs one device's instances, as the pool and the schedulers use it."""

    @property
    def device(self) -> WorkerDevice: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def alive(self) -> bool: ...

    @property
    def in_process(self) -> bool:
        """Its instances run in the daemon's own process (no process of their own)."""
        ...

    @property
    def restarts(self) -> int: ...

    @property
    def failures(self) -> dict[str, int]:
        """Times it was lost while serving, by cause."""
        ...

    @property
    def unhealthy_reason(self) -> str | None:
        """Set when gpud gave up on the device."""
        ...

    @property
    def providers(self) -> tuple[str, ...]: ...

    @property
    def instances(self) -> dict[str, InstanceHandle]:
        """Its instances by key: the pool adds and removes them."""
        ...

    @property
    def busy(self) -> BusyTracker: ...

    async def start(self) -> None: ...

    async def load(self, inst: InstanceHandle) -> None:
        """Load `inst` (one of `instances`): it is ready after, or `inst.error` says why not."""
        ...

    def submit(self, msg: Infer, callback: Callable[[Reply], None]) -> None:
        """Run a batch; `callback` gets its Reply, from the event loop, after this returns."""
        ...

    def poll(self) -> None:
        """Handle the answers already waiting."""
        ...

    def forget_segments(self, names: list[str]) -> None: ...

    async def unload(self, key: str) -> None: ...

    async def stop(self, timeout_s: float = 10.0) -> None: ...

    def claim_direct(self, key: str, rows: int = 1, quick_only: bool = False) -> LentInstance | None:
        """Instance `key` lent to the caller's thread for one run (None: not here, or not quick enough)."""
        ...

    def release_direct(self, lent: LentInstance) -> None: ...


@dataclass(eq=False)
class InstanceHandle:
    """One model instance on one device, as the front end sees it. Owns its shared-memory regions."""

    key: str
    model: str
    version: str
    index: int
    device_id: str
    model_path: str
    config: ModelConfig
    estimate_bytes: int
    worker: DeviceWorker | None = None
    ready: bool = False
    memory_bytes: int | None = None  # measured at load
    measured_by: str = ""
    load_seconds: float = 0.0
    provider: str = ""
    error: str = ""
    in_seg: Segment | None = None
    out_seg: Segment | None = None
    on_ready_change: Callable[[InstanceHandle], None] | None = None

    def apply_load_reply(self, reply: Loaded | LoadFailed) -> None:
        """The instance is loaded (ready, its footprint measured) or not (`error` says why); logged, and its
        scheduler told."""
        if isinstance(reply, Loaded):
            self.memory_bytes = reply.memory_bytes
            self.measured_by = reply.measured_by
            self.load_seconds = reply.load_seconds
            self.provider = reply.provider
            self.error = ""
            self.ready = True
            log.info("instance %s on %s: loaded in %.2f s with %s, footprint %.1f MiB (%s)", self.key, self.device_id,
                     self.load_seconds, self.provider, self.footprint_bytes / 2**20, self.measured_by)
        else:
            self.error = reply.error
            self.ready = False
            log.error("instance %s on %s: load failed: %s", self.key, self.device_id, self.error)
        if self.on_ready_change:
            self.on_ready_change(self)

    @property
    def footprint_bytes(self) -> int:
        return self.memory_bytes if self.memory_bytes is not None else self.estimate_bytes

    def open_segments(self) -> None:
        """Create its input and output regions, one full batch each (or a default that grows, for variable
        shapes)."""
        config = execution_config(self.config)  # a sequence model's control and state tensors travel there too
        # Pages are reserved as batches reach them (ensure_capacity; the worker for its outputs), not a full
        # batch's up front: a model whose batches stay small takes no more shared memory than they need.
        self.in_seg = Segment.create(new_segment_name("in"), tensor_region_bytes(config, config.inputs),
                                     reserve=False)
        self.out_seg = Segment.create(new_segment_name("out"), tensor_region_bytes(config, config.outputs),
                                      reserve=False)
        full = self.in_seg.size_bytes + self.out_seg.size_bytes
        free = shm_free_bytes()
        if free is not None and free < full:
            log.warning("instance %s: a full batch takes %.1f MiB of shared memory (%s), %.1f MiB is free: batches "
                        "that do not fit will be refused (503); give gpud more (a container's --shm-size)",
                        self.key, full / 2**20, shm_dir(), free / 2**20)

    def ensure_capacity(self, input_bytes: int) -> Segment:
        """The input region, grown first when a batch does not fit (variable-size inputs; the worker drops the old
        one)."""
        if self.in_seg is not None and self.in_seg.size_bytes >= input_bytes:
            self.in_seg.reserve(input_bytes)  # (shm.ShmFull: no room; the batch fails, the instance stays)
            return self.in_seg
        old = self.in_seg
        size = max(input_bytes, 2 * old.size_bytes if old else DEFAULT_SEGMENT_BYTES)
        grown = Segment.create(new_segment_name("in"), size, reserve=False)
        try:
            grown.reserve(input_bytes)
        except BaseException:
            grown.close()
            raise
        self.in_seg = grown
        if old is not None:
            old.close()
            if self.worker is not None:
                self.worker.forget_segments([old.name])
        return self.in_seg

    def close_segments(self) -> None:
        for seg in (self.in_seg, self.out_seg):
            if seg is not None:
                seg.close()
        self.in_seg = self.out_seg = None
