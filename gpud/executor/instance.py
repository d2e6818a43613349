"""A model instance on a device, as the daemon sees it: where it runs, whether it is ready, its shared memory."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpud.executor.model_config import ModelConfig
from gpud.executor.protocol import DEFAULT_SEGMENT_BYTES, Loaded, LoadFailed, tensor_region_bytes
from gpud.executor.model_config import execution_config
from gpud.executor.shm import Segment, new_segment_name

if TYPE_CHECKING:
    from gpud.executor.local_worker import LocalWorker
    from gpud.executor.supervisor import WorkerSupervisor

log = logging.getLogger("gpud.executor")


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
    worker: WorkerSupervisor | LocalWorker | None = None
    ready: bool = False
    memory_bytes: int | None = None  # measured at load
    measured_by: str = ""
    load_seconds: float = 0.0
    provider: str = ""
    error: str = ""
    in_seg: Segment | None = None
    out_seg: Segment | None = None
    on_ready_change: Callable[[InstanceHandle], None] | None = None
    _load_future: asyncio.Future[Loaded | LoadFailed] | None = None

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
        self.in_seg = Segment.create(new_segment_name("in"), tensor_region_bytes(config, config.inputs))
        self.out_seg = Segment.create(new_segment_name("out"), tensor_region_bytes(config, config.outputs))

    def ensure_capacity(self, input_bytes: int) -> Segment:
        """The input region, grown first when a batch does not fit (variable-size inputs; the worker drops the old
        one)."""
        if self.in_seg is not None and self.in_seg.size_bytes >= input_bytes:
            return self.in_seg
        old = self.in_seg
        size = max(input_bytes, 2 * old.size_bytes if old else DEFAULT_SEGMENT_BYTES)
        self.in_seg = Segment.create(new_segment_name("in"), size)
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
