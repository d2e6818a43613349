"""gpud.executor.protocol: typed worker messages through the real framing, and the shared-memory staging of a batch."""
from __future__ import annotations

import select
import socket
import time
import typing
from multiprocessing.connection import Connection

import numpy as np
import pytest

from gpud.executor import protocol
from gpud.executor.busy import BusyTracker
from gpud.executor.channel import WorkerChannel
from gpud.executor.model_config import ModelConfig, TensorSpec
from gpud.executor.protocol import (Done, Exit, Failed, ForgetSegments, Hello, Infer, Load, Loaded, LoadFailed,
                               SetLogging, TensorMeta, Unload, Unloaded, dumps, loads, read_inputs, read_outputs,
                               write_inputs, write_outputs)
from gpud.executor.shm import Segment, align, new_segment_name

CONFIG = ModelConfig(name="m", max_batch_size=8, inputs=(TensorSpec("x", "FP32", (2,)), TensorSpec("s", "BYTES", (1,))),
                     outputs=(TensorSpec("y", "FP32", (2,)),))
ROWS = (TensorMeta("x", "FP32", (3, 2), 0, 24), TensorMeta("s", "BYTES", (3, 1), 64, 17))

TO_WORKER = [
    Load("m/1/0", "/models/m/1/model.onnx", CONFIG),
    Load("m/1/1", "/models/m/1/model.onnx", CONFIG, intra_op_threads=2),
    Infer("m/1/0", "gpud-1-in-0", "gpud-1-out-1", ROWS, ("y",), ("FP32",), seq=7),
    Unload("m/1/0"),
    ForgetSegments(("gpud-1-in-0", "gpud-1-in-2")),
    Exit(),
    SetLogging(True, False, True, 2, "ISO8601"),
]
FROM_WORKER = [
    Hello(1234, ("CUDAExecutionProvider", "CPUExecutionProvider")),
    Loaded("m/1/0", 123_456, "process_rss", 0.25, "CPUExecutionProvider"),
    LoadFailed("m/1/0", "InvalidGraph: bad model"),
    Done(7, ROWS, "", 10, 20, 30),
    Done(8, (), "gpud-2-out-9-abcdef", 1, 2, 3),
    Failed(7, "INVALID_ARGUMENT", "InvalidArgument: wrong rank"),
    Unloaded("m/1/0"),
]


def _same(got, want) -> None:
    """Equal fields and the same classes, rows included (tuples alone compare by value, whatever their class)."""
    assert type(got) is type(want) and got == want
    for name in ("inputs", "outputs"):
        rows = getattr(want, name, None)
        if rows and isinstance(rows[0], TensorMeta):
            assert all(type(r) is TensorMeta for r in getattr(got, name))


def test_every_message_class_has_a_wire_tag():
    assert set(protocol._CLASSES) == set(typing.get_args(protocol.Message))
    assert {type(m) for m in TO_WORKER + FROM_WORKER} == set(protocol._CLASSES)


@pytest.mark.parametrize("msg", TO_WORKER + FROM_WORKER, ids=lambda m: type(m).__name__)
def test_a_message_round_trips_with_its_class(msg):
    _same(loads(dumps(msg)), msg)


def test_the_wire_holds_only_builtin_types():
    # The point of the encoding: no class reference for pickle to resolve on either side, per message.
    for msg in (TO_WORKER[2], FROM_WORKER[3]):
        assert b"executor" not in dumps(msg)


def test_numbering_a_batch_changes_only_its_seq():
    batch = Infer("m/1/0", "in", "out", ROWS, ("y",), ("FP32",))
    assert batch.seq == -1
    numbered = batch.numbered(41)
    _same(numbered, batch._replace(seq=41))


@pytest.fixture
def channel_and_worker_end():
    ours, theirs = socket.socketpair()
    seen: list = []
    channel = WorkerChannel(ours, name="cpu", on_message=seen.append, on_closed=lambda: None,
                            busy=BusyTracker(time.monotonic))
    worker_end = Connection(theirs.detach())
    yield channel, worker_end, seen
    channel.close()
    worker_end.close()


def test_messages_cross_the_real_framing_both_ways(channel_and_worker_end):
    channel, worker_end, seen = channel_and_worker_end
    for msg in TO_WORKER:  # the daemon's send, the worker's read (gpud.executor.worker.Worker.serve)
        channel.send(msg)
        _same(loads(worker_end.recv_bytes()), msg)
    replies = {}
    for seq in (7, 8):
        channel._inflight[seq] = lambda reply, seq=seq: replies.setdefault(seq, []).append(reply)
    end = Unloaded("the last one")
    for msg in FROM_WORKER + [end]:  # the worker's send (Worker.send), the daemon's non-blocking reader
        worker_end.send_bytes(dumps(msg))
    while not seen or seen[-1] != end:
        assert select.select([channel._rsock], [], [], 10)[0], "the messages did not arrive"
        channel._on_readable()
    # Replies go to their batch's callback, once (Failed 7 comes after Done 7 took it); the rest to on_message.
    assert list(replies) == [7, 8] and len(replies[7]) == len(replies[8]) == 1
    _same(replies[7][0], FROM_WORKER[3])
    _same(replies[8][0], FROM_WORKER[4])
    others = [m for m in FROM_WORKER if not isinstance(m, (Done, Failed))] + [end]
    assert len(seen) == len(others)
    for got, want in zip(seen, others):
        _same(got, want)


def test_a_submitted_batch_is_numbered_and_its_reply_goes_to_its_callback(channel_and_worker_end):
    channel, worker_end, _ = channel_and_worker_end
    got = []
    batch = Infer("m/1/0", "in", "out", ROWS, ("y",), ("FP32",))
    seqs = [channel.submit(batch, got.append) for _ in range(2)]
    sent = [loads(worker_end.recv_bytes()) for _ in seqs]
    assert [m.seq for m in sent] == seqs == [0, 1] and all(m._replace(seq=-1) == batch for m in sent)
    assert channel.inflight == 2 and channel.busy._running == 2
    worker_end.send_bytes(dumps(Done(1, (), "", 0, 0, 0)))
    while not got:
        assert select.select([channel._rsock], [], [], 10)[0], "the reply did not arrive"
        channel._on_readable()
    assert got == [Done(1, (), "", 0, 0, 0)] and channel.inflight == 1 and channel.busy._running == 1
    (left,) = channel.close()  # the caller fails what is left
    assert left == got.append and channel.closed and channel.inflight == 0


# ---------------------------------------------------------------------------------------------------------------------
# Staging
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def segments():
    made: list[Segment] = []

    def make(size_bytes: int) -> Segment:
        seg = Segment.create(new_segment_name("test"), size_bytes)
        made.append(seg)
        return seg

    yield make
    for seg in made:
        seg.close()


def test_a_batchs_inputs_are_concatenated_into_the_segment_and_read_back_as_views(segments):
    requests = [{"x": np.array([[1, 2]], np.float32), "s": np.array([[b"a"]], object)},
                {"x": np.array([[3, 4], [5, 6]], np.float32), "s": np.array([[b""], [b"hello"]], object)}]
    reserved = []
    seg = segments(4096)

    def reserve(total_bytes: int) -> Segment:
        reserved.append(total_bytes)
        return seg

    rows, _ = write_inputs(CONFIG, requests, reserve)
    # x: 3 rows * 2 * 4 bytes = 24 -> 64 aligned; s: (4 + 1) + (4 + 0) + (4 + 5) = 18 bytes -> 64
    assert reserved == [128]
    assert rows == (TensorMeta("x", "FP32", (3, 2), 0, 24), TensorMeta("s", "BYTES", (3, 1), 64, 18))
    assert all(type(r) is TensorMeta for r in rows)
    feed = read_inputs(Segment.attach(seg.name), rows)  # the worker's own mapping
    np.testing.assert_array_equal(feed["x"], [[1, 2], [3, 4], [5, 6]])
    assert feed["s"].reshape(-1).tolist() == [b"a", b"", b"hello"]
    seg.ndarray(0, (3, 2), np.float32)[0, 0] = 9  # the worker reads the segment itself, not a copy
    assert feed["x"][0, 0] == 9


def test_a_model_that_does_not_batch_stages_its_one_request_as_is(segments):
    config = ModelConfig(name="u", max_batch_size=0, inputs=(TensorSpec("x", "INT64", (2, 2)),))
    seg = segments(4096)
    rows, _ = write_inputs(config, [{"x": np.arange(4, dtype=np.int64).reshape(2, 2)}], lambda n: seg)
    assert rows == (TensorMeta("x", "INT64", (2, 2), 0, 32),)
    np.testing.assert_array_equal(read_inputs(seg, rows)["x"], [[0, 1], [2, 3]])


def test_outputs_that_fit_go_to_the_instances_segment_and_are_read_as_copies(segments):
    seg = segments(4096)
    y = np.arange(6, dtype=np.float32).reshape(3, 2)
    rows, ovf = write_outputs(seg, ("y", "s"), ("FP32", "BYTES"), [y, np.array([b"ab", b"c"], object)])
    assert ovf == ""
    # y: 24 bytes at 0; s at align(24) = 64: (4 + 2) + (4 + 1) = 11 bytes
    assert rows == (TensorMeta("y", "FP32", (3, 2), 0, 24), TensorMeta("s", "BYTES", (2,), 64, 11))
    outputs = read_outputs(Done(0, rows, ovf, 0, 0, 0), seg)
    assert [(name, datatype) for name, datatype, _ in outputs] == [("y", "FP32"), ("s", "BYTES")]
    np.testing.assert_array_equal(outputs[0][2], y)
    assert outputs[1][2].tolist() == [b"ab", b"c"]
    seg.ndarray(0, (3, 2), np.float32)[...] = -1  # the next batch reuses the segment: the answer must not change
    np.testing.assert_array_equal(outputs[0][2], y)


def test_outputs_too_big_for_the_segment_go_to_an_overflow_segment_that_reading_removes(segments):
    seg = segments(64)
    y = np.ones((100,), np.float32)  # 400 bytes > 64
    rows, ovf = write_outputs(seg, ("y",), ("FP32",), [y])
    assert ovf and rows == (TensorMeta("y", "FP32", (100,), 0, 400),)
    (name, _, arr), = read_outputs(Done(0, rows, ovf, 0, 0, 0), seg)
    np.testing.assert_array_equal(arr, y)
    with pytest.raises(FileNotFoundError):
        Segment.attach(ovf)


def test_an_overflow_segment_whose_write_fails_is_removed(segments, monkeypatch):
    # The daemon never hears of an overflow segment whose batch failed: the worker must remove it itself.
    created: list[str] = []
    real_create = Segment.create

    def create(name: str, size_bytes: int) -> Segment:
        created.append(name)
        return real_create(name, size_bytes)

    def broken_ndarray(self, *args, **kwargs):
        raise MemoryError("scripted")

    seg = segments(64)
    monkeypatch.setattr(Segment, "create", staticmethod(create))
    monkeypatch.setattr(Segment, "ndarray", broken_ndarray)
    with pytest.raises(MemoryError):
        write_outputs(seg, ("y",), ("FP32",), [np.ones((100,), np.float32)])  # 400 bytes > 64: overflow
    assert len(created) == 1
    with pytest.raises(FileNotFoundError):
        Segment.attach(created[0])


def test_region_size_is_aligned_per_tensor():
    cfg = ModelConfig("m", max_batch_size=4, inputs=(TensorSpec("a", "FP32", (5,)), TensorSpec("b", "INT8", (3,))))
    # a: 4 * 5 * 4 = 80 -> 128 aligned; b: 4 * 3 = 12 -> 64; 192 < the 4096-byte floor
    assert align(80) + align(12) == 192
    assert protocol.tensor_region_bytes(cfg, cfg.inputs) == 4096
