"""The example repository: generated deterministically, served as configured, and really computable."""
from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import pytest

from gpud.executor.model_config import DynamicBatching, TensorSpec
from gpud.executor.datatypes import numpy_dtype
from gpud.examples import EXAMPLES, two_input_reference, write_example_repository
from gpud.repository.footprint import estimate_footprint_bytes
from gpud.repository.layout import ModelEntry, ModelRepository


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("repo")
    write_example_repository(out)
    return os.fspath(out)


@pytest.fixture(scope="module")
def entries(repo) -> dict[str, ModelEntry]:
    scanned = ModelRepository(repo).scan()
    assert all(isinstance(e, ModelEntry) for e in scanned.values()), scanned
    return scanned  # type: ignore[return-value]


def test_layout(repo):
    assert sorted(os.listdir(repo)) == sorted(EXAMPLES)
    assert os.path.isfile(os.path.join(repo, "mlp", "config.pbtxt"))
    assert not os.path.exists(os.path.join(repo, "cnn", "config.pbtxt"))  # auto-completed from the ONNX file
    assert os.path.isfile(os.path.join(repo, "two_input", "config.pbtxt"))


def test_deterministic(tmp_path):
    a = write_example_repository(tmp_path / "a")
    b = write_example_repository(tmp_path / "b")
    for pa, pb in zip(a, b):
        with open(pa, "rb") as fa, open(pb, "rb") as fb:
            assert fa.read() == fb.read(), pa


def test_unknown_example(tmp_path):
    with pytest.raises(ValueError, match="unknown example"):
        write_example_repository(tmp_path, ["nope"])


def test_configs(entries):
    mlp = entries["mlp"].config
    assert mlp.max_batch_size == 64
    assert mlp.dynamic_batching == DynamicBatching(preferred_batch_sizes=(16, 32, 64), max_queue_delay_us=3000)
    assert mlp.inputs == (TensorSpec("input", "FP32", (256,)),)
    assert mlp.outputs == (TensorSpec("output", "FP32", (16,)),)

    cnn = entries["cnn"].config  # Triton's auto-complete: default max batch size 4 and an empty dynamic_batching
    assert cnn.max_batch_size == 4
    assert cnn.dynamic_batching == DynamicBatching()
    assert cnn.inputs == (TensorSpec("input", "FP32", (3, 32, 32)),)
    assert cnn.outputs == (TensorSpec("logits", "FP32", (10,)),)

    two = entries["two_input"].config
    assert [(t.name, t.datatype, t.dims) for t in two.inputs] == [("ids", "INT64", (4,)), ("scale", "FP32", (4,))]
    assert [(t.name, t.datatype, t.dims) for t in two.outputs] == [("out", "FP32", (4,))]


def test_mlp_footprint(entries):
    e = entries["mlp"]
    # weights: (256*1024 + 1024 + 1024*1024 + 1024 + 1024*16 + 16) * 4 = 5_316_672
    # activations per item: input 256 + 6 tensors of 1024 (matmul, add, relu twice) + 16 + 16 = 6432 floats
    #   * 4 bytes * max_batch_size 64 = 1_646_592
    assert estimate_footprint_bytes(e.model_path(), e.config) == 5_316_672 + 1_646_592


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_runs_in_onnxruntime(entries, name):
    entry = entries[name]
    cfg = entry.config
    session = ort.InferenceSession(entry.model_path(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    batch = 3
    feeds = {}
    for spec in cfg.inputs:
        shape = (batch, *spec.dims)
        dtype = numpy_dtype(spec.datatype)
        if np.issubdtype(dtype, np.integer):
            feeds[spec.name] = rng.integers(-5, 5, size=shape).astype(dtype)
        else:
            feeds[spec.name] = rng.standard_normal(shape).astype(dtype)
    outputs = session.run([s.name for s in cfg.outputs], feeds)
    for spec, value in zip(cfg.outputs, outputs):
        assert value.shape == (batch, *spec.dims)
        assert value.dtype == numpy_dtype(spec.datatype)
        assert np.all(np.isfinite(value))
    if name == "two_input":
        np.testing.assert_allclose(outputs[0], two_input_reference(feeds["ids"], feeds["scale"]), rtol=1e-6)


def test_the_script_writes_what_gpud_serves_with_no_repository(tmp_path, monkeypatch):
    """scripts/make_example_models.py writes the repository ./scripts/run serves (gpud with no --model-repository):
    the same models, the pipeline ensemble and its steps included, byte for byte."""
    import subprocess
    import sys
    from pathlib import Path

    from gpud.wiring import repository_path

    root = Path(__file__).resolve().parent.parent
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    served = Path(repository_path(None))
    assert served == tmp_path / "cache" / "gpud" / "example-models"
    script = tmp_path / "script"
    subprocess.run([sys.executable, str(root / "scripts" / "make_example_models.py"), str(script)], check=True,
                   capture_output=True)

    def files(d: Path) -> dict[str, bytes]:
        return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}
    assert files(script) == files(served)
    assert {p.name for p in script.iterdir()} == {"mlp", "cnn", "two_input", "pipeline", "preprocess", "classifier",
                                                  "postprocess"}
    assert all(isinstance(e, ModelEntry) for e in ModelRepository(str(script)).scan().values())
