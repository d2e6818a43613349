#!/usr/bin/env python3
"""Profile gpud under steady wrk load: py-spy on the front end and on the worker at once, hot spots as text.

    .venv/bin/python bench/serving/profile_gpud.py [--body binary|json] [--concurrency 64] [--seconds 20] [--native]

Starts gpud on the tiny MLP (same repository as run.py), drives it with wrk, and records both processes with
py-spy (`--nonblocking`, 100 Hz; installed into .bench/venv-mosec, or .bench/venv-pyspy if that is missing). Writes
folded stacks (for flamegraph.pl or speedscope) under .bench/profile/, and prints for each process the functions with the most
samples: self (the function itself on top of the stack) and inclusive (anywhere on the stack), as % of samples.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import run  # noqa: E402


def py_spy() -> str:
    for venv in ("venv-mosec", "venv-pyspy"):
        exe = os.path.join(run.BENCH_DIR, venv, "bin", "py-spy")
        if os.access(exe, os.X_OK):
            return exe
    python = run.ensure_venv("pyspy", ["py-spy"])
    return os.path.join(os.path.dirname(python), "py-spy")


AREAS = [  # (substring of a frame's file, area): the first match names the area
    ("gpud/api/http_server", "gpud http_server"), ("gpud/api/http_api", "gpud http_api"),
    ("gpud/api/http_infer", "gpud http_api"), ("gpud/api/grpc_api", "gpud grpc_api"),
    ("gpud/core", "gpud core"), ("gpud/registry", "gpud core"),
    ("gpud/executor/scheduler", "executor scheduler"), ("gpud/executor/batcher", "executor batcher"),
    ("gpud/executor/validation", "executor validation"), ("gpud/executor/protocol", "executor protocol + staging"),
    ("gpud/executor/channel", "executor channel"), ("gpud/executor/supervisor", "executor supervisor"),
    ("gpud/executor/pool", "executor pool"), ("gpud/executor/worker", "executor worker"), ("gpud/executor/", "executor other"),
    ("multiprocessing/connection", "multiprocessing Connection"), ("multiprocessing/", "multiprocessing other"),
    ("web_urldispatcher", "aiohttp routing"), ("web_protocol", "aiohttp protocol"), ("http_parser", "aiohttp parser"),
    ("web_response", "aiohttp response"), ("http_writer", "aiohttp writer"), ("aiohttp/", "aiohttp other"),
    ("grpc/", "grpc.aio"), ("google/protobuf", "protobuf"), ("prometheus_client", "prometheus_client"),
    ("gpud/telemetry/", "gpud telemetry"), ("selector_events", "asyncio transport"), ("asyncio/", "asyncio loop"),
    ("selectors", "asyncio select"), ("numpy", "numpy"), ("onnxruntime", "onnxruntime"), ("threading", "threading"),
    ("queue.py", "queue"),
]


def area(frame: str) -> str:
    file = frame[frame.rfind("(") + 1:frame.rfind(":")] if "(" in frame else frame
    return next((name for key, name in AREAS if key in file), file)


def summarize(folded: str, top: int) -> str:
    """Self and inclusive sample shares per function from py-spy's raw (folded) output."""
    self_n, incl_n = collections.Counter(), collections.Counter()
    self_a, incl_a = collections.Counter(), collections.Counter()
    total = 0
    for line in open(folded):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        n = int(n)
        frames = stack.split(";")[1:]  # first item is the thread name / process
        total += n
        if not frames:
            continue
        self_n[frames[-1]] += n
        for f in set(frames):
            incl_n[f] += n
        self_a[area(frames[-1])] += n
        for a in {area(f) for f in frames}:
            incl_a[a] += n
    out = [f"{total} samples"]
    out.append("  self%  area (file of the innermost frame)      incl%  area")
    left, right = self_a.most_common(top), incl_a.most_common(top)
    for i in range(max(len(left), len(right))):
        a = f"  {100 * left[i][1] / total:5.1f}  {left[i][0]:38}" if i < len(left) else " " * 48
        b = f"{100 * right[i][1] / total:5.1f}  {right[i][0]}" if i < len(right) else ""
        out.append(a + b)
    out.append("  self%  function")
    for f, n in self_n.most_common(top):
        out.append(f"  {100 * n / total:5.1f}  {f}")
    out.append("  incl%  function")
    for f, n in incl_n.most_common(top):
        out.append(f"  {100 * n / total:5.1f}  {f}")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--body", choices=["binary", "json", "grpc"], default="binary",
                   help="HTTP binary / HTTP JSON (wrk) or gRPC (perf_analyzer --async)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=int, default=20)
    p.add_argument("--native", action="store_true", help="include native (C/C++) frames")
    p.add_argument("--idle", action="store_true", help="include idle (waiting) samples")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    spy = py_spy()
    wrk = run.ensure_wrk()
    outdir = os.path.join(run.BENCH_DIR, "profile")
    os.makedirs(outdir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="gpud-profile-")
    repo = os.path.join(workdir, "models")
    run.models.write_repository(repo)
    import numpy as np

    row = np.random.default_rng(0).standard_normal(256).astype(np.float32)
    if args.body in ("binary", "grpc"):
        body, header_len, kind = *run.kserve_binary(row), "kserve-binary"
    else:
        body, header_len, kind = run.kserve_json(row), 0, "kserve-json"
    body_file = os.path.join(workdir, "body.bin")
    with open(body_file, "wb") as f:
        f.write(body)
    server = run.GpudServer(workdir, repo)
    server.start()
    try:
        front = psutil.Process(server.proc.pid)
        workers = front.children(recursive=True)
        log = run.log
        log(f"gpud front end pid {front.pid}; workers {[w.pid for w in workers]}")
        target = run.Target("gpud", f"gpud {args.body}", "http", kind, "/v2/models/{model}/infer")
        if args.body == "grpc":
            pa = run.ensure_perf_analyzer()
            run.run_perf_analyzer(pa, server, "mlp", args.concurrency, 3, workdir)  # warm-up
            load = subprocess.Popen([pa, "-m", "mlp", "-u", f"127.0.0.1:{server.grpc_port}", "-i", "grpc", "--async",
                                     "--concurrency-range", str(args.concurrency), "-p",
                                     str((args.seconds + 4) * 1000 // 3), "-s", "100", "-r", "3"],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        else:
            run.run_wrk(wrk, server, target, "mlp", args.concurrency, 3, body_file, header_len, workdir)  # warm-up
            env = dict(os.environ, BODY_FILE=body_file, CONTENT_TYPE=run.content_type(kind),
                       HEADER_LENGTH=str(header_len or ""), RESULT_FILE=os.path.join(workdir, "wrk.json"))
            load = subprocess.Popen([wrk, "-t1", f"-c{args.concurrency}", f"-d{args.seconds + 4}s", "-s", run.LUA,
                                     f"http://127.0.0.1:{server.http_port}/v2/models/mlp/infer"], env=env,
                                    stdout=subprocess.DEVNULL)
        time.sleep(2)
        spies = []
        for name, proc in [("frontend", front)] + [(f"worker{i}", w) for i, w in enumerate(workers)]:
            folded = os.path.join(outdir, f"{name}-{args.body}-c{args.concurrency}.folded")
            cmd = [spy, "record", "--pid", str(proc.pid), "--duration", str(args.seconds), "--rate", "100",
                   "--nonblocking", "--format", "raw", "-o", folded]
            if args.native:
                cmd.append("--native")
            if args.idle:
                cmd.append("--idle")
            spies.append((name, folded, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
        cpu0 = {n: psutil.Process(pr.pid).cpu_times() for n, pr in [("frontend", front)]
                + [(f"worker{i}", w) for i, w in enumerate(workers)]}
        t0 = time.monotonic()
        for name, folded, sp in spies:
            err = sp.communicate()[1]
            if sp.returncode != 0:
                log(f"py-spy {name} failed: {err.decode()[-500:]}")
        dt = time.monotonic() - t0
        if args.body == "grpc":
            text = load.communicate()[0]
            print("load (perf_analyzer, under py-spy sampling):", *[ln.strip() for ln in text.splitlines()
                                                                   if "Throughput" in ln or "p99" in ln][-2:])
        else:
            load.wait()
            res = json.load(open(os.path.join(workdir, "wrk.json")))
            rps = res["requests"] / (res["duration_us"] / 1e6)
            print(f"load: {rps:.0f} req/s, p50 {res['p50_us'] / 1e3:.2f} ms, p99 {res['p99_us'] / 1e3:.2f} ms "
                  f"(under py-spy sampling)")
        for name, folded, _ in spies:
            c0 = cpu0[name]
            pr = front if name == "frontend" else workers[int(name[6:])]
            c1 = pr.cpu_times()
            share = (c1.user + c1.system - c0.user - c0.system) / dt
            print(f"\n== {name} (pid {pr.pid}): {100 * share:.0f}% of a core "
                  f"(user {c1.user - c0.user:.1f} s, system {c1.system - c0.system:.1f} s over {dt:.1f} s)")
            if os.path.exists(folded):
                print(summarize(folded, args.top))
                print(f"  folded stacks (flamegraph.pl / speedscope): {folded}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
