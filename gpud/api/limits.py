"""Limits on what a client may declare, shared by the HTTP and gRPC front ends.

A request's body is bounded by --max-request-bytes, but a tensor's declared shape is not: `[1, 10**12]` costs a
few bytes to write. Every declared shape is checked here before anything is allocated for it, so a shape that
could only fail later (or make numpy raise, or allocate a huge array) is a client error at once.
"""
from __future__ import annotations

import math
from typing import Protocol

from gpud.executor.types import ErrorKind, InferenceError

DEFAULT_MAX_TENSOR_ELEMENTS = 2**28  # 4x the elements a 64 MiB body can carry even of 1-byte types
MAX_TENSOR_DIMS = 32  # numpy 1.x's limit (numpy 2 allows 64); no model has more
DEFAULT_MAX_HEADER_BYTES = 64 * 1024  # an HTTP request's line and headers; gRPC metadata


class SharedCount(Protocol):
    """The open connections of every process accepting on one port (gpud.frontproc.connections): a front-end
    process's server checks its connection cap against `total()` and reports its own with `set`."""

    def total(self) -> int: ...

    def set(self, count: int) -> None: ...


def check_shape(name: str, shape: list[int] | tuple[int, ...], max_elements: int) -> int:
    """The element count of input `name`'s declared shape; INVALID_ARGUMENT when a dimension is negative, when
    there are more than MAX_TENSOR_DIMS, or when the shape spans more than `max_elements` elements.

    A zero dimension does not exempt the others: numpy refuses `[0, 2**62, 4]` (its size computation overflows),
    so the extent counted is the product of the dimensions with zeros read as ones."""
    if len(shape) > MAX_TENSOR_DIMS:
        raise InferenceError(ErrorKind.INVALID_ARGUMENT, f"input '{name}': shape has {len(shape)} dimensions, "
                                                         f"more than the limit of {MAX_TENSOR_DIMS}")
    extent = 1
    for dim in shape:
        if dim < 0:
            raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                                 f"input '{name}': shape {list(shape)} has a negative dimension")
        extent *= dim or 1
    if extent > max_elements:
        raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                             f"input '{name}': shape {list(shape)} declares {extent} elements, more than the limit "
                             f"of {max_elements} (--max-tensor-elements)")
    return math.prod(shape)
