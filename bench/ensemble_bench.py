"""Ensembles (issue 16): what a 3-step pipeline served by gpud costs beyond its steps, and its throughput against its
slowest step served alone. One run, ratios against baselines measured in the same run.

    .venv/bin/python bench/ensemble_bench.py [--requests 2000] [--repeat 2] [--seconds 6] [--kind cpu|gpu]
                                             [--throughput-only] [--json FILE]

Models (a temporary Triton-layout repository; every instance on the CPU worker, or with --kind gpu on a GPU (a real
one on a GPU node: scripts/gpu-validate runs it so); max_batch_size 64 and dynamic batching with a 3 ms delay, as
bench/serving):
  pre   UINT8 "raw" [-1, 256] -> FP32 "x" [-1, 256] (pixels scaled to [-1, 1])
  mlp   gpud.examples.make_mlp: FP32 [-1, 256] -> [-1, 16] (tiny: the serving path, not the engine, is measured)
  heavy bench/serving/models.py's compute-bound model (0.4-1 ms of CPU per row; deeper with --heavy-layers):
        FP32 [-1, 256] -> [-1, 16]
  post  FP32 [-1, 16] -> softmax [-1, 16] and argmax [-1, 1]
  pipe_mlp = pre -> mlp -> post, pipe_heavy = pre -> heavy -> post (ensembles)

1. Concurrency 1 on pipe_mlp, inside gpud: the bench builds gpud's core in its own process (the daemon's registry,
   placement service and worker pool; no network, no front end) and times `core.infer`, one request at a time,
   rows interleaved in blocks, medians over all blocks:
   - the pipeline; each step alone, fed what the pipeline feeds it; and the three steps chained by hand through the
     same core (each answer's output made the next request's input), which is what the ensemble does for a client;
   - ensemble overhead per step (the target): (pipeline - the three steps chained by hand) / 3, and against the
     sum of the steps alone: (pipeline - sum) / 3. Every step's own path (its queue, staging into shared memory,
     the worker round trip, onnxruntime, copying the outputs out) is in both sides; what is left is the ensemble's:
     checking its request, building each step's, routing, handing tensors on, answering.
   Also over HTTP (the daemon; Python http.client, KServe binary tensors, keep-alive): the pipeline against the
   client chaining the three steps itself over the network.
2. Concurrency 64 (wrk -t1 -c64, binary): requests/s of pipe_heavy against heavy served alone (the slowest step,
   fed what the pipeline feeds it), alternating, each --seconds after 2 s of warm-up, --repeat pairs on one daemon;
   the ratio of each pair (pairs are adjacent in time, so load from elsewhere on the machine hits both alike), and
   their median.
Client and server share the machine's cores.
"""
from __future__ import annotations

import argparse
import asyncio
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

import floor  # noqa: E402  (bench/serving/floor.py: starting gpud)
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
instance_group [ {{ count: 1, kind: {kind} }} ]
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


def write_repository(repo: str, heavy_layers: int = serving_models.HEAVY_LAYERS,
                     kind: str = "KIND_CPU") -> dict[str, str]:
    """The four step models (instances of `kind`) and the two ensembles; returns each step model's file."""
    steps = {
        "pre": (make_pre(), [_tensor("raw", "TYPE_UINT8", WIDTH)], [_tensor("x", "TYPE_FP32", WIDTH)]),
        "mlp": (make_mlp(), [_tensor("input", "TYPE_FP32", WIDTH)], [_tensor("output", "TYPE_FP32", CLASSES)]),
        "heavy": (serving_models.make_heavy(heavy_layers), [_tensor("input", "TYPE_FP32", WIDTH)],
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
            f.write(STEP_CONFIG.format(name=name, inputs=", ".join(inputs), outputs=", ".join(outputs), kind=kind))
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


# --- concurrency 1 ---------------------------------------------------------------------------------------------
def bodies(rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict[str, tuple[bytes, int]]]:
    """What each row sends: the pipeline's image, and each step fed what the pipeline feeds it (arrays, and the
    same as KServe binary bodies)."""
    image = rng.integers(0, 256, (1, WIDTH), dtype=np.uint8)
    x = (image.astype(np.float32) * np.float32(2 / 255) - 1).astype(np.float32)
    logits = rng.standard_normal((1, CLASSES)).astype(np.float32)
    arrays = {"image": image, "pre": image, "mlp": x, "heavy": x, "post": logits}
    return arrays, {"pipe_mlp": binary_body({"IMAGE": image}, ["PROBS", "LABEL"]),
                    "pipe_heavy": binary_body({"IMAGE": image}, ["PROBS", "LABEL"]),
                    "pre": binary_body({"raw": image}, ["x"]), "mlp": binary_body({"input": x}, ["output"]),
                    "heavy": binary_body({"input": x}, ["output"]),
                    "post": binary_body({"logits": logits}, ["probs", "label"])}


async def inprocess_ms(repo: str, arrays: dict[str, np.ndarray], n: int, blocks: int) -> dict[str, float]:
    """Median latency of `core.infer` per row, in gpud's core built in this process; rows interleaved in blocks."""
    from gpud.executor.pool import ExecutorPool
    from gpud.executor.types import InferRequest, InferTensor
    from gpud.core import GpudCore
    from gpud.placing.inputs import has_gpus
    from gpud.placing.service import PlacementService
    from gpud.scheduling import new_registry
    from gpud.repository.layout import ModelRepository
    from gpud.telemetry.discovery import discover

    def tensor(name: str, a: np.ndarray) -> InferTensor:
        return InferTensor(name, _KSERVE[a.dtype], a.shape, a)

    pool = ExecutorPool()
    backend = discover(None, pool)
    registry = new_registry(has_gpus=has_gpus(backend.leaf_devices()))
    core = GpudCore(ModelRepository(repo), registry, PlacementService(backend, pool, registry), pool)
    await core.start()
    requests = {"pipe_mlp": InferRequest("pipe_mlp", [tensor("IMAGE", arrays["image"])]),
                "pre": InferRequest("pre", [tensor("raw", arrays["pre"])]),
                "mlp": InferRequest("mlp", [tensor("input", arrays["mlp"])]),
                "post": InferRequest("post", [tensor("logits", arrays["post"])])}

    async def chained() -> None:
        x = (await core.infer(requests["pre"])).outputs[0]
        out = (await core.infer(InferRequest("mlp", [InferTensor("input", x.datatype, x.shape, x.data)]))).outputs[0]
        await core.infer(InferRequest("post", [InferTensor("logits", out.datatype, out.shape, out.data)]))

    rows = {name: (lambda r=r: core.infer(r)) for name, r in requests.items()}
    rows["chain"] = chained
    samples: dict[str, list[float]] = {name: [] for name in rows}
    try:
        for call in rows.values():
            for _ in range(300):
                await call()
        for _ in range(blocks):
            for name, call in rows.items():
                for _ in range(max(1, n // blocks)):
                    t0 = time.perf_counter()
                    await call()
                    samples[name].append(time.perf_counter() - t0)
    finally:
        await core.shutdown()
    return {name: statistics.median(v) * 1e3 for name, v in samples.items()}


def http_ms(port: int, bodies_: dict[str, tuple[bytes, int]], image: np.ndarray, n: int,
            blocks: int) -> dict[str, float]:
    """Over HTTP, one request at a time: the pipeline, and the client chaining the three steps itself."""
    client = Client(port)

    def chained() -> None:
        x = client.post("pre", *binary_body({"raw": image}, ["x"]))["x"]
        out = client.post("mlp", *binary_body({"input": x}, ["output"]))["output"]
        client.post("post", *binary_body({"logits": np.array(out)}, ["probs", "label"]))

    rows = {"pipe_mlp": lambda: client.post("pipe_mlp", *bodies_["pipe_mlp"]), "chain": chained}
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for call in rows.values():
        for _ in range(300):
            call()
    for _ in range(blocks):
        for name, call in rows.items():
            for _ in range(max(1, n // blocks)):
                t0 = time.perf_counter()
                call()
                samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) * 1e3 for name, v in samples.items()}


def orchestration_us(n: int) -> float:
    """The ensemble scheduler's own cost per 3-step request: its steps answered at once by scripted models (no
    scheduler, no worker; each checks its request as a model's scheduler would, through its signature cache). One
    request per turn of an event loop (its first step is sent at the end of the turn: rule 6), less the cost of a
    bare turn, measured in the same run."""
    from gpud.executor.ensemble import EnsembleScheduler
    from gpud.executor.model_config import (ENSEMBLE_PLATFORM, EnsembleScheduling, EnsembleStep, ModelConfig,
                                       TensorSpec)
    from gpud.executor.types import InferRequest, InferResponse, InferTensor
    from gpud.executor.validation import PreparedCache

    spec = (TensorSpec("x", "FP32", (WIDTH,)),)

    class Answering:
        def __init__(self) -> None:
            self.prepare = PreparedCache(ModelConfig(name="m", max_batch_size=64, inputs=spec,
                                                     outputs=(TensorSpec("y", "FP32", (WIDTH,)),))).prepare

        def submit(self, request, done):
            self.prepare(request)
            x = request.inputs[0].data
            done(InferResponse(request.model_name, "1", [InferTensor("y", "FP32", x.shape, x)]))

        def cancel(self, handle) -> None:
            pass

    steps = tuple(EnsembleStep(f"s{i}", -1, (("x", f"t{i}"),), (("y", f"t{i + 1}"),)) for i in range(3))
    config = ModelConfig(name="e", platform=ENSEMBLE_PLATFORM, backend="", max_batch_size=64,
                         inputs=(TensorSpec("t0", "FP32", (WIDTH,)),), outputs=(TensorSpec("t3", "FP32", (WIDTH,)),),
                         instance_groups=(), ensemble=EnsembleScheduling(steps))
    targets = {s.model_name: Answering() for s in steps}
    scheduler = EnsembleScheduler(config, "1", lambda r: targets[r.model_name])
    x = np.zeros((1, WIDTH), np.float32)
    request = InferRequest("e", [InferTensor("t0", "FP32", x.shape, x)], signature=object())
    answers: list = []

    async def timed(count: int, submit: bool) -> float:
        t0 = time.perf_counter()
        for _ in range(count):
            if submit:
                scheduler.submit(request, answers.append)
            await asyncio.sleep(0)  # the turn ends: the first step goes
        return time.perf_counter() - t0

    async def measure() -> float:
        await timed(1000, True)
        await timed(1000, False)
        with_turns, turns = await timed(n, True), await timed(n, False)
        return (with_turns - turns) / n * 1e6

    us = asyncio.run(measure())
    assert len(answers) == n + 1000 and isinstance(answers[-1], InferResponse)
    return us


def raw_compute_ms(files: dict[str, str], arrays: dict[str, np.ndarray], n: int) -> dict[str, float]:
    """onnxruntime in-process, batch 1, with gpud's worker's session settings: each step's own compute."""
    out = {}
    for name in STEPS:
        sess = make_session(files[name])
        feed = {sess.get_inputs()[0].name: arrays[name]}
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
    # The placement controller off: the instance counts stay as configured, one per step model.
    return floor.start(workdir, repo, False, "--placement-control", "off")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="measured requests per concurrency-1 row")
    p.add_argument("--blocks", type=int, default=10, help="concurrency 1: blocks the rows are interleaved in")
    p.add_argument("--repeat", type=int, default=3, help="concurrency 64: pairs (pipeline, slowest step alone)")
    p.add_argument("--seconds", type=float, default=6.0, help="each concurrency-64 point")
    p.add_argument("--heavy-layers", type=int, default=serving_models.HEAVY_LAYERS,
                   help="the slowest step's depth (bench/serving's heavy: 44; its CPU per row grows with it)")
    p.add_argument("--kind", choices=("cpu", "gpu"), default="cpu",
                   help="the step models' instance kind: cpu (every step on the CPU worker, the default) or gpu "
                        "(on a GPU node: the steps on a GPU, so the slowest step computes off the host cores)")
    p.add_argument("--throughput-only", action="store_true",
                   help="only the concurrency-64 pairs (part 2), not the concurrency-1 rows")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    wrk = serving_run.ensure_wrk()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="gpud-ensemble-bench-") as workdir:
        repo = os.path.join(workdir, "models")
        files = write_repository(repo, args.heavy_layers, f"KIND_{args.kind.upper()}")
        arrays, body = bodies(np.random.default_rng(0))
        first = not args.throughput_only
        if first:
            raw = raw_compute_ms(files, arrays, args.requests)
            own_us = orchestration_us(10 * args.requests)
            inproc = asyncio.run(inprocess_ms(repo, arrays, args.requests, args.blocks))
        proc, ports = start_gpud(workdir, repo)
        try:
            if first:
                over_http = http_ms(ports["http"], body, arrays["image"], args.requests, args.blocks)
                client = Client(ports["http"])
                before = request_ns(client)
                for _ in range(200):
                    client.post("pipe_mlp", *body["pipe_mlp"])
                after = request_ns(client)
                copies = {s: per_request_us(before, after, s, field=2) for s in STEPS}
            procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            pairs = []
            for _ in range(args.repeat):
                pairs.append({model: throughput_row(wrk, ports["http"], model, body[model], args.seconds, workdir,
                                                    procs) for model in ("pipe_heavy", "heavy")})
        finally:
            proc.terminate()
            proc.wait(30)
    ratios = [pair["pipe_heavy"]["req_s"] / pair["heavy"]["req_s"] for pair in pairs]
    ratio = statistics.median(ratios)
    print(f"# {platform.node()}: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, Python "
          f"{platform.python_version()}; gpud {_git_describe()}; load average (1, 5, 15 min) before: "
          f"{' '.join(f'{x:.1f}' for x in load_before)}, after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"# .venv/bin/python bench/ensemble_bench.py --requests {args.requests} --blocks {args.blocks} "
          f"--repeat {args.repeat} --seconds {args.seconds:g} --heavy-layers {args.heavy_layers} --kind {args.kind}"
          + (" --throughput-only" if args.throughput_only else ""))
    if first:
        steps_alone = sum(inproc[s] for s in STEPS)
        overhead_ms = (inproc["pipe_mlp"] - inproc["chain"]) / 3
        overhead_vs_alone_ms = (inproc["pipe_mlp"] - steps_alone) / 3
        print(f"# concurrency 1, pipe_mlp = pre -> mlp -> post: gpud's core in-process (core.infer), medians of "
              f"{args.requests} requests per row in {args.blocks} interleaved blocks")
        print(f"{'row':40s} {'p50 ms':>8s} {'onnxruntime ms':>15s} {'tensors in+out us':>18s}")
        print(f"{'pipeline (ensemble)':40s} {inproc['pipe_mlp']:8.3f} {sum(raw.values()):15.3f}")
        print(f"{'the three steps chained by hand':40s} {inproc['chain']:8.3f}")
        for s in STEPS:
            print(f"{s + ' alone':40s} {inproc[s]:8.3f} {raw[s]:15.3f} {copies[s]:18.0f}")
        print(f"ensemble overhead per step: {overhead_ms:.4f} ms against its steps chained by hand, "
              f"{overhead_vs_alone_ms:.4f} ms against the sum of its steps alone (target < {OVERHEAD_TARGET_MS} ms: "
              f"{'PASS' if max(overhead_ms, overhead_vs_alone_ms) < OVERHEAD_TARGET_MS else 'FAIL'})")
        print(f"the ensemble scheduler's own cost (scripted steps answering at once): {own_us:.1f} us per 3-step request")
        print(f"# over HTTP (Python http.client, binary tensors, keep-alive), medians in {args.blocks} interleaved blocks")
        print(f"{'pipeline (ensemble)':40s} {over_http['pipe_mlp']:8.3f}")
        print(f"{'the client chaining the three steps':40s} {over_http['chain']:8.3f}")
        print(f"pipeline / client chaining: {over_http['pipe_mlp'] / over_http['chain']:.2f}")
    print(f"# concurrency 64 (wrk -t1 -c64, binary, {args.seconds:g} s after 2 s warm-up), {args.repeat} pairs")
    print(f"{'row':40s} {'req/s':>8s} {'p50 ms':>8s} {'front us/req':>13s} {'workers us/req':>15s} {'errors':>7s}")
    for k, pair in enumerate(pairs):
        for model, label in (("pipe_heavy", "pipeline (pre -> heavy -> post)"), ("heavy", "heavy alone")):
            r = pair[model]
            print(f"{f'{k + 1}: {label}':40s} {r['req_s']:8.0f} {r['p50_ms']:8.2f} {r['front_us']:13.0f} "
                  f"{r['workers_us']:15.0f} {r['errors']:7d}")
    print(f"pipeline / slowest step alone, per pair: {', '.join(f'{x:.3f}' for x in ratios)}; median {ratio:.3f} "
          f"(target >= {THROUGHPUT_TARGET}: {'PASS' if ratio >= THROUGHPUT_TARGET else 'FAIL'})")
    if args.json:
        with open(args.json, "w") as f:
            results = {"throughput": pairs, "throughput_ratios": ratios}
            if first:
                results |= {"orchestration_us": own_us, "inprocess_ms": inproc, "http_ms": over_http,
                            "onnxruntime_ms": raw, "tensors_in_out_us": copies, "overhead_per_step_ms": overhead_ms,
                            "overhead_per_step_vs_alone_ms": overhead_vs_alone_ms}
            json.dump(results, f, indent=2)
    return 0


def _git_describe() -> str:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() or "?"
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
