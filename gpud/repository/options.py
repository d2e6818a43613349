"""config.pbtxt `parameters` that gpud interprets, read once when the configuration is read.

gpud's own options are `gpud_*` parameters; of Triton's, it reads the onnxruntime backend's `intra_op_thread_count`.
Each is parsed and checked here into `ModelOptions`; a bad value (or a `gpud_*` key gpud does not know: a typo would
otherwise be ignored without a word) is a ModelConfigError naming the file, the key and what is allowed. Other
parameters pass through untouched (they are reported by the /config endpoints as given).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpud.executor.model_config import (BATCHING, BATCHING_MODES, COMPUTE_FRACTION, CUDA_TF32, INTRA_OP_THREADS,
                                        LATENCY_OBJECTIVE_MS, LATENCY_OBJECTIVE_SHARE, LATENCY_OBJECTIVE_SHED,
                                        MAX_INSTANCES, MIN_INSTANCES, InstanceGroup, ModelOptions)
from gpud.executor.objective import parse_objective_ms, parse_objective_share
from gpud.repository.errors import ModelConfigError


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise ValueError
    return value


def _mode(text: str) -> str:
    if text not in BATCHING_MODES:
        raise ValueError
    return text


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1"):
        return True
    if value in ("false", "0"):
        return False
    raise ValueError


# key -> (ModelOptions field, parser (ValueError: refused), what is allowed, for the message)
_READERS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    MIN_INSTANCES: ("min_instances", _count, "a whole number of instances >= 0"),
    MAX_INSTANCES: ("max_instances", _count, "a whole number of instances >= 0"),
    COMPUTE_FRACTION: ("compute_fraction", _fraction, "a number in (0, 1] (a share of one device's compute)"),
    BATCHING: ("batching", _mode, f"one of {', '.join(BATCHING_MODES)}"),
    CUDA_TF32: ("cuda_tf32", _bool, "true or false"),
    INTRA_OP_THREADS: ("intra_op_threads", _count, "a whole number of threads >= 0 (0: onnxruntime's default)"),
    LATENCY_OBJECTIVE_MS: ("latency_objective_ms", parse_objective_ms,
                           "a number of milliseconds > 0 and at most 3600000 (an hour)"),
    LATENCY_OBJECTIVE_SHARE: ("latency_objective_share", parse_objective_share,
                              "a share of requests, a number in (0, 1) such as 0.99"),
    LATENCY_OBJECTIVE_SHED: ("latency_objective_shed", _bool, "true or false"),
}
KNOWN = tuple(sorted(_READERS))


def read_options(parameters: Mapping[str, str], instance_groups: Sequence[InstanceGroup], path: str) -> ModelOptions:
    """The options `parameters` set; ModelConfigError(path, ...) for a bad value, an unknown `gpud_*` key, or a
    gpud_max_instances below the minimum (gpud_min_instances, else the instance_group count)."""
    values: dict[str, Any] = {}
    for key, text in parameters.items():
        reader = _READERS.get(key)
        if reader is None:
            if key.startswith("gpud_"):
                raise ModelConfigError(path, f"unknown parameter {key!r}; gpud's parameters are "
                                             f"{', '.join(k for k in KNOWN if k.startswith('gpud_'))}")
            continue
        name, parse, allowed = reader
        try:
            values[name] = parse(text)
        except ValueError:
            raise ModelConfigError(path, f"parameter {key} must be {allowed}, got {text!r}") from None
    options = ModelOptions(**values)
    if options.max_instances is not None:
        lo = options.min_instances
        if lo is None:
            lo = sum(g.count for g in instance_groups)
            if options.max_instances < lo:
                raise ModelConfigError(path, f"parameter {MAX_INSTANCES} ({options.max_instances}) is below the "
                                             f"minimum ({lo}: the instance_group count; set {MIN_INSTANCES} too)")
        elif options.max_instances < lo:
            raise ModelConfigError(path, f"parameter {MAX_INSTANCES} ({options.max_instances}) is below the "
                                         f"minimum ({lo})")
    return options
