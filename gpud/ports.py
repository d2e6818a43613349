"""Are the daemon's ports free? Checked before any model loads, so that a port in use fails the start at once (loading
a node's models can take minutes) with one line that names it.

Each configured port is bound and listened on as the servers will (SO_REUSEADDR, as asyncio's servers and gRPC set
it: a port left in TIME_WAIT by the previous run is free), then released; the servers bind it again once the models
are loaded. A process that takes the port in between is still found then, later.
"""
from __future__ import annotations

import errno
import socket
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Listener:
    what: str  # "HTTP", "gRPC", "metrics": who the port is for
    address: str
    port: int  # 0: any free port (never in use)
    flag: str  # the option that sets it, for the error message

    @property
    def where(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


def check_ports_free(listeners: Sequence[Listener]) -> None:
    """OSError naming the first listener whose port is taken (by another process, or by another of `listeners`)."""
    seen: dict[tuple[str, int], Listener] = {}
    for li in listeners:
        if li.port == 0:
            continue
        other = seen.get((li.address, li.port))
        if other is not None:
            raise OSError(errno.EADDRINUSE, f"{li.what} and {other.what} are both set to port {li.where} "
                                            f"({other.flag}, {li.flag})")
        seen[(li.address, li.port)] = li
        try:
            _try_bind(li.address, li.port)
        except OSError as exc:
            why = "in use" if exc.errno == errno.EADDRINUSE else f"not available ({exc.strerror or exc})"
            raise OSError(exc.errno, f"{li.what} port {li.where} is {why}: free it or choose another with "
                                     f"{li.flag}") from None


def _try_bind(address: str, port: int) -> None:
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(address or None, port, socket.AF_UNSPEC,
                                                              socket.SOCK_STREAM, 0, socket.AI_PASSIVE):
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio's servers: an IPv6 address is bound alone
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(sockaddr)
            s.listen(1)
