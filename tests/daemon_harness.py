"""Starts the real gpud daemon as a subprocess on loopback for end-to-end tests, and builds test repositories."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120.0


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    """Poll an observable condition until it holds (bounded). Not a sleep standing in for an event: the condition
    itself is checked, and a timeout fails the test with `what`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


@dataclass
class Daemon:
    proc: subprocess.Popen
    ports: dict
    log_lines: list[str] = field(default_factory=list)

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=30) as r:
            return json.loads(r.read())

    def post_json(self, path: str, doc: object = None, timeout_s: float = 120) -> tuple[int, dict]:
        """POST `doc` as JSON (an empty body for None): the status and the answer's JSON ({} for an empty one), also
        for an error status."""
        body = json.dumps(doc).encode() if doc is not None else b""
        req = urllib.request.Request(f"http://{self.http_url}{path}", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                text = r.read()
                return r.status, json.loads(text) if text else {}
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def inspect(self) -> dict:
        return self.get_json("/v2/gpud/inspect")

    def log(self) -> str:
        return "".join(self.log_lines)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode


# GPUD_TEST_FRONTEND_PROCESSES=N: every daemon the tests start serves HTTP and gRPC from N front-end processes of
# their own (gpud.frontproc), so that the e2e suites run in that mode too (.ci/run runs them so). Without it, 0 (the
# front ends on the core's loop), said outright: the default ("auto") would depend on the machine's CPUs.
_PROCESSES = os.environ.get("GPUD_TEST_FRONTEND_PROCESSES") or "0"
FRONTEND_PROCESSES: tuple[str, ...] = ("--http-processes", _PROCESSES, "--grpc-processes", _PROCESSES)
# GPUD_TEST_GRPC_SERVER=grpcio: every daemon (and tests/test_grpc_api.py's server) serves gRPC on grpcio's server
# instead of gpud's own (.ci/run runs the gRPC suites so).
GRPC_SERVER = os.environ.get("GPUD_TEST_GRPC_SERVER", "gpud")
if GRPC_SERVER != "gpud":
    FRONTEND_PROCESSES += ("--grpc-server", GRPC_SERVER)


def start_daemon(repo: Path | None, tmp: Path, *extra: str, node: str | None = "config/nodes/dgx-a100-2gpu-mig.yaml",
                 env: dict[str, str] | None = None, launch: tuple[str, ...] = ("-m", "gpud.main")) -> Daemon:
    """`repo` None: gpud's example models, as ./scripts/run serves them. `env`: added to the daemon's environment
    (e.g. NOTIFY_SOCKET). `launch`: python's arguments that run gpud's main with the rest as its argv."""
    ready_file = tmp / f"ready-{time.monotonic_ns()}.json"
    cmd = [sys.executable, *launch, *(["--model-repository", str(repo)] if repo is not None else []),
           "--address", "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
           "--ready-file", str(ready_file), *FRONTEND_PROCESSES, *extra]
    if node:
        cmd += ["--node", str(ROOT / node)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env} if env else None)
    daemon = Daemon(proc, {})
    ready = threading.Event()

    def pump() -> None:  # drain stderr so the daemon never blocks on a full pipe; "ready" is our start event
        for line in proc.stderr:
            daemon.log_lines.append(line)
            if "ready: serving" in line:
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(START_TIMEOUT_S) or proc.poll() is not None:
        proc.kill()
        raise AssertionError(f"gpud did not start:\n{daemon.log()}")
    daemon.ports = json.loads(ready_file.read_text())
    return daemon


# --- test models ---------------------------------------------------------------------------------------------
def save(model: onnx.ModelProto, repo: Path, name: str, config: str | None = None, version: int = 1) -> Path:
    d = repo / name / str(version)
    d.mkdir(parents=True, exist_ok=True)
    onnx.save(model, d / "model.onnx")
    if config is not None:
        (repo / name / "config.pbtxt").write_text(config)
    return d / "model.onnx"


ADD_SUB_CONFIG = """max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }, { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
dynamic_batching { max_queue_delay_microseconds: 500 }
"""


def add_sub_model() -> onnx.ModelProto:
    """Triton's `simple` example: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 ([batch, 16] FP32)."""
    t = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 16])  # noqa: E731
    graph = helper.make_graph([helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
                               helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])], "add_sub",
                              [t("INPUT0"), t("INPUT1")], [t("OUTPUT0"), t("OUTPUT1")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def slow_model(width: int = 1024, layers: int = 300, seed: int = 0) -> onnx.ModelProto:
    """[-1, width] FP32 -> same: `layers` matmuls with one shared weight, so a batch takes a while to compute (for
    tests that need a request to be in flight) while the file stays small."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32), "w")
    nodes, prev = [], "x"
    for i in range(layers):
        nodes.append(helper.make_node("MatMul", [prev, "w"], [f"h{i}"]))
        nodes.append(helper.make_node("Tanh", [f"h{i}"], [f"t{i}"]))
        prev = f"t{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    graph = helper.make_graph(nodes, "slow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="gpud-tests")
    model.ir_version = 8
    return model


SLOW_CONFIG = """
max_batch_size: 64
dynamic_batching { }
instance_group [ { count: 1, kind: KIND_CPU } ]
"""


def example_inputs(name: str, rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """`rows` rows of random input for one of gpud.examples' models (mlp, cnn, two_input) or slow_model's."""
    if name == "mlp":
        return {"input": rng.standard_normal((rows, 256)).astype(np.float32)}
    if name == "cnn":
        return {"input": rng.standard_normal((rows, 3, 32, 32)).astype(np.float32)}
    if name in ("slow", "slow_alone"):
        return {"x": rng.standard_normal((rows, 512)).astype(np.float32)}
    return {"ids": rng.integers(-5, 5, (rows, 4)).astype(np.int64), "scale": rng.random((rows, 4)).astype(np.float32)}


def onnxruntime_reference(repo: Path, name: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of model `name` (version 1 in `repo`) run by onnxruntime itself on the CPU, by name."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(repo / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, inputs)))
