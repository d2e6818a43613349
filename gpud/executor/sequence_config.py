"""Sequence batching as the executor sees it: Triton's ModelSequenceBatching as typed values, and the tensors the
sequence batcher adds to a model's inputs (control tensors, implicit state).

`gpud.repository.sequence_config` builds these from config.pbtxt; the executor only reads them. A sequence model
has two sets of inputs: the client's (`ModelConfig.inputs`: what requests carry and the metadata lists) and the
model's (`gpud.executor.model_config.execution_config`: those plus the control inputs and the state inputs, which gpud
fills in). The worker loads the model with the latter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gpud.executor.datatypes import numpy_dtype

START, END, READY, CORRID = "CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_END", "CONTROL_SEQUENCE_READY", \
    "CONTROL_SEQUENCE_CORRID"
BOOLEAN_CONTROLS = (START, END, READY)
CORRID_DATATYPES = ("UINT64", "INT64", "UINT32", "INT32", "BYTES")  # Triton's allowed CORRID types
DIRECT, OLDEST = "direct", "oldest"
DEFAULT_MAX_SEQUENCE_IDLE_US = 1_000_000  # Triton's SEQUENCE_IDLE_DEFAULT_MICROSECONDS


@dataclass(frozen=True)
class ControlInput:
    """One control tensor: its input name, which control it carries, its datatype (KServe) and, for START, END and
    READY, the values it takes for false and true (`int32_false_true`, `fp32_false_true` or `bool_false_true`)."""

    name: str
    kind: str  # START | END | READY | CORRID
    datatype: str
    false_value: float = 0
    true_value: float = 1


@dataclass(frozen=True)
class StateSpec:
    """Triton's implicit state: the model's `output_name` after one request is its `input_name` on the next request
    of the same sequence. `dims` exclude the batch dimension; `initial` is the raw bytes of `initial_state`
    (little-endian, or KServe's BYTES layout) with its `initial_dims`, or None: zeros (empty strings for BYTES)."""

    input_name: str
    output_name: str
    datatype: str
    dims: tuple[int, ...]
    initial: bytes | None = None
    initial_dims: tuple[int, ...] = ()
    # As config.pbtxt said them, for the config endpoints (gpud keeps a sequence's state as arrays either way):
    initial_name: str = ""
    initial_data_file: str = ""  # "": zero_data
    use_same_buffer_for_input_output: bool = False
    use_growable_memory: bool = False


@dataclass(frozen=True)
class SequenceBatching:
    """Triton's ModelSequenceBatching (the fields gpud honours: all but iterative_sequence)."""

    strategy: str = DIRECT  # direct | oldest
    max_sequence_idle_us: int = DEFAULT_MAX_SEQUENCE_IDLE_US
    controls: tuple[ControlInput, ...] = ()
    states: tuple[StateSpec, ...] = ()
    # direct
    max_queue_delay_us: int = 0  # direct.max_queue_delay_microseconds, or oldest's
    minimum_slot_utilization: float = 0.0  # direct
    # oldest
    max_candidate_sequences: int = 0  # 0: max(1, max_batch_size), as Triton
    preferred_batch_sizes: tuple[int, ...] = ()
    preserve_ordering: bool = False

    def control(self, kind: str) -> ControlInput | None:
        return next((c for c in self.controls if c.kind == kind), None)

    def slots_per_instance(self, max_batch_size: int) -> int:
        """Sequences one instance holds at once (Triton's seq_slot_cnt)."""
        if self.strategy == OLDEST and self.max_candidate_sequences > 0:
            return self.max_candidate_sequences
        return max(1, max_batch_size)


# --- the tensors the batcher adds ------------------------------------------------------------------------------


def control_value(control: ControlInput, value: bool | int | str, batches: bool) -> np.ndarray:
    """One request's (one batch row's) control tensor: shape [1] ([1, 1] for a model that batches). START, END and
    READY take their false/true value; CORRID the correlation id: a uint64 id is cast to the CORRID type (wrapping,
    as Triton's copy of its low bytes does), a string id is one BYTES element."""
    shape = (1, 1) if batches else (1,)
    if control.kind == CORRID:
        if control.datatype == "BYTES":
            out = np.empty(shape, dtype=object)
            out[...] = value.encode() if isinstance(value, str) else str(value).encode()
            return out
        dtype = numpy_dtype(control.datatype)
        return np.array(int(value) & (2 ** (8 * dtype.itemsize) - 1), dtype=np.uint64).astype(dtype).reshape(shape)
    chosen = control.true_value if value else control.false_value
    return np.full(shape, chosen, dtype=numpy_dtype(control.datatype))


def initial_state(state: StateSpec, batches: bool) -> np.ndarray:
    """A new sequence's state input (one batch row): `initial_state`'s data, or zeros of the state's dims (a variable
    dim counts 1, as Triton's SequenceStates::Initialize)."""
    lead = (1,) if batches else ()
    if state.initial is None:
        shape = lead + tuple(1 if d < 0 else d for d in state.dims)
        if state.datatype == "BYTES":
            out = np.empty(shape, dtype=object)
            out[...] = b""
            return out
        return np.zeros(shape, dtype=numpy_dtype(state.datatype))
    shape = lead + state.initial_dims
    if state.datatype == "BYTES":
        from gpud.executor.bytes_tensor import decode_bytes_elements

        return decode_bytes_elements(state.initial, math.prod(shape)).reshape(shape)
    dtype = numpy_dtype(state.datatype).newbyteorder("<")
    count = math.prod(shape)
    return np.frombuffer(state.initial, dtype=dtype, count=count).astype(dtype.newbyteorder("="), copy=True) \
        .reshape(shape)
