"""The port's connection cap with front ends in processes (gpud.frontproc.connections): each process counts every
process's open connections against the whole cap, as the front end on the core's loop counts its own."""
from __future__ import annotations

import http.client
import os

import pytest

from gpud.frontproc.connections import SharedConnections
from tests.daemon_harness import start_daemon


def test_the_slots_add_up_each_written_by_its_process_and_a_dead_ones_cleared():
    host = SharedConnections.create(3)
    # the processes map the same page (here by a duplicate of the descriptor, as pass_fds gives them one)
    first, second = (SharedConnections(os.dup(host.fd), 3, i) for i in (0, 2))
    try:
        assert host.total() == 0
        first.set(4)
        second.set(2)
        assert (host.total(), first.total(), second.total()) == (6, 6, 6)
        first.set(3)
        assert second.total() == 5
        host.clear(2)  # the host's call when process 2 ended
        assert first.total() == 3
    finally:
        for page in (first, second, host):
            page.close()
        host.close()  # twice: no matter
        host.clear(0)  # after the end: nothing to clear


def _connect(url: str) -> http.client.HTTPConnection:
    host, port = url.split(":")
    return http.client.HTTPConnection(host, int(port), timeout=30)


def _status(conn: http.client.HTTPConnection) -> int:
    conn.request("GET", "/v2/health/live")
    response = conn.getresponse()
    response.read()
    return response.status


@pytest.mark.slow
def test_two_http_processes_hold_the_cap_for_the_port_not_each_a_share(tmp_path):
    daemon = start_daemon(None, tmp_path, "--http-processes", "2", "--http-max-connections", "3",
                          "--placement-control", "off", node=None)
    held = []
    try:
        for _ in range(3):  # one after the other, each answered before the next: every process has counted it
            conn = _connect(daemon.http_url)
            assert _status(conn) == 200
            held.append(conn)
        over = _connect(daemon.http_url)
        assert _status(over) == 503  # whichever process accepted it: 3 are open on the port
        over.close()
        held.pop().close()
        # a slot freed in whichever process held it: a new connection is served (once that process has counted it)
        for _ in range(200):
            conn = _connect(daemon.http_url)
            status = _status(conn)
            if status == 200:
                held.append(conn)
                break
            conn.close()
        else:
            raise AssertionError("no connection served after one of three closed")
    finally:
        for conn in held:
            conn.close()
        assert daemon.stop() == 0, daemon.log()
