"""--grpc-max-connections on the real daemon, with gRPC on the core's loop and in a front-end process: a connection
over the cap is closed with GOAWAY while the others serve, and a SIGHUP reload raises the cap live."""
from __future__ import annotations

import signal

import pytest
import yaml

from gpud.api.grpcwire import frames
from tests.daemon_harness import GRPC_SERVER, start_daemon, wait_for
from tests.test_grpcwire import Raw

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(GRPC_SERVER != "gpud", reason="the cap is gpud's gRPC server's (grpcio's has none)")]


def _served(url: str) -> bool:
    """Whether a new connection is served (its PING answered) rather than sent away (GOAWAY, or closed before the
    client's preface is even sent)."""
    raw = None
    try:
        raw = Raw(url)
        raw.send(frames.frame(frames.PING, 0, 0, b"cap-test"))
        while (f := raw.read_frame()) is not None:
            if f[0] == frames.PING:
                return True
            if f[0] == frames.GOAWAY:
                return False
        return False
    except (BrokenPipeError, ConnectionResetError):
        return False
    finally:
        if raw is not None:
            raw.sock.close()


@pytest.mark.parametrize("processes", ["0", "1", "2"])  # 2: the cap counts both processes' connections
def test_the_cap_refuses_a_connection_over_it_and_a_reload_raises_it(tmp_path, processes):
    settings = tmp_path / "gpud.yaml"
    settings.write_text(yaml.safe_dump({"grpc_max_connections": 1}))
    daemon = start_daemon(None, tmp_path, "--config", str(settings), "--grpc-processes", processes,
                          "--placement-control", "off", node=None)
    try:
        held = Raw(daemon.grpc_url)  # takes the one connection allowed
        held.send(frames.frame(frames.PING, 0, 0, b"held...."))
        assert held.until(frames.PING) is not None
        assert not _served(daemon.grpc_url)
        settings.write_text(yaml.safe_dump({"grpc_max_connections": 2}))
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: daemon.inspect()["reload"]["last"] is not None, 60, "the reload to finish")
        assert daemon.inspect()["reload"]["last"]["applied"] == ["grpc_max_connections 1 -> 2"]
        # a front-end process hears of the new cap over its link: served once it has
        wait_for(lambda: _served(daemon.grpc_url), 30, "a second connection to be served")
        held.sock.close()
    finally:
        assert daemon.stop() == 0, daemon.log()
