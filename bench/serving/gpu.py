#!/usr/bin/env python3
"""The serving harness's GPU path: gpud serving a model on a GPU against raw onnxruntime-gpu on the same GPU, at
batch 1..64 (issue 17: served >= 0.9x raw at the best batch size).

    <venv with the gpu extra>/bin/python bench/serving/gpu.py [--duration 5] [--batch-sizes 1,2,4,...,64]
                                                              [--models mlp,heavy] [--concurrency 4] [--cpu]

What it does:
  1. writes the harness's models (models.py) with `instance_group [{ kind: KIND_GPU }]`;
  2. raw onnxruntime-gpu in this process, with the session gpud's worker builds (gpud.executor.onnxruntime_backend: CUDA EP
     on the first visible GPU, its own stream, FP32): rows/s at each batch size with plain `run` (numpy in, numpy
     out: a host->device and a device->host copy per call, as gpud's worker does), and with IO binding (the input in
     a device buffer updated in place, the output left on the device and copied back once per call): how much a
     worker using IO binding could gain;
  3. starts gpud on the node's real GPUs (NVML), checks one answer against onnxruntime on the CPU, and drives it with
     wrk (KServe binary bodies of `b` rows, --concurrency connections) at each batch size;
  4. prints a table (rows/s: raw, raw with IO binding, served; served / best raw) and the target, and writes JSON.
`--cpu` runs the same path on the CPU (simulated node): a check of the harness itself on a machine without a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import models  # noqa: E402
import run  # noqa: E402

TARGET_RATIO = 0.9


def write_repository(root: str, kind: str) -> dict[str, str]:
    paths = models.write_repository(root)
    for name in paths:
        config = os.path.join(root, name, "config.pbtxt")
        with open(config) as f:
            text = f.read()
        with open(config, "w") as f:
            f.write(text.replace("kind: KIND_CPU", f"kind: {kind}"))
    return paths


def kserve_binary(x: np.ndarray) -> tuple[bytes, int]:
    raw = x.astype("<f4").tobytes()
    header = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()
    return header + raw, len(header)


def raw_rows_per_s(path: str, batch_sizes: list[int], seconds: float, cpu: bool) -> tuple[str, dict, dict]:
    """(provider, rows/s with run(), rows/s with IO binding) per batch size."""
    import onnxruntime as ort

    from gpud.executor.device import WorkerDevice
    from gpud.executor.onnxruntime_backend import OnnxRuntimeInstance
    from gpud.repository.layout import load_model

    entry = load_model(os.path.dirname(os.path.dirname(path)))
    device = WorkerDevice("cpu", "cpu") if cpu else WorkerDevice("gpu0", "gpu", "")
    inst = OnnxRuntimeInstance(path, entry.config, device)
    sess, on = inst.session, ("cpu" if cpu else "cuda")
    x = np.random.default_rng(1).standard_normal((max(batch_sizes), 256)).astype(np.float32)
    plain, bound = {}, {}
    for b in batch_sizes:
        xb = np.ascontiguousarray(x[:b])
        sess.run(["output"], {"input": xb})
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds or n == 0:
            sess.run(["output"], {"input": xb})
            n += 1
        plain[b] = n * b / elapsed
        io = sess.io_binding()
        x_dev = ort.OrtValue.ortvalue_from_numpy(xb, on, 0)
        io.bind_ortvalue_input("input", x_dev)
        io.bind_output("output", on)
        sess.run_with_iobinding(io)
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds or n == 0:
            x_dev.update_inplace(xb)  # the request's rows reach the device, as a server's would
            sess.run_with_iobinding(io)
            io.copy_outputs_to_cpu()
            n += 1
        bound[b] = n * b / elapsed
    return inst.provider, plain, bound


class Gpud(run.GpudServer):
    """gpud from this interpreter's environment (the gpu venv), on the real GPUs or, with --cpu, the simulated node."""

    def __init__(self, workdir: str, repo: str, cpu: bool):
        super().__init__(workdir, repo)
        self.cpu = cpu

    def start(self) -> None:
        ready = self.fresh_ready_file()
        cmd = [sys.executable, "-m", "gpud.main", "--model-repository", self.repo, "--address", "127.0.0.1",
               "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--log-level", "WARNING",
               "--ready-file", ready]
        if self.cpu:
            cmd += ["--node", os.path.join(ROOT, "config", "nodes", "a100-40gb-1gpu.yaml")]
        self._spawn(cmd, env=dict(os.environ, PYTHONPATH=ROOT))
        deadline = time.monotonic() + 180
        while not os.path.exists(ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gpud did not become ready; see {self.logfile}:\n"
                                   + open(self.logfile).read()[-3000:])
            time.sleep(0.2)
        self.http_port = json.load(open(ready))["http"]


def served_rows_per_s(server: Gpud, wrk: str, model: str, b: int, args, workdir: str) -> dict:
    x = np.random.default_rng(2).standard_normal((b, 256)).astype(np.float32)
    body, header_len = kserve_binary(x)
    body_file = os.path.join(workdir, f"body-{b}.bin")
    with open(body_file, "wb") as f:
        f.write(body)
    target = run.Target("gpud", "gpud http-binary", "http", "kserve-binary", "/v2/models/{model}/infer")
    if args.warmup > 0:
        run.run_wrk(wrk, server, target, model, args.concurrency, args.warmup, body_file, header_len, workdir)
    r = run.run_wrk(wrk, server, target, model, args.concurrency, args.duration, body_file, header_len, workdir)
    errors = r["errors_status"] + r["errors_read"] + r["errors_timeout"]
    return {"rows_per_s": r["requests"] * b / (r["duration_us"] / 1e6), "p50_ms": r["p50_us"] / 1e3,
            "p99_ms": r["p99_us"] / 1e3, "errors": errors}


def check_answer(server: Gpud, model: str, path: str) -> None:
    import onnxruntime as ort

    x = np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32)
    body, header_len = kserve_binary(x)
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v2/models/{model}/infer", data=body,
                                 method="POST", headers={"Inference-Header-Content-Length": str(header_len)})
    with urllib.request.urlopen(req, timeout=60) as r:
        n = int(r.headers["Inference-Header-Content-Length"])
        got = np.frombuffer(r.read()[n:], dtype="<f4").reshape(4, 16)
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(["output"], {"input": x})[0]
    worst = float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))
    if worst > 1e-4:
        raise RuntimeError(f"gpud's {model} answer differs from onnxruntime on the CPU by {worst:.2e} (> 1e-4)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=5.0, help="seconds of measured load per served point")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of unmeasured load before each point")
    p.add_argument("--raw-seconds", type=float, default=2.0, help="seconds per raw onnxruntime point")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", help="rows per request (<= 64)")
    p.add_argument("--concurrency", type=int, default=4, help="connections (requests in flight)")
    p.add_argument("--models", default="mlp,heavy", help="comma list of mlp, heavy")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (simulated node): checks the harness only")
    p.add_argument("--output", default=None, help="JSON results (default .bench/results/gpu-<time>.json)")
    args = p.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    if not batch_sizes or any(not 1 <= b <= models.MAX_BATCH_SIZE for b in batch_sizes):
        p.error(f"--batch-sizes: each must be 1..{models.MAX_BATCH_SIZE}")
    wanted = [m for m in args.models.split(",") if m]
    unknown = sorted(set(wanted) - set(models.BUILDERS))
    if unknown:
        p.error(f"--models: unknown {unknown}; known: {sorted(models.BUILDERS)}")
    import onnxruntime as ort

    if not args.cpu and "CUDAExecutionProvider" not in ort.get_available_providers():
        print("bench/serving/gpu.py: onnxruntime here has no CUDAExecutionProvider (install the gpu extra, "
              "onnxruntime-gpu in place of onnxruntime; scripts/gpu-validate does), or run with --cpu",
              file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output = args.output or os.path.join(ROOT, ".bench", "results", f"gpu-{stamp}.json")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    wrk = run.ensure_wrk()
    results: dict = {"meta": {"machine": platform.node(), "onnxruntime": ort.__version__, "cpu": args.cpu,
                              "command": " ".join([sys.executable, *sys.argv]), "time": stamp,
                              "concurrency": args.concurrency, "duration_s": args.duration}, "models": {}}
    lines = []
    with tempfile.TemporaryDirectory(prefix="gpud-gpu-bench-") as workdir:
        repo = os.path.join(workdir, "models")
        paths = {m: p for m, p in write_repository(repo, "KIND_CPU" if args.cpu else "KIND_GPU").items()
                 if m in wanted}
        raw = {}
        for m, path in paths.items():
            run.log(f"{m}: raw onnxruntime, batch {batch_sizes}")
            raw[m] = raw_rows_per_s(path, batch_sizes, args.raw_seconds, args.cpu)
        server = Gpud(workdir, repo, args.cpu)
        server.start()
        try:
            for m, path in paths.items():
                check_answer(server, m, path)
                provider, plain, bound = raw[m]
                served = {}
                for b in batch_sizes:
                    run.log(f"{m}: gpud b={b} c={args.concurrency}")
                    served[b] = served_rows_per_s(server, wrk, m, b, args, workdir)
                best_raw = max(max(plain.values()), max(bound.values()))
                best_served = max(s["rows_per_s"] for s in served.values())
                ratio = best_served / best_raw
                results["models"][m] = {"provider": provider, "raw_rows_per_s": plain, "raw_iobinding_rows_per_s": bound,
                                        "served": served, "served_over_best_raw": ratio}
                lines += [f"# {m} on {provider}", f"{'batch':>5} {'raw rows/s':>12} {'raw+iobind':>12} "
                          f"{'served rows/s':>14} {'p50 ms':>8} {'p99 ms':>8} {'served/raw':>10}"]
                for b in batch_sizes:
                    s = served[b]
                    lines.append(f"{b:>5} {plain[b]:>12.0f} {bound[b]:>12.0f} {s['rows_per_s']:>14.0f} "
                                 f"{s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f} {s['rows_per_s'] / plain[b]:>10.2f}"
                                 + (f"  ERRORS {s['errors']}" if s["errors"] else ""))
                verdict = "PASS" if ratio >= TARGET_RATIO else "FAIL"
                lines += [f"[{verdict}] {m}: best served {best_served:.0f} rows/s = {ratio:.2f} x best raw "
                          f"{best_raw:.0f} rows/s (need >= {TARGET_RATIO})", ""]
        finally:
            server.stop()
    text = "\n".join(lines)
    print(text)
    results["table"] = text
    with open(output, "w") as f:
        json.dump(results, f, indent=1, default=float)
    run.log(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
