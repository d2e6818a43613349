"""Request validation against the model configuration (executor.validation): bad input never reaches a worker."""
from __future__ import annotations

import numpy as np
import pytest

from executor.model_config import ModelConfig, TensorSpec
from executor.types import ErrorKind, InferenceError, InferRequest, InferTensor, RequestedOutput
from executor.validation import prepare

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
