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
