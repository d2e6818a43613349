"""Requests a front-end process hands the core as one (issue 25): those that arrive in one turn of its event loop and
differ in nothing but their rows. Their rows are concatenated in the arena, one tensor per input; the core submits
them as one request standing for them all (`Scheduler.submit(..., members=n)`: batched, answered and counted as
n requests), and the one answer is split back into n here, by rows. Nothing waits for a group to fill: a turn's
requests go when the turn ends, as they did one by one.

The rule (`group_key`) is conservative and explicit: requests group when they are for the same model and version,
with the same inputs (names, datatypes, shapes: the same rows each), the same requested outputs, and
nothing of their own that the core acts on: no priority, no timeout, no parameters but the front end's own (how
it writes the answer), no shared memory, no text (the core checks text element by element). The core then decides
how many may go as one (`GpudCore.group_limit`: a model that batches them, their rows within its max_batch_size;
`group_sizes` cuts the rest), and submits each member alone where a group is refused (its validation, a full
queue): each then gets its own answer, as it would have without grouping.
"""
from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from gpud.executor.types import InferRequest, InferResponse, InferTensor

# Parameters only the front end reads (how it writes the answer), or that nothing in gpud acts on (Triton's clients
# send `triton_enable_empty_final_response`, for decoupled models' streams; perf_analyzer sends it with every
# request): members may differ in them.
FRONT_END_PARAMETERS = frozenset({"binary_data_output", "triton_enable_empty_final_response"})
FRONT_END_OUTPUT_PARAMETERS = frozenset({"binary_data"})


def group_key(request: InferRequest) -> Hashable | None:
    """What requests that may go as one group share (the same key: interchangeable but for their rows); None for a
    request that goes alone."""
    if request.uses_shm or request.priority or request.timeout_us:
        return None
    for name in request.parameters:
        if name not in FRONT_END_PARAMETERS:  # a sequence's id, anything the core may act on
            return None
    outputs = None
    if request.outputs is not None:
        names = []
        for o in request.outputs:
            if o.shm is not None:
                return None
            for name in o.parameters:
                if name not in FRONT_END_OUTPUT_PARAMETERS:  # classification, anything the core acts on
                    return None
            names.append(o.name)
        outputs = tuple(names)
    inputs = []
    for t in request.inputs:
        shape = tuple(t.shape)
        # (data elsewhere, NO_DATA or a client's region, has no rows here to put together)
        if t.datatype == "BYTES" or not shape or shape[0] < 1 or type(t.data) is not np.ndarray or \
                t.data.shape != shape:
            return None
        inputs.append((t.name, t.datatype, shape))
    if not inputs:
        return None
    # Not the id: each member's answer carries its own (RemoteCore sets it), and the core only echoes it.
    return request.model_name, request.model_version, tuple(inputs), outputs


def group_sizes(count: int, limit: int) -> list[int]:
    """`count` requests cut into groups of at most `limit` (the most that may go as one; 1: each alone)."""
    if count < 1:
        return []
    limit = max(1, limit)
    return [limit] * (count // limit) + ([count % limit] if count % limit else [])


def split_answer(response: InferResponse, count: int) -> list[InferResponse]:
    """A group's answer as its `count` members' answers: each output's rows cut into `count` equal parts, in the
    members' order (each member had the same rows: the scheduler gives a request the output rows of its input
    rows). ValueError when an output's rows do not divide."""
    parts: list[list[InferTensor]] = [[] for _ in range(count)]
    for t in response.outputs:
        data = t.data
        rows, left = divmod(data.shape[0] if data.ndim else 0, count)
        if left or not rows:
            raise ValueError(f"output '{t.name}' has {data.shape[0] if data.ndim else 0} rows, not {count} equal "
                             f"parts")
        start = 0
        for part in parts:
            piece = data[start:start + rows]
            part.append(InferTensor(t.name, t.datatype, piece.shape, piece))
            start += rows
    return [InferResponse(response.model_name, response.model_version, part, response.id, dict(response.parameters),
                          response.compute_ns) for part in parts]
