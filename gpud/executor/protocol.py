"""What the daemon and a device worker say to each other, and how a batch's tensors travel between them.

Messages are typed, immutable records (NamedTuples), one class per message; a receiver dispatches on the class.
Daemon -> worker: Load, Infer, Unload, ForgetSegments, Exit. Worker -> daemon: Hello, Loaded, LoadFailed, Done,
Failed, Unloaded. Tensors never travel in a message: a batch's inputs are written into the instance's input segment
(shared memory the daemon owns) and its outputs into the instance's output segment, or into a one-off overflow
segment when they do not fit; messages carry only where each tensor lies (TensorMeta rows).

On the wire a message is one pickle of a plain tuple, (tag, field, ...), with TensorMeta rows as plain tuples too:
pickle writes builtin types in C, while a class reference costs a module import check on each side, which made
a batch's two messages about three times as costly as dicts. `dumps`/`loads` are the only codec; framing is
multiprocessing.Connection's (the daemon reads it without blocking, gpud.executor.channel).

Messages compare by value like any tuple, whatever their class: Unload("k") == Unloaded("k"). Compare the class too
where it matters.
"""
from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from gpud.executor.bytes_tensor import decode_bytes_elements, encode_bytes_elements
from gpud.executor.model_config import ModelConfig, TensorSpec
from gpud.executor.datatypes import numpy_dtype, placeholder
from gpud.executor.shm import Segment, align, new_segment_name, unlink
from gpud.executor.types import RegionSlice

DEFAULT_SEGMENT_BYTES = 1 << 20


class TensorMeta(NamedTuple):
    """Where one tensor of a batch lies in a segment."""

    name: str
    datatype: str  # KServe datatype: "FP32", "BYTES", ...
    shape: tuple[int, ...]  # Python ints (numpy ints would pickle slowly)
    offset: int  # bytes from the segment's start, a multiple of shm.ALIGN_BYTES
    nbytes: int  # BYTES tensors: the length of their serialized elements


# --- daemon -> worker --------------------------------------------------------------------------------------------
class Load(NamedTuple):
    """Load instance `key` of the model at `model_path`; answered by Loaded or LoadFailed."""

    key: str
    model_path: str
    config: ModelConfig
    intra_op_threads: int = 0  # 0: the backend's default (the config's intra_op_thread_count parameter wins)


class Infer(NamedTuple):
    """Run one batch on instance `key`: inputs in segment `in_seg`, outputs to `out_seg`; answered by Done or Failed.
    The daemon sends an instance its next batch only once the previous one is answered."""

    key: str
    in_seg: str
    out_seg: str
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[str, ...]  # output names, in the order Done lists them
    output_types: tuple[str, ...]  # the model's datatype of each output
    seq: int = -1  # numbered when sent (numbered()); the reply carries it back
    # Inputs in clients' shared-memory regions, which the worker copies into `in_seg` before reading the batch:
    # (offset in in_seg, region path, offset in it, bytes, the request's index in the batch). The daemon never
    # touches those bytes. A read that fails fails its request alone (Done.read_errors).
    reads: tuple[tuple[int, str, int, int, int], ...] = ()
    # Outputs the worker writes into clients' regions: (output index, first row, row past the last (-1: the whole
    # tensor), region path, offset in it, bytes the client gave, the request's index in the batch). An output every
    # row of which goes to a region is not written into the output segment (its TensorMeta offset is -1).
    writes: tuple[tuple[int, int, int, str, int, int, int], ...] = ()

    def numbered(self, seq: int) -> Infer:
        """This batch with its sequence number; cheaper than _replace, which this runs for every batch."""
        return _new(Infer, (*self[:6], seq, self[7], self[8]))


class Unload(NamedTuple):
    """Drop instance `key`; answered by Unloaded (also when it was not loaded)."""

    key: str


class ForgetSegments(NamedTuple):
    """Unmap these segments: the daemon replaced them (an input segment grown for a bigger batch)."""

    names: tuple[str, ...]


class Exit(NamedTuple):
    """Stop every instance and exit."""


class SetLogging(NamedTuple):
    """Log as these settings say from now on (gpud.log_settings.LogSettings's fields, in order)."""

    info: bool
    warning: bool
    error: bool
    verbose_level: int
    format: str


# --- worker -> daemon --------------------------------------------------------------------------------------------
class Hello(NamedTuple):
    """The worker is up and serving."""

    pid: int
    providers: tuple[str, ...]  # the execution providers its backends can use on this device


class Loaded(NamedTuple):
    key: str
    memory_bytes: int  # what loading and one warm-up run took, measured as `measured_by` says
    measured_by: str  # "device_memory" | "process_rss"
    load_seconds: float
    provider: str  # the execution provider that runs the instance


class LoadFailed(NamedTuple):
    key: str
    error: str


class Done(NamedTuple):
    """Batch `seq` ran: its outputs lie in the instance's output segment, or in `ovf_seg` (which the daemon reads
    and removes) when they did not fit."""

    seq: int
    outputs: tuple[TensorMeta, ...]
    ovf_seg: str  # "": none
    input_ns: int  # reading the inputs
    infer_ns: int  # the backend's run
    output_ns: int  # writing the outputs
    # (index into Infer.writes, ErrorKind name, why): those requests failed (a region too small, gone, truncated)
    write_errors: tuple[tuple[int, str, str], ...] = ()
    # (request index in the batch, ErrorKind name, why): requests whose input could not be read from their region
    # (truncated, unregistered, a CUDA handle that does not open here); they fail, their batch mates are answered
    read_errors: tuple[tuple[int, str, str], ...] = ()


class Failed(NamedTuple):
    seq: int
    kind: str  # a gpud.executor.types.ErrorKind name
    error: str


class Unloaded(NamedTuple):
    key: str


ToWorker = Load | Infer | Unload | ForgetSegments | Exit | SetLogging
FromWorker = Hello | Loaded | LoadFailed | Done | Failed | Unloaded
Message = ToWorker | FromWorker

# --- wire encoding -----------------------------------------------------------------------------------------------
_CLASSES: tuple[type, ...] = (Load, Infer, Unload, ForgetSegments, Exit, Hello, Loaded, LoadFailed, Done, Failed,
                              Unloaded, SetLogging)
_TAG = {cls: tag for tag, cls in enumerate(_CLASSES)}
_INFER, _DONE = _TAG[Infer], _TAG[Done]
_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
_new = tuple.__new__  # builds a NamedTuple from its fields without the Python-level __new__
_meta = partial(_new, TensorMeta)


def _plain(rows: tuple[TensorMeta, ...]) -> tuple[tuple, ...]:
    return tuple(map(tuple, rows))


def dumps(msg: Message) -> bytes:
    """The bytes of one message (a frame's payload)."""
    wire: tuple
    if type(msg) is Infer:
        key, in_seg, out_seg, inputs, outputs, output_types, seq, reads, writes = msg
        wire = (_INFER, key, in_seg, out_seg, _plain(inputs), outputs, output_types, seq, reads, writes)
    elif type(msg) is Done:
        seq, done_outputs, ovf_seg, input_ns, infer_ns, output_ns, write_errors, read_errors = msg
        wire = (_DONE, seq, _plain(done_outputs), ovf_seg, input_ns, infer_ns, output_ns, write_errors, read_errors)
    else:
        wire = (_TAG[type(msg)], *msg)
    return pickle.dumps(wire, _PICKLE_PROTOCOL)


def loads(data) -> Message:
    """The message in a frame's payload (bytes or a buffer)."""
    wire = pickle.loads(data)
    tag = wire[0]
    if tag == _INFER:
        _, key, in_seg, out_seg, inputs, outputs, output_types, seq, reads, writes = wire
        return _new(Infer, (key, in_seg, out_seg, tuple(map(_meta, inputs)), outputs, output_types, seq, reads,
                            writes))
    if tag == _DONE:
        _, seq, outputs, ovf_seg, input_ns, infer_ns, output_ns, write_errors, read_errors = wire
        return _new(Done, (seq, tuple(map(_meta, outputs)), ovf_seg, input_ns, infer_ns, output_ns, write_errors,
                           read_errors))
    return _new(_CLASSES[tag], wire[1:])


# --- staging: the daemon's side ----------------------------------------------------------------------------------
def tensor_region_bytes(config: ModelConfig, tensors: Sequence[TensorSpec],
                        default: int = DEFAULT_SEGMENT_BYTES) -> int:
    """Shared-memory bytes for one full batch of `tensors`, or `default` when a dim is variable or BYTES."""
    total = 0
    rows = max(1, config.max_batch_size)
    for spec in tensors:
        if spec.datatype == "BYTES" or any(d < 0 for d in spec.dims):
            return max(default, total)
        count = rows
        for d in spec.dims:
            count *= d
        total += align(count * numpy_dtype(spec.datatype).itemsize)
    return max(total, 4096)


def write_inputs(config: ModelConfig, requests: Sequence[Mapping[str, np.ndarray]],
                 reserve: Callable[[int], Segment],
                 regions: Sequence[Mapping[str, RegionSlice] | None] = ()) -> tuple[tuple[TensorMeta, ...], tuple]:
    """Assemble a batch straight into an input segment: every input's per-request arrays (each mapping holds the same
    names, in the model's order) concatenated along the batch dimension, one copy per tensor. `reserve(total_bytes)`
    returns a segment at least that big. A model that does not batch has one request per batch. `regions[i]`: the
    inputs of request i that lie in a client's region; their place in the segment is left for the worker to fill
    (Infer.reads, returned second)."""
    plans: list[tuple[str, str, tuple[int, ...], Any, int]] = []  # name, datatype, shape, data, bytes
    total = 0
    for name in requests[0]:
        parts = [r[name] for r in requests]
        spec = config.input(name)
        assert spec is not None  # requests were validated against the config
        datatype = spec.datatype
        if datatype == "BYTES":
            blob = b"".join(encode_bytes_elements(a) for a in parts)
            shape = ((sum(a.shape[0] for a in parts),) + parts[0].shape[1:]) if config.batches else parts[0].shape
            plans.append((name, "BYTES", shape, blob, len(blob)))
            total += align(len(blob))
        else:
            rows = sum(a.shape[0] for a in parts) if config.batches else None
            shape = ((rows,) + parts[0].shape[1:]) if rows is not None else parts[0].shape
            nbytes = math.prod(shape) * numpy_dtype(datatype).itemsize
            plans.append((name, datatype, shape, parts, nbytes))
            total += align(nbytes)
    seg = reserve(total)
    rows_meta, offset = [], 0
    reads: list[tuple[int, str, int, int, int]] = []
    for name, datatype, shape, payload, nbytes in plans:
        if datatype == "BYTES":
            seg.buf[offset:offset + nbytes] = payload
        elif any(regions):
            _place_parts(seg, offset, name, payload, [r.get(name) if r else None for r in regions], reads)
        else:
            out = seg.ndarray(offset, tuple(shape), numpy_dtype(datatype))
            if len(payload) == 1:
                out[...] = payload[0]
            else:
                np.concatenate(payload, axis=0, out=out)
        rows_meta.append(TensorMeta(name, datatype, tuple(int(d) for d in shape), offset, nbytes))
        offset += align(nbytes)
    return tuple(rows_meta), tuple(reads)


def _place_parts(seg: Segment, offset: int, name: str, parts: Sequence[np.ndarray],
                 slices: Sequence[RegionSlice | None], reads: list[tuple[int, str, int, int, int]]) -> None:
    """One input's per-request parts one after another from `offset`: copied when given, or a read for the worker
    when in a client's region."""
    for owner, (part, where) in enumerate(zip(parts, slices)):
        if where is not None:
            reads.append((offset, where.path, where.offset, where.byte_size, owner))
            offset += where.byte_size
        else:
            seg.buf[offset:offset + part.nbytes] = np.ascontiguousarray(part).reshape(-1).view(np.uint8).data
            offset += part.nbytes


def read_outputs(done: Done, segment: Segment) -> list[tuple[str, str, np.ndarray]]:
    """(name, datatype, array) of each output of a finished batch, copied out of `segment` (the instance's output
    segment, which the next batch reuses) or out of the batch's overflow segment, which is then removed."""
    seg = Segment.attach(done.ovf_seg) if done.ovf_seg else segment
    try:
        outputs = []
        for name, datatype, shape, offset, nbytes in done.outputs:
            if offset < 0:  # every row of it went into clients' regions: only its shape comes back
                arr = placeholder(datatype, shape)
            elif datatype == "BYTES":
                arr = decode_bytes_elements(seg.buf[offset:offset + nbytes], math.prod(shape)).reshape(shape)
            else:
                arr = seg.ndarray(offset, shape, numpy_dtype(datatype)).copy()
            outputs.append((name, datatype, arr))
        return outputs
    finally:
        if done.ovf_seg:
            seg.close()
            unlink(done.ovf_seg)


# --- staging: the worker's side ----------------------------------------------------------------------------------
def read_inputs(segment: Segment, inputs: Sequence[TensorMeta]) -> dict[str, np.ndarray]:
    """The batch's inputs by name: zero-copy views of the segment (BYTES tensors decoded into object arrays)."""
    feed = {}
    for name, datatype, shape, offset, nbytes in inputs:
        if datatype == "BYTES":
            feed[name] = decode_bytes_elements(segment.buf[offset:offset + nbytes], math.prod(shape)).reshape(shape)
        else:
            feed[name] = segment.ndarray(offset, shape, numpy_dtype(datatype))
    return feed


def write_outputs(segment: Segment, names: Sequence[str], output_types: Sequence[str],
                  results: Sequence[np.ndarray],
                  skip: frozenset[int] = frozenset()) -> tuple[tuple[TensorMeta, ...], str]:
    """Write a batch's outputs into `segment`, or into a new overflow segment when they do not fit (variable-size
    outputs); returns their rows and the overflow segment's name ("" when none). The overflow segment is left for
    the daemon, which reads and removes it. Outputs whose index is in `skip` (written into clients' regions) are
    only described: offset -1."""
    blobs: list[tuple[str, str, tuple[int, ...], np.ndarray | bytes]] = []
    skipped: list[TensorMeta] = []
    for index, (name, spec_type, arr) in enumerate(zip(names, output_types, results)):
        arr = np.asarray(arr)
        if index in skip:
            skipped.append(TensorMeta(name, "BYTES" if spec_type == "BYTES" else spec_type, tuple(arr.shape), -1, 0))
            continue
        if spec_type == "BYTES" or arr.dtype.kind in ("O", "U", "S"):
            blobs.append((name, "BYTES", arr.shape, encode_bytes_elements(arr)))
        else:
            blobs.append((name, spec_type, arr.shape, np.ascontiguousarray(arr)))
    sizes = [align(b.nbytes if isinstance(b, np.ndarray) else len(b)) for *_, b in blobs]
    seg, ovf_name = segment, ""
    if sum(sizes) > seg.size_bytes:
        ovf_name = new_segment_name("out")
        seg = Segment.create(ovf_name, sum(sizes))
        seg.owner = False  # the daemon removes it once read
    else:
        seg.reserve(sum(sizes))  # (shm.ShmFull: no room; the batch fails, not the worker)
    rows, offset = [], 0
    try:
        for (name, datatype, shape, blob), size in zip(blobs, sizes):
            if isinstance(blob, np.ndarray):
                seg.ndarray(offset, blob.shape, blob.dtype)[...] = blob
                nbytes = blob.nbytes
            else:
                seg.buf[offset:offset + len(blob)] = blob
                nbytes = len(blob)
            rows.append(TensorMeta(name, datatype, tuple(shape), offset, nbytes))
            offset += size
    except BaseException:
        if ovf_name:  # the daemon never hears of this segment: remove it here, or it stays in /dev/shm
            seg.close()
            unlink(ovf_name)
        raise
    if ovf_name:
        seg.close()
    if skipped:  # Done lists outputs in the batch's order
        order = {name: i for i, name in enumerate(names)}
        rows = sorted(rows + skipped, key=lambda r: order[r.name])
    return tuple(rows), ovf_name
