"""Inference requests, responses and errors as the executor sees them: no HTTP, no gRPC."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from gpud.executor.errors import ErrorKind, InferenceError

__all__ = ["ClientIO", "ErrorKind", "InferRequest", "InferResponse", "InferTensor", "InferenceError", "RegionSlice",
           "RequestedOutput", "ShmRef"]


def _by_fields(value: Any) -> tuple[Any, tuple[Any, ...]]:
    """`__reduce__` for the classes below. Compiled (gpud.compiled), they are native classes, whose instances pickle
    only as their constructor's call (the JSON codec's child sends a decoded request back): the fields in order, which
    is each constructor's order of arguments."""
    return type(value), tuple([getattr(value, f.name) for f in fields(value)])


@dataclass(frozen=True, slots=True)
class ShmRef:
    """A tensor in a client's registered shared-memory region (the shared-memory extension's three parameters)."""

    region: str
    offset: int
    byte_size: int

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _by_fields(self)


@dataclass(frozen=True, slots=True)
class RegionSlice:
    """Where a tensor lies in a client's registered region: `byte_size` bytes at `offset` of the file at `path`
    (the region's own offset added; `path` opens the region's file from any of gpud's processes)."""

    region: str
    path: str
    offset: int
    byte_size: int

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _by_fields(self)


@dataclass(slots=True)
class ClientIO:
    """A request's tensors in client regions that the device worker moves itself (gpud.executor.client_shm): the
    inputs it reads (by name; their `data` is a placeholder of the right shape) and the outputs it writes."""

    inputs: dict[str, RegionSlice] = field(default_factory=dict)
    outputs: dict[str, tuple[ShmRef, RegionSlice]] = field(default_factory=dict)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _by_fields(self)


# The classes made for every request (InferTensor, InferRequest, InferResponse, a JSON request's RequestedOutput)
# write their own __init__ rather than take the dataclass decorator's: compiled, a written __init__ is compiled too,
# and the decorator's stays interpreted, ~0.5 µs a call. The decorator still gives them repr, ==, fields() and
# replace().
@dataclass(slots=True, init=False)
class InferTensor:
    """A named tensor. `data` is a numpy array of exactly `shape`; BYTES tensors hold an object array of bytes.
    With `shm`, the tensor lies in a client's region instead and `data` is not read (an input until the core reads
    it; an output the core wrote there, which goes back without data)."""

    name: str
    datatype: str  # KServe datatype: "FP32", "INT64", "BYTES", ...
    shape: tuple[int, ...]
    data: np.ndarray
    shm: ShmRef | None

    def __init__(self, name: str, datatype: str, shape: tuple[int, ...], data: np.ndarray,
                 shm: ShmRef | None = None) -> None:
        self.name = name
        self.datatype = datatype
        self.shape = shape
        self.data = data
        self.shm = shm

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _by_fields(self)


@dataclass(init=False)
class RequestedOutput:
    name: str
    parameters: dict[str, Any]  # e.g. {"binary_data": True}; front ends read these
    shm: ShmRef | None  # written into a client's shared-memory region instead of sent back

    def __init__(self, name: str, parameters: dict[str, Any] | None = None, shm: ShmRef | None = None) -> None:
        self.name = name
        self.parameters = {} if parameters is None else parameters
        self.shm = shm

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _by_fields(self)


@dataclass(slots=True, init=False)
class InferRequest:
    model_name: str
    inputs: list[InferTensor]
    model_version: str  # "" = the version policy's choice (latest)
    id: str
    outputs: list[RequestedOutput] | None  # None = every output
    priority: int  # 0 = the model's default priority level
    timeout_us: int  # 0 = the model's default queue timeout
    parameters: dict[str, Any]
    # The same object for requests with the same input names, datatypes and shapes and the same requested outputs
    # (a front end's parsed-header cache sets it): the executor then reuses its validation. None: not known.
    # Such requests share `outputs` and `parameters`: read them, never change them.
    signature: Any
    uses_shm: bool  # an input or a requested output has `shm` (front ends set it: the core then stages them)
    client_io: ClientIO | None  # set by the core's staging when the version's worker moves them itself
    trace: Any  # the core's gpud.tracing.tracer.Trace when the request is traced: its scheduler adds its timestamps

    def __init__(self, model_name: str, inputs: list[InferTensor], model_version: str = "", id: str = "",
                 outputs: list[RequestedOutput] | None = None, priority: int = 0, timeout_us: int = 0,
                 parameters: dict[str, Any] | None = None, signature: Any = None, uses_shm: bool = False,
                 client_io: ClientIO | None = None, trace: Any = None) -> None:
        self.model_name = model_name
        self.inputs = inputs
        self.model_version = model_version
        self.id = id
        self.outputs = outputs
        self.priority = priority
        self.timeout_us = timeout_us
        self.parameters = {} if parameters is None else parameters
        self.signature = signature
        self.uses_shm = uses_shm
        self.client_io = client_io
        self.trace = trace

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _by_fields(self)


@dataclass(slots=True, init=False)
class InferResponse:
    model_name: str
    model_version: str
    outputs: list[InferTensor]
    id: str
    parameters: dict[str, Any]
    # The compute phases (input, infer, output; ns) of the batch that answered it, which every request of the batch
    # shares: what an ensemble adds up over its steps for its own statistics (as Triton's ensemble scheduler does).
    compute_ns: tuple[int, int, int]

    def __init__(self, model_name: str, model_version: str, outputs: list[InferTensor], id: str = "",
                 parameters: dict[str, Any] | None = None, compute_ns: tuple[int, int, int] = (0, 0, 0)) -> None:
        self.model_name = model_name
        self.model_version = model_version
        self.outputs = outputs
        self.id = id
        self.parameters = {} if parameters is None else parameters
        self.compute_ns = compute_ns

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _by_fields(self)
