"""The daemon's reader of worker messages (gpud.executor.channel.WorkerChannel._on_readable): multiprocessing.Connection
frames read with non-blocking recvs, however the bytes arrive."""
from __future__ import annotations

import os
import select
import socket
import threading
import time
from multiprocessing.connection import Connection

import pytest

from gpud.executor.busy import BusyTracker
from gpud.executor.channel import WorkerChannel
from gpud.executor.protocol import Done, Failed, Hello, Unloaded, dumps
from tests.fakes import replaces_methods_of


@pytest.fixture
def channel_and_peer():
    ours, theirs = socket.socketpair()
    seen: list = []
    deaths: list[bool] = []
    channel = WorkerChannel(ours, name="cpu", on_message=seen.append, on_closed=lambda: deaths.append(True),
                            busy=BusyTracker(time.monotonic))
    channel._handle = seen.append  # every message, replies included
    yield channel, theirs, seen, deaths
    channel.close()
    theirs.close()


def _frame(obj) -> bytes:
    payload = dumps(obj)
    return len(payload).to_bytes(4, "big", signed=True) + payload


@replaces_methods_of("gpud.executor.channel")
def test_messages_sent_by_a_connection_are_read(channel_and_peer):
    channel, theirs, seen, deaths = channel_and_peer
    sender = Connection(os.dup(theirs.fileno()))
    big = Failed(3, "INTERNAL", "x" * (3 << 20))  # several reads' worth: more than the socket buffer holds
    messages = [Done(1, (), "", 1, 2, 3), big, Failed(2, "INTERNAL", "boom")]
    thread = threading.Thread(target=lambda: [sender.send_bytes(dumps(m)) for m in messages])
    thread.start()
    try:
        while len(seen) < 3 and not deaths:  # the bytes arrive over many readable events, as in the event loop
            select.select([channel._rsock], [], [], 10)
            channel._on_readable()
    finally:
        thread.join(10)
        sender.close()
    assert [(type(m), m) for m in seen] == [(type(m), m) for m in messages]


@replaces_methods_of("gpud.executor.channel")
def test_a_frame_split_anywhere_waits_for_its_end(channel_and_peer):
    channel, theirs, seen, deaths = channel_and_peer
    data = _frame(Unloaded("a")) + _frame(Hello(2, ()))
    for cut in (1, 3, 5, len(data) - 1):
        seen.clear()
        theirs.sendall(data[:cut])
        channel._on_readable()
        theirs.sendall(data[cut:])
        channel._on_readable()
        assert [(type(m), m) for m in seen] == [(Unloaded, ("a",)), (Hello, (2, ()))]
    channel._on_readable()  # nothing waiting: no message, no death
    assert [(type(m), m) for m in seen] == [(Unloaded, ("a",)), (Hello, (2, ()))] and not deaths


@replaces_methods_of("gpud.executor.channel")
def test_end_of_file_is_the_workers_death(channel_and_peer):
    channel, theirs, seen, deaths = channel_and_peer
    theirs.sendall(_frame(Done(9, (), "", 0, 0, 0)))
    theirs.shutdown(socket.SHUT_WR)
    channel._on_readable()  # the message first
    assert seen == [Done(9, (), "", 0, 0, 0)] and type(seen[0]) is Done
    channel._on_readable()  # the loop reports the end of file as readable
    assert deaths == [True]


@replaces_methods_of("gpud.executor.channel")
def test_poll_reads_only_with_batches_in_flight(channel_and_peer):
    channel, theirs, seen, _ = channel_and_peer
    theirs.sendall(_frame(Done(1, (), "", 0, 0, 0)))
    channel.poll()
    assert seen == []  # nothing in flight: the event loop's reader will get it
    channel._inflight[1] = lambda msg: None
    channel.poll()
    assert seen == [Done(1, (), "", 0, 0, 0)] and type(seen[0]) is Done
