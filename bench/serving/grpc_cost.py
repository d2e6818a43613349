"""The gRPC front end's own CPU per request on the core's loop (issue 25), without the sockets in the way: http_cost.py
for gpud's own gRPC server.

    .venv/bin/python bench/serving/grpc_cost.py [--requests 20000] [--concurrency 64] [--connections 1] [--rounds 3]
                                                [--profile N] [--against TREE]

perf_analyzer's and h2load's load point (tiny MLP, one 1x256 FP32 row per ModelInfer call in raw_input_contents;
`--concurrency` calls in flight over `--connections` HTTP/2 connections) without the client and without the sockets:
the daemon's parts run in this process (gpud.wiring, the MLP in a real worker process, the real servicer and method
table), and each connection is the real `GrpcConnection` protocol on a stand-in transport. The transport reads the
frames the server writes; each call's trailers (grpc-status 0, or the run stops) bring the next call on a new stream
on the loop's next turn, as a client's next read would. Measured: the Python the daemon runs per call (HTTP/2
frames, HPACK, the ModelInfer plan, batch, stage, complete, encode, frames out) plus the worker pipe's per-batch
system calls, none of the per-call socket system calls.

The baseline, measured in the same run: the same connections and calls with a ModelInfer that answers every call at
once with a prebuilt message (HTTP/2 and gRPC framing alone). Printed as http_cost.py prints: µs of CPU per call
(this process; the worker is another), the servicer's own (the difference), calls/s and rows per batch.
`--against TREE`: this tree and another checkout (the code before a change), a process each, alternating.
`--compiled-against-pure`: this tree with its request path compiled (gpud.compiled) against itself as pure Python.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from cost_harness import add_arguments, compare, mlp_parts, rows_per_batch, run_loop  # noqa: E402

from gpud.api.grpcwire import frames  # noqa: E402 - the tree measured (PYTHONPATH, as cost_harness runs an arm)

PATH = "/inference.GRPCInferenceService/ModelInfer"


class _Client:
    """One client connection's side: the HTTP/2 frames of its calls (the same header block after the first, as
    an HPACK encoder that indexes them sends it: gRPC clients do), and the server's frames read back."""

    def __init__(self, message: bytes):
        import hpack

        encoder = hpack.Encoder()
        headers = [(":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", "127.0.0.1:8001"),
                   ("content-type", "application/grpc"), ("te", "trailers"), ("user-agent", "grpc-cost")]
        self.first_block = encoder.encode(headers)
        self.block = encoder.encode(headers)  # indexed: what every later call's HEADERS carries
        self.data = message
        self.next_stream_id = 1
        self.sent_first = False
        self.pending = bytearray()
        self.in_flight: set[int] = set()

    def call(self) -> bytes:
        sid = self.next_stream_id
        self.next_stream_id += 2
        block = self.block if self.sent_first else self.first_block
        self.sent_first = True
        self.in_flight.add(sid)
        return (frames.frame(frames.HEADERS, frames.END_HEADERS, sid, block) +
                frames.frame(frames.DATA, frames.END_STREAM, sid, self.data))

    def read(self, data: bytes, ok_trailers: bytes) -> list[int]:
        """The streams the server ended in `data` (their trailers said OK); SystemExit on any other end."""
        buf = self.pending
        buf += data
        ended: list[int] = []
        i = 0
        while len(buf) - i >= 9:
            length = int.from_bytes(buf[i:i + 3], "big")
            if len(buf) - i < 9 + length:
                break
            kind, flags = buf[i + 3], buf[i + 4]
            sid = int.from_bytes(buf[i + 5:i + 9], "big") & 0x7FFFFFFF
            payload = bytes(buf[i + 9:i + 9 + length])
            i += 9 + length
            if kind == frames.HEADERS and flags & frames.END_STREAM:
                if payload != ok_trailers:
                    raise SystemExit(f"stream {sid} ended without grpc-status 0: {payload!r}")
                self.in_flight.discard(sid)
                ended.append(sid)
            elif kind in (frames.RST_STREAM, frames.GOAWAY) and sid in self.in_flight | {0}:
                raise SystemExit(f"the server sent frame type {kind} on stream {sid}: {payload!r}")
        del buf[:i]
        return ended


class _Transport:
    """A client connection as the server's protocol sees it: every call the server ends brings the next on a new
    stream on the loop's next turn, until the round's calls are all sent."""

    def __init__(self, load: _Load, client: _Client):
        self.load = load
        self.client = client
        self.protocol = None
        self.closed = False

    def get_extra_info(self, name: str, default=None):
        return ("127.0.0.1", 40000) if name == "peername" else default

    def write(self, data: bytes) -> None:
        for _ in self.client.read(bytes(data), self.load.ok_trailers):
            self.load.answered(self)

    def writelines(self, data) -> None:
        self.write(b"".join(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _Load:
    """`total` calls over the connections, closed loop; `on_mark(name)` at the warm-up's end and at the end."""

    def __init__(self, loop: asyncio.AbstractEventLoop, total: int, warmup: int, on_mark: Callable[[str], None]):
        self.loop = loop
        self.total = total
        self.marks = {warmup: "start", total: "end"}
        self.on_mark = on_mark
        self.ok_trailers = frames.STATUS_OK_TRAILERS
        self.sent = 0
        self.answers = 0
        self.finished = loop.create_future()

    def send(self, transport: _Transport) -> None:
        self.sent += 1
        transport.protocol.data_received(transport.client.call())

    def answered(self, transport: _Transport) -> None:
        self.answers += 1
        mark = self.marks.get(self.answers)
        if mark is not None:
            self.on_mark(mark)
            if mark == "end" and not self.finished.done():
                self.finished.set_result(None)
        if self.sent < self.total:
            self.loop.call_soon(self.send, transport)  # as the client's next call comes: a later turn


async def measure(server, message: bytes, requests: int, warmup: int, concurrency: int, connections: int,
                  profile: cProfile.Profile | None) -> tuple[float, float]:
    """CPU seconds of this process, and wall seconds, over `requests` calls through `server`'s protocol."""
    from gpud.api.grpcwire.connection import GrpcConnection

    loop = asyncio.get_running_loop()
    cpu: dict[str, float] = {}
    wall: dict[str, float] = {}

    def on_mark(name: str) -> None:
        cpu[name] = time.process_time()
        wall[name] = time.perf_counter()
        if profile is not None:
            (profile.enable if name == "start" else profile.disable)()

    load = _Load(loop, warmup + requests, warmup, on_mark)
    if warmup == 0:
        on_mark("start")
    transports = []
    for _ in range(connections):
        transport = _Transport(load, _Client(message))
        protocol = GrpcConnection(server)
        transport.protocol = protocol
        protocol.connection_made(transport)
        # the connection's window as large as HTTP/2 allows: this client never acknowledges what it reads
        protocol.data_received(frames.PREFACE + frames.settings_frame({}) + frames.frame(frames.SETTINGS, frames.ACK, 0)
                               + frames.window_update(0, frames.MAX_WINDOW_BYTES - frames.DEFAULT_WINDOW_BYTES))
        transports.append(transport)
    for k in range(concurrency):
        if load.sent < load.total:
            load.send(transports[k % connections])
    await asyncio.wait_for(load.finished, 600)
    for transport in transports:
        transport.protocol.connection_lost(None)
    return cpu["end"] - cpu["start"], wall["end"] - wall["start"]


def request_message() -> bytes:
    """What perf_analyzer and bench/serving/run.py's h2load send for the MLP: one framed ModelInferRequest."""
    import run

    return run.grpc_infer_message("mlp", np.random.default_rng(0).standard_normal(256).astype(np.float32))


def _answering_methods(answer: bytes) -> dict:
    """The baseline's method table: ModelInfer answers every call at once with the same message."""
    from gpud.api.grpcwire.calls import Method

    def start(request, context, reply):
        reply(0, "", answer)
        return None

    return {PATH: Method(lambda request, context: None, lambda data: data, lambda m: m, start=start)}


async def main_async(args) -> int:
    from gpud.api import grpc_api
    from gpud.api.grpcwire.server import GrpcServer

    async with mlp_parts("gpud-grpc-cost-") as parts:
        core = parts.core
        scheduler = core.registry.version("mlp", "").scheduler
        limits = {"max_message_bytes": 1 << 24, "max_metadata_bytes": 1 << 16}
        servicer = grpc_api.InferenceServicer(core, None)
        message = request_message()
        answer = b"\0" * 90  # about the MLP's answer (16 FP32 and their description)
        servers = {"gpud": GrpcServer(grpc_api.method_table(servicer), **limits),
                   "parse": GrpcServer(_answering_methods(answer), **limits)}
        n, warm, c, conns = args.requests, args.warmup, args.concurrency, args.connections
        await measure(servers["gpud"], message, 2000, 0, c, conns, None)  # the worker's first batches
        runs: dict[str, list[float]] = {"gpud": [], "parse": []}
        rates: list[float] = []
        rows: list[float] = []
        for _ in range(args.rounds):
            s0 = (scheduler.stats.inference_count, scheduler.stats.execution_count)
            cpu_s, wall_s = await measure(servers["gpud"], message, n, warm, c, conns, None)
            s1 = (scheduler.stats.inference_count, scheduler.stats.execution_count)
            runs["gpud"].append(cpu_s / n * 1e6)
            rates.append(n / wall_s)
            rows.append(rows_per_batch(s0, s1))
            runs["parse"].append((await measure(servers["parse"], message, n, warm, c, conns, None))[0] / n * 1e6)
        gpud_us, parse_us = statistics.median(runs["gpud"]), statistics.median(runs["parse"])
        if args.json:
            from gpud import compiled

            print(json.dumps({"gpud_us": gpud_us, "parse_us": parse_us, "rps": statistics.median(rates),
                              "rows": statistics.median(rows), "compiled": compiled.status().compiled}))
            return 0
        print(f"# {n} calls a round after {warm} of warm-up, {c} in flight over {conns} connection(s), "
              f"{args.rounds} rounds (medians); CPU of this process (the front end's loop; the worker is another)")
        print(f"gpud   {gpud_us:7.1f} us/call  (each: {', '.join(f'{x:.1f}' for x in runs['gpud'])}); "
              f"{statistics.median(rates):.0f} calls/s; {statistics.median(rows):.1f} rows per batch")
        print(f"parse  {parse_us:7.1f} us/call  (each: {', '.join(f'{x:.1f}' for x in runs['parse'])})")
        print(f"the servicer's own (gpud - parse) {gpud_us - parse_us:.1f} us/call")
        if args.profile:
            profile = cProfile.Profile(time.process_time)
            await measure(servers["gpud"], message, n, warm, c, conns, profile)
            stats = pstats.Stats(profile)
            stats.dump_stats(os.environ.get("GRPC_COST_PSTATS", "/tmp/grpc_cost.pstats"))
            stats.sort_stats("tottime").print_stats(args.profile)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.add_argument("--connections", type=int, default=1, help="HTTP/2 connections the calls share (a channel: 1)")
    args = p.parse_args(argv)
    if args.connections < 1 or args.concurrency < args.connections:
        p.error("--connections must be at least 1 and at most --concurrency")
    if args.against or args.compiled_against_pure:
        return compare(__file__, args, ["--connections", str(args.connections)],
                       f"{args.concurrency} in flight over {args.connections} connection(s)",
                       ("gpud us/call", "parse us/call", "servicer"), ("gpud_us", "parse_us"), "call")
    return run_loop(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
