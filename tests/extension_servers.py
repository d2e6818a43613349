"""gpud's HTTP and gRPC front ends over one core (the adapters' own test servers), for the tests of an API
extension against tritonclient (the logging and trace extensions): with or without an admin token."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import tritonclient.http as httpclient

from gpud.api.admin import AdminAuth
from tests.test_grpc_api import ServerThread as GrpcServerThread
from tests.test_http_api import ServerThread as HttpServerThread


@contextmanager
def serving(core, token: str | None) -> Iterator[SimpleNamespace]:
    """Both front ends on loopback: `http_port`, `grpc_url`, `token` (None: admin actions from loopback)."""
    admin = AdminAuth(token)
    http = HttpServerThread(core, admin=admin)
    grpc_server = GrpcServerThread(core, admin=admin)
    try:
        yield SimpleNamespace(http_port=http.port, grpc_url=grpc_server.url, token=token)
    finally:
        grpc_server.close()
        http.stop()


def auth(servers: SimpleNamespace) -> dict[str, str]:
    """The admin token's header where one is set (lower case: gRPC metadata too)."""
    return {"authorization": f"Bearer {servers.token}"} if servers.token else {}


class HttpClient(httpclient.InferenceServerClient):
    def __del__(self):
        pass  # closed by the test; a garbage collection on the servers' thread would make gevent refuse to join
