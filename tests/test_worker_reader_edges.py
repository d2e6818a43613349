"""gpud.executor.channel.WorkerChannel's non-blocking frame reader (_on_readable/_read/poll), and the supervisor's
handling of the end of the pipe."""
from __future__ import annotations

import asyncio
import select
import socket
import time

import pytest

from gpud.executor.busy import BusyTracker
from gpud.executor.channel import READ_CHUNK_BYTES, WorkerChannel
from gpud.executor.device import WorkerDevice
from gpud.executor.instance import InstanceHandle
from gpud.executor.model_config import ModelConfig, TensorSpec
from gpud.executor.protocol import Done, Failed, dumps
from gpud.executor.supervisor import WorkerSupervisor
from gpud.executor.types import InferenceError
from tests.fakes import replaces_methods_of


def _frame(obj) -> bytes:
    payload = dumps(obj)
    return len(payload).to_bytes(4, "big", signed=True) + payload


def _done(seq: int) -> Done:
    return Done(seq, (), "", 0, 0, 0)


def _frame_of_exactly(size: int, seq: int) -> bytes:
    pad = size - len(_frame(Failed(seq, "INTERNAL", "")))
    while True:
        f = _frame(Failed(seq, "INTERNAL", "x" * pad))
        if len(f) == size:
            return f
        pad += size - len(f)


def _socketpair() -> tuple[socket.socket, socket.socket]:
    ours, theirs = socket.socketpair()
    for s in (ours, theirs):  # room for a whole read chunk without a reader on the other side
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    return ours, theirs


@pytest.fixture
def channel_and_peer():
    ours, theirs = _socketpair()
    channel = WorkerChannel(ours, name="cpu", on_message=lambda msg: None, on_closed=lambda: None,
                            busy=BusyTracker(time.monotonic))
    yield channel, theirs
    channel.close()
    theirs.close()


@pytest.fixture
def supervisor_and_peer():
    ours, theirs = _socketpair()
    supervisor = WorkerSupervisor(WorkerDevice("cpu", "cpu", "", True))
    channel = supervisor._open_channel(ours)
    yield supervisor, channel, theirs
    channel.close()
    theirs.close()


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


# ---------------------------------------------------------------------------------------------------------------------
# Fixed bugs (each test failed before its fix)
# ---------------------------------------------------------------------------------------------------------------------
@replaces_methods_of("gpud.executor.channel")
def test_replies_received_before_end_of_file_are_handled_first(channel_and_peer):
    channel, theirs = channel_and_peer
    seen, deaths = [], []
    channel._handle = lambda msg: seen.append(msg.seq)
    channel.on_closed = lambda: deaths.append(len(seen))
    theirs.sendall(_frame_of_exactly(READ_CHUNK_BYTES, seq=1))  # the worker's last reply, then it exits
    theirs.shutdown(socket.SHUT_WR)
    channel._on_readable()
    if not deaths:
        channel._on_readable()
    assert deaths == [1], f"the worker's death was handled with replies {seen} processed (expected [1] first)"


def test_a_raising_handler_does_not_strand_the_next_reply(channel_and_peer):
    channel, theirs = channel_and_peer
    answered = []

    def boom(msg):
        raise RuntimeError("a callback bug")

    channel._inflight = {1: boom, 2: answered.append}
    theirs.sendall(_frame(_done(1)) + _frame(_done(2)))
    channel._on_readable()  # the callback's error is logged; the reader goes on
    assert answered == [_done(2)] and type(answered[0]) is Done, "reply 2 was read off the socket but never handled"


# ---------------------------------------------------------------------------------------------------------------------
# Tricky cases that are handled correctly
# ---------------------------------------------------------------------------------------------------------------------
def test_poll_from_inside_a_reply_callback_does_not_reenter(channel_and_peer):
    channel, theirs = channel_and_peer
    order = []

    def first(msg):
        order.append(("start", msg.seq))
        theirs.sendall(_frame(_done(3)))  # more arrives while we are handling
        channel.poll()  # e.g. a done callback submitting a request: must not handle 2 or 3 inside 1
        order.append(("end", msg.seq))

    channel._inflight = {1: first, 2: lambda m: order.append(("cb", 2)), 3: lambda m: order.append(("cb", 3))}
    theirs.sendall(_frame(_done(1)) + _frame(_done(2)))
    channel._on_readable()
    assert order == [("start", 1), ("end", 1), ("cb", 2)]
    assert _readable(channel._rsock)  # 3 is still on the socket: the loop's reader gets it
    channel._on_readable()
    assert order[-1] == ("cb", 3) and not channel._inflight and not channel._reading


def test_end_of_file_fails_in_flight_batches_after_marking_instances_unready(supervisor_and_peer):
    handle, channel, theirs = supervisor_and_peer
    config = ModelConfig(name="m", max_batch_size=0, inputs=(TensorSpec("x", "FP32", (1,)),),
                         outputs=(TensorSpec("y", "FP32", (1,)),))
    inst = InstanceHandle(key="m/1/0", model="m", version="1", index=0, device_id="cpu", model_path="",
                          config=config, estimate_bytes=0, worker=handle, ready=True)
    handle.instances[inst.key] = inst
    handle._stopping = True  # no restart in a unit test
    events = []
    inst.on_ready_change = lambda i: events.append(("ready", i.ready))
    channel._inflight = {1: lambda r: events.append(("reply", r.seq)),
                        2: lambda r: events.append(("failed", isinstance(r, InferenceError), inst.ready))}
    handle.busy.begin()
    handle.busy.begin()

    async def run():
        theirs.sendall(_frame(_done(1)))
        theirs.shutdown(socket.SHUT_WR)
        handle.poll()
        handle.poll()  # nothing more from poll (batch 2 is still in flight): the end of file

    asyncio.run(run())
    assert events == [("reply", 1), ("ready", False), ("failed", True, False)]
    assert handle.channel is None and channel._rsock is None and not channel._inflight
    handle.poll()  # after the death: a no-op
