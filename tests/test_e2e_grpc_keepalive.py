"""gRPC keepalive settings on the real daemon, with gRPC on the core's loop and in a front-end process: Triton's flags
and gpud's idle timeout reach the server that holds the connection."""
from __future__ import annotations

import pytest

from gpud.api.grpcwire import frames
from tests.daemon_harness import start_daemon
from tests.test_grpcwire import Raw

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("processes", ["0", "1"])
def test_the_idle_timeout_and_ping_policy_reach_the_server(tmp_path, processes):
    daemon = start_daemon(None, tmp_path, "--grpc-max-connection-idle-ms", "200",
                          "--grpc-http2-max-ping-strikes", "1", "--grpc-processes", processes,
                          "--placement-control", "off", node=None)
    try:
        idle = Raw(daemon.grpc_url)
        pings = Raw(daemon.grpc_url)
        for i in range(3):  # no call open: a first ping, strike 1, strike 2 > 1 (acknowledged, then sent away)
            pings.send(frames.frame(frames.PING, 0, 0, b"ping-%03d" % i))
            assert pings.until(frames.PING) is not None
        _, _, _, payload = pings.until(frames.GOAWAY)
        assert (frames.u32(payload, 4), payload[8:]) == (frames.ENHANCE_YOUR_CALM, b"too_many_pings")
        _, _, _, payload = idle.until(frames.GOAWAY)
        assert payload[8:] == b"connection idle"
    finally:
        assert daemon.stop() == 0, daemon.log()
