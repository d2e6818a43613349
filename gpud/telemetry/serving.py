"""What the serving core looks like at one instant: a typed, read-only snapshot of its models, versions, instances
and queues, with each version's statistics record (`gpud.executor.stats.ModelStats`).

The core builds it on demand (`GpudCore.snapshot()`, cheap: no device reads); the Prometheus collectors read it at
scrape time, the autoscaling hints on their tick, and `gpudctl inspect` per call. Nothing that reads it can change
the core: the views are frozen and the records are read, never written (the scheduler is their only writer).
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gpud.executor.stats import ModelStats


class ModelState(str, enum.Enum):
    """A model version's state as clients see it (Triton's repository index states)."""

    LOADING = "LOADING"
    READY = "READY"  # at least one instance serves
    UNAVAILABLE = "UNAVAILABLE"  # no instance could be loaded, or none is ready now (a worker restarting)
    UNLOADING = "UNLOADING"


@dataclass(frozen=True, slots=True)
class InstanceView:
    index: int  # within its model version
    device_id: str
    ready: bool
    memory_bytes: int | None  # measured at load (device memory delta on a GPU, RSS delta on the CPU); None: not yet
    estimate_bytes: int  # from the model file, before it was measured
    measured_by: str  # "device_memory" | "process_rss" | "" (not measured)
    load_seconds: float  # load + warm-up run
    provider: str  # the execution provider the backend chose ("CUDAExecutionProvider", ...)
    error: str  # why it is not ready, when it is not

    @property
    def footprint_bytes(self) -> int:
        return self.memory_bytes if self.memory_bytes is not None else self.estimate_bytes


@dataclass(frozen=True, slots=True)
class PipelineStep:
    """One step of an ensemble: the model that serves it and how the ensemble's tensors flow through it."""

    index: int  # in the ensemble's config
    model: str
    version: str  # as configured: "-1" (the newest served) or a version number
    serving_version: str  # the version that serves it now; "" when none does
    ready: bool
    inputs: tuple[tuple[str, str], ...]  # (the model's input, the ensemble tensor it reads)
    outputs: tuple[tuple[str, str], ...]  # (the model's output, the ensemble tensor it writes)


@dataclass(frozen=True, slots=True)
class VersionView:
    model: str
    version: str
    state: ModelState
    reason: str  # why it is not READY ("" when it is)
    max_batch_size: int
    device_kinds: frozenset[str]  # device kinds its instance groups may use ("gpu", "mig", "cpu")
    pending_requests: int  # queued or running
    instances: tuple[InstanceView, ...]
    stats: ModelStats  # the executor's live record of this version: read it, never write it
    min_instances: int = 1  # the controller's bounds (config.pbtxt gpud_min_instances / gpud_max_instances)
    max_instances: int | None = None  # None: as many as the node has room for
    last_used_unix_s: float = 0.0  # the later of its last executed batch and its last load; 0: never
    # A sequence model's live sequences: holding a slot, and waiting in the backlog for one (None: not a sequence model)
    sequences_in_slots: int | None = None
    sequences_in_backlog: int = 0
    # An ensemble's steps (platform "ensemble"): it has no instances; its steps' models are placed and scaled.
    pipeline: tuple[PipelineStep, ...] = ()

    @property
    def is_ensemble(self) -> bool:
        return bool(self.pipeline)

    @property
    def ready_instances(self) -> int:
        return sum(1 for i in self.instances if i.ready)

    @property
    def load_seconds(self) -> float | None:
        """How long one of its instances takes to load (its cold start): the longest of the ready ones measured;
        None when none is."""
        return max((i.load_seconds for i in self.instances if i.ready and i.load_seconds > 0), default=None)


@dataclass(frozen=True, slots=True)
class ModelView:
    name: str
    error: str  # why the repository could not read the model ("" when it could)
    versions: tuple[VersionView, ...]  # oldest first; empty when unloaded or unreadable


@dataclass(frozen=True, slots=True)
class ServingSnapshot:
    models: tuple[ModelView, ...]  # by name

    def versions(self) -> Iterator[VersionView]:
        for m in self.models:
            yield from m.versions


SnapshotSource = Callable[[], ServingSnapshot]
