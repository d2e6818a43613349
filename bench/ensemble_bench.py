"""Ensembles (issue 16): what a 3-step pipeline served by gpud costs beyond its steps, and its throughput against its
slowest step served alone. One run, ratios against baselines measured in the same run.

    .venv/bin/python bench/ensemble_bench.py [--requests 2000] [--repeat 2] [--seconds 6] [--json FILE]

Models (a temporary Triton-layout repository; every instance on the CPU worker; max_batch_size 64 and dynamic
batching with a 3 ms delay, as bench/serving):
  pre   UINT8 "raw" [-1, 256] -> FP32 "x" [-1, 256] (pixels scaled to [-1, 1])
  mlp   gpud.examples.make_mlp: FP32 [-1, 256] -> [-1, 16] (tiny: the serving path, not the engine, is measured)
  heavy bench/serving/models.py's compute-bound model (~1 ms of CPU per row): FP32 [-1, 256] -> [-1, 16]
  post  FP32 [-1, 16] -> softmax [-1, 16] and argmax [-1, 1]
  pipe_mlp = pre -> mlp -> post, pipe_heavy = pre -> heavy -> post (ensembles)

1. Concurrency 1 on pipe_mlp, one request at a time from a Python client (http.client, KServe binary tensors,
   keep-alive): the pipeline; each step alone, fed what the pipeline feeds it; and the client chaining the three
   steps itself (what one does without an ensemble). p50 of --requests after 300 warm-up, best of --repeat rounds.
   - Ensemble overhead per step, inside gpud (the target): (the ensemble's request time - the sum of its steps'
     request times), per request, from the statistics of the same requests, / 3 steps. A step's request time runs
     from its request reaching the model's scheduler to its answer (queue, staging into shared memory, the worker
     round trip, onnxruntime, copying the outputs out); what is left is the ensemble's: checking its request,
     building each step's, routing, handing tensors on, answering.
   - The same against the steps served alone: (pipeline p50 - (sum of the steps' p50 alone - 2 x the front end's
     round trip)) / 3, the front end's round trip being a step's p50 alone minus its time inside gpud.
2. Concurrency 64 (wrk -t1 -c64, binary): requests/s of pipe_heavy against heavy served alone (the slowest step,
   fed what the pipeline feeds it), each --seconds after 2 s of warm-up; best of --repeat rounds; the ratio.
Every round starts a fresh gpud and measures the rows interleaved. Client and server share the machine's cores.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx
import psutil
from onnx import TensorProto, helper, numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "serving"))
sys.path.insert(0, ROOT)

import models as serving_models  # noqa: E402
import run as serving_run  # noqa: E402
from ort_session import make_session  # noqa: E402

from gpud.examples import IR_VERSION, OPSET_VERSION, make_mlp  # noqa: E402

WIDTH, CLASSES = 256, 16
STEPS = ("pre", "mlp", "post")
OVERHEAD_TARGET_MS = 0.1
THROUGHPUT_TARGET = 0.9

STEP_CONFIG = """\
name: "{name}"
backend: "onnxruntime"
max_batch_size: 64
input [ {inputs} ]
output [ {outputs} ]
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
dynamic_batching {{ max_queue_delay_microseconds: 3000 }}
"""
ENSEMBLE_CONFIG = """\
name: "{name}"
platform: "ensemble"
max_batch_size: 64
input [ {{ name: "IMAGE", data_type: TYPE_UINT8, dims: [ 256 ] }} ]
output [ {{ name: "PROBS", data_type: TYPE_FP32, dims: [ 16 ] }}, {{ name: "LABEL", data_type: TYPE_INT64, dims: [ 1 ] }} ]
ensemble_scheduling {{ step [
  {{ model_name: "pre", model_version: -1, input_map {{ key: "raw", value: "IMAGE" }},
     output_map {{ key: "x", value: "x" }} }},
  {{ model_name: "{model}", model_version: -1, input_map {{ key: "input", value: "x" }},
     output_map {{ key: "output", value: "logits" }} }},
  {{ model_name: "post", model_version: -1, input_map {{ key: "logits", value: "logits" }},
     output_map [ {{ key: "probs", value: "PROBS" }}, {{ key: "label", value: "LABEL" }} ] }}
] }}
"""


def _finish(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET_VERSION)], producer_name="bench")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def make_pre() -> onnx.ModelProto:
    return _finish(helper.make_graph(
        [helper.make_node("Cast", ["raw"], ["f"], to=TensorProto.FLOAT), helper.make_node("Mul", ["f", "k"], ["m"]),
         helper.make_node("Sub", ["m", "one"], ["x"])], "pre",
        [helper.make_tensor_value_info("raw", TensorProto.UINT8, ["b", WIDTH])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", WIDTH])],
        [numpy_helper.from_array(np.array(2 / 255, np.float32), "k"), numpy_helper.from_array(np.array(1, np.float32),
                                                                                              "one")]))


def make_post() -> onnx.ModelProto:
    return _finish(helper.make_graph(
        [helper.make_node("Softmax", ["logits"], ["probs"], axis=1),
         helper.make_node("ArgMax", ["logits"], ["label"], axis=1, keepdims=1)], "post",
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", CLASSES])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["b", CLASSES]),
         helper.make_tensor_value_info("label", TensorProto.INT64, ["b", 1])]))


def _tensor(name: str, dtype: str, dims: int) -> str:
    return f'{{ name: "{name}", data_type: {dtype}, dims: [ {dims} ] }}'


def write_repository(repo: str) -> dict[str, str]:
    """The four step models and the two ensembles; returns each step model's file."""
    steps = {
        "pre": (make_pre(), [_tensor("raw", "TYPE_UINT8", WIDTH)], [_tensor("x", "TYPE_FP32", WIDTH)]),
        "mlp": (make_mlp(), [_tensor("input", "TYPE_FP32", WIDTH)], [_tensor("output", "TYPE_FP32", CLASSES)]),
        "heavy": (serving_models.make_heavy(), [_tensor("input", "TYPE_FP32", WIDTH)],
                  [_tensor("output", "TYPE_FP32", CLASSES)]),
        "post": (make_post(), [_tensor("logits", "TYPE_FP32", CLASSES)],
                 [_tensor("probs", "TYPE_FP32", CLASSES), _tensor("label", "TYPE_INT64", 1)]),
    }
    files = {}
    for name, (model, inputs, outputs) in steps.items():
        os.makedirs(os.path.join(repo, name, "1"))
        files[name] = os.path.join(repo, name, "1", "model.onnx")
        onnx.save(model, files[name])
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(STEP_CONFIG.format(name=name, inputs=", ".join(inputs), outputs=", ".join(outputs)))
    for name, model in (("pipe_mlp", "mlp"), ("pipe_heavy", "heavy")):
        os.makedirs(os.path.join(repo, name, "1"))
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(ENSEMBLE_CONFIG.format(name=name, model=model))
    return files


# --- KServe binary bodies ----------------------------------------------------------------------------------------
_KSERVE = {np.dtype(np.uint8): "UINT8", np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}


def binary_body(inputs: dict[str, np.ndarray], outputs: list[str]) -> tuple[bytes, int]:
    header = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": _KSERVE[a.dtype],
                          "parameters": {"binary_data_size": a.nbytes}} for n, a in inputs.items()],
              "outputs": [{"name": o, "parameters": {"binary_data": True}} for o in outputs]}
    head = json.dumps(header).encode()
    return head + b"".join(np.ascontiguousarray(a).tobytes() for a in inputs.values()), len(head)


def parse_binary(body: bytes, header_len: int) -> dict[str, np.ndarray]:
    header = json.loads(body[:header_len])
    out, at = {}, header_len
    for o in header["outputs"]:
        dtype = {v: k for k, v in _KSERVE.items()}[o["datatype"]]
        size = o["parameters"]["binary_data_size"]
        out[o["name"]] = np.frombuffer(body[at:at + size], dtype=dtype).reshape(o["shape"])
        at += size
    return out


class Client:
    """One keep-alive HTTP connection, one request at a time."""

    def __init__(self, port: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(self, model: str, body: bytes, header_len: int) -> dict[str, np.ndarray]:
        self.conn.request("POST", f"/v2/models/{model}/infer", body,
                          {"Inference-Header-Content-Length": str(header_len),
                           "Content-Type": "application/octet-stream"})
        response = self.conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"{model}: HTTP {response.status}: {data[:300]!r}")
        return parse_binary(data, int(response.getheader("Inference-Header-Content-Length")))

    def get(self, path: str) -> dict:
        self.conn.request("GET", path)
        response = self.conn.getresponse()
        return json.loads(response.read())


def request_ns(client: Client) -> dict[str, tuple[int, int, int]]:
    """Per model: (successful requests, their summed time inside gpud, their summed compute_input +
    compute_output: staging the inputs into shared memory and copying the outputs out, with the worker's own
    reads and writes; ns)."""
    out = {}
    for s in client.get("/v2/models/stats")["model_stats"]:
        st = s["inference_stats"]
        out[s["name"]] = (st["success"]["count"], st["success"]["ns"], st["compute_input"]["ns"]
                          + st["compute_output"]["ns"])
    return out


def per_request_us(before: dict, after: dict, model: str, field: int = 1) -> float:
    n = after[model][0] - before[model][0]
    return (after[model][field] - before[model][field]) / max(1, n) / 1e3


# --- concurrency 1 ------------------------------------------------------------------------------------------------
def bodies(rng: np.random.Generator) -> dict[str, tuple[bytes, int]]:
    """What each row sends: the pipeline's image, and each step fed what the pipeline feeds it."""
    image = rng.integers(0, 256, (1, WIDTH), dtype=np.uint8)
    x = (image.astype(np.float32) * np.float32(2 / 255) - 1).astype(np.float32)
    logits = rng.standard_normal((1, CLASSES)).astype(np.float32)
    return {"pipe_mlp": binary_body({"IMAGE": image}, ["PROBS", "LABEL"]),
            "pipe_heavy": binary_body({"IMAGE": image}, ["PROBS", "LABEL"]),
            "pre": binary_body({"raw": image}, ["x"]), "mlp": binary_body({"input": x}, ["output"]),
            "heavy": binary_body({"input": x}, ["output"]), "post": binary_body({"logits": logits}, ["probs", "label"]),
            "image": (image.tobytes(), 0)}


def latency_row(client: Client, model: str, body: tuple[bytes, int], n: int) -> tuple[float, dict, dict]:
    for _ in range(300):
        client.post(model, *body)
    before = request_ns(client)
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.post(model, *body)
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat) * 1e3, before, request_ns(client)


def chain_row(client: Client, image: np.ndarray, n: int) -> float:
    """The client runs pre -> mlp -> post itself: three requests, the tensors through the client."""
    def once() -> None:
        x = client.post("pre", *binary_body({"raw": image}, ["x"]))["x"]
        out = client.post("mlp", *binary_body({"input": x}, ["output"]))["output"]
        client.post("post", *binary_body({"logits": np.array(out)}, ["probs", "label"]))
    for _ in range(300):
        once()
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        once()
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat) * 1e3


def raw_compute_ms(files: dict[str, str], body_arrays: dict[str, np.ndarray], n: int) -> dict[str, float]:
    """onnxruntime in-process, batch 1, with gpud's worker's session settings: each step's own compute."""
    out = {}
    for name in STEPS:
        sess = make_session(files[name])
        feed = {sess.get_inputs()[0].name: body_arrays[name]}
        for _ in range(200):
            sess.run(None, feed)
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            sess.run(None, feed)
            lat.append(time.perf_counter() - t0)
        out[name] = statistics.median(lat) * 1e3
    return out


# --- concurrency 64 -----------------------------------------------------------------------------------------------
class _Port:
    def __init__(self, port: int):
        self.http_port = port


def throughput_row(wrk: str, port: int, model: str, body: tuple[bytes, int], seconds: float, workdir: str,
                   procs: list[psutil.Process]) -> dict:
    body_file = os.path.join(workdir, f"{model}.body")
    with open(body_file, "wb") as f:
        f.write(body[0])
    target = serving_run.Target("gpud", model, "http", "kserve-binary", "/v2/models/{model}/infer")
    serving_run.run_wrk(wrk, _Port(port), target, model, 64, 2, body_file, body[1], workdir)  # warm-up
    cpu0 = [p.cpu_times() for p in procs]
    result = serving_run.run_wrk(wrk, _Port(port), target, model, 64, seconds, body_file, body[1], workdir)
    cpu1 = [p.cpu_times() for p in procs]
    n = max(1, result["requests"])
    busy = [(b.user + b.system - a.user - a.system) for a, b in zip(cpu0, cpu1)]
    errors = result["errors_status"] + result["errors_read"] + result["errors_timeout"]
    return {"req_s": result["requests"] / (result["duration_us"] / 1e6), "p50_ms": result["p50_us"] / 1e3,
            "front_us": busy[0] / n * 1e6, "workers_us": sum(busy[1:]) / n * 1e6, "errors": errors}


def start_gpud(workdir: str, repo: str) -> tuple[subprocess.Popen, dict]:
    ready = os.path.join(workdir, "ready")
    if os.path.exists(ready):
        os.remove(ready)
    cmd = [sys.executable, "-m", "gpud.main", "--model-repository", repo, "--address", "127.0.0.1", "--http-port",
           "0", "--grpc-port", "0", "--metrics-port", "0", "--log-level", "WARNING", "--ready-file", ready,
           "--placement-control", "off"]  # the instance counts stay as configured: one per step model
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(os.path.join(workdir, "log"), "a"))
    deadline = time.monotonic() + 120
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("gpud did not become ready: " + open(os.path.join(workdir, "log")).read()[-2000:])
        time.sleep(0.1)
    return proc, json.load(open(ready))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="measured requests per concurrency-1 row")
    p.add_argument("--repeat", type=int, default=2, help="rounds (a fresh gpud each); best of them kept")
    p.add_argument("--seconds", type=float, default=6.0, help="each concurrency-64 point")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    wrk = serving_run.ensure_wrk()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="gpud-ensemble-bench-") as workdir:
        repo = os.path.join(workdir, "models")
        files = write_repository(repo)
        body = bodies(rng)
        image = np.frombuffer(body["image"][0], np.uint8).reshape(1, WIDTH)
        arrays = {"pre": image, "mlp": (image.astype(np.float32) * np.float32(2 / 255) - 1).astype(np.float32),
                  "post": rng.standard_normal((1, CLASSES)).astype(np.float32)}
        raw = raw_compute_ms(files, arrays, args.requests)
        best: dict[str, float] = {}
        inside: dict[str, float] = {}  # the best round's figures inside gpud (us per request)
        throughput: dict[str, dict] = {}
        for _ in range(args.repeat):
            proc, ports = start_gpud(workdir, repo)
            try:
                client = Client(ports["http"])
                p50, before, after = latency_row(client, "pipe_mlp", body["pipe_mlp"], args.requests)
                if p50 < best.get("pipe_mlp", float("inf")):
                    best["pipe_mlp"] = p50
                    inside["ensemble"] = per_request_us(before, after, "pipe_mlp")
                    for s in STEPS:
                        inside[f"{s} in the pipeline"] = per_request_us(before, after, s)
                        inside[f"{s} tensors in and out"] = per_request_us(before, after, s, field=2)
                for s in STEPS:
                    p50, before, after = latency_row(client, s, body[s], args.requests)
                    if p50 < best.get(s, float("inf")):
                        best[s] = p50
                        inside[f"{s} alone"] = per_request_us(before, after, s)
                best["chain"] = min(best.get("chain", float("inf")), chain_row(client, image, args.requests))
                procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
                for model in ("pipe_heavy", "heavy"):
                    row = throughput_row(wrk, ports["http"], model, body[model], args.seconds, workdir, procs)
                    if row["req_s"] > throughput.get(model, {}).get("req_s", 0):
                        throughput[model] = row
            finally:
                proc.terminate()
                proc.wait(30)
    overhead_inside_ms = (inside["ensemble"] - sum(inside[f"{s} in the pipeline"] for s in STEPS)) / 3 / 1e3
    front_ms = statistics.median(best[s] - inside[f"{s} alone"] / 1e3 for s in STEPS)
    overhead_alone_ms = (best["pipe_mlp"] - (sum(best[s] for s in STEPS) - 2 * front_ms)) / 3
    ratio = throughput["pipe_heavy"]["req_s"] / throughput["heavy"]["req_s"]
    cpu = os.cpu_count()
    print(f"# {platform.node()}: {cpu} cores, {platform.processor() or platform.machine()}, Python "
          f"{platform.python_version()}; gpud {_git_describe()}")
    print(f"# .venv/bin/python bench/ensemble_bench.py --requests {args.requests} --repeat {args.repeat} "
          f"--seconds {args.seconds:g}")
    print(f"# concurrency 1 (pipe_mlp = pre -> mlp -> post), Python http.client, binary tensors; best p50 of "
          f"{args.repeat} rounds")
    print(f"{'row':34s} {'p50 ms':>8s} {'in gpud us':>11s} {'onnxruntime us':>15s} {'tensors in+out us':>18s}")
    print(f"{'pipeline (ensemble)':34s} {best['pipe_mlp']:8.3f} {inside['ensemble']:11.0f} "
          f"{sum(raw.values()) * 1e3:15.0f}")
    for s in STEPS:
        print(f"{'  ' + s + ' (its step, in the pipeline)':34s} {'':>8s} {inside[s + ' in the pipeline']:11.0f} "
              f"{raw[s] * 1e3:15.0f} {inside[s + ' tensors in and out']:18.0f}")
    for s in STEPS:
        print(f"{s + ' alone':34s} {best[s]:8.3f} {inside[s + ' alone']:11.0f} {raw[s] * 1e3:15.0f}")
    print(f"{'client chains the 3 steps':34s} {best['chain']:8.3f}")
    print(f"ensemble overhead per step, inside gpud: {overhead_inside_ms:.4f} ms (target < {OVERHEAD_TARGET_MS} ms: "
          f"{'PASS' if overhead_inside_ms < OVERHEAD_TARGET_MS else 'FAIL'})")
    print(f"ensemble overhead per step against the steps served alone: {overhead_alone_ms:.4f} ms (front end's "
          f"round trip {front_ms:.3f} ms)")
    print(f"pipeline p50 / client chaining the steps: {best['pipe_mlp'] / best['chain']:.2f}")
    print(f"# concurrency 64 (wrk -t1 -c64, binary, {args.seconds:g} s after 2 s warm-up), best of {args.repeat}")
    print(f"{'row':34s} {'req/s':>8s} {'p50 ms':>8s} {'front us/req':>13s} {'workers us/req':>15s} {'errors':>7s}")
    for model, label in (("pipe_heavy", "pipeline (pre -> heavy -> post)"), ("heavy", "heavy alone")):
        r = throughput[model]
        print(f"{label:34s} {r['req_s']:8.0f} {r['p50_ms']:8.2f} {r['front_us']:13.0f} {r['workers_us']:15.0f} "
              f"{r['errors']:7d}")
    print(f"pipeline / slowest step alone: {ratio:.3f} (target >= {THROUGHPUT_TARGET}: "
          f"{'PASS' if ratio >= THROUGHPUT_TARGET else 'FAIL'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"p50_ms": best, "inside_us": inside, "onnxruntime_ms": raw, "throughput": throughput,
                       "overhead_per_step_inside_ms": overhead_inside_ms,
                       "overhead_per_step_vs_alone_ms": overhead_alone_ms, "throughput_ratio": ratio}, f, indent=2)
    return 0


def _git_describe() -> str:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() or "?"
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
