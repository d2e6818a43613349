"""The core's own CPU per request with the front ends out of process (issue 25, item 3), without HTTP in the way.

    .venv/bin/python bench/serving/core_cost.py [--requests 20000] [--concurrency 64] [--rounds 3] [--profile N]
                                                [--against TREE] [--grouped] [--trace-rate N]

The core runs in this process (gpud.wiring, the tiny MLP of run.py in a real worker process), behind the real
FrontendHost. A stand-in front-end process on the other end of the link keeps `--concurrency` requests in flight, each
one 1x256 FP32 row placed in its arena as an HTTP front-end process places it (one header: one signature number),
and sends a new one for each answer. `--grouped`: it sends them through a front-end process's own code
(gpud.frontproc.remote_core: the arena, and the requests alike that come in one turn as one group, where the tree
groups them) instead of one message per request. The CPU of this process (every thread of it; the worker and the
stand-in are other processes) over the measured requests, divided by their count, is the core's CPU per request.

The baseline, measured in the same run on the same link: the host with a core that answers every request at once
with a ready answer (no validation, no batch, no worker): what the link alone costs (framing, pickling, the socket).
Printed: µs/request of CPU for both, the core's own (the difference), requests/s, rows per batch, and the ratio
core / link. Rounds alternate the two, the median of each is kept. `--profile N`: cProfile over the core's N most
expensive functions (by own time, CPU time), in one extra round. `--against TREE`: the same in this tree and in
another checkout of gpud (the code before a change), a process each, alternating, `--rounds` each: medians and
head / base (on a shared machine the CPU per request drifts with the load: compare only within one such run).
`--trace-rate N`: every N-th request traced (gpud.tracing, level TIMESTAMPS, into a temporary file), for what tracing
costs the core against the same link baseline.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import logging
import os
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from cost_harness import add_arguments, compare, mlp_parts, rows_per_batch, run_loop  # noqa: E402


# --- the stand-in front end (its own process) ------------------------------------------------------------------
def frontend(link_fd: int, requests: int, warmup: int, concurrency: int, grouped: int = 0) -> None:
    asyncio.run((_frontend_grouped if grouped else _frontend)(link_fd, requests, warmup, concurrency))


async def _frontend_grouped(link_fd: int, requests: int, warmup: int, concurrency: int) -> None:
    """`--grouped`: what an HTTP front-end process sends, through its own code (gpud.frontproc.remote_core: each
    request's tensor placed in the arena, and the requests alike that come in one turn sent as one group, where the
    tree does that)."""
    from gpud.executor.types import InferRequest, InferTensor, RequestedOutput
    from gpud.frontproc.arena import Arena
    from gpud.frontproc.remote_core import RemoteCore

    loop = asyncio.get_running_loop()
    arena = Arena()
    core = RemoteCore(socket.socket(fileno=link_fd), arena)
    core.start()
    row = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    outputs = [RequestedOutput("output", {"binary_data": True})]
    signature = object()  # the HTTP front end's parsed header, the same for every request
    total = warmup + requests
    marks = {warmup: "start", total: "end"}
    sent = answered = 0
    finished = loop.create_future()

    def submit() -> None:
        nonlocal sent
        request = InferRequest("mlp", [InferTensor("input", "FP32", (1, 256), row)], outputs=outputs)
        request.signature = signature
        core.submit(request, on_answer)
        sent += 1

    def on_answer(result) -> None:
        nonlocal answered
        if not hasattr(result, "outputs"):
            raise SystemExit(f"request failed: {result}")
        answered += 1
        if answered in marks:
            core.sender.put(("mark", marks[answered]))
        if sent < total:
            submit()
        elif answered == total and not finished.done():
            finished.set_result(None)

    if warmup == 0:
        core.sender.put(("mark", "start"))
    for _ in range(min(concurrency, total)):
        submit()
    await finished
    core.sender.drain_blocking()
    core.close()
    arena.close()


async def _frontend(link_fd: int, requests: int, warmup: int, concurrency: int) -> None:
    """What an HTTP front-end process sends for each request, through the same link code (gpud.frontproc.link:
    each turn's messages sent together), and nothing else."""
    from gpud.executor.client_shm import NO_DATA
    from gpud.executor.types import InferRequest, InferTensor, RequestedOutput
    from gpud.frontproc.arena import Arena
    from gpud.frontproc.link import FrameReader, Sender, request_wire

    loop = asyncio.get_running_loop()
    sock = socket.socket(fileno=link_fd)
    sock.setblocking(False)
    arena = Arena()
    row = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    where, _ = arena.put(row)  # read-only to everyone: every request may point at the same block
    outputs = [RequestedOutput("output", {"binary_data": True})]
    request = InferRequest("mlp", [InferTensor("input", "FP32", (1, 256), NO_DATA)], outputs=outputs)
    wire = request_wire(request)
    placed = {"input": (where.path, where.offset, where.byte_size)}
    total = warmup + requests
    marks = {warmup: "start", total: "end"}
    sent = answered = 0
    finished = loop.create_future()
    sender = Sender(sock, lambda: None)

    def submit() -> None:
        nonlocal sent
        sender.put(("submit", sent, wire, placed, 1))
        sent += 1

    def on_message(message: tuple) -> None:
        nonlocal answered
        if message[0] != "answer":
            return
        if not message[2]:
            raise SystemExit(f"request failed: {message[3]}")
        answered += 1
        if answered in marks:
            sender.put(("mark", marks[answered]))
        if sent < total:
            submit()
        elif answered == total and not finished.done():
            finished.set_result(None)

    reader = FrameReader(sock, on_message)
    loop.add_reader(sock.fileno(), reader.read)
    if warmup == 0:
        sender.put(("mark", "start"))
    for _ in range(min(concurrency, total)):
        submit()
    await finished
    sender.drain_blocking()
    loop.remove_reader(sock.fileno())
    arena.close()


# --- the core's side -------------------------------------------------------------------------------------------
class _Answering:
    """The baseline's core: every request answered at once with the same answer."""

    def __init__(self, response):
        self.response = response
        self.answers = {1: response}  # by members: a group's answer has each member's rows

    def group_limit(self, request) -> int:
        return 64  # the mlp's max_batch_size (bench/serving/models.py)

    def submit(self, request, done, placed=None, members=1):
        answer = self.answers.get(members)
        if answer is None:
            t = self.response.outputs[0]
            data = np.concatenate([t.data] * members)
            answer = self.answers[members] = type(self.response)(
                self.response.model_name, self.response.model_version, [type(t)(t.name, t.datatype, data.shape, data)])
        done(answer)
        return lambda: None


async def measure(core, requests: int, warmup: int, concurrency: int,
                  profile: cProfile.Profile | None, grouped: bool = False) -> tuple[float, float]:
    """CPU seconds of this process, and wall seconds, over `requests` requests through a FrontendHost onto `core`."""
    from gpud.api.admin import AdminAuth
    from gpud.frontproc.host import FrontendHost, FrontendProcess
    from gpud.frontproc.link import FrameReader, Sender

    loop = asyncio.get_running_loop()
    host = FrontendHost(core, AdminAuth(), 1, socket.socket(), {"kind": "http"})
    host._loop = loop
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, __file__, "--frontend", str(theirs.fileno()), str(requests), str(warmup),
                             str(concurrency), str(int(grouped))], pass_fds=(theirs.fileno(),))
    theirs.close()
    ours.setblocking(False)
    fp = FrontendProcess(0, proc, ours)
    cpu: dict[str, float] = {}
    wall: dict[str, float] = {}
    finished = loop.create_future()

    def on_message(message: tuple) -> None:
        if message[0] == "mark":
            cpu[message[1]] = time.process_time()
            wall[message[1]] = time.perf_counter()
            if profile is not None:
                (profile.enable if message[1] == "start" else profile.disable)()
            if message[1] == "end" and not finished.done():
                finished.set_result(None)
            return
        host._on_message(fp, message)

    fp.reader = FrameReader(ours, on_message)
    fp.sender = Sender(ours, lambda: None)
    host.processes[0] = fp

    def readable() -> None:
        assert fp.reader is not None
        if not fp.reader.read():  # the stand-in is done (after its last mark) or failed
            loop.remove_reader(ours.fileno())
            if not finished.done():
                finished.set_exception(RuntimeError("the stand-in front end ended early"))
    loop.add_reader(ours.fileno(), readable)
    try:
        await asyncio.wait_for(finished, 600)
    finally:
        loop.remove_reader(ours.fileno())
        proc.wait()
        host.stopping = True
        ours.close()
    return cpu["end"] - cpu["start"], wall["end"] - wall["start"]


async def main_async(args) -> int:
    from gpud.executor.types import InferResponse, InferTensor

    async with mlp_parts("gpud-core-cost-") as parts:
        core = parts.core
        if args.trace_rate:  # every N-th request traced into a file, as `--trace-config` has gpud do
            from gpud.tracing.settings import TraceSettings
            from gpud.tracing.tracer import Tracer

            trace_file = os.path.join(tempfile.gettempdir(), f"gpud-core-cost-trace-{os.getpid()}.json")
            core.tracer = Tracer(TraceSettings(("TIMESTAMPS",), args.trace_rate, -1, 0, trace_file))
        scheduler = core.registry.version("mlp", "").scheduler
        out = np.zeros((1, 16), np.float32)
        link_only = _Answering(InferResponse("mlp", "1", [InferTensor("output", "FP32", (1, 16), out)]))
        n, warm, c = args.requests, args.warmup, args.concurrency
        g = args.grouped
        await measure(core, 2000, 0, c, None, g)  # the worker's first batches, onnxruntime's first runs
        runs: dict[str, list[float]] = {"core": [], "link": []}
        rates: list[float] = []
        rows: list[float] = []
        for _ in range(args.rounds):
            s0 = (scheduler.stats.inference_count, scheduler.stats.execution_count)
            cpu_s, wall_s = await measure(core, n, warm, c, None, g)
            runs["core"].append(cpu_s / n * 1e6)
            rates.append(n / wall_s)
            s1 = (scheduler.stats.inference_count, scheduler.stats.execution_count)
            rows.append(rows_per_batch(s0, s1))  # (the warm-up's batches too)
            runs["link"].append((await measure(link_only, n, warm, c, None, g))[0] / n * 1e6)
        core_us, link_us = statistics.median(runs["core"]), statistics.median(runs["link"])
        if args.trace_rate:
            core.tracer.close()
            os.unlink(trace_file)
        if args.json:
            print(json.dumps({"core_us": core_us, "link_us": link_us, "rps": statistics.median(rates),
                              "rows": statistics.median(rows)}))
            return 0
        print(f"# {n} requests a round after {warm} of warm-up, {c} in flight, {args.rounds} rounds (medians); "
              f"CPU of the core's process")
        print(f"core   {core_us:7.1f} us/req  (each: {', '.join(f'{x:.1f}' for x in runs['core'])}); "
              f"{statistics.median(rates):.0f} req/s; {statistics.median(rows):.1f} rows per batch")
        print(f"link   {link_us:7.1f} us/req  (each: {', '.join(f'{x:.1f}' for x in runs['link'])})")
        print(f"core's own (core - link) {core_us - link_us:.1f} us/req; core / link {core_us / link_us:.2f}")
        if args.profile:
            profile = cProfile.Profile(time.process_time)  # CPU, not wall time: the loop is preempted
            await measure(core, n, warm, c, profile, g)
            stats = pstats.Stats(profile)
            stats.sort_stats("tottime").print_stats(args.profile)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--frontend":
        frontend(*(int(a) for a in argv[1:6]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p, compiled_against_pure=False)
    p.add_argument("--grouped", action="store_true",
                   help="the stand-in sends as a front-end process does (gpud.frontproc.remote_core): requests alike "
                        "that come in one turn as one group, where the tree groups them")
    p.add_argument("--trace-rate", type=int, default=0, metavar="N",
                   help="trace every N-th request (level TIMESTAMPS, into a file that is removed after): what "
                        "tracing costs the core (0: tracing off, the default)")
    args = p.parse_args(argv)
    if args.against and args.trace_rate:
        p.error("--trace-rate measures this tree alone (a tree before tracing has no such setting)")
    if args.against:
        return compare(__file__, args, ["--grouped"] if args.grouped else [], f"{args.concurrency} in flight",
                       ("core us/req", "link us/req", "core - link"), ("core_us", "link_us"), "request")
    logging.basicConfig(level=logging.WARNING)
    return run_loop(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
