"""gpud.executor.backend: which backend runs a model, and a worker that runs every model through that protocol.

The worker (gpud.executor.worker.Worker) runs in a thread of this process over a socket pair, with a fake backend
registered: no onnxruntime, no subprocess."""
from __future__ import annotations

import logging
import socket
import threading
from multiprocessing.connection import Connection

import numpy as np
import pytest

from gpud.executor import protocol
from gpud.executor.backend import BACKENDS, BackendEntry, Backends, LoadOptions, UnsupportedBackend
from gpud.executor.device import WorkerDevice
from gpud.executor.model_config import ModelConfig, TensorSpec
from gpud.executor.onnxruntime_backend import CPU_EP
from gpud.executor.protocol import Done, Exit, Failed, Hello, Infer, Load, Loaded, LoadFailed, Unload, Unloaded
from gpud.executor.shm import Segment, new_segment_name
from gpud.executor.worker import Worker

FAKE = ModelConfig(name="double", platform="", backend="fake", max_batch_size=4,
                   inputs=(TensorSpec("x", "FP32", (2,)),), outputs=(TensorSpec("y", "FP32", (2,)),))
ONNX = ModelConfig(name="o")  # platform onnxruntime_onnx, backend onnxruntime: the defaults


class InvalidArgument(Exception):
    """Named like onnxruntime's: the worker reports it as the client's error."""


class FakeInstance:
    provider = "FakeExecutionProvider"

    def __init__(self, model_path: str, config: ModelConfig, device: WorkerDevice, options: LoadOptions):
        self.loaded_with = (model_path, config.name, device.id, options)
        self.runs: list[tuple[dict, tuple]] = []
        self.threads: list[str] = []  # the thread of each run
        self.closed = False

    def run(self, inputs, output_names):
        self.runs.append(({k: v.copy() for k, v in inputs.items()}, tuple(output_names)))
        self.threads.append(threading.current_thread().name)
        if (inputs["x"] < 0).any():
            raise InvalidArgument("x must not be negative")
        return [2 * inputs["x"]]

    def warmup_feed(self):
        return {"x": np.zeros((1, 2), np.float32)}

    def close(self) -> None:
        self.closed = True


class FakeBackend:
    def __init__(self) -> None:
        self.instances: list[FakeInstance] = []

    def providers(self) -> list[str]:
        return ["FakeExecutionProvider", CPU_EP]

    def load(self, model_path, config, device, options) -> FakeInstance:
        inst = FakeInstance(model_path, config, device, options)
        self.instances.append(inst)
        return inst


class BrokenBackend:
    def providers(self) -> list[str]:
        raise ImportError("No module named 'tensorrt'")


# ---------------------------------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------------------------------
class TestRegistry:
    def test_a_model_gets_the_backend_its_config_names_or_else_its_platforms(self):
        loads = []
        fake = FakeBackend()
        backends = Backends([BackendEntry("onnxruntime", ("onnxruntime_onnx",), lambda: pytest.fail("imported")),
                             BackendEntry("fake", ("fake_plan",), lambda: loads.append(1) or fake)])
        assert backends.for_config(FAKE) is fake
        assert backends.for_config(ModelConfig(name="p", platform="fake_plan", backend="")) is fake
        assert loads == [1], "a backend is imported once, on first use"
        assert backends.entry_for(ONNX).name == "onnxruntime"  # choosing imports nothing

    @pytest.mark.parametrize("platform, backend, asked", [
        ("", "tensorrt", "backend 'tensorrt'"),
        ("tensorrt_plan", "", "platform 'tensorrt_plan'"),
    ])
    def test_an_unknown_backend_is_an_error_naming_what_is_supported(self, platform, backend, asked):
        with pytest.raises(UnsupportedBackend) as e:
            Backends().for_config(ModelConfig(name="m", platform=platform, backend=backend))
        assert str(e.value) == (f"model 'm': {asked} is not supported; "
                                "supported: onnxruntime (platform onnxruntime_onnx)")

    def test_the_built_in_table_serves_triton_onnx_models_with_onnxruntime(self):
        assert [(e.name, e.platforms) for e in BACKENDS] == [("onnxruntime", ("onnxruntime_onnx",))]
        backend = Backends().for_config(ONNX)
        assert type(backend).__name__ == "OnnxRuntimeBackend" and CPU_EP in backend.providers()

    def test_providers_skip_a_backend_that_cannot_run_and_say_so(self, caplog):
        backends = Backends([BackendEntry("tensorrt", ("tensorrt_plan",), BrokenBackend),
                             BackendEntry("fake", (), FakeBackend), BackendEntry("again", (), FakeBackend)])
        with caplog.at_level(logging.ERROR, logger="gpud.worker"):
            assert backends.providers() == ("FakeExecutionProvider", CPU_EP)
        assert "backend tensorrt is not usable: No module named 'tensorrt'" in caplog.text


# ---------------------------------------------------------------------------------------------------------------------
# A worker dispatching through the protocol
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def worker():
    """A Worker serving in a thread with the fake backend; yields the daemon's end and the backend."""
    ours, theirs = socket.socketpair()
    daemon_end, worker_end = Connection(ours.detach()), Connection(theirs.detach())
    fake = FakeBackend()
    backends = Backends([BackendEntry("fake", ("fake_plan",), lambda: fake)])
    w = Worker(worker_end, WorkerDevice("cpu", "cpu", "", True), backends)
    thread = threading.Thread(target=w.serve, daemon=True)
    thread.start()
    segs: list[Segment] = []
    yield daemon_end, fake, segs
    if thread.is_alive():
        daemon_end.send_bytes(protocol.dumps(Exit()))
        thread.join(30)
    daemon_end.close()
    worker_end.close()
    for seg in segs:
        seg.close()


def _recv(conn: Connection):
    assert conn.poll(30), "the worker did not answer"
    return protocol.loads(conn.recv_bytes())


def _batch(segs: list[Segment], key: str, x: np.ndarray) -> Infer:
    in_seg = Segment.create(new_segment_name("in"), 4096)
    out_seg = Segment.create(new_segment_name("out"), 4096)
    segs += [in_seg, out_seg]
    rows, _ = protocol.write_inputs(FAKE, [{"x": x}], lambda n: in_seg)
    return Infer(key, in_seg.name, out_seg.name, rows, ("y",), ("FP32",), seq=5)


def test_the_worker_loads_and_runs_models_through_the_backend_protocol(worker):
    conn, fake, segs = worker
    hello = _recv(conn)
    assert type(hello) is Hello and hello.providers == ("FakeExecutionProvider", CPU_EP)

    conn.send_bytes(protocol.dumps(Load("double/1/0", "/models/double/1/model.plan", FAKE, intra_op_threads=3)))
    loaded = _recv(conn)
    assert type(loaded) is Loaded and loaded.key == "double/1/0" and loaded.provider == "FakeExecutionProvider"
    (inst,) = fake.instances
    assert inst.loaded_with == ("/models/double/1/model.plan", "double", "cpu", LoadOptions(intra_op_threads=3))
    assert [names for _, names in inst.runs] == [("y",)]  # the warm-up run, from the instance's warmup_feed

    batch = _batch(segs, "double/1/0", np.array([[1, 2], [3, 4]], np.float32))
    conn.send_bytes(protocol.dumps(batch))
    done = _recv(conn)
    assert type(done) is Done and done.seq == 5
    (name, datatype, y), = protocol.read_outputs(done, segs[-1])  # the output segment this batch named
    assert (name, datatype) == ("y", "FP32")
    np.testing.assert_array_equal(y, [[2, 4], [6, 8]])
    np.testing.assert_array_equal(inst.runs[-1][0]["x"], [[1, 2], [3, 4]])

    conn.send_bytes(protocol.dumps(_batch(segs, "double/1/0", np.array([[-1, 0]], np.float32))))
    failed = _recv(conn)
    assert type(failed) is Failed and failed.seq == 5
    assert (failed.kind, failed.error) == ("INVALID_ARGUMENT", "InvalidArgument: x must not be negative")

    conn.send_bytes(protocol.dumps(Unload("double/1/0")))
    assert _recv(conn) == Unloaded("double/1/0") and inst.closed


def test_a_model_for_a_backend_the_worker_lacks_fails_its_load_saying_what_is_supported(worker):
    conn, fake, _ = worker
    _recv(conn)  # hello
    onnx = ModelConfig(name="o", platform="onnxruntime_onnx", backend="")
    conn.send_bytes(protocol.dumps(Load("o/1/0", "/models/o/1/model.onnx", onnx)))
    failed = _recv(conn)
    assert type(failed) is LoadFailed and failed.key == "o/1/0"
    assert failed.error == ("UnsupportedBackend: model 'o': platform 'onnxruntime_onnx' is not supported; "
                            "supported: fake (platform fake_plan)")
    assert not fake.instances


@pytest.mark.parametrize("inline_max_s, second_on", [(0.002, "reader"), (0.0, "instance")])
def test_a_quick_instance_among_several_runs_its_next_batch_on_the_readers_thread(worker, monkeypatch, inline_max_s,
                                                                                  second_on):
    """Two instances on one device: a batch goes to its instance's thread (a wake-up each) unless the instance is
    idle and its last batch was quick, when the reader runs it itself; it was so only for a device's only instance."""
    import gpud.executor.worker as worker_module

    monkeypatch.setattr(worker_module, "INLINE_MAX_S", inline_max_s)
    conn, fake, segs = worker
    _recv(conn)  # Hello
    for key in ("a/1/0", "b/1/0"):
        conn.send_bytes(protocol.dumps(Load(key, "/models/m/1/model.plan", FAKE)))
        assert type(_recv(conn)) is Loaded
    a = fake.instances[0]
    for _ in range(2):
        conn.send_bytes(protocol.dumps(_batch(segs, "a/1/0", np.array([[1, 2]], np.float32))))
        assert type(_recv(conn)) is Done
    warmup, first, second = a.threads
    assert first == "instance-a/1/0", "no batch time known yet: its own thread"
    assert (second == "instance-a/1/0") == (second_on == "instance")



def test_a_batch_is_judged_quick_by_the_last_ones_time_scaled_up_by_its_rows():
    from gpud.executor.worker import INLINE_MAX_S, _Instance

    inst = _Instance("a/1/0", None)  # type: ignore[arg-type]
    rows = lambda n: Infer("a/1/0", "in", "out", (protocol.TensorMeta("x", "FP32", (n, 2), 0, 8 * n),), ("y",),
                           ("FP32",))  # noqa: E731
    assert not inst.quick_for(rows(1)), "no batch time known yet"
    inst.last_run_s, inst.last_rows = INLINE_MAX_S / 10, 4
    assert inst.quick_for(rows(1)) and inst.quick_for(rows(4)) and inst.quick_for(rows(39))
    assert not inst.quick_for(rows(40)), "10x the rows of a batch that took a tenth of the bound"
