"""A serving core's snapshot for telemetry tests: model versions with real `gpud.executor.stats` records, filled the way
the scheduler fills them, and instances and queues set by the test."""
from __future__ import annotations

from dataclasses import dataclass, field

from gpud.executor.stats import ModelStats
from gpud.telemetry.serving import InstanceView, ModelState, ModelView, ServingSnapshot, VersionView


def ns(seconds: float) -> int:
    return round(seconds * 1e9)


def instance(index: int, device: str, memory_bytes: int | None, *, ready: bool = True, load_seconds: float = 1.5,
             estimate_bytes: int = 2**30) -> InstanceView:
    return InstanceView(index, device, ready, memory_bytes, estimate_bytes, "process_rss" if memory_bytes else "",
                        load_seconds, "CPUExecutionProvider", "")


@dataclass
class _Version:
    stats: ModelStats = field(default_factory=ModelStats)
    pending: int = 0
    instances: tuple[InstanceView, ...] = ()
    kinds: frozenset[str] = frozenset({"gpu", "mig"})
    min_instances: int = 1
    max_batch_size: int = 8
    max_instances: int | None = None


class FakeServing:
    """Callable like `GpudCore.snapshot`."""

    def __init__(self) -> None:
        self._versions: dict[tuple[str, str], _Version] = {}

    def version(self, model: str, version: str = "1", *, pending: int | None = None,
                instances: tuple[InstanceView, ...] | None = None, kinds: frozenset[str] | None = None) -> _Version:
        v = self._versions.setdefault((model, str(version)), _Version())
        if pending is not None:
            v.pending = pending
        if instances is not None:
            v.instances = tuple(instances)
        if kinds is not None:
            v.kinds = kinds
        return v

    def stats(self, model: str, version: str = "1") -> ModelStats:
        return self.version(model, version).stats

    def remove(self, model: str, version: str = "1") -> None:
        self._versions.pop((model, str(version)), None)

    # --- recording, as the scheduler does -----------------------------------------------------------------------------
    def batch(self, model: str, version: str = "1", *, rows: int | None = None, queue_s: tuple[float, ...] = (0.0,),
              request_s: tuple[float, ...] | None = None, input_s: float = 0.0, infer_s: float = 0.0,
              output_s: float = 0.0) -> None:
        """One successful batch: one request per queue time (rows default: one per request)."""
        request_s = request_s if request_s is not None else tuple(0.0 for _ in queue_s)
        self.stats(model, version).record_batch(rows if rows is not None else len(queue_s),
                                                [ns(q) for q in queue_s], [ns(r) for r in request_s],
                                                ns(input_s), ns(infer_s), ns(output_s), 1_700_000_000_000)

    def request(self, model: str, version: str = "1", queue_s: float = 0.0, input_s: float = 0.0,
                infer_s: float = 0.0, output_s: float = 0.0, request_s: float = 0.0) -> None:
        """One successful request, alone in its batch."""
        self.batch(model, version, queue_s=(queue_s,), request_s=(request_s,), input_s=input_s, infer_s=infer_s,
                   output_s=output_s)

    def failure(self, model: str, version: str = "1", request_s: float = 0.0) -> None:
        self.stats(model, version).record_failure(ns(request_s))

    def __call__(self) -> ServingSnapshot:
        models: dict[str, list[VersionView]] = {}
        for (model, version), v in sorted(self._versions.items()):
            models.setdefault(model, []).append(VersionView(
                model, version, ModelState.READY, "", v.max_batch_size, v.kinds, v.pending, v.instances, v.stats, v.min_instances,
                v.max_instances))
        return ServingSnapshot(tuple(ModelView(name, "", tuple(vs)) for name, vs in models.items()))
