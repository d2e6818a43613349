"""Per-model statistics in the shape of Triton's statistics extension (what perf_analyzer reads)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class ModelStats:
    """Cumulative counters for one model version. Request-level durations count once per request; batch-level ones
    once per execution, keyed by batch size (rows)."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0  # rows inferred (Triton counts batch rows)
    execution_count: int = 0  # batches executed
    last_inference_ms: int = 0
    batches: dict[int, BatchStats] = field(default_factory=dict)

    def record_batch(self, rows: int, input_ns: int, infer_ns: int, output_ns: int, wall_ms: int) -> None:
        self.execution_count += 1
        self.inference_count += rows
        self.last_inference_ms = wall_ms
        b = self.batches.setdefault(rows, BatchStats())
        b.compute_input.add(input_ns)
        b.compute_infer.add(infer_ns)
        b.compute_output.add(output_ns)

    def json(self, name: str, version: str) -> dict[str, Any]:
        zero = {"count": 0, "ns": 0}
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.json(),
                "fail": self.fail.json(),
                "queue": self.queue.json(),
                "compute_input": self.compute_input.json(),
                "compute_infer": self.compute_infer.json(),
                "compute_output": self.compute_output.json(),
                "cache_hit": dict(zero),
                "cache_miss": dict(zero),
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": b.compute_input.json(),
                    "compute_infer": b.compute_infer.json(),
                    "compute_output": b.compute_output.json(),
                }
                for size, b in sorted(self.batches.items())
            ],
        }
