"""The admin socket (gpud --admin-socket): its file (mode 0660, a stale one replaced, a live one or a non-socket
refused), the HTTP API on it with admin actions needing no token, TCP refusing them unless a token is set, and
gpudctl reaching gpud through it. The daemon end to end: test_e2e_admin_socket.py."""
from __future__ import annotations

import asyncio
import os
import socket
import stat
import threading

import pytest

from gpud.executor.types import ErrorKind, InferenceError
from gpud.api.admin import AdminAuth
from gpud.api.http_api import start_http_server, start_http_unix_server
from gpud.api.unix_socket import bind_unix_socket
from gpud.cli.client import DEFAULT_URL, Endpoint, GpudUnreachable, endpoint, fetch_inspect, post_json
from tests.fake_core import FakeCore

TIMEOUT_S = 10
TOKEN = "s3cret-token-for-tests-0123456789"


class TestTheSocketFile:
    def test_created_0660_whatever_the_umask(self, tmp_path):
        path = str(tmp_path / "admin.sock")
        old = os.umask(0o000)  # the widest: bind alone would make it 0777
        try:
            sock = bind_unix_socket(path)
        finally:
            os.umask(old)
        try:
            st = os.stat(path)
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
            assert st.st_uid == os.getuid() and st.st_gid == os.getgid()
        finally:
            sock.close()

    def test_a_stale_socket_is_replaced(self, tmp_path):
        path = str(tmp_path / "admin.sock")
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(path)
        dead.close()  # the file stays, nobody listens: a gpud that died
        bind_unix_socket(path).close()

    def test_a_live_socket_is_refused_and_kept(self, tmp_path):
        path = str(tmp_path / "admin.sock")
        live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        live.bind(path)
        live.listen()
        try:
            with pytest.raises(OSError, match="is in use"):
                bind_unix_socket(path)
            assert os.path.exists(path)
        finally:
            live.close()

    def test_a_path_that_is_not_a_socket_is_refused_and_kept(self, tmp_path):
        path = tmp_path / "admin.sock"
        path.write_text("precious")
        with pytest.raises(OSError, match="exists and is not a socket"):
            bind_unix_socket(str(path))
        assert path.read_text() == "precious"

    def test_a_missing_directory_is_said(self, tmp_path):
        with pytest.raises(OSError, match=r"admin socket .*/missing/admin.sock: No such file or directory \(its "
                                          r"directory must exist"):
            bind_unix_socket(str(tmp_path / "missing" / "admin.sock"))

    def test_a_path_too_long_is_refused(self, tmp_path):
        with pytest.raises(OSError, match="longer than a unix socket path may be"):
            bind_unix_socket(str(tmp_path / ("x" * 120)))


class TestTcpWithASocket:
    def test_without_a_token_admin_actions_are_refused_and_the_socket_named(self):
        auth = AdminAuth(socket_path="/run/gpud/admin.sock")
        with pytest.raises(InferenceError) as exc:
            auth.check(None, "unloading model 'mlp'")
        assert exc.value.kind is ErrorKind.PERMISSION_DENIED
        assert "served only on the admin socket /run/gpud/admin.sock" in exc.value.message
        assert "--admin-token-file" in exc.value.message
        with pytest.raises(InferenceError):  # a token does not help: none is set
            auth.check(f"Bearer {TOKEN}", "unloading model 'mlp'")

    def test_with_a_token_too_they_need_it(self):
        auth = AdminAuth(TOKEN, socket_path="/run/gpud/admin.sock")
        auth.check(f"Bearer {TOKEN}", "loading")
        with pytest.raises(InferenceError) as exc:
            auth.check(None, "loading")
        assert exc.value.kind is ErrorKind.UNAUTHENTICATED


class TestNeitherTokenNorSocket:
    @pytest.mark.parametrize("peer, allowed", [
        ("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("::ffff:127.0.0.1", True),  # loopback, mapped too
        ("", True),  # not a network client
        ("10.0.0.7", False), ("192.168.1.20", False), ("2001:db8::1", False), ("::ffff:10.0.0.7", False),
        ("not-an-address", False),
    ])
    def test_only_loopback_clients_unless_opened(self, peer, allowed):
        auth = AdminAuth()
        if allowed:
            auth.check(None, "applying a placement", peer)
        else:
            with pytest.raises(InferenceError) as exc:
                auth.check(None, "applying a placement", peer)
            assert exc.value.kind is ErrorKind.PERMISSION_DENIED
            assert f"applying a placement from {peer} is refused" in exc.value.message
            assert "--admin-token-file" in exc.value.message and "--admin-open" in exc.value.message
        AdminAuth(open_to_network=True).check(None, "applying a placement", peer)  # --admin-open: from anywhere
        AdminAuth(TOKEN).check(f"Bearer {TOKEN}", "applying a placement", peer)  # a token: from anywhere

    @pytest.mark.parametrize("peer, host", [
        ("ipv4:10.1.2.3:5123", "10.1.2.3"), ("ipv6:[::1]:5123", "::1"), ("ipv6:[2001:db8::1]:80", "2001:db8::1"),
        ("unix:/run/gpud/grpc.sock", ""), ("", ""),
    ])
    def test_the_grpc_peer_string_is_read(self, peer, host):
        from gpud.api.admin import grpc_peer_host

        assert grpc_peer_host(peer) == host

    def test_the_http_server_hands_the_peer_address_to_the_check(self):
        # What a route sees as the request's peer is the connection's address.
        from gpud.api.http_server import HttpServer

        seen: list[str] = []

        def handler(request, respond):
            seen.append(request.peer)
            respond(200, b"{}")

        async def scenario() -> None:
            server = HttpServer(handler)
            port = await server.start("127.0.0.1", 0)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n")
            await writer.drain()
            await asyncio.wait_for(reader.readuntil(b"{}"), 10)
            writer.close()
            await server.close(1.0)

        asyncio.run(scenario())
        assert seen == ["127.0.0.1"]


class Servers:
    """The HTTP API on TCP (with the socket's policy) and on the admin socket, on one loop in a thread."""

    def __init__(self, core: FakeCore, path: str, token: str | None = None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start():
            tcp, port = await start_http_server(core, "127.0.0.1", 0, admin=AdminAuth(token, socket_path=path))
            return tcp, port, await start_http_unix_server(core, path)
        self.tcp, port, self.unix = asyncio.run_coroutine_threadsafe(start(), self.loop).result(TIMEOUT_S)
        self.tcp_endpoint = Endpoint(f"http://127.0.0.1:{port}")
        self.socket_endpoint = Endpoint(socket_path=path)

    def stop(self) -> None:
        async def close():
            await self.tcp.close(1.0)
            await self.unix.close(1.0)
        asyncio.run_coroutine_threadsafe(close(), self.loop).result(TIMEOUT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT_S)
        self.loop.close()


@pytest.mark.parametrize("token", [None, TOKEN])
def test_admin_actions_on_the_socket_need_no_token_over_tcp_they_are_refused_or_need_one(tmp_path, token):
    core = FakeCore()
    path = str(tmp_path / "admin.sock")
    servers = Servers(core, path, token)
    try:
        name = next(iter(core.models))
        # reads work on both
        assert fetch_inspect(servers.socket_endpoint)["models"] == fetch_inspect(servers.tcp_endpoint)["models"]
        # over TCP: refused (no token) or needs the token
        with pytest.raises(GpudUnreachable, match="HTTP 403" if token is None else "HTTP 401"):
            post_json(servers.tcp_endpoint, f"/v2/repository/models/{name}/unload", {})
        assert core.models[name].ready
        # over the socket: no token needed
        post_json(servers.socket_endpoint, f"/v2/repository/models/{name}/unload", {})
        assert not core.models[name].ready
        if token is not None:
            token_file = tmp_path / "token"
            token_file.write_text(TOKEN)
            post_json(servers.tcp_endpoint, f"/v2/repository/models/{name}/load", {}, token_file=str(token_file))
            assert core.models[name].ready
    finally:
        servers.stop()
    assert not os.path.exists(path)  # removed at close


def test_gpudctl_says_when_the_socket_cannot_be_used(tmp_path):
    with pytest.raises(GpudUnreachable, match=r"cannot reach gpud at unix socket .*missing.sock.*may you use the"):
        fetch_inspect(Endpoint(socket_path=str(tmp_path / "missing.sock")))


@pytest.mark.parametrize("url, sock, env, expected", [
    (None, None, {}, Endpoint(DEFAULT_URL)),
    ("host:9000", None, {}, Endpoint("http://host:9000")),
    (None, "/run/gpud/admin.sock", {}, Endpoint(socket_path="/run/gpud/admin.sock")),
    (None, None, {"GPUD_ADMIN_SOCKET": "/s"}, Endpoint(socket_path="/s")),
    (None, None, {"GPUD_URL": "h:1"}, Endpoint("http://h:1")),
    (None, None, {"GPUD_URL": "h:1", "GPUD_ADMIN_SOCKET": "/s"}, Endpoint(socket_path="/s")),
    ("host:9000", None, {"GPUD_ADMIN_SOCKET": "/s"}, Endpoint("http://host:9000")),  # a flag wins
    ("host:9000", "/x", {}, Endpoint(socket_path="/x")),
])
def test_where_gpudctl_looks(monkeypatch, url, sock, env, expected):
    monkeypatch.delenv("GPUD_URL", raising=False)
    monkeypatch.delenv("GPUD_ADMIN_SOCKET", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert endpoint(url, sock) == expected
