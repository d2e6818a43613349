"""Who may use the admin actions: those that change what gpud serves (the repository API's load and unload,
`POST /v2/gpud/placement`, client shared-memory registration) or what it logs (the logging extension's changes).
Reading, inference and health never need anything.

- `--admin-token-file`: they need `Authorization: Bearer <token>` (HTTP header, gRPC metadata).
- `--admin-socket`: they are served on a unix socket whose file permissions decide who may use it (no token there);
  over TCP (HTTP and gRPC) they are then refused, unless a token is also set, which they then need.
- neither: only from the loopback address (a process on this machine), unless `--admin-open` opens them to any
  address (the model control mode still decides whether load/unload work). gpud listens on all addresses by
  default; a placement can move or remove every instance, so the network gets no admin action without a token.
"""
from __future__ import annotations

import hmac
import ipaddress

from gpud.executor.types import ErrorKind, InferenceError


def read_token_file(path: str) -> str:
    """The token in the file (surrounding whitespace dropped); ValueError for an unreadable or empty file."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"admin token file {path}: {exc}") from None
    if len(token) < 16:
        raise ValueError(f"admin token file {path}: the token must be at least 16 characters (got {len(token)})")
    return token


class AdminAuth:
    """The check of one listener. `socket_path`: the admin socket served beside this (TCP) listener: without a
    token, admin actions are refused here and the message says where they are served."""

    def __init__(self, token: str | None = None, *, socket_path: str | None = None, open_to_network: bool = False):
        self._token = token.encode() if token else None
        self.socket_path = socket_path
        self.open_to_network = open_to_network  # --admin-open: no token and no socket, from any address

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def set_token(self, token: str | None) -> None:
        """A new token (a reload read the token file again): the old one stops working at once."""
        self._token = token.encode() if token else None

    def describe(self) -> str:
        """For the start-up log: what an admin action needs on this listener."""
        if self._token is not None:
            return "need the admin token"
        if self.socket_path:
            return f"are served only on the admin socket {self.socket_path}"
        if self.open_to_network:
            return "are open to any address (--admin-open)"
        return "are open on the loopback address only (--admin-token-file or --admin-socket for others)"

    def check(self, authorization: str | None, action: str, peer: str | None = None) -> None:
        """Raise UNAUTHENTICATED unless `authorization` ("Bearer <token>") carries the token, PERMISSION_DENIED when
        admin actions are served only on the admin socket, or (neither set) when `peer`, the client's address, is not
        a loopback one and --admin-open is not given. `peer` None or "": not a network client (the admin socket)."""
        if self._token is None:
            if self.socket_path:
                raise InferenceError(ErrorKind.PERMISSION_DENIED,
                                     f"{action} is served only on the admin socket {self.socket_path} (gpudctl "
                                     "--socket or GPUD_ADMIN_SOCKET); start gpud with --admin-token-file as well to "
                                     "allow it over TCP with the token")
            if peer and not self.open_to_network and not is_loopback(peer):
                raise InferenceError(ErrorKind.PERMISSION_DENIED,
                                     f"{action} from {peer} is refused: without --admin-token-file gpud takes admin "
                                     "actions from this machine (the loopback address) only; start it with "
                                     "--admin-token-file (or --admin-socket), or --admin-open to take them from any "
                                     "address without a token")
            return
        scheme, _, given = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
            raise InferenceError(ErrorKind.UNAUTHENTICATED,
                                 f"{action} needs the admin token: send 'Authorization: Bearer <token>' (gpudctl: "
                                 "--token-file or GPUD_ADMIN_TOKEN_FILE)")


def is_loopback(host: str) -> bool:
    """Whether `host` (an IPv4 or IPv6 address, IPv4-mapped ones included) is a loopback address."""
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def grpc_peer_host(peer: str) -> str:
    """The address in a gRPC peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/path" -> "")."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    return ""
