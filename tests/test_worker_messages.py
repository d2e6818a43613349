"""The daemon's reader of worker messages (executor.pool.WorkerHandle._on_readable): multiprocessing.Connection
frames read with non-blocking recvs, however the bytes arrive."""
from __future__ import annotations

import os
import select
import socket
import threading
from multiprocessing.connection import Connection

import pytest

from executor.device import WorkerDevice
from executor.pool import ExecutorPool, WorkerHandle
from executor.protocol import Done, Failed, Hello, Unloaded, dumps


@pytest.fixture
def handle_and_peer():
    ours, theirs = socket.socketpair()
    pool = ExecutorPool([])
    handle = WorkerHandle(WorkerDevice("cpu", "cpu", "", True), pool)
    handle.conn = Connection(ours.detach())
    handle._rsock = socket.socket(fileno=os.dup(handle.conn.fileno()))
    seen: list[dict] = []
    handle._handle = seen.append
    deaths: list[bool] = []
    handle._on_death = lambda: deaths.append(True)
    yield handle, theirs, seen, deaths
    handle._close_reader()
    handle.conn.close()
    theirs.close()


def _frame(obj) -> bytes:
    payload = dumps(obj)
    return len(payload).to_bytes(4, "big", signed=True) + payload


def test_messages_sent_by_a_connection_are_read(handle_and_peer):
    handle, theirs, seen, deaths = handle_and_peer
    sender = Connection(os.dup(theirs.fileno()))
    big = Failed(3, "INTERNAL", "x" * (3 << 20))  # several reads' worth: more than the socket buffer holds
    messages = [Done(1, (), "", 1, 2, 3), big, Failed(2, "INTERNAL", "boom")]
    thread = threading.Thread(target=lambda: [sender.send_bytes(dumps(m)) for m in messages])
    thread.start()
    try:
        while len(seen) < 3 and not deaths:  # the bytes arrive over many readable events, as in the event loop
            select.select([handle._rsock], [], [], 10)
            handle._on_readable()
    finally:
        thread.join(10)
        sender.close()
    assert [(type(m), m) for m in seen] == [(type(m), m) for m in messages]


def test_a_frame_split_anywhere_waits_for_its_end(handle_and_peer):
    handle, theirs, seen, deaths = handle_and_peer
    data = _frame(Unloaded("a")) + _frame(Hello(2, ()))
    for cut in (1, 3, 5, len(data) - 1):
        seen.clear()
        theirs.sendall(data[:cut])
        handle._on_readable()
        theirs.sendall(data[cut:])
        handle._on_readable()
        assert [(type(m), m) for m in seen] == [(Unloaded, ("a",)), (Hello, (2, ()))]
    handle._on_readable()  # nothing waiting: no message, no death
    assert [(type(m), m) for m in seen] == [(Unloaded, ("a",)), (Hello, (2, ()))] and not deaths


def test_end_of_file_is_the_workers_death(handle_and_peer):
    handle, theirs, seen, deaths = handle_and_peer
    theirs.sendall(_frame(Done(9, (), "", 0, 0, 0)))
    theirs.shutdown(socket.SHUT_WR)
    handle._on_readable()  # the message first
    assert seen == [Done(9, (), "", 0, 0, 0)] and type(seen[0]) is Done
    handle._on_readable()  # the loop reports the end of file as readable
    assert deaths == [True]


def test_poll_reads_only_with_batches_in_flight(handle_and_peer):
    handle, theirs, seen, _ = handle_and_peer
    theirs.sendall(_frame(Done(1, (), "", 0, 0, 0)))
    handle.poll()
    assert seen == []  # nothing in flight: the event loop's reader will get it
    handle._inflight[1] = lambda msg: None
    handle.poll()
    assert seen == [Done(1, (), "", 0, 0, 0)] and type(seen[0]) is Done
