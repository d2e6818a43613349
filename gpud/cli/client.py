"""How gpudctl reaches a running gpud: over HTTP (`--url`, `GPUD_URL`) or over its admin socket (`--socket`,
`GPUD_ADMIN_SOCKET`: gpud --admin-socket, where admin actions need no token), and errors a person can act on."""
from __future__ import annotations

import http.client
import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

DEFAULT_URL = "http://127.0.0.1:8000"
ENDPOINT_HELP = (f"default: $GPUD_ADMIN_SOCKET, else $GPUD_URL, else {DEFAULT_URL}")


class GpudUnreachable(RuntimeError):
    """gpud could not be reached or refused the call; the message says which and what to check."""


@dataclass(frozen=True)
class Endpoint:
    """Where gpud listens: a unix socket path, or an HTTP base URL."""
    url: str = DEFAULT_URL
    socket_path: str | None = None

    def __str__(self) -> str:
        return f"unix socket {self.socket_path}" if self.socket_path else self.url

    @property
    def chosen(self) -> bool:
        """Named by a flag or the environment, rather than the default."""
        return self.socket_path is not None or self.url != DEFAULT_URL


def base_url(url: str | None = None) -> str:
    """`url`, else $GPUD_URL, else DEFAULT_URL; `host:port` gets http:// in front."""
    base = (url or os.environ.get("GPUD_URL") or DEFAULT_URL).rstrip("/")
    return base if "://" in base else "http://" + base


def endpoint(url: str | None = None, socket_path: str | None = None) -> Endpoint:
    """--socket, else --url, else $GPUD_ADMIN_SOCKET, else $GPUD_URL, else the default URL."""
    if socket_path:
        return Endpoint(socket_path=socket_path)
    if url:
        return Endpoint(base_url(url))
    if os.environ.get("GPUD_ADMIN_SOCKET"):
        return Endpoint(socket_path=os.environ["GPUD_ADMIN_SOCKET"])
    return Endpoint(base_url())


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _connection(ep: Endpoint, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    if ep.socket_path:
        return _UnixConnection(ep.socket_path, timeout_s), ""
    parts = urlsplit(ep.url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.netloc, timeout=timeout_s), parts.path.rstrip("/")


def request(ep: Endpoint, method: str, path: str, body: Any = None, *, timeout_s: float = 300.0,
            token_file: str | None = None) -> Any:
    """One call to gpud; its JSON answer (None for an empty one). A refusal raises GpudUnreachable with gpud's status
    and message; so does a gpud that cannot be reached, saying where it was looked for."""
    headers = {} if method != "POST" else \
        {"Content-Type": "application/json", **({} if ep.socket_path else admin_headers(token_file))}
    conn, prefix = _connection(ep, timeout_s)
    try:
        conn.request(method, prefix + path, body=None if body is None else json.dumps(body).encode(),
                     headers=headers)
        resp = conn.getresponse()
        status, data = resp.status, resp.read()
    except (OSError, http.client.HTTPException) as exc:
        hint = " (is it running, and may you use the socket? see --socket)" if ep.socket_path \
            else " (is it running? see --url)"
        raise GpudUnreachable(f"cannot reach gpud at {ep}: {getattr(exc, 'strerror', None) or exc}{hint}") \
            from None
    finally:
        conn.close()
    if status >= 400:
        try:
            message = json.loads(data).get("error", "")
        except (ValueError, AttributeError):
            message = data.decode(errors="replace")[:200]
        raise GpudUnreachable(f"gpud refused it (HTTP {status}): {message}")
    return json.loads(data) if data else None


def fetch_inspect(ep: Endpoint, timeout_s: float = 10.0) -> dict[str, Any]:
    """GET /v2/gpud/inspect."""
    return request(ep, "GET", "/v2/gpud/inspect", timeout_s=timeout_s)


def admin_headers(token_file: str | None = None) -> dict[str, str]:
    """The Authorization header for gpud's admin actions (gpud --admin-token-file): the token in `token_file`, else
    in $GPUD_ADMIN_TOKEN_FILE; none when neither is set."""
    path = token_file or os.environ.get("GPUD_ADMIN_TOKEN_FILE")
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return {"Authorization": f"Bearer {f.read().strip()}"}
    except OSError as exc:
        raise GpudUnreachable(f"cannot read the admin token file {path}: {exc.strerror or exc}") from None


def post_json(ep: Endpoint, path: str, body: Any, timeout_s: float = 300.0,
              token_file: str | None = None) -> Any:
    """POST a JSON body (with the admin token, if one is configured)."""
    return request(ep, "POST", path, body, timeout_s=timeout_s, token_file=token_file)


def add_endpoint_arguments(p: Any, what: str = "the running gpud") -> None:
    """--url, --socket and --token-file, the same for every command that talks to gpud."""
    p.add_argument("--url", default=None, help=f"the HTTP endpoint of {what} ({ENDPOINT_HELP})")
    p.add_argument("--socket", default=None, metavar="PATH",
                   help="gpud's admin socket (gpud --admin-socket; systemd: /run/gpud/admin.sock), where admin "
                        "actions need no token: who may use it is decided by the socket file's permissions")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="the admin token for loading, unloading, placing and changing the log settings over HTTP "
                        "when gpud has --admin-token-file (default $GPUD_ADMIN_TOKEN_FILE)")


def show_or_change(prog: str, args: Any, path: str, changes: dict[str, Any],
                   render: Callable[[dict[str, Any]], str]) -> int:
    """A settings command's run (`gpudctl log`, `gpudctl trace`): GET `path` when `changes` is empty, else POST them
    with the admin token; the settings printed (`--json`: as gpud answers them). Exit status 1 when gpud is not
    reached or refuses."""
    ep = endpoint(args.url, args.socket)
    try:
        settings = post_json(ep, path, changes, token_file=args.token_file, timeout_s=30.0) if changes \
            else request(ep, "GET", path, timeout_s=30.0)
    except GpudUnreachable as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(settings) if args.json else render(settings))
    return 0

