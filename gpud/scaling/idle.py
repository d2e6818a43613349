"""Idleness and evictions, pure: one definition of how long a model version has been idle, and the order in which
idle instances may be evicted to make room.

Idle: a version with nothing queued or running, for the seconds since its last request (or since it loaded, when it
never had one). The controller's scale to zero (rules 4 of gpud.scaling.rules) and evictions both read it.

Eviction (`eviction_order`): when a load needs room that idle instances hold, the least recently used go first (the
largest first among equals, so fewer go), never below their version's minimum and never one with requests waiting or
running. A cold start (a request waits) may evict any idle instance; a scale-up only those idle for the scale-down
window (gpud.placing.ondemand applies it).
"""
from __future__ import annotations

from dataclasses import dataclass


def idle_seconds(last_used_unix_s: float, pending_requests: int, now_unix_s: float) -> float | None:
    """How long a version has had no request: None while requests are queued or running, or when it was never used
    nor loaded (`last_used_unix_s` 0)."""
    if pending_requests or not last_used_unix_s:
        return None
    return max(0.0, now_unix_s - last_used_unix_s)


@dataclass(frozen=True)
class EvictionCandidate:
    """A live instance another model's load might unload."""

    model: str
    version: str
    index: int
    device_id: str
    footprint_bytes: int
    last_used_s: float  # when its version last served a request (or was loaded); any clock, the same for all
    busy: bool  # requests of its version are queued or running
    version_instances: int  # instances its version runs now
    version_minimum: int  # its version's gpud_min_instances


def eviction_order(candidates: list[EvictionCandidate]) -> list[EvictionCandidate]:
    """The instances that may be evicted, least recently used first (the largest first among equals, so fewer go):
    never one of a busy version, and never one that would take its version below its minimum."""
    left = {(c.model, c.version): c.version_instances - c.version_minimum for c in candidates}
    out = []
    for c in sorted(candidates, key=lambda c: (c.last_used_s, -c.footprint_bytes, c.model, c.version, -c.index)):
        key = (c.model, c.version)
        if c.busy or left[key] <= 0:
            continue
        left[key] -= 1
        out.append(c)
    return out
