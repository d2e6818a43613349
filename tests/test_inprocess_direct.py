"""Models run in the application's process (gpud.Server(models_in_process=True): gpud.executor.local_worker) and calls that
find their model idle run in the caller's thread (gpud.executor.direct): where each batch runs, that the answers and the
statistics are the loop's, and that unload and stop wait for a caller's run."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import gpud
from gpud.executor.local_worker import LocalWorker, runs_inline
from gpud.executor.types import ErrorKind, InferenceError
from tests.daemon_harness import onnxruntime_reference, save, slow_model, wait_for
# The repository (the examples, slow, slow_alone) and the helpers are test_inprocess's: the same models both ways.
from tests.test_inprocess import ALONE_CONFIG, NODE, _pending, _stats, interleaved_sums, repo  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(repo):
    with gpud.Server(repo, node=NODE, placement_control="off", model_control_mode="explicit", load_model=["*"],
                     models_in_process=True) as s:
        yield s


def _instance(server, model: str):
    (inst,) = server._parts.registry.version(model, "").scheduler.instances
    return inst


class Recorder:
    """Wraps an instance's model: the threads its batches ran on, and an error to raise once."""

    def __init__(self, server, model: str):
        self.inst = _instance(server, model)
        self.model = self.inst.worker._local[self.inst.key].model
        self.threads: list[str] = []
        self.fail_next: Exception | None = None
        self.interrupt_in: str | None = None  # a thread whose next run raises KeyboardInterrupt

    def __enter__(self) -> Recorder:
        real = type(self.model).run.__get__(self.model)

        def run(feed, names):
            self.threads.append(threading.current_thread().name)
            if self.interrupt_in == threading.current_thread().name:
                self.interrupt_in = None
                raise KeyboardInterrupt
            if self.fail_next is not None:
                exc, self.fail_next = self.fail_next, None
                raise exc
            return real(feed, names)
        self.model.run = run
        return self

    def __exit__(self, *exc) -> None:
        del self.model.run


def _until_direct(rec: Recorder, call, attempts: int = 200):
    """`call()` again until one ran in this thread, and that call's result, and how many calls it took. A call runs
    in its caller's thread when the server's loop is waiting for events as it comes, which is almost always; now and
    then the loop is at work (a tick of the hints, the previous call's last callbacks) and the call goes its way."""
    me = threading.current_thread().name
    for calls in range(1, attempts + 1):
        seen = len(rec.threads)
        result = call()
        if rec.threads[seen:] == [me]:
            return result, calls
    pytest.fail(f"no call of {attempts} ran in the caller's thread: {rec.threads[-5:]}")


def _start_direct(server, rec: Recorder, pool: ThreadPoolExecutor, model: str, inputs, attempts: int = 50):
    """A call started on `pool`'s thread, once one runs there (see _until_direct), still running."""
    name = pool.submit(lambda: threading.current_thread().name).result()
    for _ in range(attempts):
        seen = len(rec.threads)
        future = pool.submit(server.infer, model, inputs)
        wait_for(lambda seen=seen: len(rec.threads) > seen, 60, "the call's run to start")
        if rec.threads[seen] == name:
            return future
        future.result(timeout=120)
    pytest.fail(f"no call of {attempts} ran in the caller's thread: {rec.threads[-5:]}")


def test_instances_run_in_this_process(server):
    workers = server.inspect()["workers"]
    assert workers and all(w["pid"] == os.getpid() and w["alive"] and w["in_process"] for w in workers)
    assert all(isinstance(w, LocalWorker) for w in server._parts.pool.workers.values())
    # No worker process of their own: no per-worker host series (the process's own gpud_process_* cover them).
    assert "gpud_worker_cpu_seconds_total{" not in server.metrics_text()
    assert 'gpud_worker_up{device="' in server.metrics_text()


def test_an_idle_models_call_runs_in_the_callers_thread(server, repo):
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    before = _stats(server, "mlp")
    with Recorder(server, "mlp") as rec:
        got, calls = _until_direct(rec, lambda: server.infer("mlp", {"input": x}))
    want = onnxruntime_reference(repo, "mlp", {"input": x})["output"]
    np.testing.assert_allclose(got["output"], want, rtol=1e-5, atol=1e-6)
    after = _stats(server, "mlp")  # the statistics count a caller's run as any batch
    assert (after.inference_count - before.inference_count,
            after.execution_count - before.execution_count) == (calls, calls)
    assert after.success.count - before.success.count == calls
    assert after.compute_infer.count - before.compute_infer.count == calls
    assert _pending(server, "mlp") == 0


def test_the_loops_path_runs_short_batches_on_the_loop_and_long_ones_on_the_instances_thread(server):
    # A call with a timeout goes the loop's way (a caller's own run could not be given up on). The mlp's batch takes
    # well under a millisecond: the loop's thread runs it. slow_alone's 64 rows take much longer: its own thread.
    x = np.zeros((1, 256), np.float32)
    # Where a batch runs follows from how long the instance's last batch took. That time is set here rather than
    # measured: on a machine busy with other work even the mlp's batch can take over a millisecond now and then
    # (then, rightly, the next one goes to its own thread), and the test would depend on that.
    with Recorder(server, "mlp") as rec:
        _last_batch(rec, seconds=0.0001)  # a quick one: the next runs on the loop's thread
        server.infer("mlp", {"input": x}, timeout=60)
    assert rec.threads == ["gpud-server"]
    with Recorder(server, "slow_alone") as rec:
        for _ in range(2):
            _last_batch(rec, seconds=0.5)  # a long one: the next runs on the instance's own thread
            server.infer("slow_alone", {"x": np.zeros((64, 512), np.float32)}, timeout=120)
    assert [t.startswith("instance-") for t in rec.threads] == [True, True], rec.threads


def _last_batch(rec: Recorder, seconds: float, rows: int = 1) -> None:
    """Make the instance's last batch one of `seconds` and `rows` (what LocalWorker decides the next one by)."""
    local = rec.inst.worker._local[rec.inst.key]  # noqa: SLF001
    local.last_run_s, local.last_rows = seconds, rows


def test_infer_async_runs_only_quick_calls_in_the_callers_loop(server):
    # From an asyncio loop a caller's own run holds up that loop: only one as short as the loop's own (the mlp's);
    # slow_alone's 64 rows go the loop's way, to the instance's thread.
    import asyncio

    x = np.zeros((1, 256), np.float32)
    with Recorder(server, "mlp") as rec:
        _until_direct(rec, lambda: server.infer("mlp", {"input": x}))  # its last run: quick
        got, _ = _until_direct(rec, lambda: asyncio.run(server.infer_async("mlp", {"input": x})))
    assert got["output"].shape == (1, 16)
    rows = {"x": np.zeros((64, 512), np.float32)}
    with Recorder(server, "slow_alone") as rec:
        _until_direct(rec, lambda: server.infer("slow_alone", rows))  # its last run: long
        asyncio.run(server.infer_async("slow_alone", rows))
    assert rec.threads[-1].startswith("instance-"), rec.threads


def test_runs_inline_scales_the_last_batch_by_rows():
    assert runs_inline(0.0002, 1, 1, 0.001)
    assert runs_inline(0.0002, 1, 5, 0.001) and not runs_inline(0.0002, 1, 6, 0.001)
    assert runs_inline(0.0008, 8, 4, 0.001)  # fewer rows than last time: never estimated below the last batch
    assert not runs_inline(0.0012, 8, 1, 0.001)


def test_a_failing_run_fails_that_request_only(server):
    x = np.zeros((1, 256), np.float32)
    before = _stats(server, "mlp")
    with Recorder(server, "mlp") as rec:
        rec.fail_next = RuntimeError("boom")
        with pytest.raises(InferenceError, match="model 'mlp' failed: RuntimeError: boom") as caught:
            server.infer("mlp", {"input": x})
        assert caught.value.kind is ErrorKind.INTERNAL
        assert server.infer("mlp", {"input": x}, timeout=60)["output"].shape == (1, 16)
    after = _stats(server, "mlp")
    assert (after.fail.count - before.fail.count, after.success.count - before.success.count) == (1, 1)


def test_threads_at_once_batch_and_each_gets_its_rows(server, repo):
    rng = np.random.default_rng(5)
    rows = [rng.standard_normal((1, 512)).astype(np.float32) for _ in range(24)]
    barrier = threading.Barrier(len(rows))
    before = _stats(server, "slow")

    def one(x: np.ndarray) -> np.ndarray:
        barrier.wait(timeout=60)
        return server.infer("slow", {"x": x})["y"]

    with ThreadPoolExecutor(len(rows)) as pool:
        got = list(pool.map(one, rows))
    want = onnxruntime_reference(repo, "slow", {"x": np.concatenate(rows)})["y"]
    np.testing.assert_allclose(np.concatenate(got), want, rtol=1e-5, atol=1e-5)
    after = _stats(server, "slow")
    assert after.inference_count - before.inference_count == 24
    assert after.execution_count - before.execution_count < 24, "nothing was batched"
    assert _pending(server, "slow") == 0


def test_unload_waits_for_a_callers_run(repo, tmp_path):
    small = tmp_path / "repo"
    save(slow_model(width=512, layers=3000), small, "slow_alone", ALONE_CONFIG)
    x = np.random.default_rng(1).standard_normal((64, 512)).astype(np.float32)
    with gpud.Server(small, node=NODE, placement_control="off", model_control_mode="explicit",
                     load_model=["slow_alone"], models_in_process=True) as s:
        with Recorder(s, "slow_alone") as rec, ThreadPoolExecutor(1) as caller:
            running = _start_direct(s, rec, caller, "slow_alone", {"x": x})
            s.unload_model("slow_alone")  # returns once the instance is closed: after the run
            assert running.done()
            np.testing.assert_allclose(running.result()["y"], onnxruntime_reference(small, "slow_alone", {"x": x})["y"],
                                       rtol=1e-5, atol=1e-5)
        assert not s.model_ready("slow_alone")


def test_stop_answers_a_callers_run_and_fails_what_queued(tmp_path):
    small = tmp_path / "repo"
    save(slow_model(width=512, layers=3000), small, "slow_alone", ALONE_CONFIG)
    s = gpud.Server(small, node=NODE, placement_control="off", models_in_process=True).start()
    callers, other = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    rec = Recorder(s, "slow_alone").__enter__()
    running = _start_direct(s, rec, callers, "slow_alone", {"x": np.zeros((64, 512), np.float32)})
    queued = other.submit(s.infer, "slow_alone", {"x": np.zeros((1, 512), np.float32)})
    wait_for(lambda: _pending(s, "slow_alone") == 2, 60, "the second request to be queued")
    s.stop(drain_timeout_s=0)
    assert not s._thread.is_alive()
    assert running.result(timeout=60)["y"].shape == (64, 512)
    with pytest.raises(InferenceError, match="the server is shutting down"):
        queued.result(timeout=60)
    callers.shutdown()
    other.shutdown()


def test_a_pipeline_and_a_sequence_model_with_models_in_process(tmp_path):
    """An ensemble's steps and a sequence model's batches go the loop's way, to instances in this process."""
    from gpud.examples import write_pipeline_example
    from tests.sequence_models import accumulator_config, accumulator_model

    write_pipeline_example(tmp_path)
    save(accumulator_model(), tmp_path, "acc", accumulator_config())
    image = np.arange(32, dtype=np.uint8).reshape(2, 16)
    with gpud.Server(tmp_path, node=NODE, placement_control="off", models_in_process=True) as s:
        got = s.infer("pipeline", {"IMAGE": image})
        features = s.infer("preprocess", {"raw": image})["features"]
        logits = s.infer("classifier", {"features": features})["logits"]
        want = s.infer("postprocess", {"logits": logits})
        np.testing.assert_allclose(got["PROBABILITIES"], want["probabilities"], rtol=1e-6)
        np.testing.assert_array_equal(got["LABEL"], want["label"])
        only = s.infer("postprocess", {"logits": logits}, outputs=["label"])  # an idle model: the caller's run
        assert list(only) == ["label"]
        np.testing.assert_array_equal(only["label"], want["label"])
        assert interleaved_sums(s) == [1, 10, 3, 30, 60]


def test_an_interrupted_callers_run_frees_the_instance(server):
    # KeyboardInterrupt inside the model's run (Ctrl-C in the caller): the call raises it, the instance is free
    # again and the next call is answered.
    x = np.zeros((1, 256), np.float32)
    with Recorder(server, "mlp") as rec:
        _until_direct(rec, lambda: server.infer("mlp", {"input": x}))  # the loop is idle: the next call is likely own
        for _ in range(200):
            rec.interrupt_in = threading.current_thread().name  # only a run in this thread (never the loop's)
            try:
                server.infer("mlp", {"input": x})
            except KeyboardInterrupt:
                break
        else:
            pytest.fail("no call ran in the caller's thread")
        rec.interrupt_in = None
    assert _pending(server, "mlp") == 0
    assert server.infer("mlp", {"input": x}, timeout=60)["output"].shape == (1, 16)
