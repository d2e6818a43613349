#!/usr/bin/env python3
"""Sequence batching: what gpud keeping a sequence's state costs, against the client keeping it (issue 16 item 2).

    .venv/bin/python bench/sequence_bench.py [--state-elements 1,16384,262144] [--concurrency 8] [--quick]

A stateful model without sequence batching makes the client carry its state: every request sends the state in and
gets the new state back. With sequence batching gpud keeps it (gpud.executor.sequence_scheduler): the client sends only
its input, and gpud stages the state through the instance's shared memory. One ONNX accumulator (state' =
(START ? 0 : state) + INPUT * READY, the state FP32 of N elements), two models in one repository:

  - `seq`:   sequence_batching (direct, max_batch_size 8, START/READY/CORRID controls, implicit state); perf_analyzer
             drives sequences of 10 requests (--sequence-length 10), the client sends INPUT only;
  - `plain`: the same file served with dynamic batching; the client sends INPUT, START, READY, CORRID and the state
             (N floats) and receives the new state (N floats) with OUTPUT: client-managed state.

perf_analyzer (gRPC, async, --concurrency) drives each in turn, one gpud, one run; the table gives requests/s, p50
and p99, and seq / plain. Client and server share the machine's cores: compare the ratios within one run.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "serving"))

from tests.daemon_harness import save, start_daemon  # noqa: E402


def accumulator(elements: int) -> onnx.ModelProto:
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
    nodes = [
        helper.make_node("Constant", [], ["zero"], value=zero),
        helper.make_node("Cast", ["START"], ["start_b"], to=TensorProto.BOOL),
        helper.make_node("Where", ["start_b", "zero", "INPUT_STATE"], ["base"]),
        helper.make_node("Cast", ["READY"], ["ready_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["INPUT", "ready_f"], ["add"]),
        helper.make_node("Add", ["base", "add"], ["OUTPUT_STATE"]),
        helper.make_node("Identity", ["add"], ["OUTPUT"]),  # the client's answer: small, whatever the state
        helper.make_node("Identity", ["CORRID"], ["CORRID_OUT"]),
    ]

    def vi(name, t, width):
        return helper.make_tensor_value_info(name, t, ["N", width])

    inputs = [vi("INPUT", TensorProto.FLOAT, 1), vi("START", TensorProto.INT32, 1), vi("READY", TensorProto.INT32, 1),
              vi("CORRID", TensorProto.UINT64, 1), vi("INPUT_STATE", TensorProto.FLOAT, elements)]
    outputs = [vi("OUTPUT", TensorProto.FLOAT, 1), vi("OUTPUT_STATE", TensorProto.FLOAT, elements),
               vi("CORRID_OUT", TensorProto.UINT64, 1)]
    model = helper.make_model(helper.make_graph(nodes, "acc", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17)], producer_name="gpud-bench")
    model.ir_version = 8
    return model


def seq_config(elements: int) -> str:
    return f"""
max_batch_size: 8
sequence_batching {{
  max_sequence_idle_microseconds: 10000000
  direct {{ }}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}
  ]
  state [ {{ input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_FP32 dims: [ {elements} ] }} ]
}}
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
"""


PLAIN_CONFIG = """
max_batch_size: 8
dynamic_batching { }
instance_group [ { count: 1, kind: KIND_CPU } ]
"""


def perf_analyzer_path() -> str:
    given = os.environ.get("GPUD_PERF_ANALYZER")
    if given:
        return given
    from run import ensure_perf_analyzer  # bench/serving/run.py installs it under .bench/ on first use

    return ensure_perf_analyzer()


def measure(pa: str, url: str, model: str, concurrency: int, window_ms: int, extra: list[str], workdir: str) -> dict:
    out_csv = os.path.join(workdir, f"{model}.csv")
    cmd = [pa, "-m", model, "-u", url, "-i", "grpc", "--async", "--concurrency-range", str(concurrency),
           "-p", str(window_ms), "-s", "100", "-r", "10", "-f", out_csv, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-2000:]}")
    with open(out_csv) as f:
        row = next(csv.DictReader(f))
    return {"requests_per_s": float(row["Inferences/Second"]), "p50_us": float(row["p50 latency"]),
            "p99_us": float(row["p99 latency"])}


def decision_cost_us(rounds: int = 3000) -> dict[str, float]:
    """In-process, no I/O: microseconds per request of the sequence batcher's decisions (enqueue, decide, complete;
    16 sequences on 2 instances of 8 slots) and of the dynamic batcher's for the same requests (the baseline)."""
    from gpud.executor.batcher import BatchQueue, Dispatch, QueuedRequest
    from gpud.executor.model_config import DynamicBatching
    from gpud.executor.sequence_batcher import SequenceBatcher, SequenceDispatch, SequenceRequest
    from gpud.executor.sequence_config import DIRECT, OLDEST, SequenceBatching

    out = {}
    for strategy in (DIRECT, OLDEST):
        sb = SequenceBatcher(SequenceBatching(strategy, max_candidate_sequences=8), model_name="m", max_batch_size=8,
                             clock=time.monotonic)
        sb.add_instance("a")
        sb.add_instance("b")
        t0 = time.perf_counter()
        for r in range(rounds):
            for cid in range(1, 17):
                sb.enqueue(SequenceRequest(None, cid, start=r == 0))
            for key in ("a", "b"):
                while isinstance(d := sb.decide(key), SequenceDispatch):
                    sb.complete(d)
            sb.expire()
        out[strategy] = (time.perf_counter() - t0) / (16 * rounds) * 1e6
    q = BatchQueue(max_batch_size=8, dynamic_batching=DynamicBatching(), clock=time.monotonic)
    t0 = time.perf_counter()
    for _ in range(rounds):
        for _ in range(16):
            q.enqueue(QueuedRequest(None, 1, "k"))
        while isinstance(q.decide(2), Dispatch):
            pass
    out["dynamic"] = (time.perf_counter() - t0) / (16 * rounds) * 1e6
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-elements", default="1,16384,262144", help="state sizes, FP32 elements (comma list)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--window-ms", type=int, default=3000, help="perf_analyzer measurement window")
    p.add_argument("--quick", action="store_true", help="one small state, short windows")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    sizes = [1] if args.quick else [int(s) for s in args.state_elements.split(",")]
    window_ms = 1000 if args.quick else args.window_ms
    costs = decision_cost_us(300 if args.quick else 3000)
    print(f"decisions per request: sequence batcher direct {costs['direct']:.2f} us "
          f"({costs['direct'] / costs['dynamic']:.2f}x the dynamic batcher's {costs['dynamic']:.2f} us), oldest "
          f"{costs['oldest']:.2f} us ({costs['oldest'] / costs['dynamic']:.2f}x)")
    pa = perf_analyzer_path()
    results = []
    with tempfile.TemporaryDirectory(prefix="gpud-seq-bench-") as tmp:
        tmp_path = Path(tmp)
        for elements in sizes:
            repo = tmp_path / f"repo{elements}"
            model = accumulator(elements)
            save(model, repo, "seq", seq_config(elements))
            save(model, repo, "plain", PLAIN_CONFIG)
            daemon = start_daemon(repo, tmp_path, "--log-verbose", "0", node=None)
            try:
                row = {"state_elements": elements, "state_bytes": 4 * elements}
                for name, extra in (("plain", []), ("seq", ["--sequence-length", "10"])):
                    measure(pa, daemon.grpc_url, name, args.concurrency, max(500, window_ms // 3), extra, tmp)
                    row[name] = measure(pa, daemon.grpc_url, name, args.concurrency, window_ms, extra, tmp)
                    print(f"[{time.strftime('%H:%M:%S')}] state {elements:>7} floats, {name:<5}: "
                          f"{row[name]['requests_per_s']:9.1f} req/s, p50 {row[name]['p50_us'] / 1e3:7.2f} ms, "
                          f"p99 {row[name]['p99_us'] / 1e3:7.2f} ms", file=sys.stderr, flush=True)
                results.append(row)
            finally:
                daemon.stop()
    print(f"\nconcurrency {args.concurrency}, gRPC, perf_analyzer --async; seq: gpud keeps the state, plain: the "
          "client sends and receives it\n")
    print(f"{'state':>12} {'plain req/s':>12} {'seq req/s':>10} {'seq/plain':>10} {'plain p50 ms':>13} "
          f"{'seq p50 ms':>11} {'plain p99 ms':>13} {'seq p99 ms':>11}")
    for r in results:
        a, b = r["plain"], r["seq"]
        size = f"{r['state_bytes'] / 1024:.0f} KiB" if r["state_bytes"] >= 1024 else f"{r['state_bytes']} B"
        print(f"{size:>12} {a['requests_per_s']:12.1f} {b['requests_per_s']:10.1f} "
              f"{b['requests_per_s'] / a['requests_per_s']:9.2f}x {a['p50_us'] / 1e3:13.2f} {b['p50_us'] / 1e3:11.2f} "
              f"{a['p99_us'] / 1e3:13.2f} {b['p99_us'] / 1e3:11.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"decisions_us": costs, "serving": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
