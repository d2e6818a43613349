"""gpud's gRPC server: listens, holds the connections, stops gracefully (GOAWAY, the open calls finish within the
grace, then the rest are answered UNAVAILABLE)."""
from __future__ import annotations

import asyncio
import logging
import socket

from gpud.api.grpcwire.calls import Method
from gpud.api.limits import SharedCount
from gpud.api.grpcwire.connection import GrpcConnection
from gpud.api.grpcwire.keepalive import Keepalive

log = logging.getLogger("gpud.grpc")


class GrpcServer:
    def __init__(self, methods: dict[str, Method], *, max_message_bytes: int, max_metadata_bytes: int,
                 max_connections: int = 10000, keepalive: Keepalive = Keepalive(),
                 shared_connections: SharedCount | None = None):
        """`methods`: by path ("/package.Service/Method"). A connection over `max_connections` is closed at once
        (GOAWAY, REFUSED: the client may retry later), so that clients cannot take every descriptor. `keepalive`:
        keepalive PINGs, the client ping policy and idle connections (gpud.api.grpcwire.keepalive), for the
        connections accepted from then on. `shared_connections` (a front-end process's): the cap counts every
        process's connections on the port."""
        self.methods = methods
        self.max_connections = max_connections
        self.keepalive = keepalive
        self.max_message_bytes = max_message_bytes
        self.max_metadata_bytes = max_metadata_bytes
        self.connections: set[GrpcConnection] = set()
        self.shared_connections = shared_connections
        self.stopping = False
        self.bound_port = 0
        self._server: asyncio.base_events.Server | None = None

    def open_connections(self) -> int:
        """The connections the cap counts: this server's, or every process's on the port."""
        return len(self.connections) if self.shared_connections is None else self.shared_connections.total()

    def counted(self) -> None:
        """This server's connections changed: the other processes on the port see its count."""
        if self.shared_connections is not None:
            self.shared_connections.set(len(self.connections))

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> None:
        """Listen on host:port (0: an ephemeral port; `bound_port` says which). OSError when it cannot bind."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: GrpcConnection(self), host, port, backlog=1024,
                                                reuse_port=reuse_port or None)
        self.bound_port = self._server.sockets[0].getsockname()[1]

    async def start_socket(self, listen: socket.socket) -> None:
        """Accept on a socket already bound and listening (a front-end process's, shared with its siblings)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: GrpcConnection(self), sock=listen, backlog=1024)
        self.bound_port = listen.getsockname()[1]

    async def stop(self, grace: float | None) -> None:
        """Stop accepting; the open calls get `grace` seconds (None: none) to finish, then are answered
        UNAVAILABLE and their connections closed. grpc.aio's Server.stop, in effect."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.go_away()
        if grace and self.connections:
            waits = [asyncio.ensure_future(c.idle.wait()) for c in list(self.connections)]
            _, pending = await asyncio.wait(waits, timeout=grace)
            for wait in pending:
                wait.cancel()
        for connection in list(self.connections):
            connection.abort()
        if self._server is not None:
            await self._server.wait_closed()
