"""A front-end process: `python -m gpud.frontproc.child --link-fd N [--listen-fd M] --options JSON` (started by
gpud.frontproc.host). Serves KServe v2 HTTP or gRPC on the inherited listening socket (grpcio's gRPC server: on the
port the daemon holds, SO_REUSEPORT: the kernel spreads connections over the processes), over a RemoteCore, until
the core says stop (or is gone); ignores SIGINT and SIGTERM, which are the core's to act on."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import sys

from gpud.api.http_api import HttpApi
from gpud.api.http_server import HttpServer
from gpud.api.json_codec import JsonCodecPool
from gpud.frontproc.arena import TRIM_INTERVAL_S, Arena
from gpud.frontproc.connections import SharedConnections
from gpud.frontproc.link import process_label
from gpud.frontproc.remote_core import RemoteAdmin, RemoteCore
from gpud.executor.process_log import LogSettings, configure
from gpud.telemetry.event_loop import LoopMonitor

log = logging.getLogger("gpud.frontend")


async def serve(link: socket.socket, listen: socket.socket | None, options: dict) -> None:
    arena = Arena()
    core = RemoteCore(link, arena)
    stop = asyncio.Event()
    grace = [options.get("grace_s", 30.0)]

    def on_stop(grace_s: float) -> None:
        grace[0] = grace_s
        stop.set()
    core.on_stop = on_stop
    core.on_lost = stop.set
    core.start()
    # This loop's lag and stalls, in the core's metrics: watched from when it serves (its start-up is not serving)
    monitor = LoopMonitor(process_label(options["kind"], options["index"]), on_report=core.report_loop)
    # the port's connection cap counts every process's connections (the host's shared page)
    connections = SharedConnections(options["connections_fd"], options["processes"], options["index"])
    connections.set(0)  # none yet (a process this one replaces may have written its last count late)
    loop = asyncio.get_running_loop()

    def trim() -> None:  # the arena gives back what a burst of large tensors made it take
        released = arena.trim()
        if released:
            log.info("gave back %d MiB of shared memory no longer in use", released >> 20)
        trimmer[0] = loop.call_later(TRIM_INTERVAL_S, trim)
    trimmer = [loop.call_later(TRIM_INTERVAL_S, trim)]
    if options["kind"] == "grpc":
        from gpud.api.grpc_api import start_grpc_server
        from gpud.api.grpcwire.keepalive import Keepalive
        from gpud.api.grpcwire.server import GrpcServer

        grpc_server = await start_grpc_server(core, options["address"], options["port"],
                                              max_message_bytes=options["max_body_bytes"],
                                              max_metadata_bytes=options["max_head_bytes"],
                                              max_tensor_elements=options["max_tensor_elements"],
                                              admin=RemoteAdmin(core), reuse_port=True, listen=listen,
                                              implementation=options["grpc_server"],
                                              max_connections=options["max_connections"],
                                              shared_connections=connections,
                                              keepalive=Keepalive(**options["grpc_keepalive"]))

        def on_tune_grpc(request_timeout_s: float, max_connections: int) -> None:
            if isinstance(grpc_server, GrpcServer):  # grpcio's server has no cap
                grpc_server.max_connections = max_connections  # a reload's --grpc-max-connections
        core.on_tune = on_tune_grpc
        monitor.start()
        core.ready()
        try:
            await stop.wait()
            await grpc_server.stop(grace[0])
        finally:
            monitor.stop()
            trimmer[0].cancel()
            core.close()
            arena.close()
        return
    assert listen is not None
    # Large JSON bodies are decoded (and large JSON answers encoded) off this process's loop too, as on the core's.
    json_codec = JsonCodecPool(options["json_processes"], options["json_offload_bytes"]) \
        if options.get("json_processes") else None
    server = HttpServer(HttpApi(core, RemoteAdmin(core), options["max_tensor_elements"], json_codec),
                        max_body_bytes=options["max_body_bytes"], max_head_bytes=options["max_head_bytes"],
                        request_timeout_s=options["request_timeout_s"], max_connections=options["max_connections"],
                        shared_connections=connections, on_close=json_codec.close if json_codec is not None else None)

    def on_tune(request_timeout_s: float, max_connections: int) -> None:
        server.request_timeout_s = request_timeout_s
        server.max_connections = max_connections
    core.on_tune = on_tune
    await server.start_socket(listen)
    monitor.start()
    core.ready()
    try:
        await stop.wait()
        await server.close(grace[0])
    finally:
        monitor.stop()
        trimmer[0].cancel()
        core.close()
        arena.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpud-frontend", description="gpud front-end process (started by gpud)")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--link-fd", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, default=-1,
                        help="the listening socket (gRPC on grpcio binds its own)")
    parser.add_argument("--options", required=True, help="JSON")
    parser.add_argument("--log-settings", default="{}", help="the daemon's log settings (JSON)")
    args = parser.parse_args(argv)
    options = json.loads(args.options)
    options["index"] = args.index
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure(LogSettings(**json.loads(args.log_settings)),
              f"%(asctime)s %(levelname)s gpud.frontend[{options['kind']} {args.index}] %(message)s")
    link = socket.socket(fileno=args.link_fd)
    listen = socket.socket(fileno=args.listen_fd) if args.listen_fd >= 0 else None
    try:
        import uvloop

        uvloop.run(serve(link, listen, options))
    except ImportError:
        asyncio.run(serve(link, listen, options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
