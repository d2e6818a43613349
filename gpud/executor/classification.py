"""Triton's classification extension, pure: a requested output with `classification: k` is answered as the top k of
each batch row's values, as BYTES strings "value:index" (":label" appended where the output's label_filename has a
line for that index), highest first; ties keep index order. Values are written as Triton writes them (C++
std::to_string: six decimals for floating point). The answer's shape is [batch, k] for a model that batches, else
[k], with k capped by the row's element count.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from gpud.executor.model_config import ModelConfig
from gpud.executor.types import ErrorKind, InferenceError, InferTensor, RequestedOutput

PARAMETER = "classification"
CLASSIFIABLE = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64"})
MAX_ELEMENTS = 1_000_000  # per row, as Triton bounds it


def class_count(output: RequestedOutput, config: ModelConfig) -> int:
    """The `classification` parameter of a requested output: 0 when absent (or 0, as Triton's HTTP front end reads
    it); INVALID_ARGUMENT for a value that is not a whole number >= 0, or an output that cannot be classified."""
    value = output.parameters.get(PARAMETER)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InferenceError(ErrorKind.INVALID_ARGUMENT,
                             f"invalid value for '{PARAMETER}' parameter of output '{output.name}', expected an "
                             f"integer >= 0, got {value!r}")
    spec = config.output(output.name)
    if value and spec is not None and spec.datatype not in CLASSIFIABLE:
        raise InferenceError(ErrorKind.INVALID_ARGUMENT, f"class result not available for output '{output.name}' "
                                                         f"due to unsupported type '{spec.datatype}'")
    return value


def _text(value: np.generic) -> str:
    return f"{float(value):f}" if isinstance(value, np.floating) else str(int(value))


def classify(tensor: InferTensor, count: int, labels: Sequence[str], batches: bool) -> InferTensor:
    """The top `count` classes of each row of `tensor` (its first dimension when the model batches)."""
    data = np.asarray(tensor.data)
    rows = data.reshape(data.shape[0], -1) if batches and data.ndim else data.reshape(1, -1)
    if rows.shape[1] > MAX_ELEMENTS:
        raise InferenceError(ErrorKind.INVALID_ARGUMENT, "classification output tensor too large")
    k = min(count, rows.shape[1])
    out = np.empty((rows.shape[0], k), dtype=np.object_)
    for r, row in enumerate(rows):
        order = np.argsort(-row.astype(np.float64), kind="stable")[:k]  # highest first, ties by index
        for j, index in enumerate(order):
            text = f"{_text(row[index])}:{index}"
            if index < len(labels):
                text += f":{labels[index]}"
            out[r, j] = text.encode()
    shaped = out if batches and data.ndim else out.reshape(k)
    return InferTensor(tensor.name, "BYTES", shaped.shape, shaped)


def classified(outputs: list[InferTensor], counts: Mapping[str, int], labels: Mapping[str, Sequence[str]],
               batches: bool) -> list[InferTensor]:
    """`outputs` with those named in `counts` (a class count > 0 each) replaced by their classification."""
    return [classify(t, counts[t.name], labels.get(t.name, ()), batches) if counts.get(t.name) else t
            for t in outputs]
