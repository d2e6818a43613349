"""A generic unary gRPC server on gpud's own HTTP/2 server (gpud.api.grpcwire) answering 100 bytes:
`gpud_server.py PORT` (run.sh). Run with the project's python (it imports gpud)."""
import asyncio
import sys

import uvloop

from gpud.api.grpcwire.calls import Method
from gpud.api.grpcwire.server import GrpcServer

RESP = b"x" * 100


async def handler(request, context):
    return RESP


async def main(port: int) -> None:
    server = GrpcServer({"/t.S/M": Method(handler, bytes, bytes)}, max_message_bytes=2**20, max_metadata_bytes=2**16)
    await server.start("127.0.0.1", port)
    print("up", flush=True)
    await asyncio.Event().wait()


uvloop.run(main(int(sys.argv[1])))
