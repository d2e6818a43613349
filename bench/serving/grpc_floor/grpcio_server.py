"""A generic unary gRPC server on grpcio answering 100 bytes: `grpcio_server.py aio|aio-uvloop|sync PORT` (run.sh)."""
import sys
import asyncio
import grpc
from concurrent import futures
mode = sys.argv[1]; port = int(sys.argv[2])
RESP = b"x" * 100
def handler_sync(req, ctx): return RESP
async def handler_aio(req, ctx): return RESP
if mode == "sync":
    h = grpc.method_handlers_generic_handler("t.S", {"M": grpc.unary_unary_rpc_method_handler(handler_sync)})
    s = grpc.server(futures.ThreadPoolExecutor(int(sys.argv[3]) if len(sys.argv) > 3 else 4)); s.add_generic_rpc_handlers((h,))
    s.add_insecure_port(f"127.0.0.1:{port}"); s.start(); print("up", flush=True); s.wait_for_termination()
else:
    async def main():
        h = grpc.method_handlers_generic_handler("t.S", {"M": grpc.unary_unary_rpc_method_handler(handler_aio)})
        s = grpc.aio.server(); s.add_generic_rpc_handlers((h,)); s.add_insecure_port(f"127.0.0.1:{port}")
        await s.start(); print("up", flush=True); await s.wait_for_termination()
    if mode == "aio-uvloop":
        import uvloop; uvloop.run(main())
    else:
        asyncio.run(main())
