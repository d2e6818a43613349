"""The executor's request, tensor and response classes behave the same compiled (native classes, gpud.compiled) and
pure: they pickle (the JSON codec's child and the front-end processes send them), copy, compare, print and take
dataclasses.replace; and gpud's public errors can still be subclassed with other exceptions."""
import copy
import dataclasses
import pickle

import numpy as np
import pytest

import gpud
from gpud.executor import types
from gpud.executor.types import (ClientIO, InferRequest, InferResponse, InferTensor, RegionSlice, RequestedOutput,
                                 ShmRef)


def _tensor(shm: ShmRef | None = None) -> InferTensor:
    return InferTensor("x", "FP32", (2, 3), np.arange(6, dtype=np.float32).reshape(2, 3), shm)


def _request() -> InferRequest:
    return InferRequest("m", [_tensor(ShmRef("r", 8, 24))], "2", "id-1",
                        [RequestedOutput("y", {"binary_data": True}, ShmRef("o", 0, 16))], 1, 500,
                        {"sequence_id": 7}, None, True, ClientIO({"x": RegionSlice("r", "/dev/shm/r", 8, 24)}))


def _response() -> InferResponse:
    return InferResponse("m", "2", [_tensor()], "id-1", {"sequence_end": True}, (1, 2, 3))


def _same(a, b) -> None:
    """Field by field (a tensor's data compared as arrays: == on a dataclass holding arrays is ambiguous)."""
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
            assert x.dtype == y.dtype
        elif isinstance(x, list):
            assert len(x) == len(y)
            for u, v in zip(x, y):
                if dataclasses.is_dataclass(u):
                    _same(u, v)
        elif dataclasses.is_dataclass(x):
            _same(x, y)
        else:
            assert x == y, f.name


VALUES = [_tensor, _request, _response, lambda: ShmRef("r", 1, 2), lambda: RegionSlice("r", "/p", 0, 8),
          lambda: ClientIO(), lambda: RequestedOutput("y")]


@pytest.mark.parametrize("make", VALUES, ids=lambda m: type(m()).__name__)
def test_each_pickles_and_copies_whole(make):
    value = make()
    for again in (pickle.loads(pickle.dumps(value, pickle.HIGHEST_PROTOCOL)), pickle.loads(pickle.dumps(value, 2)),
                  copy.copy(value), copy.deepcopy(value)):
        _same(value, again)
        assert repr(again) == repr(value)


def test_defaults_and_replace():
    r = InferRequest("m", [])
    assert (r.model_version, r.id, r.outputs, r.priority, r.timeout_us, r.parameters, r.signature, r.uses_shm,
            r.client_io) == ("", "", None, 0, 0, {}, None, False, None)
    assert r.parameters is not InferRequest("m", []).parameters  # each its own dict, as field(default_factory=dict)
    assert InferResponse("m", "1", []).compute_ns == (0, 0, 0)
    assert RequestedOutput("y").parameters == {} and InferTensor("x", "FP32", (1,), np.zeros(1)).shm is None
    changed = dataclasses.replace(_request(), id="id-2", priority=2)
    assert (changed.id, changed.priority, changed.model_name) == ("id-2", 2, "m")
    assert [f.name for f in dataclasses.fields(InferRequest)][:2] == ["model_name", "inputs"]
    assert InferRequest("m", [], id="a") == InferRequest("m", [], id="a") != InferRequest("m", [], id="b")


def test_the_public_errors_are_one_class_and_subclass_with_other_exceptions():
    assert gpud.InferenceError is types.InferenceError and gpud.ErrorKind is types.ErrorKind
    assert issubclass(gpud.InferenceTimeout, gpud.InferenceError) and issubclass(gpud.InferenceTimeout, TimeoutError)
    err = pickle.loads(pickle.dumps(gpud.InferenceError(gpud.ErrorKind.NOT_FOUND, "no such model")))
    assert (err.kind, err.message) == (gpud.ErrorKind.NOT_FOUND, "no such model")
