"""The model kinds of the replay and their measured batch times.

Each kind is a real ONNX model (a stack of `layers` matmul + tanh of one `width` x `width` weight: small files, long
batches), timed with onnxruntime alone on one CPU thread at batch sizes 1..max (median of repeats). Those times are
what a batch costs in the discrete-event model (des.Kind). `measure` writes them to kinds.json; the replay reads the
file, so its runs do not depend on how busy this machine is at the time, and the command that produced it is in
docs/benchmarks.md. The same models serve in the real-vs-model check (validate.py).
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .des import Kind

KINDS_FILE = Path(__file__).resolve().parent / "kinds.json"
BATCH_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class KindSpec:
    name: str
    width: int
    layers: int
    share: float  # the most of a whole GPU one batch can use (des rule 3): an assumption, not a measurement
    memory_gib: tuple[float, ...]  # footprints the replay gives models of this kind on a GPU (an assumption)


SPECS = (
    KindSpec("ranker", 1024, 500, 0.15, (2.0, 4.0)),
    KindSpec("encoder", 1024, 900, 0.35, (6.0, 8.0, 10.0)),
    KindSpec("vision", 1024, 1800, 0.6, (12.0, 16.0, 20.0)),
)


def build(spec: KindSpec, seed: int = 0) -> onnx.ModelProto:
    """[-1, width] FP32 -> same, `layers` x (MatMul by one shared weight, Tanh)."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array((rng.standard_normal((spec.width, spec.width)) / np.sqrt(spec.width))
                                .astype(np.float32), "w")
    nodes, prev = [], "x"
    for i in range(spec.layers):
        nodes += [helper.make_node("MatMul", [prev, "w"], [f"h{i}"]), helper.make_node("Tanh", [f"h{i}"], [f"t{i}"])]
        prev = f"t{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    graph = helper.make_graph(nodes, spec.name,
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", spec.width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", spec.width])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="gpud-replay")
    model.ir_version = 8
    return model


def measure(repeats: int = 15, names: tuple[str, ...] | None = None) -> dict[str, list[tuple[int, float]]]:
    import onnxruntime as ort

    out = {}
    for spec in SPECS:
        if names is not None and spec.name not in names:
            continue
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        session = ort.InferenceSession(build(spec).SerializeToString(), so, providers=["CPUExecutionProvider"])
        table = []
        for rows in BATCH_SIZES:
            x = np.random.default_rng(rows).random((rows, spec.width), dtype=np.float32)
            session.run(None, {"x": x})
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                session.run(None, {"x": x})
                times.append(time.perf_counter() - t)
            table.append((rows, statistics.median(times)))
        out[spec.name] = table
    return out


def load_kinds(path: Path = KINDS_FILE) -> dict[str, Kind]:
    data = json.loads(path.read_text())
    shares = {s.name: s.share for s in SPECS}
    return {name: Kind(name, tuple((int(r), float(s)) for r, s in table), shares[name])
            for name, table in data["batch_seconds"].items()}


def main() -> None:
    import platform

    table = measure()
    lines = ",\n".join(f'  "{name}": {json.dumps(rows)}' for name, rows in table.items())
    KINDS_FILE.write_text(f'{{"measured_on": {json.dumps(platform.processor() or platform.machine())},\n'
                          f' "how": "onnxruntime, 1 intra-op thread, median of 15 runs (python -m replay.kinds)",\n'
                          f' "batch_seconds": {{\n{lines}}}}}\n')
    for name, rows in table.items():
        print(name, "  ".join(f"b{r}={s * 1e3:.1f}ms" for r, s in rows))


if __name__ == "__main__":  # python -m replay.kinds (from bench/)
    main()
