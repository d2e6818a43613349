"""Ensembles for the tests: the example pipeline (gpud.examples: preprocess -> classifier -> postprocess) and a few
more built here as ONNX, with onnxruntime running each step by hand as the reference.

- `pipeline`: UINT8 IMAGE [16] -> preprocess -> classifier -> postprocess -> PROBABILITIES [4], LABEL [1].
- `fanout`: IMAGE -> preprocess -> features; `classifier` and `classifier_b` both read features (parallel steps);
  `add` joins their logits -> SUM [4]; LOGITS_A [4] is an output too.
- `lookup`: INT64 IDS [-1] -> `embed` (Gather from a 10-row table: an id outside 0..9 fails in onnxruntime) ->
  classifier -> LOGITS [4]: the failing step.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from gpud.examples import BATCH_DIM, CLASSES, PIXELS, _finish, make_classifier, write_pipeline_example

EMBED_ROWS = 10


def make_add() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["sum"])], "add",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [BATCH_DIM, CLASSES]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [BATCH_DIM, CLASSES])],
        [helper.make_tensor_value_info("sum", TensorProto.FLOAT, [BATCH_DIM, CLASSES])])
    return _finish(graph, "add")


def make_embed() -> onnx.ModelProto:
    """INT64 "ids" [batch, 1] -> FP32 "vec" [batch, 16]: rows of a 10 x 16 table."""
    table = np.arange(EMBED_ROWS * PIXELS, dtype=np.float32).reshape(EMBED_ROWS, PIXELS) / 100
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0),  # [batch, 1, 16]
         helper.make_node("Reshape", ["rows", "shape"], ["vec"])], "embed",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [BATCH_DIM, 1])],
        [helper.make_tensor_value_info("vec", TensorProto.FLOAT, [BATCH_DIM, PIXELS])],
        initializer=[numpy_helper.from_array(table, "table"),
                     numpy_helper.from_array(np.array([-1, PIXELS], dtype=np.int64), "shape")])
    return _finish(graph, "embed")


def model_config(name: str, inputs: list[tuple[str, str, list[int]]], outputs: list[tuple[str, str, list[int]]],
                 max_batch_size: int = 16, extra: str = "") -> str:
    def tensors(specs):
        return ",\n".join(f'  {{ name: "{n}", data_type: {t}, dims: {d} }}' for n, t, d in specs)
    return (f'name: "{name}"\nbackend: "onnxruntime"\nmax_batch_size: {max_batch_size}\n'
            f"input [\n{tensors(inputs)}\n]\noutput [\n{tensors(outputs)}\n]\n"
            f"dynamic_batching {{ }}\ninstance_group [ {{ count: 1, kind: KIND_CPU }} ]\n{extra}")


def step(model: str, inputs: dict[str, str], outputs: dict[str, str], version: int = -1) -> str:
    maps = "".join(f'\n      input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    maps += "".join(f'\n      output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'    {{\n      model_name: "{model}"\n      model_version: {version}{maps}\n    }}'


def ensemble_config(name: str, inputs: list[tuple[str, str, list[int]]], outputs: list[tuple[str, str, list[int]]],
                    steps: list[str], max_batch_size: int = 16, extra: str = "") -> str:
    def tensors(specs):
        return ",\n".join(f'  {{ name: "{n}", data_type: {t}, dims: {d} }}' for n, t, d in specs)
    return (f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: {max_batch_size}\n'
            f"input [\n{tensors(inputs)}\n]\noutput [\n{tensors(outputs)}\n]\n{extra}"
            "ensemble_scheduling {\n  step [\n" + ",\n".join(steps) + "\n  ]\n}\n")


def save_model(repo: Path, name: str, model: onnx.ModelProto | None, config: str, version: int = 1) -> None:
    d = repo / name / str(version)
    d.mkdir(parents=True, exist_ok=True)
    if model is not None:
        onnx.save(model, d / "model.onnx")
    (repo / name / "config.pbtxt").write_text(config)


FANOUT = ensemble_config(
    "fanout", [("IMAGE", "TYPE_UINT8", [PIXELS])], [("SUM", "TYPE_FP32", [CLASSES]), ("LOGITS_A", "TYPE_FP32", [CLASSES])],
    [step("preprocess", {"raw": "IMAGE"}, {"features": "features"}),
     step("classifier", {"features": "features"}, {"logits": "LOGITS_A"}),
     step("classifier_b", {"features": "features"}, {"logits": "logits_b"}),
     step("add", {"a": "LOGITS_A", "b": "logits_b"}, {"sum": "SUM"})])

LOOKUP = ensemble_config(  # IDS takes any length: embed takes one id per row, and refuses more itself
    "lookup", [("IDS", "TYPE_INT64", [-1])], [("LOGITS", "TYPE_FP32", [CLASSES])],
    [step("embed", {"ids": "IDS"}, {"vec": "vec"}),
     step("classifier", {"features": "vec"}, {"logits": "LOGITS"})])


def write_ensemble_repository(repo: Path) -> Path:
    """The example pipeline, `fanout` and `lookup` with their step models (all on the CPU)."""
    write_pipeline_example(repo)
    for name in ("preprocess", "classifier", "postprocess"):  # on the CPU, whatever the node: one worker
        config = repo / name / "config.pbtxt"
        config.write_text(config.read_text() + "instance_group [ { count: 1, kind: KIND_CPU } ]\n")
    save_model(repo, "classifier_b", make_classifier(seed=3),
               model_config("classifier_b", [("features", "TYPE_FP32", [PIXELS])],
                            [("logits", "TYPE_FP32", [CLASSES])]))
    save_model(repo, "add", make_add(), model_config("add", [("a", "TYPE_FP32", [CLASSES]),
                                                             ("b", "TYPE_FP32", [CLASSES])],
                                                      [("sum", "TYPE_FP32", [CLASSES])]))
    save_model(repo, "embed", make_embed(), model_config("embed", [("ids", "TYPE_INT64", [1])],
                                                         [("vec", "TYPE_FP32", [PIXELS])]))
    save_model(repo, "fanout", None, FANOUT)
    save_model(repo, "lookup", None, LOOKUP)
    return repo


class ByHand:
    """onnxruntime on each step's model file of a repository: the reference an ensemble's answer is checked
    against."""

    def __init__(self, repo: Path):
        self.repo = repo
        self._sessions: dict[str, ort.InferenceSession] = {}

    def run(self, model: str, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        session = self._sessions.get(model)
        if session is None:
            session = self._sessions[model] = ort.InferenceSession(str(self.repo / model / "1" / "model.onnx"),
                                                                   providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, inputs)))

    def pipeline(self, image: np.ndarray) -> dict[str, np.ndarray]:
        features = self.run("preprocess", raw=image)["features"]
        logits = self.run("classifier", features=features)["logits"]
        post = self.run("postprocess", logits=logits)
        return {"PROBABILITIES": post["probabilities"], "LABEL": post["label"]}

    def fanout(self, image: np.ndarray) -> dict[str, np.ndarray]:
        features = self.run("preprocess", raw=image)["features"]
        a = self.run("classifier", features=features)["logits"]
        b = self.run("classifier_b", features=features)["logits"]
        return {"SUM": self.run("add", a=a, b=b)["sum"], "LOGITS_A": a}

    def lookup(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        vec = self.run("embed", ids=ids)["vec"]
        return {"LOGITS": self.run("classifier", features=vec)["logits"]}
