"""The errors a client gets back, in protocol-neutral terms (re-exported by gpud.executor.types).

A module of their own, left interpreted where gpud.executor.types is compiled (gpud.compiled): InferenceError is
subclassed together with other exceptions (gpud.inprocess's InferenceTimeout is a TimeoutError too), which a native
class cannot be.
"""
from __future__ import annotations

import enum


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
