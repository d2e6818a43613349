"""The one inference core that the HTTP and gRPC front ends adapt, and the typed values it answers with.

Front ends own their wire formats. The core returns the protocol-neutral values below and raises
`gpud.executor.types.InferenceError`, whose kind each front end maps to its own status; `gpud.api.http_encode` writes
them as Triton's HTTP JSON and `gpud.api.grpc_encode` as Triton's protobuf messages (a test checks the two agree).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gpud.executor.client_shm import RegionStatus
from gpud.executor.model_config import ModelConfig, TensorSpec
from gpud.executor.stats import ModelStats
from gpud.executor.types import InferenceError, InferRequest, InferResponse
from gpud.executor.process_log import LogSettings
from gpud.tracing.settings import TraceSettings
from gpud.repository.config import VersionPolicy
from gpud.repository.overrides import LoadOverride
from gpud.telemetry.serving import ModelState

BATCH_DIM = -1  # the batch dimension in metadata shapes: any size up to max_batch_size


@dataclass(frozen=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...]  # the protocol extensions the server implements; clients decide what to call by it


@dataclass(frozen=True)
class TensorMetadata:
    name: str
    datatype: str  # KServe datatype: "FP32", "BYTES", ...
    shape: tuple[int, ...]  # -1 = any size; starts with the batch dimension when the model batches


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorMetadata, ...]
    outputs: tuple[TensorMetadata, ...]

    @classmethod
    def of(cls, config: ModelConfig, versions: Iterable[int | str]) -> ModelMetadata:
        """A model's metadata. Shapes carry the batch dimension (-1) when the model batches, as Triton reports."""
        batch = (BATCH_DIM,) if config.batches else ()

        def tensors(specs: tuple[TensorSpec, ...]) -> tuple[TensorMetadata, ...]:
            return tuple(TensorMetadata(s.name, s.datatype, batch + s.dims) for s in specs)

        return cls(name=config.name, versions=tuple(str(v) for v in versions), platform=config.platform,
                   inputs=tensors(config.inputs), outputs=tensors(config.outputs))


@dataclass(frozen=True)
class ServedModelConfig:
    """A model's complete configuration and the version policy it is served under (ModelConfig carries none)."""

    config: ModelConfig
    version_policy: VersionPolicy = VersionPolicy()
    source: bytes = b""  # config.pbtxt as written (model_config.proto, serialized): what the encoders keep of it


@dataclass(frozen=True)
class ModelStatistics:
    """Triton's statistics of one model version: the executor's cumulative record, read when it is encoded."""

    name: str
    version: str
    stats: ModelStats


@dataclass(frozen=True)
class RepositoryModel:
    """One row of the repository index: a model version, or a model with no version ("") and why."""

    name: str
    version: str
    state: ModelState  # Triton's repository index states
    reason: str = ""  # why it is not ready; "" when it is


# --- placement (POST /v2/gpud/placement) ------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestedPlacement:
    """One instance where a person (or `gpudctl place --apply`) wants it. `model` is a model name (its newest
    version; `instance` is the index within the version) or a placement name (`model:version[:group]`, as
    `gpudctl place` prints them; `instance` is the index within that demand)."""

    model: str
    instance: int
    device: str


@dataclass(frozen=True)
class PlacedInstance:
    model: str
    version: str
    index: int
    device: str


@dataclass(frozen=True)
class Applied:
    added: tuple[PlacedInstance, ...]
    removed: tuple[PlacedInstance, ...]


class SharedMemoryRegions(Protocol):
    """The registered client shared-memory regions, as front ends use them (gpud.executor.client_shm.ClientRegions,
    or a front-end process's proxy of it)."""

    def status(self, name: str = "") -> list[RegionStatus]: ...

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None: ...

    def unregister(self, name: str = "") -> None: ...

    def check_cuda(self) -> None: ...

    def cuda_register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None: ...

    def cuda_unregister(self, name: str = "") -> None: ...

    def cuda_status(self, name: str = "") -> list[dict[str, Any]]: ...


class InferenceCore(Protocol):
    """Every method raises `gpud.executor.types.InferenceError` for errors a client should see."""

    @property
    def client_shm(self) -> SharedMemoryRegions:
        """Clients' shared-memory regions (the shared-memory extension)."""
        ...

    def server_live(self) -> bool: ...

    def server_ready(self) -> bool: ...

    def server_metadata(self) -> ServerMetadata: ...

    def model_ready(self, name: str, version: str = "") -> bool:
        """False for a known model that is not ready; raises NOT_FOUND for an unknown model."""
        ...

    def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        """version "": every served version is listed."""
        ...

    def model_config(self, name: str, version: str = "") -> ServedModelConfig: ...

    def model_statistics(self, name: str = "", version: str = "") -> list[ModelStatistics]:
        """name "": every version of every model; version "": every version of the model."""
        ...

    def repository_index(self, ready_only: bool = False) -> list[RepositoryModel]: ...

    def inspect(self) -> dict[str, Any]:
        """gpud's own view for `gpudctl inspect` (served at GET /v2/gpud/inspect):
        {"devices": [...], "models": [...]}"""
        ...

    def log_settings(self) -> LogSettings:
        """The log settings (Triton's logging extension); UNSUPPORTED where the server has none."""
        ...

    def update_log_settings(self, changes: Mapping[str, object]) -> LogSettings:
        """Apply a log setting request (Triton's names; gpud.log_settings.updated's errors change nothing) and
        answer the settings now."""
        ...

    def trace_settings(self, model_name: str = "") -> TraceSettings:
        """The trace settings (Triton's trace extension) of a model ("": the global ones); UNSUPPORTED where the
        server has none, NOT_FOUND for a model it does not know."""
        ...

    def update_trace_settings(self, model_name: str, changes: Mapping[str, object]) -> TraceSettings:
        """Apply a trace setting request (Triton's names; gpud.tracing.tracer.Tracer.update's errors change
        nothing) to a model's settings ("": the global ones) and answer them now."""
        ...

    async def apply_placement(self, requested: Sequence[RequestedPlacement]) -> Applied:
        """Make the named model versions' instances exactly `requested` (e.g. a plan from `gpudctl place`), step by
        step, each move make-before-break (gpud.placing.service). A placement that does not fit is refused before
        anything changes; if a load fails, every step is undone and nothing changes."""
        ...

    async def load_model(self, name: str, override: LoadOverride | None = None) -> None:
        """Load or reload `name` from the repository, or with a load request's config and files (`override`)."""
        ...

    async def unload_model(self, name: str, *, unload_dependents: bool = False) -> None:
        """`unload_dependents` (Triton's): also unload the models an ensemble's steps name that were loaded only as
        its dependencies and that no other loaded ensemble uses."""
        ...

    async def infer(self, request: InferRequest) -> InferResponse: ...

    def submit(self, request: InferRequest,
               done: Callable[[InferResponse | InferenceError], None]) -> Callable[[], None]:
        """`infer` without a coroutine: raises InferenceError at once for what is refused before queueing (unknown
        or unready model, bad input, full queue); otherwise `done` is called once, from the event loop, with the
        response or the error. The HTTP front end uses it so that a request costs no task. Returns `cancel`: called
        (in the event loop) when the caller no longer waits, a request still queued never runs, and `done` is not
        called after it (the in-process server's timeouts)."""
        ...
