"""The one inference core that the HTTP and gRPC front ends adapt. Front ends only translate wire formats.

Every method raises `executor.types.InferenceError` for errors a client should see (the kind picks the HTTP status
or gRPC code). Dict results are already in the JSON shape of the KServe v2 / Triton HTTP protocol, with integers
as numbers, so the gRPC adapter can `google.protobuf.json_format.ParseDict` them into its messages.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from executor.types import InferenceError, InferRequest, InferResponse


class InferenceCore(Protocol):
    def server_live(self) -> bool: ...

    def server_ready(self) -> bool: ...

    def server_metadata(self) -> dict[str, Any]:
        """{"name": "gpud", "version": "...", "extensions": [...]}"""
        ...

    def model_ready(self, name: str, version: str = "") -> bool:
        """False for a known model that is not ready; raises NOT_FOUND for an unknown model."""
        ...

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        """{"name", "versions": ["1"], "platform", "inputs": [{"name", "datatype", "shape": [-1, 4]}], "outputs": [...]}
        Shapes include the batch dimension (-1) when the model batches, as Triton reports them."""
        ...

    def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        """Triton's ModelConfig as JSON: {"name", "platform", "backend", "max_batch_size", "input": [{"name",
        "data_type": "TYPE_FP32", "dims": [4]}], "output": [...], "instance_group": [...], "dynamic_batching": {...}}"""
        ...

    def model_statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        """Triton's statistics extension: {"model_stats": [{"name", "version", "last_inference", "inference_count",
        "execution_count", "inference_stats": {"success": {"count", "ns"}, "fail", "queue", "compute_input",
        "compute_infer", "compute_output", "cache_hit", "cache_miss"}, "batch_stats": [{"batch_size",
        "compute_input": {"count", "ns"}, "compute_infer", "compute_output"}]}]}. name "" = every model."""
        ...

    def repository_index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """[{"name", "version", "state": "READY" | "UNAVAILABLE" | "LOADING" | "UNLOADING", "reason": "..."}]"""
        ...

    def inspect(self) -> dict[str, Any]:
        """gpud's own view for `gpudctl inspect` (served at GET /v2/gpud/inspect): {"devices": [...], "models": [...]}"""
        ...

    async def apply_placement(self, placements: list[dict[str, Any]]) -> dict[str, Any]:
        """Make the named models' instances match `placements` ([{"model", "instance", "device"}], e.g. a plan from
        `gpudctl place`): new instances load first, then the ones they replace stop (make-before-break). If any
        load fails, what was added is removed again and nothing changes. Returns {"added": [...], "removed": [...]}."""
        ...

    async def load_model(self, name: str) -> None: ...

    async def unload_model(self, name: str) -> None: ...

    async def infer(self, request: InferRequest) -> InferResponse: ...

    def submit(self, request: InferRequest, done: Callable[[InferResponse | InferenceError], None]) -> None:
        """`infer` without a coroutine: raises InferenceError at once for what is refused before queueing (unknown
        or unready model, bad input, full queue); otherwise `done` is called once, from the event loop, with the
        response or the error. The HTTP front end uses it so that a request costs no task."""
        ...
