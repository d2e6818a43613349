"""Request validation against the model configuration (gpud.executor.validation): bad input never reaches a worker."""
from __future__ import annotations

import numpy as np
import pytest

from gpud.executor.model_config import ModelConfig, TensorSpec
from gpud.executor.types import ErrorKind, InferenceError, InferRequest, InferTensor, RequestedOutput
from gpud.executor.validation import PreparedCache, prepare

BATCHING = ModelConfig(name="m", max_batch_size=8,
                       inputs=(TensorSpec("a", "FP32", (4,)), TensorSpec("b", "INT64", (-1,))),
                       outputs=(TensorSpec("y", "FP32", (4,)),))
FIXED = ModelConfig(name="f", max_batch_size=0, inputs=(TensorSpec("a", "FP32", (2, 3)),),
                    outputs=(TensorSpec("y", "FP32", (2,)),))


def t(name, datatype, shape):
    dtype = {"FP32": np.float32, "INT64": np.int64, "INT32": np.int32}[datatype]
    return InferTensor(name, datatype, tuple(shape), np.zeros(shape, dtype))


def test_a_good_batched_request():
    p = prepare(BATCHING, InferRequest("m", [t("a", "FP32", (3, 4)), t("b", "INT64", (3, 7))]))
    assert p.batch_rows == 3 and p.output_names == ["y"]
    assert p.shape_key == (("a", (4,)), ("b", (7,)))  # requests batch together only with b's length 7


def test_non_batching_model_keeps_full_shape():
    p = prepare(FIXED, InferRequest("f", [t("a", "FP32", (2, 3))]))
    assert p.batch_rows == 1


@pytest.mark.parametrize("inputs, outputs, message", [
    ([t("a", "FP32", (3, 5)), t("b", "INT64", (3, 7))], None, "unexpected shape for input 'a'"),
    ([t("a", "INT32", (3, 4)), t("b", "INT64", (3, 7))], None, "data-type is 'INT32'"),
    ([t("a", "FP32", (3, 4))], None, "expected input 'b'"),
    ([t("a", "FP32", (3, 4)), t("b", "INT64", (3, 7)), t("c", "FP32", (1,))], None, "unexpected inference input 'c'"),
    ([t("a", "FP32", (9, 4)), t("b", "INT64", (9, 7))], None, "batch-size must be <= 8"),
    # an empty batch says so, and which input is empty (it read "must be <= 8, got 0")
    ([t("a", "FP32", (0, 4)), t("b", "INT64", (0, 7))], None,
     "batch-size must be >= 1 for 'm', got 0 (input 'a' has shape [0,4])"),
    ([t("a", "FP32", (3, 4)), t("b", "INT64", (2, 7))], None, "batch size 2, other inputs have 3"),
    ([t("a", "FP32", (3, 4)), t("b", "INT64", (3, 7))], [RequestedOutput("z")], "unexpected inference output 'z'"),
    ([t("a", "FP32", (4,)), t("b", "INT64", (3, 7))], None, "unexpected shape for input 'a'"),
])
def test_bad_requests_are_invalid_argument(inputs, outputs, message):
    with pytest.raises(InferenceError) as err:
        prepare(BATCHING, InferRequest("m", inputs, outputs=outputs))
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT and message in err.value.message


def test_fixed_shape_mismatch():
    with pytest.raises(InferenceError, match="Expected \\[2,3\\], got \\[1,2,3\\]"):
        prepare(FIXED, InferRequest("f", [t("a", "FP32", (1, 2, 3))]))


class TestPreparedCache:
    SIG = object()

    def _request(self, rows, signature=SIG, b_len=7):
        return InferRequest("m", [t("b", "INT64", (rows, b_len)), t("a", "FP32", (rows, 4))], signature=signature)

    def test_same_signature_reuses_the_validation_and_takes_this_requests_arrays(self):
        cache = PreparedCache(BATCHING)
        first = cache.prepare(self._request(3))
        second_request = self._request(3)
        second = cache.prepare(second_request)
        assert list(second.inputs) == ["a", "b"]  # the model's order, not the request's
        assert second.inputs["a"] is second_request.inputs[1].data
        assert second.inputs["b"] is second_request.inputs[0].data
        assert (second.batch_rows, second.shape_key, second.output_names) == \
            (first.batch_rows, first.shape_key, first.output_names)

    def test_no_signature_and_bad_requests_are_validated_in_full(self):
        cache = PreparedCache(BATCHING)
        with pytest.raises(InferenceError, match="batch-size must be <= 8"):
            cache.prepare(self._request(9, signature=None))
        bad_sig = object()
        for _ in range(2):  # a refused request is not remembered: its signature is refused every time
            with pytest.raises(InferenceError, match="batch-size must be <= 8"):
                cache.prepare(self._request(9, signature=bad_sig))

    def test_a_full_cache_starts_over(self):
        cache = PreparedCache(BATCHING, capacity=2)
        for _ in range(5):
            assert cache.prepare(self._request(2, signature=object())).batch_rows == 2
        assert len(cache._known) <= 2
