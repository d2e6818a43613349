"""Triton's reshape: a model whose inputs or outputs have another shape than the one clients send and get.

A config tensor's `dims` is the client's shape and its `reshape` the model's (both without the batch dimension of a
batching model). A common case is a batching model that takes [batch]: clients send [batch, 1] (`dims: [1]`,
`reshape { shape: [] }`, as Triton's auto-complete writes it). Variable dimensions (-1) correspond in order: the
n-th -1 of one shape takes its size from the n-th -1 of the other (the config check makes their counts equal and
the fixed sizes' products equal, so every reshape keeps the element count).

A backend never sees the client's shapes: the instance it loads is wrapped (`with_reshape`), so the worker, a
caller's own run (gpud.executor.direct) and the warm-up all feed it the model's shapes and read the client's back.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpud.executor.backend import ModelInstance
from gpud.executor.model_config import VARIABLE_DIM, ModelConfig, TensorSpec



def check_reshape(dims: Sequence[int], reshape: Sequence[int]) -> str:
    """"" when `reshape` can stand for `dims` (Triton's rule: each dim >= 1 or -1, as many -1 in both, the same
    product of the fixed sizes), else why not."""
    if any(d < 1 and d != VARIABLE_DIM for d in reshape):
        return f"reshape {list(reshape)}: each dimension must be >= 1, or -1 for a variable size"
    if list(dims).count(VARIABLE_DIM) != list(reshape).count(VARIABLE_DIM):
        return (f"reshape {list(reshape)} must have as many variable dimensions (-1) as dims {list(dims)}: "
                "they correspond in order")
    fixed = [int(np.prod([d for d in shape if d != VARIABLE_DIM], dtype=np.int64)) for shape in (dims, reshape)]
    if fixed[0] != fixed[1]:
        return (f"reshape {list(reshape)} has {fixed[1]} elements (its fixed dimensions), dims {list(dims)} "
                f"{fixed[0]}: a reshape keeps the element count")
    return ""


def resolve(target: Sequence[int], source: Sequence[int], actual: Sequence[int]) -> tuple[int, ...]:
    """`target` with each -1 replaced, in order, by the size `actual` has where `source` has a -1."""
    sizes = iter([a for s, a in zip(source, actual) if s == VARIABLE_DIM])
    return tuple(next(sizes) if d == VARIABLE_DIM else d for d in target)


def model_shape(shape: Sequence[int], spec: TensorSpec, batches: bool) -> tuple[int, ...]:
    """The shape the model takes for a client's input of `shape`."""
    if not batches:
        return resolve(spec.model_dims, spec.dims, shape)
    return (shape[0], *resolve(spec.model_dims, spec.dims, shape[1:]))


def client_shape(shape: Sequence[int], spec: TensorSpec, batches: bool) -> tuple[int, ...]:
    """The shape a client gets for a model's output of `shape`."""
    if not batches:
        return resolve(spec.dims, spec.model_dims, shape)
    return (shape[0], *resolve(spec.dims, spec.model_dims, shape[1:]))


class Reshaping:
    """A loaded instance behind the config's reshapes (a view of each array, no copy)."""

    def __init__(self, model: ModelInstance, config: ModelConfig):
        self.model = model
        self.provider = model.provider
        self._batches = config.batches
        self._inputs = {s.name: s for s in config.inputs if s.reshape is not None}
        self._outputs = {s.name: s for s in config.outputs if s.reshape is not None}

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> list[np.ndarray]:
        feed = dict(inputs)
        for name, spec in self._inputs.items():
            arr = feed.get(name)
            if arr is not None:
                feed[name] = arr.reshape(model_shape(arr.shape, spec, self._batches))
        results = []
        for name, arr in zip(output_names, self.model.run(feed, output_names)):
            out_spec = self._outputs.get(name)
            if out_spec is not None:
                arr = np.asarray(arr)
                arr = arr.reshape(client_shape(arr.shape, out_spec, self._batches))
            results.append(arr)
        return results

    def warmup_feed(self) -> dict[str, np.ndarray] | None:
        return self.model.warmup_feed()  # in the client's shapes (the config's dims): run() reshapes them

    def close(self) -> None:
        self.model.close()


def with_reshape(model: ModelInstance, config: ModelConfig) -> ModelInstance:
    """`model` behind the config's reshapes, or itself when the config has none."""
    if any(s.reshape is not None for s in (*config.inputs, *config.outputs)):
        return Reshaping(model, config)
    return model
