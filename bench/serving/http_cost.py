"""The HTTP front end's own CPU per request on the core's loop (issue 25), without the sockets in the way.

    .venv/bin/python bench/serving/http_cost.py [--requests 20000] [--concurrency 64] [--rounds 3] [--profile N]
                                                [--against TREE]

wrk's load point (`bench/serving/point.py`: tiny MLP, one 1x256 FP32 row per request, KServe binary tensors, 64
keep-alive connections) without wrk and without the sockets: the daemon's parts run in this process (gpud.wiring,
the MLP in a real worker process, the real HttpServer and HttpApi), and each of `--concurrency` connections is the
real `_Connection` protocol on a stand-in transport. The transport takes the answer (checks its status) and hands
the connection its next request, on the loop's next turn, as wrk's next `recv` would. So what is measured is the
Python the daemon runs per request (parse, route, validate, batch, stage, complete, encode, answer) plus the worker
pipe's per-batch system calls, and none of the per-request socket system calls (recv, send, epoll), which no change
to gpud's Python moves. wrk's figures swing +-15% between runs on this shared machine; this one is steady to a few
per cent, so it can tell a 5% change.

The baseline, measured in the same run: the same connections and requests with a handler that answers every
request at once with a prebuilt 200 (HTTP parsing and answering alone). Printed: µs of CPU per request (this
process; the worker is another), the handler's own (the difference), requests/s and rows per batch. Rounds
alternate the two; medians. `--profile N`: cProfile's top N functions by own time (CPU time), one extra round
(its statistics also saved to $HTTP_COST_PSTATS, default /tmp/http_cost.pstats).
`--against TREE`: the same in this tree and another checkout (the code before a change), a process each, alternating.
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


def request_bytes(port: int = 8000) -> bytes:
    """What wrk sends for bench/serving/wrk/post.lua with the KServe binary body."""
    import run

    body, header_length = run.kserve_binary(np.random.default_rng(0).standard_normal(256).astype(np.float32)
                                            .reshape(1, 256))
    head = (f"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {len(body)}\r\n"
            f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {header_length}\r\n\r\n")
    return head.encode() + body


class _Transport:
    """A keep-alive client connection as the server's protocol sees it: every answer written brings the next
    request on the loop's next turn, until the round's requests are all sent."""

    def __init__(self, loop: asyncio.AbstractEventLoop, load: _Load):
        self.loop = loop
        self.load = load
        self.protocol = None
        self.closed = False

    def get_extra_info(self, name: str, default=None):
        return default

    def write(self, data: bytes) -> None:
        if not data.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"an answer that is not 200: {bytes(data[:300])!r}")
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
    """`total` requests over the connections, closed loop; `on_mark(name)` at the warm-up's end and at the end."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request: bytes, total: int, warmup: int,
                 on_mark: Callable[[str], None]):
        self.loop = loop
        self.request = request
        self.total = total
        self.marks = {warmup: "start", total: "end"}
        self.on_mark = on_mark
        self.sent = 0
        self.answers = 0
        self.finished = loop.create_future()

    def send(self, transport: _Transport) -> None:
        self.sent += 1
        transport.protocol.data_received(self.request)

    def answered(self, transport: _Transport) -> None:
        self.answers += 1
        mark = self.marks.get(self.answers)
        if mark is not None:
            self.on_mark(mark)
            if mark == "end" and not self.finished.done():
                self.finished.set_result(None)
        if self.sent < self.total:
            self.loop.call_soon(self.send, transport)  # as the client's next request comes: a later turn


async def measure(server, request: bytes, requests: int, warmup: int, concurrency: int,
                  profile: cProfile.Profile | None) -> tuple[float, float]:
    """CPU seconds of this process, and wall seconds, over `requests` requests through `server`'s protocol."""
    from gpud.api.http_server import _Connection

    loop = asyncio.get_running_loop()
    cpu: dict[str, float] = {}
    wall: dict[str, float] = {}

    def on_mark(name: str) -> None:
        cpu[name] = time.process_time()
        wall[name] = time.perf_counter()
        if profile is not None:
            (profile.enable if name == "start" else profile.disable)()

    load = _Load(loop, request, warmup + requests, warmup, on_mark)
    if warmup == 0:
        on_mark("start")
    transports = []
    for _ in range(concurrency):
        transport = _Transport(loop, load)
        protocol = _Connection(server)
        transport.protocol = protocol
        protocol.connection_made(transport)
        transports.append(transport)
    for transport in transports:
        if load.sent < load.total:
            load.send(transport)
    await asyncio.wait_for(load.finished, 600)
    for transport in transports:
        transport.protocol.connection_lost(None)
    return cpu["end"] - cpu["start"], wall["end"] - wall["start"]


def _answering_handler() -> Callable:
    """The baseline's handler: every request answered at once with the same 200 and a 64-byte body."""
    body = b"\0" * 64

    def handler(request, respond) -> None:
        respond(200, body, "application/octet-stream", [("Inference-Header-Content-Length", "0")])
    return handler


async def main_async(args) -> int:
    from gpud.api.http_api import HttpApi
    from gpud.api.http_server import HttpServer

    async with mlp_parts("gpud-http-cost-") as parts:
        loop = asyncio.get_running_loop()
        core = parts.core
        scheduler = core.registry.version("mlp", "").scheduler
        servers = {"gpud": HttpServer(HttpApi(core, None, 1 << 24, None)),
                   "parse": HttpServer(_answering_handler())}
        for server in servers.values():
            server.loop = loop  # as start() sets it; no socket is listened on
        request = request_bytes()
        n, warm, c = args.requests, args.warmup, args.concurrency
        await measure(servers["gpud"], request, 2000, 0, c, None)  # the worker's first batches
        runs: dict[str, list[float]] = {"gpud": [], "parse": []}
        rates: list[float] = []
        rows: list[float] = []
        for _ in range(args.rounds):
            s0 = (scheduler.stats.inference_count, scheduler.stats.execution_count)
            cpu_s, wall_s = await measure(servers["gpud"], request, n, warm, c, None)
            s1 = (scheduler.stats.inference_count, scheduler.stats.execution_count)
            runs["gpud"].append(cpu_s / n * 1e6)
            rates.append(n / wall_s)
            rows.append(rows_per_batch(s0, s1))
            runs["parse"].append((await measure(servers["parse"], request, n, warm, c, None))[0] / n * 1e6)
        gpud_us, parse_us = statistics.median(runs["gpud"]), statistics.median(runs["parse"])
        if args.json:
            from gpud import compiled

            print(json.dumps({"gpud_us": gpud_us, "parse_us": parse_us, "rps": statistics.median(rates),
                              "rows": statistics.median(rows), "compiled": compiled.status().compiled}))
            return 0
        print(f"# {n} requests a round after {warm} of warm-up, {c} connections, {args.rounds} rounds (medians); "
              "CPU of this process (the front end's loop; the worker is another process)")
        print(f"gpud   {gpud_us:7.1f} us/req  (each: {', '.join(f'{x:.1f}' for x in runs['gpud'])}); "
              f"{statistics.median(rates):.0f} req/s; {statistics.median(rows):.1f} rows per batch")
        print(f"parse  {parse_us:7.1f} us/req  (each: {', '.join(f'{x:.1f}' for x in runs['parse'])})")
        print(f"the handler's own (gpud - parse) {gpud_us - parse_us:.1f} us/req")
        if args.profile:
            profile = cProfile.Profile(time.process_time)
            await measure(servers["gpud"], request, n, warm, c, profile)
            stats = pstats.Stats(profile)
            stats.dump_stats(os.environ.get("HTTP_COST_PSTATS", "/tmp/http_cost.pstats"))
            stats.sort_stats("tottime").print_stats(args.profile)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if args.against or args.compiled_against_pure:
        return compare(__file__, args, [], f"{args.concurrency} connections",
                       ("gpud us/req", "parse us/req", "handler"), ("gpud_us", "parse_us"), "request")
    return run_loop(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
