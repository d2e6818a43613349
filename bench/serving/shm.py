"""Shared memory against HTTP binary, same node, driven by Triton's perf_analyzer: an identity model, a 16 MiB FP32
input and output per request at concurrency 4 (and 1 KiB for the daemon's own cost per request).

    .venv/bin/python bench/serving/shm.py [--perf-analyzer PATH] [--concurrency 4] [--requests 200] [--repeat 2]
                                          [--cases "http 16 MiB,shm 16 MiB,cuda 16 MiB,..."]

perf_analyzer comes from `scripts/install-perf-analyzer DIR` (or $GPUD_PERF_ANALYZER). One gpud (worker processes, as
the daemon runs by default, `--allow-client-shm true`) serves every case, interleaved `--repeat` times; for each case
it prints requests/s (perf_analyzer's throughput), and the CPU seconds per request of the daemon's own process (the
front end and the core: what the shared-memory path keeps off it) and of its device workers, from /proc. Ratios are
within the run: shared memory's requests/s over HTTP binary's at 16 MiB, and the daemon's CPU per 16 MiB request
over its CPU per 1 KiB request. On a GPU node the "cuda" cases drive CUDA shared memory (perf_analyzer
`--shared-memory cuda`: its own device allocations, registered by their IPC handles).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import onnx
import psutil
from onnx import TensorProto, helper

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = """max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
"""


def write_repo(repo: str) -> None:
    graph = helper.make_graph([helper.make_node("Identity", ["INPUT"], ["OUTPUT"])], "ident",
                              [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["b", "n"])],
                              [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, ["b", "n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    for name, config in (("ident", CONFIG), ("ident_cpu", CONFIG + "instance_group [ { kind: KIND_CPU } ]\n")):
        os.makedirs(os.path.join(repo, name, "1"))
        onnx.save(model, os.path.join(repo, name, "1", "model.onnx"))
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(config)


# name -> (FP32 elements in and out, perf_analyzer's --shared-memory: "" for none, the model). "ident" is placed
# where gpud places it (a GPU when there is one: its worker moves CUDA regions' bytes), "ident_cpu" on the CPU (the
# daemon's process moves them).
CASES = {"http 16 MiB": (4 << 20, "", "ident"), "shm 16 MiB": (4 << 20, "system", "ident"),
         "cuda 16 MiB": (4 << 20, "cuda", "ident"), "cuda 16 MiB cpu model": (4 << 20, "cuda", "ident_cpu"),
         "http 1 KiB": (256, "", "ident"), "shm 1 KiB": (256, "system", "ident"), "cuda 1 KiB": (256, "cuda", "ident"),
         "shm 1 KiB paced": (256, "system", "ident")}


def start_gpud(repo: str, workdir: str) -> tuple[subprocess.Popen, dict]:
    ready = os.path.join(workdir, "ready.json")
    proc = subprocess.Popen([sys.executable, "-m", "gpud.main", "--model-repository", repo, "--address", "127.0.0.1",
                             "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--ready-file", ready,
                             "--allow-client-shm", "true", "--log-level", "WARNING"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(os.path.join(workdir, "gpud.log"), "w"))
    deadline = time.monotonic() + 120
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"gpud did not start; see {workdir}/gpud.log")
        time.sleep(0.1)
    return proc, json.load(open(ready))


def cpu_s(proc: psutil.Process) -> tuple[float, float]:
    """CPU seconds of the daemon's own process, and of its children (the device workers)."""
    own = proc.cpu_times()
    children = sum(c.cpu_times().user + c.cpu_times().system for c in proc.children(recursive=True))
    return own.user + own.system, children


def success_count(http: str, model: str) -> int:
    with urllib.request.urlopen(f"http://{http}/v2/models/{model}/stats", timeout=10) as r:
        return json.load(r)["model_stats"][0]["inference_stats"]["success"]["count"]


def run_case(pa: str, http: str, proc: psutil.Process, elements: int, shm: str, model: str, args,
             rate: float = 0) -> dict:
    load = ["--request-rate-range", f"{rate:.0f}"] if rate else ["--concurrency-range", str(args.concurrency)]
    cmd = [pa, "-m", model, "-u", http, "-i", "http", *load,
           "--shape", f"INPUT:{elements}", "--input-data", "zero", "--measurement-mode", "count_windows",
           "--measurement-request-count", str(args.requests), "--stability-percentage", "1000", "--max-trials", "3"]
    if shm:
        cmd += ["--shared-memory", shm, "--output-shared-memory-size", str(elements * 4)]
    cpu0, count0 = cpu_s(proc), success_count(http, model)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    cpu1, count1 = cpu_s(proc), success_count(http, model)
    if out.returncode != 0:
        raise SystemExit(out.stdout + out.stderr)
    rps = float(re.search(r"Throughput: ([\d.]+) infer/sec", out.stdout).group(1))
    requests = max(1, count1 - count0)
    return {"rps": rps, "daemon_cpu_ms": (cpu1[0] - cpu0[0]) / requests * 1e3,
            "worker_cpu_ms": (cpu1[1] - cpu0[1]) / requests * 1e3, "requests": requests}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--perf-analyzer", default=os.environ.get("GPUD_PERF_ANALYZER") or
                        shutil.which("perf_analyzer"))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=200, help="requests per measurement window")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--cases", default="http 16 MiB,shm 16 MiB,http 1 KiB,shm 1 KiB,shm 1 KiB paced",
                        help=f"which cases, comma-separated, of: {', '.join(CASES)}")
    args = parser.parse_args()
    if not args.perf_analyzer:
        raise SystemExit("perf_analyzer not found: scripts/install-perf-analyzer DIR, then --perf-analyzer DIR/...")
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    if "shm 1 KiB paced" in names and "shm 16 MiB" not in names:
        raise SystemExit("'shm 1 KiB paced' runs at the rate of 'shm 16 MiB': name both")
    cases = {n: CASES[n] for n in names}
    with tempfile.TemporaryDirectory(prefix="gpud-shm-bench-") as workdir:
        repo = os.path.join(workdir, "repo")
        write_repo(repo)
        proc, ports = start_gpud(repo, workdir)
        try:
            daemon = psutil.Process(proc.pid)
            http = f"127.0.0.1:{ports['http']}"
            best: dict[str, dict] = {}
            for _ in range(args.repeat):
                for name, (elements, shm, model) in cases.items():
                    rate = 0.0
                    if name == "shm 1 KiB paced":  # at the 16 MiB case's rate: the same wake-ups per request
                        rate = best["shm 16 MiB"]["rps"]
                    r = run_case(args.perf_analyzer, http, daemon, elements, shm, model, args, rate)
                    print(f"  {name:16s} {r['rps']:9.1f} req/s  daemon {r['daemon_cpu_ms']:.3f} ms CPU/req  "
                          f"workers {r['worker_cpu_ms']:.3f} ms CPU/req", flush=True)
                    if name not in best or r["rps"] > best[name]["rps"]:
                        best[name] = r
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"\nconcurrency {args.concurrency}, best of {args.repeat} (perf_analyzer, one gpud, identity model)")
    for name, r in best.items():
        print(f"  {name:16s} {r['rps']:9.1f} req/s  daemon {r['daemon_cpu_ms']:.3f} ms CPU/req  "
              f"workers {r['worker_cpu_ms']:.3f} ms CPU/req")
    ratios = [("shm / http requests/s at 16 MiB (target >= 2)", "shm 16 MiB", "http 16 MiB", "rps"),
              ("cuda / http requests/s at 16 MiB", "cuda 16 MiB", "http 16 MiB", "rps"),
              ("cuda / shm requests/s at 16 MiB", "cuda 16 MiB", "shm 16 MiB", "rps"),
              ("cuda, model on the GPU / on the CPU, requests/s at 16 MiB", "cuda 16 MiB", "cuda 16 MiB cpu model",
               "rps"),
              ("daemon CPU per request, shm 16 MiB / shm 1 KiB at the same request rate (target <= 1.5)",
               "shm 16 MiB", "shm 1 KiB paced", "daemon_cpu_ms"),
              (f"daemon CPU per request, shm 16 MiB / shm 1 KiB at concurrency {args.concurrency}",
               "shm 16 MiB", "shm 1 KiB", "daemon_cpu_ms"),
              ("daemon CPU per request, shm 16 MiB / http 1 KiB", "shm 16 MiB", "http 1 KiB", "daemon_cpu_ms")]
    for label, top, bottom, key in ratios:
        if top in best and bottom in best:
            print(f"{label}: {best[top][key] / best[bottom][key]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
