"""KServe v2 datatypes: their numpy dtypes and Triton's config enum names (one table)."""
from __future__ import annotations

import numpy as np

# KServe v2 datatype -> (Triton TYPE_ enum name, numpy dtype or None for BYTES)
_DATATYPES: dict[str, tuple[str, type[np.generic]]] = {
    "BOOL": ("TYPE_BOOL", np.bool_),
    "UINT8": ("TYPE_UINT8", np.uint8),
    "UINT16": ("TYPE_UINT16", np.uint16),
    "UINT32": ("TYPE_UINT32", np.uint32),
    "UINT64": ("TYPE_UINT64", np.uint64),
    "INT8": ("TYPE_INT8", np.int8),
    "INT16": ("TYPE_INT16", np.int16),
    "INT32": ("TYPE_INT32", np.int32),
    "INT64": ("TYPE_INT64", np.int64),
    "FP16": ("TYPE_FP16", np.float16),
    "FP32": ("TYPE_FP32", np.float32),
    "FP64": ("TYPE_FP64", np.float64),
    "BYTES": ("TYPE_STRING", np.object_),
}
KSERVE_DATATYPES = frozenset(_DATATYPES)
# Fixed-size datatypes any bytes of which are valid values: a front end may cut a request's tensors out of its bytes
# by a plan made from an earlier request of the same header (BYTES is text to check, BOOL must be 0 or 1).
UNCHECKED_DATATYPES = KSERVE_DATATYPES - {"BYTES", "BOOL"}
_TRITON_TO_KSERVE = {triton: kserve for kserve, (triton, _) in _DATATYPES.items()}


_NUMPY_DTYPES: dict[str, np.dtype] = {name: np.dtype(t) for name, (_, t) in _DATATYPES.items()}


def numpy_dtype(datatype: str) -> np.dtype:
    """numpy dtype for a KServe datatype ("FP32" -> float32). BYTES maps to object. (Made once: a batch's staging
    asks for each of its tensors.)"""
    try:
        return _NUMPY_DTYPES[datatype]
    except KeyError:
        raise ValueError(f"unknown datatype {datatype!r}; expected one of {sorted(KSERVE_DATATYPES)}") from None


_ZERO_ELEMENT = bytes(16)  # one zero element of any fixed-size datatype (read-only)
_NO_TEXT = np.zeros(1, dtype=object)  # one element of a BYTES tensor


def placeholder(datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    """An array of `shape` and the datatype's dtype that holds no memory (strides 0: every element is the same zero):
    what a tensor another process reads or writes looks like where only its shape and datatype count (a client's
    shared-memory input before its worker reads it; an output the worker wrote into a client's region). Read-only,
    so one is shared by every request of the same datatype and shape (made once: every placed input needs one)."""
    key = (datatype, tuple(shape))
    array = _PLACEHOLDERS.get(key)
    if array is None:
        strides = (0,) * len(shape)
        if datatype == "BYTES":  # object elements: a view of a real object array, never of raw bytes
            array = np.lib.stride_tricks.as_strided(_NO_TEXT, shape=shape, strides=strides, writeable=False)
        else:
            array = np.ndarray(shape, numpy_dtype(datatype), _ZERO_ELEMENT, 0, strides)
        if len(_PLACEHOLDERS) >= _PLACEHOLDERS_MAX:
            _PLACEHOLDERS.clear()  # shapes churn (variable dims): start over
        _PLACEHOLDERS[key] = array
    return array


_PLACEHOLDERS: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}
_PLACEHOLDERS_MAX = 1024


def triton_type(datatype: str) -> str:
    """Triton config enum name for a KServe datatype ("FP32" -> "TYPE_FP32")."""
    try:
        return _DATATYPES[datatype][0]
    except KeyError:
        raise ValueError(f"unknown datatype {datatype!r}") from None


def kserve_datatype(triton_type_name: str) -> str:
    """KServe datatype for a Triton config enum name ("TYPE_FP32" -> "FP32")."""
    try:
        return _TRITON_TO_KSERVE[triton_type_name]
    except KeyError:
        raise ValueError(f"unknown data_type {triton_type_name!r}; "
                         f"expected one of {sorted(_TRITON_TO_KSERVE)}") from None
