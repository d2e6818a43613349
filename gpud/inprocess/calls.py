"""What one in-process call is made of: the core's request built from the caller's arrays, the error a call that
runs out of time raises, and the two ways a caller waits for the answer the server's loop delivers (a lock for a
thread, a future in its own loop for asyncio code)."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferResponse, InferTensor, RequestedOutput

# numpy (kind, itemsize) -> KServe datatype; by kind and size so that a big-endian array maps too (it is converted
# to the native order when the batch is copied into shared memory).
_DATATYPES = {("b", 1): "BOOL", ("u", 1): "UINT8", ("u", 2): "UINT16", ("u", 4): "UINT32", ("u", 8): "UINT64",
              ("i", 1): "INT8", ("i", 2): "INT16", ("i", 4): "INT32", ("i", 8): "INT64",
              ("f", 2): "FP16", ("f", 4): "FP32", ("f", 8): "FP64"}
_BYTES_KINDS = frozenset("OSU")  # object (bytes or str elements), bytes, str: KServe BYTES


class InferenceTimeout(InferenceError, TimeoutError):
    """No answer within the call's `timeout`. A request still queued then is withdrawn and never runs; one already
    running on an instance finishes there and its answer is dropped."""

    def __init__(self, message: str):
        super().__init__(ErrorKind.UNAVAILABLE, message)

    def __reduce__(self):
        return type(self), (self.message,)


def kserve_datatype_of(array: np.ndarray, name: str, model: str) -> str:
    """The KServe datatype of a numpy array given as input `name`; INVALID_ARGUMENT for one that has none."""
    dtype = array.dtype
    if dtype.kind in _BYTES_KINDS:
        return "BYTES"
    datatype = _DATATYPES.get((dtype.kind, dtype.itemsize))
    if datatype is None:
        raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                             f"input '{name}' for model '{model}': numpy dtype {dtype} has no KServe datatype "
                             f"(bool, [u]int8-64, float16/32/64, or bytes/str/object for BYTES)")
    return datatype


def make_request(model: str, inputs: Mapping[str, Any], version: str | int = "",
                 outputs: Iterable[str] | None = None, priority: int = 0,
                 parameters: Mapping[str, Any] | None = None) -> InferRequest:
    """The core's request for `inputs` (name -> array; anything else is converted with np.asarray). The arrays are
    referenced, not copied: they are read when the batch is written to shared memory. `parameters`: the request's
    parameters as the front ends pass them (a sequence model's `sequence_id`, `sequence_start`, `sequence_end`)."""
    if parameters is not None and not isinstance(parameters, Mapping):
        raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                             f"parameters must be a mapping of name to value, got {type(parameters).__name__}")
    if not isinstance(model, str) or not model:
        raise InferenceError(ErrorKind.INVALID_ARGUMENT, f"model must be a non-empty name, got {model!r}")
    if not isinstance(inputs, Mapping):
        raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                             f"inputs must be a mapping of input name to numpy array, got {type(inputs).__name__}")
    tensors = []
    for name, value in inputs.items():
        array = value if isinstance(value, np.ndarray) else np.asarray(value)
        tensors.append(InferTensor(name, kserve_datatype_of(array, name, model), array.shape, array))
    if isinstance(outputs, str):  # one name given alone, not a list of its characters
        outputs = (outputs,)
    requested = None if outputs is None else [RequestedOutput(str(o)) for o in outputs]
    return InferRequest(model, tensors, str(version), outputs=requested, priority=int(priority),
                        parameters=dict(parameters or {}))


def outputs_of(response: InferResponse) -> dict[str, np.ndarray]:
    return {t.name: t.data for t in response.outputs}


class Waiter:
    """A synchronous caller waiting for its answer: the lock is held until `done` (called once, in the loop).
    `waiting` is the server's set of unanswered callers, which `done` leaves."""

    __slots__ = ("lock", "result", "cancel", "waiting")

    def __init__(self, waiting: set) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.result: InferResponse | InferenceError | None = None
        self.cancel: Callable[[], None] | None = None
        self.waiting = waiting

    def done(self, result: InferResponse | InferenceError) -> None:
        """The answer; a second one (the server stopping while a caller's own run ends) is dropped."""
        self.waiting.discard(self)
        if self.result is not None:
            return
        self.result = result
        self.lock.release()


class AsyncWaiter:
    """An asyncio caller waiting in its own loop: `done` (in the server's loop) hands the answer over to it."""

    __slots__ = ("loop", "future", "cancel", "waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop, waiting: set) -> None:
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()
        self.cancel: Callable[[], None] | None = None
        self.waiting = waiting

    def done(self, result: InferResponse | InferenceError) -> None:
        self.waiting.discard(self)
        try:
            self.loop.call_soon_threadsafe(self._resolve, result)
        except RuntimeError:  # the caller's loop is closed: nobody waits
            pass

    def _resolve(self, result: InferResponse | InferenceError) -> None:
        if not self.future.done():
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)
