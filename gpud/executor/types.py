"""Inference requests, responses and errors as the executor sees them: no HTTP, no gRPC."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class ErrorKind(enum.Enum):
    """What went wrong, in protocol-neutral terms. Each front end maps it to its own status (HTTP status, gRPC code).
    Worker processes send the kind by name."""

    INVALID_ARGUMENT = enum.auto()  # malformed request, wrong shape or dtype, unknown input
    NOT_FOUND = enum.auto()  # unknown model or version
    UNAVAILABLE = enum.auto()  # model not ready, queue full, worker lost, shutting down, timed out in queue
    INTERNAL = enum.auto()  # a bug or a backend failure
    PERMISSION_DENIED = enum.auto()  # an action the server's settings do not allow (model control off)
    UNAUTHENTICATED = enum.auto()  # an admin action without the admin token
    UNSUPPORTED = enum.auto()  # a feature this server does not offer, or not with its settings (HTTP 501, as Triton)
    ALREADY_EXISTS = enum.auto()  # a name already taken (a shared-memory region registered twice)


class InferenceError(Exception):
    """An error a client gets back, with its kind. The message is shown to the client as is."""

    def __init__(self, kind: ErrorKind, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message

    def __repr__(self) -> str:
        return f"InferenceError({self.kind.name}, {self.message!r})"

    def __reduce__(self):  # pickled whole (a front end's decoding process sends it back): Exception's drops kind
        return type(self), (self.kind, self.message)


@dataclass(frozen=True, slots=True)
class ShmRef:
    """A tensor in a client's registered shared-memory region (the shared-memory extension's three parameters)."""

    region: str
    offset: int
    byte_size: int


@dataclass(frozen=True, slots=True)
class RegionSlice:
    """Where a tensor lies in a client's registered region: `byte_size` bytes at `offset` of the file at `path`
    (the region's own offset added; `path` opens the region's file from any of gpud's processes)."""

    region: str
    path: str
    offset: int
    byte_size: int


@dataclass(slots=True)
class ClientIO:
    """A request's tensors in client regions that the device worker moves itself (gpud.executor.client_shm): the
    inputs it reads (by name; their `data` is a placeholder of the right shape) and the outputs it writes."""

    inputs: dict[str, RegionSlice] = field(default_factory=dict)
    outputs: dict[str, tuple[ShmRef, RegionSlice]] = field(default_factory=dict)


@dataclass(slots=True)
class InferTensor:
    """A named tensor. `data` is a numpy array of exactly `shape`; BYTES tensors hold an object array of bytes.
    With `shm`, the tensor lies in a client's region instead and `data` is not read (an input until the core reads
    it; an output the core wrote there, which goes back without data)."""

    name: str
    datatype: str  # KServe datatype: "FP32", "INT64", "BYTES", ...
    shape: tuple[int, ...]
    data: np.ndarray
    shm: ShmRef | None = None


@dataclass
class RequestedOutput:
    name: str
    parameters: dict[str, Any] = field(default_factory=dict)  # e.g. {"binary_data": True}; front ends read these
    shm: ShmRef | None = None  # written into a client's shared-memory region instead of sent back


@dataclass(slots=True)
class InferRequest:
    model_name: str
    inputs: list[InferTensor]
    model_version: str = ""  # "" = the version policy's choice (latest)
    id: str = ""
    outputs: list[RequestedOutput] | None = None  # None = every output
    priority: int = 0  # 0 = the model's default priority level
    timeout_us: int = 0  # 0 = the model's default queue timeout
    parameters: dict[str, Any] = field(default_factory=dict)
    # The same object for requests with the same input names, datatypes and shapes and the same requested outputs
    # (a front end's parsed-header cache sets it): the executor then reuses its validation. None: not known.
    # Such requests share `outputs` and `parameters`: read them, never change them.
    signature: Any = None
    uses_shm: bool = False  # an input or a requested output has `shm` (front ends set it: the core then stages them)
    client_io: ClientIO | None = None  # set by the core's staging when the version's worker moves them itself


@dataclass(slots=True)
class InferResponse:
    model_name: str
    model_version: str
    outputs: list[InferTensor]
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    # The compute phases (input, infer, output; ns) of the batch that answered it, which every request of the batch
    # shares: what an ensemble adds up over its steps for its own statistics (as Triton's ensemble scheduler does).
    compute_ns: tuple[int, int, int] = (0, 0, 0)
