"""Where gpud's latency at concurrency 1 goes: each protocol's floor against the whole path, with one client.

    .venv/bin/python bench/serving/floor.py [--requests 2000] [--repeat 2] [--no-perf-analyzer]

For HTTP binary and gRPC, one request at a time from a Python client (the same client for both rows of a
protocol), and gRPC from perf_analyzer at concurrency 1 (run.py's client; `--no-perf-analyzer` skips it), against two gpud processes serving the harness's tiny MLP (models.py):
  - `floor`: gpud whose core answers every request after the first from a cached response, so the request goes
    through the protocol stack, decoding and encoding but never reaches the batcher or the worker process;
  - `full`: gpud as shipped.
It prints p50 for both, full / floor, and full - floor (what the core, the batcher and the worker round trip
add), and decomposes the full path with the model's statistics (queue, compute input / infer / output per request).
A Python client is slower than wrk or perf_analyzer, so compare its rows with each other, not with run.py's figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import models  # noqa: E402

MODEL = "mlp"


def serve_canned(argv: list[str]) -> int:
    """Run gpud with its core answering from a per-model cache after the first real answer (the floor server)."""
    from gpud import core as core_module
    from gpud.main import main

    cache: dict[str, object] = {}
    real_submit, real_infer = core_module.GpudCore.submit, core_module.GpudCore.infer

    def submit(self, request, done):
        cached = cache.get(request.model_name)
        if cached is not None:
            done(dataclasses.replace(cached, id=request.id))  # clients (perf_analyzer) match answers by id
            return

        def keep(result):
            if not isinstance(result, BaseException):
                cache[request.model_name] = result
            done(result)
        real_submit(self, request, keep)

    async def infer(self, request):
        cached = cache.get(request.model_name)
        if cached is None:
            cached = cache[request.model_name] = await real_infer(self, request)
        return dataclasses.replace(cached, id=request.id)

    core_module.GpudCore.submit, core_module.GpudCore.infer = submit, infer
    return main(argv)


def start(workdir: str, repo: str, canned: bool = False, *extra_args: str) -> tuple[subprocess.Popen, dict]:
    """gpud (or, `canned`, the floor server) on loopback with free ports, `extra_args` added; the process and the
    ports its ready file lists, once it serves."""
    ready = os.path.join(workdir, "ready")
    if os.path.exists(ready):
        os.remove(ready)
    gpud_args = ["--model-repository", repo, "--address", "127.0.0.1", "--http-port", "0", "--grpc-port", "0",
                 "--metrics-port", "0", "--log-level", "WARNING", "--ready-file", ready, *extra_args]
    cmd = [sys.executable, os.path.abspath(__file__), "--serve-canned", *gpud_args] if canned else \
        [sys.executable, "-m", "gpud.main", *gpud_args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(os.path.join(workdir, "log"), "a"))
    deadline = time.monotonic() + 120
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("gpud did not become ready: " + open(os.path.join(workdir, "log")).read()[-2000:])
        time.sleep(0.1)
    return proc, json.load(open(ready))


def http_latencies_ms(port: int, n: int) -> list[float]:
    header = json.dumps({"inputs": [{"name": "input", "shape": [1, 256], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 1024}}],
                         "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()
    body = header + np.random.default_rng(0).random((1, 256), dtype=np.float32).tobytes()
    headers = {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.request("POST", f"/v2/models/{MODEL}/infer", body, headers)
        response = conn.getresponse()
        response.read()
        out.append((time.perf_counter() - t0) * 1e3)
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")
    conn.close()
    return out


def grpc_latencies_ms(port: int, n: int) -> list[float]:
    import grpc
    from gpud.proto import grpc_service_pb2 as pb
    from gpud.proto import grpc_service_pb2_grpc as pb_grpc

    request = pb.ModelInferRequest(model_name=MODEL)
    tensor = request.inputs.add(name="input", datatype="FP32")
    tensor.shape.extend([1, 256])
    request.raw_input_contents.append(np.random.default_rng(0).random((1, 256), dtype=np.float32).tobytes())
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            stub.ModelInfer(request, timeout=10)
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def perf_analyzer_latencies_ms(port: int, n: int) -> list[float]:
    """gRPC at concurrency 1 from perf_analyzer (compiled, as in run.py): one p50 figure per call, not per request."""
    import run  # the harness installs and wraps perf_analyzer

    class _Port:
        grpc_port = port
    seconds = max(1.5, n / 1500)
    with tempfile.TemporaryDirectory(prefix="gpud-floor-pa-") as workdir:
        # -x 1: without an explicit version perf_analyzer looks for it in the statistics' changes, and the floor
        # server's statistics do not change.
        result = run.run_perf_analyzer(run.ensure_perf_analyzer(), _Port, MODEL, 1, seconds, workdir,
                                       extra_args=("-x", "1"))
    return [result["p50_us"] / 1e3]


def stats_us(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", f"/v2/models/{MODEL}/stats")
    st = json.loads(conn.getresponse().read())["model_stats"][0]["inference_stats"]
    conn.close()
    return {k: v["ns"] / v["count"] / 1e3 for k, v in st.items() if v["count"]}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-canned":
        return serve_canned(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="measured requests per row (after 300 warm-up)")
    p.add_argument("--repeat", type=int, default=2, help="rounds, floor and full interleaved; best p50 kept")
    p.add_argument("--no-perf-analyzer", action="store_true", help="skip the perf_analyzer gRPC row")
    args = p.parse_args()
    clients = {"http-binary": ("http", http_latencies_ms), "grpc": ("grpc", grpc_latencies_ms)}
    if not args.no_perf_analyzer:
        clients["grpc (perf_analyzer)"] = ("grpc", perf_analyzer_latencies_ms)
    best: dict[tuple[str, str], float] = {}
    decomposition: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="gpud-floor-") as workdir:
        repo = os.path.join(workdir, "models")
        models.write_repository(repo)
        for _ in range(args.repeat):
            for kind in ("floor", "full"):
                proc, ports = start(workdir, repo, canned=kind == "floor")
                try:
                    for label, (port_key, measure) in clients.items():
                        measure(ports[port_key], 300)
                        lat = measure(ports[port_key], args.requests)
                        key = (label, kind)
                        best[key] = min(best.get(key, float("inf")), statistics.median(lat))
                    if kind == "full":
                        decomposition = stats_us(ports["http"])
                finally:
                    proc.terminate()
                    proc.wait(30)
    print(f"# concurrency 1; Python clients: {args.requests} requests per row; best p50 of {args.repeat} rounds")
    print(f"{'protocol':21s} {'floor p50 ms':>13s} {'full p50 ms':>12s} {'full/floor':>11s} {'full-floor ms':>14s}")
    for label in clients:
        floor, full = best[(label, "floor")], best[(label, "full")]
        print(f"{label:21s} {floor:13.3f} {full:12.3f} {full / floor:11.2f} {full - floor:14.3f}")
    print("# full path, per request (model statistics, last round, both protocols): "
          + ", ".join(f"{k} {v:.0f} us" for k, v in decomposition.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
