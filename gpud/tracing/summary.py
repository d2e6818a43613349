"""A trace file summed up per model (`gpudctl trace --summary FILE`): how many traces, and where their time went on
average (request, queue, compute and its input, infer and output phases, and what is left: overhead). Pure; reads
Triton's trace format, so Triton's own trace files too."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# (span, from timestamp, to timestamp), Triton's names
SPANS = (("request", "REQUEST_START", "REQUEST_END"), ("queue", "QUEUE_START", "COMPUTE_START"),
         ("compute", "COMPUTE_START", "COMPUTE_END"), ("input", "COMPUTE_START", "COMPUTE_INPUT_END"),
         ("infer", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START"), ("output", "COMPUTE_OUTPUT_START", "COMPUTE_END"))


@dataclass
class ModelSummary:
    model_name: str
    model_version: int
    traces: int = 0
    total_ns: dict[str, int] = field(default_factory=dict)  # span -> summed over the traces that have it
    counts: dict[str, int] = field(default_factory=dict)  # span -> traces that have it
    request_ns: list[int] = field(default_factory=list)  # each trace's, for its percentiles

    def mean_us(self, span: str) -> float | None:
        n = self.counts.get(span, 0)
        return self.total_ns[span] / n / 1000 if n else None

    def request_percentile_us(self, q: float) -> float | None:
        if not self.request_ns:
            return None
        ordered = sorted(self.request_ns)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000


def traces_of(objects: Iterable[Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
    """Triton's objects merged per trace id: model, version, parent and every timestamp by name. ValueError for
    an object that is not one of Triton's."""
    traces: dict[int, dict[str, Any]] = {}
    for o in objects:
        if not isinstance(o, Mapping) or not isinstance(o.get("id"), int):
            raise ValueError(f"not a trace object (no integer 'id'): {str(o)[:120]}")
        t = traces.setdefault(o["id"], {"timestamps": {}})
        for key in ("model_name", "model_version", "parent_id", "request_id"):
            if key in o:
                t[key] = o[key]
        for stamp in o.get("timestamps", ()):
            t["timestamps"][stamp["name"]] = stamp["ns"]
    return traces


def summarize(objects: Iterable[Mapping[str, Any]]) -> list[ModelSummary]:
    """Each model's summary (ensembles' steps under their own models), by model name and version."""
    by_model: dict[tuple[str, int], ModelSummary] = {}
    for t in traces_of(objects).values():
        stamps = t["timestamps"]
        if "model_name" not in t or "REQUEST_START" not in stamps or "REQUEST_END" not in stamps:
            continue  # a part of a trace (a file cut by log frequency), or one without its request's span
        key = (t["model_name"], t.get("model_version", -1))
        s = by_model.get(key)
        if s is None:
            s = by_model[key] = ModelSummary(*key)
        s.traces += 1
        for span, start, end in SPANS:
            if start in stamps and end in stamps:
                s.total_ns[span] = s.total_ns.get(span, 0) + stamps[end] - stamps[start]
                s.counts[span] = s.counts.get(span, 0) + 1
        s.request_ns.append(stamps["REQUEST_END"] - stamps["REQUEST_START"])
    return [by_model[k] for k in sorted(by_model)]


def render(summaries: list[ModelSummary]) -> str:
    """For a person: a block per model, averages in microseconds."""
    if not summaries:
        return "no complete trace (each needs REQUEST_START and REQUEST_END)"
    lines: list[str] = []
    for s in summaries:
        lines.append(f"{s.model_name} (version {s.model_version}): {s.traces} trace(s)")
        p50, p99 = s.request_percentile_us(0.5), s.request_percentile_us(0.99)
        lines.append(f"  request   {s.mean_us('request'):10.1f} us avg   p50 {p50:.1f} us   p99 {p99:.1f} us")
        queue, compute = s.mean_us("queue"), s.mean_us("compute")
        if queue is not None and compute is not None:
            overhead = (s.total_ns["request"] - s.total_ns["queue"] - s.total_ns["compute"]) / s.traces / 1000 \
                if s.counts["queue"] == s.counts["compute"] == s.traces else None
            lines.append(f"    queue   {queue:10.1f} us avg")
            lines.append(f"    compute {compute:10.1f} us avg")
            for phase in ("input", "infer", "output"):
                mean = s.mean_us(phase)
                if mean is not None:
                    lines.append(f"      {phase:<7} {mean:8.1f} us avg")
            if overhead is not None:
                lines.append(f"    other   {overhead:10.1f} us avg (to and from the device worker, the core)")
    return "\n".join(lines)
