"""One gpud load point, repeated: requests/s, latency, CPU per request split by process, and the batch sizes that
formed. For quick A/B checks of one change (run it on each build, interleaved); run.py is the full comparison.

    .venv/bin/python bench/serving/point.py [--concurrency 64] [--body binary|json] [--seconds 5] [--repeat 5]
                                            [--model mlp|heavy] [--intra-op-threads N]

Each repetition starts a fresh gpud on the harness's model repository (models.py), drives it with wrk like run.py,
and reads the model's statistics endpoint for the executions. Same machine caveats as run.py: compare within one
invocation (or interleaved invocations), not across machines.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import models  # noqa: E402
import run  # noqa: E402


def cpu_seconds(procs) -> float:
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs)


def read_stats(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)["model_stats"][0]


def batch_infer_ns(stats: dict) -> int:
    """Time inside the engine's run, summed over batches (batch_stats counts each execution once)."""
    return sum(b["compute_infer"]["ns"] for b in stats.get("batch_stats", []))


def one_point(args, workdir: str, repo: str, body_file: str, header_len: int, wrk: str) -> dict:
    server = run.GpudServer(workdir, repo, ("--http-processes", str(args.http_processes)))
    server.start()
    try:
        front, *children = server.tree()
        frontends = [c for c in children if "gpud.frontproc.child" in " ".join(c.cmdline())]
        workers = [c for c in children if c not in frontends]
        target = next(t for t in server.targets() if t.label == f"gpud http-{args.body}")
        url = f"http://127.0.0.1:{server.http_port}/v2/models/{args.model}/stats"
        stats_before = read_stats(url)
        before = (cpu_seconds([front]), cpu_seconds(workers), time.perf_counter(), cpu_seconds(frontends))
        result = run.run_wrk(wrk, server, target, args.model, args.concurrency, args.seconds, body_file, header_len,
                             workdir)
        after = (cpu_seconds([front]), cpu_seconds(workers), time.perf_counter(), cpu_seconds(frontends))
        stats = read_stats(url)
    finally:
        server.stop()
    n = max(1, result["requests"])
    batches = stats["execution_count"] - stats_before["execution_count"]
    infer_s = (batch_infer_ns(stats) - batch_infer_ns(stats_before)) / 1e9
    return {
        "req_s": result["requests"] / (result["duration_us"] / 1e6),
        "p50_ms": result["p50_us"] / 1e3, "p99_ms": result["p99_us"] / 1e3,
        "front_us": (after[0] - before[0]) / n * 1e6, "worker_us": (after[1] - before[1]) / n * 1e6,
        "fe_us": (after[3] - before[3]) / n * 1e6,
        "rows_per_batch": (stats["inference_count"] - stats_before["inference_count"]) / max(1, batches),
        # The share of the point the worker spent inside the engine's run: what is left is the instance waiting
        # between batches (for requests, or for the front end to hand it the next batch).
        "infer_busy": infer_s / (after[2] - before[2]), "infer_ms_per_batch": infer_s * 1e3 / max(1, batches),
        "errors": result["errors_status"] + result["errors_read"] + result["errors_timeout"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--body", choices=("binary", "json"), default="binary")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--model", choices=("mlp", "heavy"), default="mlp")
    p.add_argument("--intra-op-threads", type=int, default=0)
    p.add_argument("--http-processes", type=int, default=0,
                   help="gpud's --http-processes: front ends in N processes (their CPU is the 'fe' column; 'front' "
                        "is then the core's process alone)")
    args = p.parse_args(argv)
    wrk = run.ensure_wrk()
    with tempfile.TemporaryDirectory(prefix="gpud-point-") as workdir:
        repo = os.path.join(workdir, "models")
        models.write_repository(repo, intra_op_threads=args.intra_op_threads)
        row = np.random.default_rng(0).standard_normal(256).astype(np.float32)
        body_file = os.path.join(workdir, "body")
        if args.body == "binary":
            body, header_len = run.kserve_binary(row)
        else:
            body, header_len = run.kserve_json(row), 0
        with open(body_file, "wb") as f:
            f.write(body)
        print(f"# {args.model}, {args.concurrency} connections, HTTP {args.body}, {args.seconds:.0f} s x {args.repeat},"
              f" --http-processes {args.http_processes}")
        print(f"{'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'front us/req':>12} {'worker us/req':>13} {'rows/batch':>10} {'infer busy':>10} {'infer ms/batch':>14} {'fe us/req':>9}")
        for _ in range(args.repeat):
            r = one_point(args, workdir, repo, body_file, header_len, wrk)
            print(f"{r['req_s']:8.0f} {r['p50_ms']:7.2f} {r['p99_ms']:7.2f} {r['front_us']:12.0f} "
                  f"{r['worker_us']:13.0f} {r['rows_per_batch']:10.1f} {r['infer_busy']:10.0%} "
                  f"{r['infer_ms_per_batch']:14.2f} {r['fe_us']:9.0f}" + (f"  errors {r['errors']}" if r["errors"]
                                                                          else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
