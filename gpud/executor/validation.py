"""Checks a request against its model's configuration before it is queued (pure): bad input never reaches a worker."""
from __future__ import annotations

import math

import numpy as np

from gpud.executor.classification import class_count
from gpud.executor.model_config import ModelConfig, TensorSpec
from gpud.executor.types import ErrorKind, InferenceError, InferRequest


class PreparedRequest:
    """A request's inputs as its model takes them. One per request: a plain class with slots (compiled, a
    dataclass's generated __init__ would stay interpreted)."""
    __slots__ = ("inputs", "batch_rows", "shape_key", "output_names")

    def __init__(self, inputs: dict[str, np.ndarray], batch_rows: int, shape_key: tuple,
                 output_names: list[str]) -> None:
        self.inputs = inputs  # in the model's input order
        self.batch_rows = batch_rows  # the request's batch size (1 for a model that does not batch)
        self.shape_key = shape_key  # requests batch together only when the non-batch dims match
        self.output_names = output_names

    def __repr__(self) -> str:
        return (f"PreparedRequest(inputs={list(self.inputs)}, batch_rows={self.batch_rows}, "
                f"shape_key={self.shape_key!r}, output_names={self.output_names!r})")


def _bad(message: str) -> InferenceError:
    return InferenceError(ErrorKind.INVALID_ARGUMENT, message)


def _fmt(shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _check_dims(model: str, spec: TensorSpec, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if len(shape) != len(expected) or any(e >= 0 and s != e for s, e in zip(shape, expected)):
        raise _bad(f"unexpected shape for input '{spec.name}' for model '{model}'. "
                   f"Expected {_fmt(expected)}, got {_fmt(shape)}")


def prepare(config: ModelConfig, request: InferRequest) -> PreparedRequest:
    """Validate names, datatypes and shapes; raise INVALID_ARGUMENT with a message a client can act on."""
    model = config.name
    given = {}
    for tensor in request.inputs:
        if tensor.name in given:
            raise _bad(f"input '{tensor.name}' given more than once")
        given[tensor.name] = tensor
    unknown = sorted(set(given) - {s.name for s in config.inputs})
    if unknown:
        raise _bad(f"unexpected inference input '{unknown[0]}' for model '{model}'; "
                   f"its inputs are {[s.name for s in config.inputs]}")
    inputs: dict[str, np.ndarray] = {}
    batch_rows: int | None = None
    key = []
    for spec in config.inputs:
        t = given.get(spec.name)
        if t is None:
            if spec.optional:
                continue
            raise _bad(f"expected input '{spec.name}' for model '{model}' is missing")
        if t.datatype != spec.datatype:
            raise _bad(f"inference input '{spec.name}' data-type is '{t.datatype}', but model '{model}' "
                       f"expects '{spec.datatype}'")
        shape = tuple(int(d) for d in t.shape)
        if any(d < 0 for d in shape):
            raise _bad(f"input '{spec.name}' has a negative dimension in shape {_fmt(shape)}")
        if config.batches:
            if len(shape) < 1:
                raise _bad(f"input '{spec.name}' for model '{model}' needs a batch dimension; expected "
                           f"{_fmt((-1,) + spec.dims)}, got {_fmt(shape)}")
            _check_dims(model, spec, shape, (-1,) + spec.dims)
            rows = shape[0]
            if rows < 1:  # an empty batch: nothing to run, and "must be <= N" would not say why
                raise _bad(f"inference request batch-size must be >= 1 for '{model}', got {rows} (input "
                           f"'{spec.name}' has shape {_fmt(shape)})")
            if rows > config.max_batch_size:
                raise _bad(f"inference request batch-size must be <= {config.max_batch_size} for '{model}', "
                           f"got {rows}")
            if batch_rows is not None and rows != batch_rows:
                raise _bad(f"input '{spec.name}' has batch size {rows}, other inputs have {batch_rows}")
            batch_rows = rows
            key.append((spec.name, shape[1:]))
        else:
            _check_dims(model, spec, shape, spec.dims)
            key.append((spec.name, shape))
        data = t.data
        if data.shape != shape:
            if data.size != math.prod(shape):
                raise _bad(f"input '{spec.name}': {data.size} elements given for shape {_fmt(shape)}")
            data = data.reshape(shape)
        if spec.datatype == "BYTES":
            check_text(spec.name, data)
        inputs[spec.name] = data
    if request.outputs is None:
        output_names = [o.name for o in config.outputs]
    else:
        output_names = []
        known = {o.name for o in config.outputs}
        for o in request.outputs:
            if o.name not in known:
                raise _bad(f"unexpected inference output '{o.name}' for model '{model}'")
            if o.name in output_names:  # as Triton: one entry per output
                raise _bad(f"output '{o.name}' already exists in request")
            if o.parameters:
                class_count(o, config)  # the classification extension's parameter, checked now
            output_names.append(o.name)
    return PreparedRequest(inputs, batch_rows or 1, tuple(key), output_names)


def check_text(name: str, data: np.ndarray) -> None:
    """A BYTES input's elements are text the model can take: onnxruntime's string tensors hold UTF-8 (any
    character, NUL included). Bytes that are not UTF-8 are refused with the input and element named, never altered."""
    for i, item in enumerate(data.reshape(-1)):
        try:
            if isinstance(item, str):
                item.encode("utf-8")
            else:
                bytes(item).decode("utf-8")
        except (UnicodeDecodeError, UnicodeEncodeError) as exc:
            raise _bad(f"input '{name}' element {i} is not UTF-8 text ({exc.reason} at byte {exc.start}): "
                       "the model's string tensors hold UTF-8 text") from None
        except TypeError:
            raise _bad(f"input '{name}' element {i} is {type(item).__name__}, not bytes or text") from None


class PreparedCache:
    """`prepare` for one model, remembering the outcome per request signature (InferRequest.signature): a request
    whose signature was validated before only has its arrays picked out. Requests without a signature, and the
    first of each signature, go through `prepare` in full."""

    def __init__(self, config: ModelConfig, capacity: int = 1024):
        self.config = config
        self.capacity = capacity
        self._known: dict[object, tuple[tuple[tuple[str, int], ...], int, tuple, list[str]]] = {}
        # Text inputs are checked element by element on every request (check_text): no shortcut for them.
        self._cacheable = all(s.datatype != "BYTES" for s in config.inputs)

    def prepare(self, request: InferRequest) -> PreparedRequest:
        signature = request.signature if self._cacheable else None
        if signature is not None:
            known = self._known.get(signature)
            if known is not None:
                order, batch_rows, shape_key, output_names = known
                tensors = request.inputs
                return PreparedRequest({name: tensors[i].data for name, i in order}, batch_rows, shape_key,
                                       output_names)
        prepared = prepare(self.config, request)
        if signature is not None:
            if len(self._known) >= self.capacity:
                self._known.clear()  # signatures churn (e.g. a request id in every header): start over
            index = {t.name: i for i, t in enumerate(request.inputs)}
            # Only when nothing was reshaped: then every request of this signature has its arrays as given.
            if all(request.inputs[index[n]].data is a for n, a in prepared.inputs.items()):
                self._known[signature] = (tuple((n, index[n]) for n in prepared.inputs), prepared.batch_rows,
                                          prepared.shape_key, prepared.output_names)
        return prepared
