"""gRPC keepalive, the client ping policy and idle connections (gpud.api.grpcwire.keepalive), with Triton's flags:
the policy as a pure function, gpud's server against raw HTTP/2 frames (the ping-policy and idle rules against
grpcio's server too, which applies gRPC core's: the same frames must get the same answers), grpcio's client, and the
settings.

Timers are tens of milliseconds; the tests wait for frames with the socket's bounded timeout, never by sleeping. A
check that something does NOT happen reads for several periods: a slow machine can only make it pass more easily.
"""
from __future__ import annotations

import subprocess
import sys

import hpack
import pytest

grpc = pytest.importorskip("grpc")

from gpud.api.grpcwire import frames  # noqa: E402
from gpud.api.grpcwire.keepalive import Keepalive, PingStrikes  # noqa: E402
from gpud.main import build_parser, resolve_settings  # noqa: E402
from gpud.settings import grpc_keepalive  # noqa: E402
from tests.daemon_harness import ROOT  # noqa: E402
from tests.test_grpcwire import GRPC_HEADERS, TIMEOUT_S, Raw, ServerThread, _framed, _unary  # noqa: E402

Frame = tuple[int, int, int, bytes]


# --- the ping policy, pure -------------------------------------------------------------------------------------------

class TestPingStrikes:
    """gRPC core's Chttp2PingAbusePolicy: a strike is a PING sooner than the interval after the previous one."""

    @pytest.mark.parametrize("min_ms, strikes, idle, times_s, over", [
        # 300 s apart: none is a strike
        (300_000, 2, False, [0, 300, 600, 900], [False] * 4),
        # 1 s apart: pings 2 and 3 are strikes 1 and 2; ping 4 is strike 3 > 2
        (300_000, 2, False, [0, 1, 2, 3], [False, False, False, True]),
        # exactly the interval after the previous: allowed (core's next_allowed <= now)
        (1000, 1, False, [0, 1, 2, 3], [False] * 4),
        # interval 0 with a call open: never a strike
        (0, 2, False, [0, 0, 0, 0, 0], [False] * 5),
        # no call open: two hours, whatever the setting (RFC 1122's TCP keepalive)
        (0, 2, True, [0, 1, 2, 3], [False, False, False, True]),
        (0, 2, True, [0, 7200, 14400], [False] * 3),
        # 0 strikes: no limit
        (300_000, 0, False, [0, 0, 0, 0, 0, 0], [False] * 6),
    ])
    def test_strikes(self, min_ms, strikes, idle, times_s, over):
        policy = PingStrikes(Keepalive(min_recv_ping_interval_without_data_ms=min_ms, max_ping_strikes=strikes))
        assert [policy.received(t, idle) for t in times_s] == over

    def test_data_sent_forgives_the_strikes(self):
        policy = PingStrikes(Keepalive())
        assert [policy.received(t, False) for t in (0, 1, 2)] == [False] * 3  # strikes 1 and 2
        policy.forgive()
        # 2 + 3 = 5 > 2 without the pardon; with it: a first ping, then strikes 1 and 2
        assert [policy.received(t, False) for t in (3, 4, 5)] == [False] * 3
        assert policy.received(6, False)


def test_grpcio_options_are_gRPC_cores_channel_arguments():
    assert dict(Keepalive().grpc_options()) == {
        "grpc.keepalive_time_ms": 7_200_000, "grpc.keepalive_timeout_ms": 20_000,
        "grpc.keepalive_permit_without_calls": 0, "grpc.http2.max_pings_without_data": 2,
        "grpc.http2.min_ping_interval_without_data_ms": 300_000, "grpc.http2.max_ping_strikes": 2}
    assert ("grpc.max_connection_idle_ms", 100) in Keepalive(max_connection_idle_ms=100).grpc_options()


# --- raw HTTP/2 against the server -----------------------------------------------------------------------------------

def _headers(path: str) -> list[tuple[str, str]]:
    return [(k, path if k == ":path" else v) for k, v in GRPC_HEADERS]


def _call(raw: _Raw, stream_id: int, method: str = "/t.S/Echo", message: bytes = b"x") -> None:
    raw.send(raw.headers(stream_id, _headers(method))
             + frames.frame(frames.DATA, frames.END_STREAM, stream_id, _framed(message)))


class _Raw(Raw):
    """A raw connection that keeps its HPACK decoder: grpcio's server indexes what it sends."""

    def __init__(self, url: str):
        super().__init__(url)
        self.decoder = hpack.Decoder()


def _answer(raw: _Raw, stream_id: int) -> list[tuple[str, str]]:
    """The call's trailers (or trailers-only answer), ACKing the server's PINGs on the way."""
    decoder = raw.decoder
    while (f := raw.read_frame()) is not None:
        kind, flags, sid, payload = f
        if kind == frames.PING and not flags & frames.ACK:
            raw.send(frames.frame(frames.PING, frames.ACK, 0, payload))
        elif kind == frames.HEADERS:
            block = decoder.decode(payload)
            if sid == stream_id and flags & frames.END_STREAM:
                return block
        assert kind != frames.GOAWAY, f
    raise AssertionError("the connection closed before the answer")


def _server_ping(raw: _Raw) -> bytes:
    """The data of the server's next PING (not an ACK)."""
    while (f := raw.read_frame()) is not None:
        assert f[0] != frames.GOAWAY, f
        if f[0] == frames.PING and not f[1] & frames.ACK:
            return f[3]
    raise AssertionError("the connection closed without a PING")


def _ping(raw: _Raw, data: bytes = b"pingpong") -> Frame:
    """Send a PING; its ACK, or the GOAWAY that came instead."""
    raw.send(frames.frame(frames.PING, 0, 0, data))
    while (f := raw.read_frame()) is not None:
        if f[0] == frames.GOAWAY or (f[0] == frames.PING and f[1] & frames.ACK and f[3] == data):
            return f
    raise AssertionError("the connection closed without an answer to a PING")


def _goaway_and_close(raw: _Raw) -> tuple[int, bytes]:
    """The GOAWAY's error code and debug data; the connection must close after it."""
    f = raw.until(frames.GOAWAY)
    assert f is not None, "closed without GOAWAY"
    payload = f[3]
    try:
        while raw.read_frame() is not None:
            pass
    except ConnectionResetError:
        pass
    return frames.u32(payload, 4), payload[8:]


def _frames_within(raw: _Raw, seconds: float) -> list[Frame]:
    """Every frame that comes within `seconds` (to check that something does not come)."""
    raw.sock.settimeout(seconds)
    out: list[Frame] = []
    try:
        while (f := raw.read_frame()) is not None:
            out.append(f)
    except TimeoutError:
        pass
    finally:
        raw.sock.settimeout(TIMEOUT_S)
    return out


def _server_pings(seen: list[Frame]) -> list[Frame]:
    return [f for f in seen if f[0] == frames.PING and not f[1] & frames.ACK]


@pytest.fixture
def make_server():
    servers: list[ServerThread] = []

    def make(**keepalive) -> ServerThread:
        servers.append(ServerThread(keepalive=Keepalive(**keepalive)))
        return servers[-1]
    yield make
    for s in servers:
        s.close()


def _release(server: ServerThread) -> None:
    server.loop.call_soon_threadsafe(server.handlers.release.set)


class TestKeepalive:
    def test_a_connection_with_a_call_open_is_pinged_and_closed_when_no_ack_comes(self, make_server):
        server = make_server(time_ms=50, timeout_ms=100)
        raw = _Raw(server.url)
        _call(raw, 1, "/t.S/Wait")
        assert server.handlers.started.wait(TIMEOUT_S)
        assert len(_server_ping(raw)) == 8  # not acknowledged
        assert _goaway_and_close(raw) == (frames.NO_ERROR, b"keepalive watchdog timeout")
        assert server.handlers.cancelled.wait(TIMEOUT_S)  # the dead client's call is stopped

    def test_acknowledged_pings_keep_the_connection_and_its_call(self, make_server):
        server = make_server(time_ms=30, timeout_ms=1000, max_pings_without_data=0)
        raw = _Raw(server.url)
        _call(raw, 1, "/t.S/Wait")
        assert server.handlers.started.wait(TIMEOUT_S)
        for _ in range(5):  # 0 pings without data: no limit
            raw.send(frames.frame(frames.PING, frames.ACK, 0, _server_ping(raw)))
        _release(server)
        assert ("grpc-status", "0") in _answer(raw, 1)
        assert not server.handlers.cancelled.is_set()

    def test_no_keepalive_ping_without_a_call_unless_permitted(self, make_server):
        quiet = make_server(time_ms=30, timeout_ms=1000, max_pings_without_data=0)
        raw = _Raw(quiet.url)
        assert _server_pings(_frames_within(raw, 0.4)) == []  # 13 periods without a call
        pinging = make_server(time_ms=30, timeout_ms=1000, permit_without_calls=True, max_pings_without_data=0)
        raw = _Raw(pinging.url)
        for _ in range(3):
            raw.send(frames.frame(frames.PING, frames.ACK, 0, _server_ping(raw)))

    def test_at_most_max_pings_without_data_until_data_is_sent(self, make_server):
        server = make_server(time_ms=30, timeout_ms=1000)  # max_pings_without_data: 2 (the default)
        raw = _Raw(server.url)
        _call(raw, 1, "/t.S/Wait")
        assert server.handlers.started.wait(TIMEOUT_S)
        for _ in range(2):
            raw.send(frames.frame(frames.PING, frames.ACK, 0, _server_ping(raw)))
        assert _server_pings(_frames_within(raw, 0.4)) == []  # no third while nothing else is sent
        _call(raw, 3)  # answered: HEADERS and DATA sent, the pings may go again
        assert ("grpc-status", "0") in _answer(raw, 3)
        raw.send(frames.frame(frames.PING, frames.ACK, 0, _server_ping(raw)))
        _release(server)
        assert ("grpc-status", "0") in _answer(raw, 1)


# --- the client ping policy and idle connections, on both servers ----------------------------------------------------

class _Target:
    """A server under test and a unary method of it that answers at once."""

    def __init__(self, implementation: str, keepalive: Keepalive):
        self.implementation = implementation
        if implementation == "gpud":
            self._server = ServerThread(keepalive=keepalive)
            self.path = "/t.S/Echo"
        else:
            from tests.fake_core import FakeCore
            from tests.test_grpc_api import ServerThread as ApiServerThread

            self._server = ApiServerThread(FakeCore(), implementation="grpcio", keepalive=keepalive)
            self.path = "/inference.GRPCInferenceService/ServerLive"
        self.url = self._server.url

    def call(self, raw: _Raw, stream_id: int) -> None:
        _call(raw, stream_id, self.path, b"" if self.implementation == "grpcio" else b"x")
        assert ("grpc-status", "0") in _answer(raw, stream_id)

    def close(self) -> None:
        self._server.close()


@pytest.fixture(params=["gpud", "grpcio"])
def target(request):
    targets: list[_Target] = []

    def make(**keepalive) -> _Target:
        targets.append(_Target(request.param, Keepalive(**keepalive)))
        return targets[-1]
    yield make
    for t in targets:
        t.close()


class TestPingPolicy:
    def test_a_client_pinging_too_often_gets_goaway_enhance_your_calm(self, target):
        server = target(min_recv_ping_interval_without_data_ms=60_000, max_ping_strikes=2)
        for call_first in (True, False):
            raw = _Raw(server.url)
            if call_first:
                server.call(raw, 1)  # the pings come after its answer: no data between them
            for i in range(3):  # a first ping, then strikes 1 and 2
                assert _ping(raw, b"ping-%03d" % i)[0] == frames.PING
            assert _ping(raw, b"ping-003")[0] == frames.PING  # strike 3: acknowledged, then sent away (core's order)
            assert _goaway_and_close(raw) == (frames.ENHANCE_YOUR_CALM, b"too_many_pings")

    def test_pings_while_data_flows_are_no_strikes(self, target):
        server = target(min_recv_ping_interval_without_data_ms=60_000, max_ping_strikes=1)
        raw = _Raw(server.url)
        for i in range(6):
            server.call(raw, 2 * i + 1)  # the server sends HEADERS and DATA between the pings
            assert _ping(raw, b"ping-%03d" % i)[0] == frames.PING
            assert _ping(raw, b"pong-%03d" % i)[0] == frames.PING  # one strike: within the limit of 1

    def test_no_call_open_means_two_hours_unless_permitted(self, target):
        strict = target(min_recv_ping_interval_without_data_ms=0)
        raw = _Raw(strict.url)
        for i in range(4):
            _ping(raw, b"ping-%03d" % i)
        assert _goaway_and_close(raw) == (frames.ENHANCE_YOUR_CALM, b"too_many_pings")
        permitted = target(min_recv_ping_interval_without_data_ms=0, permit_without_calls=True)
        raw = _Raw(permitted.url)
        for i in range(10):
            assert _ping(raw, b"ping-%03d" % i)[0] == frames.PING


class TestIdle:
    def test_a_connection_without_a_call_is_closed_with_goaway_no_error(self, target):
        server = target(max_connection_idle_ms=100)
        raw = _Raw(server.url)
        server.call(raw, 1)
        code, debug = _goaway_and_close(raw)
        assert debug == b"connection idle"
        # gpud's is graceful (NO_ERROR: the client may reconnect at once); grpcio 1.85's core sends INTERNAL_ERROR
        assert code == (frames.NO_ERROR if server.implementation == "gpud" else frames.INTERNAL_ERROR)

    def test_a_connection_with_a_call_open_is_not_idle(self, make_server):
        server = make_server(max_connection_idle_ms=50)
        raw = _Raw(server.url)
        _call(raw, 1, "/t.S/Wait")
        assert server.handlers.started.wait(TIMEOUT_S)
        assert not [f for f in _frames_within(raw, 0.4) if f[0] == frames.GOAWAY]  # 8 periods with the call open
        _release(server)
        assert ("grpc-status", "0") in _answer(raw, 1)
        assert _goaway_and_close(raw) == (frames.NO_ERROR, b"connection idle")  # idle from then on


# --- grpcio's client -------------------------------------------------------------------------------------------------

TRITONCLIENT_KEEPALIVE = [  # tritonclient.grpc.KeepAliveOptions() as channel options: what Triton's clients send
    ("grpc.keepalive_time_ms", 2**31 - 1), ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 0), ("grpc.http2.max_pings_without_data", 2)]


def test_grpcio_clients_with_keepalive_are_served_under_tritons_defaults(make_server):
    server = make_server()
    for options in (TRITONCLIENT_KEEPALIVE,
                    # pinging every 10 s with calls open, as gRPC's doc suggests for a client behind a proxy
                    [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_permit_without_calls", 0)]):
        with grpc.insecure_channel(server.url, options=options) as channel:
            echo = _unary(channel, "Echo")
            for i in range(200):
                assert echo(b"%d" % i, timeout=TIMEOUT_S) == b"%d" % i
            futures = [echo.future(b"%d" % i, timeout=TIMEOUT_S) for i in range(100)]
            assert [f.result() for f in futures] == [b"%d" % i for i in range(100)]
            assert len(server.server.connections) == 1  # one connection all along: never sent away


def test_grpcio_client_acknowledges_the_servers_keepalive_pings(make_server):
    server = make_server(time_ms=30, timeout_ms=2000, permit_without_calls=True, max_pings_without_data=0)
    with grpc.insecure_channel(server.url, options=TRITONCLIENT_KEEPALIVE) as channel:
        wait = _unary(channel, "Wait").future(b"", timeout=TIMEOUT_S)
        assert server.handlers.started.wait(TIMEOUT_S)
        assert not server.handlers.cancelled.wait(0.5)  # 16 keepalive periods: each PING acknowledged
        _release(server)
        assert wait.result() == b"released"
        assert _unary(channel, "Echo")(b"again", timeout=TIMEOUT_S) == b"again"
        assert len(server.server.connections) == 1


def test_tritonclient_with_its_keepalive_options_on_gpuds_inference_service():
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tests.fake_core import FakeCore
    from tests.test_grpc_api import ServerThread as ApiServerThread

    server = ApiServerThread(FakeCore(), implementation="gpud", keepalive=Keepalive())  # Triton's defaults
    try:
        with grpcclient.InferenceServerClient(url=server.url, keepalive_options=grpcclient.KeepAliveOptions()) as c:
            for _ in range(50):
                assert c.is_server_live() and c.is_server_ready()
            assert len(server.server.connections) == 1
    finally:
        server.close()


# --- settings --------------------------------------------------------------------------------------------------------

class TestSettings:
    def test_defaults_are_tritons(self):
        s = resolve_settings(build_parser().parse_args([]))
        assert grpc_keepalive(s) == Keepalive(time_ms=7_200_000, timeout_ms=20_000, permit_without_calls=False,
                                              max_pings_without_data=2,
                                              min_recv_ping_interval_without_data_ms=300_000, max_ping_strikes=2,
                                              max_connection_idle_ms=0)

    def test_tritons_flags_and_the_config_file(self, tmp_path):
        s = resolve_settings(build_parser().parse_args([
            "--grpc-keepalive-time", "10000", "--grpc-keepalive-timeout", "500",
            "--grpc-keepalive-permit-without-calls", "true", "--grpc-http2-max-pings-without-data", "0",
            "--grpc-http2-min-recv-ping-interval-without-data", "5000", "--grpc-http2-max-ping-strikes", "0",
            "--grpc-max-connection-idle-ms", "60000"]))
        assert grpc_keepalive(s) == Keepalive(10_000, 500, True, 0, 5000, 0, 60_000)
        assert resolve_settings(build_parser().parse_args(["--grpc-keepalive-permit-without-calls"])) \
            .grpc_keepalive_permit_without_calls  # Triton's bool flag, bare
        assert resolve_settings(build_parser().parse_args(["--grpc-keepalive-time-ms", "7"])).grpc_keepalive_time_ms \
            == 7  # the settings' own name works as a flag too
        f = tmp_path / "gpud.yaml"
        f.write_text("grpc_keepalive_time_ms: 60000\ngrpc-http2-max-ping-strikes: 5\n"
                     "grpc_keepalive_permit_without_calls: true\n")
        s = resolve_settings(build_parser().parse_args(["--config", str(f), "--grpc-http2-max-ping-strikes", "3"]))
        assert (s.grpc_keepalive_time_ms, s.grpc_http2_max_ping_strikes, s.grpc_keepalive_permit_without_calls) == \
            (60_000, 3, True)

    @pytest.mark.parametrize("argv, message", [
        (["--grpc-keepalive-time", "0"], "grpc_keepalive_time_ms must be 1 to 2147483647 (milliseconds), got 0"),
        (["--grpc-keepalive-timeout", "-5"], "grpc_keepalive_timeout_ms must be 1 to 2147483647"),
        (["--grpc-keepalive-time", "2147483648"], "grpc_keepalive_time_ms must be 1 to 2147483647"),
        (["--grpc-http2-max-pings-without-data", "-1"], "grpc_http2_max_pings_without_data must be 0 to 2147483647"),
        (["--grpc-http2-min-recv-ping-interval-without-data", "-1"],
         "grpc_http2_min_recv_ping_interval_without_data_ms must be 0 to"),
        (["--grpc-http2-max-ping-strikes", "-2"], "grpc_http2_max_ping_strikes must be 0 to"),
        (["--grpc-max-connection-idle-ms", "-1"], "grpc_max_connection_idle_ms must be 0 to"),
    ])
    def test_bad_values_are_refused(self, argv, message):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            resolve_settings(build_parser().parse_args(argv))

    def test_the_daemon_exits_2_and_help_lists_the_flags(self):
        out = subprocess.run([sys.executable, "-m", "gpud.main", "--grpc-http2-max-ping-strikes", "-1"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 2 and "grpc_http2_max_ping_strikes must be 0 to" in out.stderr
        text = build_parser().format_help()
        for flag in ("--grpc-keepalive-time", "--grpc-keepalive-timeout", "--grpc-keepalive-permit-without-calls",
                     "--grpc-http2-max-pings-without-data", "--grpc-http2-min-recv-ping-interval-without-data",
                     "--grpc-http2-max-ping-strikes", "--grpc-max-connection-idle-ms"):
            assert flag in text
