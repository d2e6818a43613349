"""Soak: the real daemon at saturation for N minutes with a mix of good and bad requests (not run in CI).

Client processes (default 6, for 2 cores: the daemon and its device worker are kept busy) send, each on its own
keep-alive connection and its own gRPC channel, a fixed weighted mix: good JSON, binary and gRPC inferences on the
example `mlp` and on the example ensemble `pipeline` (its steps batched in groups: gpud/executor/ensemble.py rule 6),
64-row JSON bodies (decoded in a child process: the soak offloads JSON over 64 KiB), health
probes; and bad requests: unknown models,
malformed JSON, huge declared shapes, a pipeline request over its batch size, traversal names, conflicting Content-Length, declared bodies over the limit,
gzip bombs, gRPC messages that are no protobuf, bodies abandoned half-way (the client closes). Every request has an
expected answer; one that gets no answer or another status is *lost*. A good inference answered 503 (a full queue:
load shedding) is counted as shed, not lost.

Every 10 s the daemon's resident memory (and its children's: device worker, JSON decoders), its open file
descriptors and connections, and the requests done so far are recorded. At the end: the counts, the samples, and the
growth of RSS and descriptors between the first sample after warm-up and the last. Exit status 1 when a request was
lost or descriptors grew.

    .venv/bin/python bench/soak.py --minutes 10            # as in docs/benchmarks.md
    .venv/bin/python bench/soak.py --minutes 1 --clients 4  # a quick check
"""
from __future__ import annotations

import argparse
import collections
import gzip
import http.client
import json
import multiprocessing as mp
import os
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import orjson
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpud.examples import write_example_repository, write_pipeline_example  # noqa: E402
from gpud.proto import grpc_service_pb2 as pb  # noqa: E402
from gpud.proto import grpc_service_pb2_grpc as pb_grpc  # noqa: E402
from tests.daemon_harness import start_daemon  # noqa: E402

SAMPLE_EVERY_S = 10.0
MAX_REQUEST_BYTES = 8 * 2**20
TIMEOUT_S = 60.0

ROW = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
GOOD_JSON = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 256], "data": ROW}]},
                         option=orjson.OPT_SERIALIZE_NUMPY)
BIN_HEADER = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 256],
                                       "parameters": {"binary_data_size": 1024}}],
                           "parameters": {"binary_data_output": True}})
GOOD_BINARY = BIN_HEADER + ROW.tobytes()
ROWS_BIG = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)  # mlp's max_batch_size
BIG_JSON = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [64, 256], "data": ROWS_BIG}]},
                        option=orjson.OPT_SERIALIZE_NUMPY)  # ~180 KB; the soak's daemon offloads JSON over 64 KiB
IMAGE = np.random.default_rng(2).integers(0, 256, (2, 16), dtype=np.uint8)  # the example pipeline's input
GOOD_PIPELINE = orjson.dumps({"inputs": [{"name": "IMAGE", "datatype": "UINT8", "shape": [2, 16],
                                          "data": IMAGE.ravel().tolist()}]})
# A valid ensemble request of 17 rows: the pipeline takes max_batch_size 16, so the ensemble refuses it at once.
BAD_PIPELINE = orjson.dumps({"inputs": [{"name": "IMAGE", "datatype": "UINT8", "shape": [17, 16],
                                         "data": [0] * (17 * 16)}]})
HUGE_SHAPE = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 10**12], "data": [1.0]}]})
BOMB = gzip.compress(b"0" * (MAX_REQUEST_BYTES + 4096))


class Client:
    """One HTTP keep-alive connection, reopened when the server closes it."""

    def __init__(self, port: int):
        self.port = port
        self.conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> int:
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
            try:
                self.conn.request(method, path, body=body, headers=headers or {})
                response = self.conn.getresponse()
                response.read()
                if response.getheader("Connection", "").lower() == "close":
                    self.close()
                return response.status
            except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected):
                # a keep-alive connection the server closed while idle: the request was never read; retry once
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def raw(port: int, data: bytes, expect_answer: bool = True) -> int | None:
    """Bytes on a fresh connection; the first answer's status (None if the server closed without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.sendall(data)
        if not expect_answer:
            return None  # closed half-way: nothing to wait for
        received = b""
        while b"\r\n" not in received:
            chunk = sock.recv(4096)
            if not chunk:
                return None
            received += chunk
        return int(received.split(b" ", 2)[1])


def post_head(path: str, length: int, *extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: soak\r\nContent-Length: {length}\r\n" + "".join(e + "\r\n" for e in extra)
            + "\r\n").encode()


# kind: (weight, what it does -> status or grpc code name, the answers it may get)
def make_kinds(http_port: int, stub) -> dict:
    c = Client(http_port)
    json_headers = {"Content-Type": "application/json"}
    bin_headers = {"Inference-Header-Content-Length": str(len(BIN_HEADER)), "Content-Type": "application/octet-stream"}
    good_grpc = pb.ModelInferRequest(model_name="mlp", inputs=[pb.ModelInferRequest.InferInputTensor(
        name="input", datatype="FP32", shape=[1, 256])], raw_input_contents=[ROW.tobytes()])
    bad_grpc_bytes = stub["raw"]
    good_grpc_pipeline = pb.ModelInferRequest(model_name="pipeline", inputs=[pb.ModelInferRequest.InferInputTensor(
        name="IMAGE", datatype="UINT8", shape=[2, 16])], raw_input_contents=[IMAGE.tobytes()])

    def grpc_code(fn, message) -> str:
        try:
            fn(message, timeout=TIMEOUT_S)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name

    return {
        "good json": (25, lambda: c.request("POST", "/v2/models/mlp/infer", GOOD_JSON, json_headers), {200}, {503}),
        "good binary": (25, lambda: c.request("POST", "/v2/models/mlp/infer", GOOD_BINARY, bin_headers), {200}, {503}),
        "good grpc": (15, lambda: grpc_code(stub["stub"].ModelInfer, good_grpc), {"OK"}, {"UNAVAILABLE"}),
        "big json (offloaded)": (2, lambda: c.request("POST", "/v2/models/mlp/infer", BIG_JSON, json_headers), {200},
                             {503}),
        "good pipeline": (10, lambda: c.request("POST", "/v2/models/pipeline/infer", GOOD_PIPELINE, json_headers),
                          {200}, {503}),
        "good grpc pipeline": (5, lambda: grpc_code(stub["stub"].ModelInfer, good_grpc_pipeline), {"OK"},
                               {"UNAVAILABLE"}),
        "pipeline over its batch size": (2, lambda: c.request("POST", "/v2/models/pipeline/infer", BAD_PIPELINE,
                                                              json_headers), {400}, set()),
        "health": (8, lambda: c.request("GET", "/v2/health/ready"), {200}, set()),
        "unknown model": (4, lambda: c.request("POST", "/v2/models/nope/infer", GOOD_JSON, json_headers), {404},
                          set()),
        "malformed json": (4, lambda: c.request("POST", "/v2/models/mlp/infer", b'{"inputs": [', json_headers),
                           {400}, set()),
        "huge shape": (4, lambda: c.request("POST", "/v2/models/mlp/infer", HUGE_SHAPE, json_headers), {400}, set()),
        "traversal": (3, lambda: c.request("GET", "/v2/models/..%2F..%2Fetc/config"), {400, 404}, set()),
        "traversal name": (2, lambda: c.request("GET", "/v2/models/..%00/config"), {400}, set()),
        "conflicting length": (2, lambda: raw(http_port, post_head("/v2/models/mlp/infer", 2, "Content-Length: 9")
                                              + b"{}"), {400}, set()),
        "over the limit": (2, lambda: raw(http_port, post_head("/v2/models/mlp/infer", MAX_REQUEST_BYTES + 1)),
                           {413}, set()),
        "gzip bomb": (1, lambda: c.request("POST", "/v2/models/mlp/infer", BOMB,
                                           {**json_headers, "Content-Encoding": "gzip"}), {413}, set()),
        "abandoned body": (2, lambda: raw(http_port, post_head("/v2/models/mlp/infer", len(GOOD_JSON))
                                          + GOOD_JSON[:100], expect_answer=False), {None}, set()),
        "grpc not a message": (3, lambda: grpc_code(bad_grpc_bytes, b"\x00\x01garbage"), {"INVALID_ARGUMENT"},
                               set()),
        "grpc bad shape": (3, lambda: grpc_code(stub["stub"].ModelInfer, pb.ModelInferRequest(
            model_name="mlp", inputs=[pb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32",
                                                                             shape=[1, 10**12])],
            raw_input_contents=[b"\0" * 8])), {"INVALID_ARGUMENT"}, set()),
    }


def client_main(index: int, http_port: int, grpc_url: str, deadline_s: float, done: "mp.Value", lost: "mp.Value",
                results: "mp.Queue") -> None:
    rng = random.Random(index)
    channel = grpc.insecure_channel(grpc_url)
    stub = {"stub": pb_grpc.GRPCInferenceServiceStub(channel),
            "raw": channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                       request_serializer=lambda b: b, response_deserializer=lambda b: b)}
    kinds = make_kinds(http_port, stub)
    names = list(kinds)
    weights = [kinds[k][0] for k in names]
    counts: dict[str, collections.Counter] = {k: collections.Counter() for k in names}
    lost_examples: list[str] = []
    while time.time() < deadline_s:
        kind = rng.choices(names, weights)[0]
        _, run, expected, shed = kinds[kind]
        try:
            outcome = run()
        except Exception as e:  # noqa: BLE001 - a request that got no answer: lost
            outcome = f"exception {type(e).__name__}: {e}"
        if outcome in expected:
            counts[kind]["ok"] += 1
        elif outcome in shed:
            counts[kind]["shed"] += 1
        else:
            counts[kind][f"lost ({outcome})"] += 1
            with lost.get_lock():
                lost.value += 1
            if len(lost_examples) < 5:
                lost_examples.append(f"{kind}: {outcome}")
        with done.get_lock():
            done.value += 1
    channel.close()
    results.put((counts, lost_examples))


def tree_rss_bytes(proc: psutil.Process) -> tuple[int, int]:
    children = 0
    for child in proc.children(recursive=True):
        try:
            children += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return proc.memory_info().rss, children


def tree_cpu_s(proc: psutil.Process) -> float:
    """CPU seconds of the daemon and its children so far (the device worker does the computing)."""
    total = sum(proc.cpu_times()[:2])
    for child in proc.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--warmup-seconds", type=float, default=30.0,
                        help="growth is measured from the first sample after this (default 30)")
    parser.add_argument("--output", help="write the samples and counts as JSON here")
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="gpud-soak-"))
    write_example_repository(tmp / "repo", ["mlp"])
    write_pipeline_example(tmp / "repo")
    daemon = start_daemon(tmp / "repo", tmp, "--max-request-bytes", str(MAX_REQUEST_BYTES),
                          "--json-offload-bytes", "65536", node=None)
    proc = psutil.Process(daemon.proc.pid)
    print(f"gpud pid {proc.pid}; {args.clients} clients for {args.minutes:g} min", flush=True)
    start_s = time.time()
    deadline_s = start_s + args.minutes * 60
    done, lost = mp.Value("q", 0), mp.Value("q", 0)
    results: mp.Queue = mp.Queue()
    clients = [mp.Process(target=client_main, args=(i, daemon.ports["http"], daemon.grpc_url, deadline_s, done, lost,
                                                    results)) for i in range(args.clients)]
    for p in clients:
        p.start()
    samples = []
    stop = threading.Event()
    last_cpu = [tree_cpu_s(proc), time.time()]

    def sample() -> None:
        rss, children = tree_rss_bytes(proc)
        cpu_s, now_s = tree_cpu_s(proc), time.time()
        cores = (cpu_s - last_cpu[0]) / max(now_s - last_cpu[1], 1e-9)
        last_cpu[:] = [cpu_s, now_s]
        samples.append({"t_s": round(now_s - start_s, 1), "rss_bytes": rss, "children_rss_bytes": children,
                        "fds": proc.num_fds(), "connections": len(proc.net_connections(kind="inet")),
                        "requests": done.value, "lost": lost.value, "cpu_cores": round(cores, 2)})
        s = samples[-1]
        print(f"t={s['t_s']:6.1f}s rss={rss / 2**20:7.1f} MB children={children / 2**20:7.1f} MB fds={s['fds']:4d} "
              f"conns={s['connections']:4d} requests={s['requests']:8d} lost={s['lost']} "
              f"gpud cpu={cores:.2f} cores", flush=True)

    sample()
    while time.time() < deadline_s:
        stop.wait(min(SAMPLE_EVERY_S, max(0.0, deadline_s - time.time())))
        sample()
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    lost_examples = []
    for _ in clients:
        part, examples = results.get(timeout=120)
        for kind, c in part.items():
            counts[kind].update(c)
        lost_examples += examples
    for p in clients:
        p.join(30)
    time.sleep(2.0)  # noqa: the last connections' closes reach the daemon; then one more sample
    sample()
    code = daemon.stop()
    log = daemon.log()

    elapsed_s = samples[-1]["t_s"]
    base = next((s for s in samples if s["t_s"] >= args.warmup_seconds), samples[0])
    last = samples[-1]
    total = sum(sum(c.values()) for c in counts.values())
    print(f"\n{total} requests in {elapsed_s:.0f} s ({total / elapsed_s:.0f}/s); lost {lost.value}; daemon exit {code}")
    for kind in sorted(counts):
        print(f"  {kind:22s} " + ", ".join(f"{k}: {v}" for k, v in sorted(counts[kind].items())))
    rss_values = [s["rss_bytes"] for s in samples if s["t_s"] >= base["t_s"]]
    print(f"RSS after warm-up {base['rss_bytes'] / 2**20:.1f} MB -> end {last['rss_bytes'] / 2**20:.1f} MB "
          f"(min {min(rss_values) / 2**20:.1f}, max {max(rss_values) / 2**20:.1f}); children "
          f"{base['children_rss_bytes'] / 2**20:.1f} -> {last['children_rss_bytes'] / 2**20:.1f} MB; fds "
          f"{base['fds']} -> {last['fds']} (max {max(s['fds'] for s in samples)}); tracebacks in the log: "
          f"{log.count('Traceback')}")
    if lost_examples:
        print("lost, for example:", *lost_examples, sep="\n  ")
    if args.output:
        Path(args.output).write_text(json.dumps({"samples": samples, "counts": {k: dict(v) for k, v in counts.items()},
                                                 "lost": lost.value, "exit_code": code}, indent=1))
    return 0 if lost.value == 0 and code == 0 and last["fds"] <= base["fds"] + 8 and "Traceback" not in log else 1


if __name__ == "__main__":
    sys.exit(main())
