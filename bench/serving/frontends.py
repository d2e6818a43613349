"""Front ends in processes of their own (issue 25), scaled: gpud with 0, 1, 2, 4 HTTP (and gRPC) front-end processes
under the same load, each count on a fresh daemon, interleaved.

    .venv/bin/python bench/serving/frontends.py [--counts 0,1,2,4] [--concurrency 64] [--seconds 5] [--rounds 2]
                                                [--protocols http,grpc,grpc-h2load,grpc-stream,grpcio] [--perf-analyzer PATH]

HTTP: wrk with one fixed KServe binary body (run.py's harness, the tiny MLP, one 1x256 FP32 row per request). gRPC:
perf_analyzer --async (--perf-analyzer, $GPUD_PERF_ANALYZER or run.py's own install) on gpud's own gRPC server
("grpc"), the same with --streaming (its requests on ModelStreamInfer streams: "grpc-stream"), or on
grpcio's server ("grpcio": --grpc-server grpcio); or h2load on gpud's own gRPC server ("grpc-h2load": one HTTP/2
connection, the same ModelInfer message on --concurrency streams), a client that costs about what wrk does where
perf_analyzer's costs six times as much (docs/benchmarks.md). For each point it prints requests/s, p50 and p99, and
the CPU per request of the core's process, of the front-end processes together, of the device workers and of the
client. 0 is the front end on the core's event loop. Compare within one run: the client, the daemon's processes and
the workers share the machine's cores.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import models  # noqa: E402
import run  # noqa: E402
from ort_session import make_session  # noqa: E402


def split(server: run.GpudServer) -> tuple[list, list, list]:
    core, *children = server.tree()
    fe = [c for c in children if "gpud.frontproc.child" in " ".join(c.cmdline())]
    return [core], fe, [c for c in children if c not in fe]


def pending(server: run.GpudServer) -> str:
    """The model's pending requests and counts as the core reports them (gpudctl inspect's view), for a stall."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/v2/gpud/inspect", timeout=10) as r:
            doc = json.load(r)
        return json.dumps([{k: m.get(k) for k in ("name", "pending_requests", "instances")}
                           for m in doc.get("models", [])])[:2000]
    except Exception as exc:  # noqa: BLE001 - a diagnostic: the daemon may be stuck too
        return f"(inspect failed: {exc})"


def point(args, protocol: str, count: int, workdir: str, repo: str, body_file: str, header_len: int,
          tools: dict, grpc: tuple[str, bytes, np.ndarray]) -> dict:
    """One point on a fresh daemon. `grpc`: h2load's message file, the message, and the answer onnxruntime gives."""
    flag = "--http-processes" if protocol == "http" else "--grpc-processes"
    extra = ("--grpc-server", "grpcio") if protocol == "grpcio" else ()
    server = run.GpudServer(workdir, repo, (flag, str(count), *extra, *shlex.split(args.gpud_args)))
    server.start()
    try:
        time.sleep(0.5)  # the front-end processes announce themselves; their CPU at start is not the load's
        core, fe, workers = split(server)
        before = (run.cpu_seconds(core), run.cpu_seconds(fe), run.cpu_seconds(workers))
        client0 = run.children_cpu_seconds()
        if protocol == "http":
            target = next(t for t in server.targets() if t.label == "gpud http-binary")
            r = run.run_wrk(tools["wrk"], server, target, "mlp", args.concurrency, args.seconds, body_file, header_len,
                            workdir, args.client_threads)
            n, rps = r["requests"], r["requests"] / (r["duration_us"] / 1e6)
            p50, p99 = r["p50_us"] / 1e3, r["p99_us"] / 1e3
        elif protocol == "grpc-h2load":
            message_file, message, expected = grpc
            answer_bytes = run.check_grpc_answer(server.grpc_port, "mlp", message, expected)
            before = (run.cpu_seconds(core), run.cpu_seconds(fe), run.cpu_seconds(workers))
            r = run.run_h2load(tools["h2load"], server.grpc_port, args.concurrency, args.seconds, message_file,
                               answer_bytes, workdir)
            if r["errors"]:
                raise RuntimeError(f"h2load: {r['errors']} of {r['requests']} calls failed")
            n, rps = r["requests"], r["requests"] / (r["duration_us"] / 1e6)
            p50, p99 = r["p50_us"] / 1e3, r["p99_us"] / 1e3
        else:
            t0 = time.monotonic()
            # perf_analyzer: windows of seconds/3 until three agree, at most ten; more than twice that is a stall
            r = run.run_perf_analyzer(tools["perf_analyzer"], server, "mlp", args.concurrency, args.seconds,
                                      workdir, ("--streaming",) if protocol == "grpc-stream" else (),
                                      timeout_s=max(30.0, 8 * args.seconds),
                                      on_stall=lambda: f"# the core then: {pending(server)}")
            rps, p50, p99 = r["requests_per_s"], r["p50_us"] / 1e3, r["p99_us"] / 1e3
            n = rps * (time.monotonic() - t0)  # perf_analyzer's windows plus its set-up: an estimate of the count
        after = (run.cpu_seconds(core), run.cpu_seconds(fe), run.cpu_seconds(workers))
        client_s = run.children_cpu_seconds() - client0
    finally:
        server.stop()
    n = max(1, n)
    return {"rps": rps, "p50": p50, "p99": p99, "core_us": (after[0] - before[0]) / n * 1e6,
            "fe_us": (after[1] - before[1]) / n * 1e6, "worker_us": (after[2] - before[2]) / n * 1e6,
            "client_us": client_s / n * 1e6}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", default="0,1,2,4")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--protocols", default="http,grpc,grpc-h2load")
    p.add_argument("--perf-analyzer", default=os.environ.get("GPUD_PERF_ANALYZER") or shutil.which("perf_analyzer"))
    p.add_argument("--client-threads", type=int, default=1,
                   help="wrk's threads (one keeps up with gpud on a few cores; more on a large node)")
    p.add_argument("--instances", type=int, default=1, help="the model's CPU instances (instance_group count)")
    p.add_argument("--gpud-args", default="", help="more gpud flags for every point, e.g. '--node FILE'")
    args = p.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    protocols = [x for x in args.protocols.split(",") if x]
    tools = {"wrk": run.ensure_wrk()}
    if any(p in ("grpc", "grpc-stream", "grpcio") for p in protocols):
        tools["perf_analyzer"] = args.perf_analyzer or run.ensure_perf_analyzer()
    if "grpc-h2load" in protocols:
        tools["h2load"] = run.ensure_h2load()
    print(f"# {os.cpu_count()} cores; mlp ({args.instances} CPU instance(s)); concurrency {args.concurrency}; "
          f"{args.seconds:.0f} s a point; best of {args.rounds} rounds (interleaved); "
          f"wrk threads {args.client_threads}")
    best: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory(prefix="gpud-frontends-") as workdir:
        repo = os.path.join(workdir, "models")
        paths = models.write_repository(repo, instances=args.instances)
        row = np.random.default_rng(0).standard_normal(256).astype(np.float32)
        body, header_len = run.kserve_binary(row)
        body_file = os.path.join(workdir, "body")
        with open(body_file, "wb") as f:
            f.write(body)
        message = run.grpc_infer_message("mlp", row)
        with open(os.path.join(workdir, "grpc-message"), "wb") as f:
            f.write(message)
        expected = make_session(paths["mlp"], 0).run(["output"], {"input": row[None]})[0][0]
        grpc = (os.path.join(workdir, "grpc-message"), message, expected)
        for _ in range(args.rounds):
            for protocol in protocols:
                for count in counts:
                    try:
                        r = point(args, protocol, count, workdir, repo, body_file, header_len, tools, grpc)
                    except RuntimeError as exc:  # one point's failure (a stall, a client error) ends no other
                        print(f"# {protocol} {count}: FAILED: {exc}", flush=True)
                        continue
                    print(f"# {protocol} {count}: {r['rps']:.0f} req/s, p50 {r['p50']:.2f} ms, p99 {r['p99']:.2f} ms, "
                          f"core {r['core_us']:.0f} us/req, front ends {r['fe_us']:.0f}, workers "
                          f"{r['worker_us']:.0f}, client {r['client_us']:.0f}", flush=True)
                    key = (protocol, count)
                    if key not in best or r["rps"] > best[key]["rps"]:
                        best[key] = r
    print(f"{'protocol':11} {'processes':>9} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'core us/req':>11} "
          f"{'front ends us/req':>17} {'workers us/req':>14} {'client us/req':>13} {'req/s vs 0':>10} {'vs HTTP':>7}")
    for (protocol, count), r in best.items():
        base = best.get((protocol, counts[0]), r)["rps"]
        http = best.get(("http", count))
        vs_http = f"{r['rps'] / http['rps']:7.2f}" if http else f"{'-':>7}"
        print(f"{protocol:11} {count:9d} {r['rps']:8.0f} {r['p50']:7.2f} {r['p99']:7.2f} {r['core_us']:11.0f} "
              f"{r['fe_us']:17.0f} {r['worker_us']:14.0f} {r['client_us']:13.0f} {r['rps'] / base:10.2f} {vs_http}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
