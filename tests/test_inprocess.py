"""The in-process API (gpud.Server) against the daemon: the same answers, the same errors, batching across threads
and asyncio tasks, timeouts that withdraw queued requests, model control, inspect and metrics."""
from __future__ import annotations

import asyncio
import http.client
import json
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.http as httpclient

import gpud
from gpud.executor.types import ErrorKind, InferenceError
from gpud.api.http_api import HTTP_STATUS
from gpud.examples import write_example_repository
from tests.daemon_harness import (ROOT, SLOW_CONFIG, example_inputs, onnxruntime_reference, save, slow_model,
                                  start_daemon, wait_for)

pytestmark = pytest.mark.slow
NODE = str(ROOT / "config/nodes/dgx-a100-2gpu-mig.yaml")
# A slower model without dynamic batching: every request is a batch of its own, so a second one waits in the queue
# for as long as the first computes (64 rows: hundreds of milliseconds, against the 20 ms the second waits).
ALONE_CONFIG = """
max_batch_size: 64
instance_group [ { count: 1, kind: KIND_CPU } ]
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_example_repository(repo)  # mlp (config.pbtxt), cnn (no config), two_input (INT64 + FP32)
    save(slow_model(width=512, layers=300), repo, "slow", SLOW_CONFIG)
    save(slow_model(width=512, layers=3000), repo, "slow_alone", ALONE_CONFIG)  # 64 rows: about half a second
    return repo


@pytest.fixture(scope="module", params=[False, True], ids=["worker-processes", "models-in-process"])
def server(repo, request):
    """Both ways of running the models: in the device worker processes (the default), and in this process
    (models_in_process: gpud.executor.local_worker, with idle models' calls run in the caller's thread)."""
    with gpud.Server(repo, node=NODE, model_control_mode="explicit", load_model=["*"], metrics_port=0,
                     models_in_process=request.param) as s:
        yield s


@pytest.fixture(scope="module")
def daemon(repo, tmp_path_factory):
    d = start_daemon(repo, tmp_path_factory.mktemp("run"), "--model-control-mode", "explicit", "--load-model", "*")
    yield d
    assert d.stop() == 0, d.log()


def _stats(server, model: str):
    return server.model_statistics(model)[0].stats


def _pending(server, model: str) -> int:
    return next(m["pending_requests"] for m in server.inspect()["models"] if m["name"] == model)


# --- the same answers as the daemon -------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["mlp", "cnn", "two_input"])
def test_outputs_equal_the_daemons_over_http(server, daemon, repo, model):
    arrays = example_inputs(model, 3, np.random.default_rng(11))
    client = httpclient.InferenceServerClient(daemon.http_url)
    meta = client.get_model_metadata(model)
    inputs = []
    for m in meta["inputs"]:
        inp = httpclient.InferInput(m["name"], list(arrays[m["name"]].shape), m["datatype"])
        inp.set_data_from_numpy(arrays[m["name"]], binary_data=True)
        inputs.append(inp)
    over_http = client.infer(model, inputs)
    in_process = server.infer(model, arrays)
    assert sorted(in_process) == sorted(o["name"] for o in meta["outputs"])
    for name, got in in_process.items():
        np.testing.assert_array_equal(got, over_http.as_numpy(name))  # same engine, same batch: bit for bit
        assert got.dtype == over_http.as_numpy(name).dtype
    for name, want in onnxruntime_reference(repo, model, arrays).items():
        np.testing.assert_allclose(in_process[name], want, rtol=1e-5, atol=1e-5)


def test_infer_async_and_requested_outputs(server, repo):
    arrays = example_inputs("two_input", 2, np.random.default_rng(3))
    want = onnxruntime_reference(repo, "two_input", arrays)["out"]
    got = asyncio.run(server.infer_async("two_input", arrays, version=1, outputs=["out"]))
    assert list(got) == ["out"]
    np.testing.assert_allclose(got["out"], want, rtol=1e-6)
    # Any array-like is taken (np.asarray); the caller's arrays are not changed.
    lists = {k: v.tolist() for k, v in arrays.items()}
    lists["scale"] = np.asarray(lists["scale"], dtype=np.float32)
    np.testing.assert_allclose(server.infer("two_input", lists, outputs="out")["out"], want, rtol=1e-6)


# --- the same errors --------------------------------------------------------------------------------------------
BAD_REQUESTS = {
    # id: (model, version, inputs as (name, datatype, shape), requested outputs, the kind)
    "unknown model": ("nope", "", [("input", "FP32", [1, 256])], None, ErrorKind.NOT_FOUND),
    "unknown version": ("mlp", "7", [("input", "FP32", [1, 256])], None, ErrorKind.NOT_FOUND),
    "wrong datatype": ("mlp", "", [("input", "FP64", [1, 256])], None, ErrorKind.INVALID_ARGUMENT),
    "wrong shape": ("mlp", "", [("input", "FP32", [1, 255])], None, ErrorKind.INVALID_ARGUMENT),
    "batch too large": ("two_input", "", [("ids", "INT64", [9, 4]), ("scale", "FP32", [9, 4])], None,
                        ErrorKind.INVALID_ARGUMENT),
    "unknown input": ("mlp", "", [("input", "FP32", [1, 256]), ("extra", "FP32", [1, 2])], None,
                      ErrorKind.INVALID_ARGUMENT),
    "missing input": ("two_input", "", [("ids", "INT64", [1, 4])], None, ErrorKind.INVALID_ARGUMENT),
    "unknown output": ("mlp", "", [("input", "FP32", [1, 256])], ["nope"], ErrorKind.INVALID_ARGUMENT),
}
_NUMPY = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_errors_are_the_daemons(server, daemon, case):
    model, version, tensors, outputs, kind = BAD_REQUESTS[case]
    with pytest.raises(InferenceError) as caught:
        server.infer(model, {n: np.zeros(shape, _NUMPY[dt]) for n, dt, shape in tensors}, version=version,
                     outputs=outputs)
    assert caught.value.kind is kind
    body = {"inputs": [{"name": n, "datatype": dt, "shape": shape, "data": [0] * int(np.prod(shape))}
                       for n, dt, shape in tensors]}
    if outputs:
        body["outputs"] = [{"name": o} for o in outputs]
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    host, port = daemon.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body).encode())
        response = conn.getresponse()
        status, answer = response.status, json.loads(response.read())
    finally:
        conn.close()
    assert (status, answer["error"]) == (HTTP_STATUS[kind], caught.value.message)
    assert str(caught.value) == caught.value.message


def test_inputs_that_are_not_tensors_are_refused(server):
    with pytest.raises(InferenceError, match="mapping of input name") as caught:
        server.infer("mlp", [np.zeros((1, 256), np.float32)])
    assert caught.value.kind is ErrorKind.INVALID_ARGUMENT
    with pytest.raises(InferenceError, match="complex64 has no KServe datatype"):
        server.infer("mlp", {"input": np.zeros((1, 256), np.complex64)})
    with pytest.raises(InferenceError, match="data-type is 'BYTES', but model 'mlp' expects 'FP32'"):
        server.infer("mlp", {"input": np.array([["a"] * 256])})
    with pytest.raises(InferenceError, match="data-type is 'FP64'"):  # a list of floats is float64, as numpy has it
        server.infer("mlp", {"input": [[0.5] * 256]})
    with pytest.raises(InferenceError, match="non-empty name"):
        server.infer("", {"input": np.zeros((1, 256), np.float32)})
    # Nothing changed: the model still answers.
    assert server.infer("mlp", {"input": np.zeros((1, 256), np.float32)})["output"].shape == (1, 16)


# --- threads and tasks at once ----------------------------------------------------------------------------------
def test_threads_at_once_are_batched_and_each_gets_its_rows(server, repo):
    # 16 threads release together; the model computes for milliseconds, so while one batch runs the others queue
    # and the batcher must put them together. Meanwhile another thread reads inspect and the statistics.
    before = _stats(server, "slow")
    rng = np.random.default_rng(5)
    rows = [rng.standard_normal((1, 512)).astype(np.float32) for _ in range(16)]
    barrier = threading.Barrier(len(rows) + 1)
    reading = threading.Event()

    def one(x: np.ndarray) -> np.ndarray:
        barrier.wait(timeout=60)
        return server.infer("slow", {"x": x}, timeout=120)["y"]

    def reader() -> int:
        barrier.wait(timeout=60)
        reads = 0
        while not reading.is_set():
            server.inspect()
            server.model_statistics()
            reads += 1
        return reads

    with ThreadPoolExecutor(len(rows) + 1) as pool:
        reads = pool.submit(reader)
        got = list(pool.map(one, rows))
        reading.set()
        assert reads.result() > 0
    want = onnxruntime_reference(repo, "slow", {"x": np.concatenate(rows)})["y"]
    np.testing.assert_allclose(np.concatenate(got), want, rtol=1e-5, atol=1e-5)
    after = _stats(server, "slow")
    inferences = after.inference_count - before.inference_count
    executions = after.execution_count - before.execution_count
    assert inferences == 16
    assert executions < inferences, f"{executions} executions for {inferences} inferences: nothing was batched"


def test_asyncio_tasks_at_once_are_batched(server, repo):
    before = _stats(server, "slow")
    rng = np.random.default_rng(6)
    rows = [rng.standard_normal((2, 512)).astype(np.float32) for _ in range(12)]

    async def main():
        return await asyncio.gather(*(server.infer_async("slow", {"x": x}) for x in rows))

    got = np.concatenate([r["y"] for r in asyncio.run(main())])
    want = onnxruntime_reference(repo, "slow", {"x": np.concatenate(rows)})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    after = _stats(server, "slow")
    assert after.inference_count - before.inference_count == 24
    assert after.execution_count - before.execution_count < 12


# --- timeouts and cancellation withdraw a queued request -------------------------------------------------------
def test_a_timeout_withdraws_the_queued_request(server):
    # The first request (64 rows of a slow model, each request a batch of its own) computes for a while; the second
    # queues behind it, gives up after 20 ms, and must never run.
    before = _stats(server, "slow_alone")
    first = ThreadPoolExecutor(1)
    running = first.submit(server.infer, "slow_alone", example_inputs("slow_alone", 64, np.random.default_rng(1)))
    wait_for(lambda: _pending(server, "slow_alone") == 1, 60, "the first request to be in flight")
    with pytest.raises(gpud.InferenceTimeout, match="no answer from model 'slow_alone' within 0.02 s") as caught:
        server.infer("slow_alone", example_inputs("slow_alone", 1, np.random.default_rng(2)), timeout=0.02)
    assert isinstance(caught.value, TimeoutError) and caught.value.kind is ErrorKind.UNAVAILABLE
    assert running.result(timeout=120)["y"].shape == (64, 512)
    first.shutdown()
    wait_for(lambda: _pending(server, "slow_alone") == 0, 60, "the queue to empty")
    after = _stats(server, "slow_alone")
    assert (after.execution_count - before.execution_count, after.inference_count - before.inference_count) == (1, 64)


def test_cancelling_or_timing_out_infer_async_withdraws_it(server):
    before = _stats(server, "slow_alone")

    async def main():
        # Tasks start in order: the first is in flight before the others are queued behind it.
        def rows(n: int, seed: int) -> dict[str, np.ndarray]:
            return example_inputs("slow_alone", n, np.random.default_rng(seed))

        first = asyncio.ensure_future(server.infer_async("slow_alone", rows(64, 1)))
        cancelled = asyncio.ensure_future(server.infer_async("slow_alone", rows(1, 2)))
        timed_out = asyncio.ensure_future(server.infer_async("slow_alone", rows(1, 3), timeout=0.02))
        with pytest.raises(gpud.InferenceTimeout):
            await timed_out
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        return await first

    assert asyncio.run(main())["y"].shape == (64, 512)
    wait_for(lambda: _pending(server, "slow_alone") == 0, 60, "the queue to empty")
    after = _stats(server, "slow_alone")
    assert (after.execution_count - before.execution_count, after.inference_count - before.inference_count) == (1, 64)


# --- model control, inspect, statistics, metrics ---------------------------------------------------------------
def test_unload_and_load_a_model(server):
    x = example_inputs("cnn", 1, np.random.default_rng(0))
    server.unload_model("cnn")
    assert not server.model_ready("cnn")
    with pytest.raises(InferenceError, match="'cnn' has no available versions") as caught:
        server.infer("cnn", x)
    assert caught.value.kind is ErrorKind.UNAVAILABLE
    index = {(r.name, r.version): r for r in server.repository_index()}
    assert index[("cnn", "")].reason == "unloaded"
    asyncio.run(server.load_model_async("cnn"))
    assert server.model_ready("cnn") and [a.shape[0] for a in server.infer("cnn", x).values()] == [1]
    with pytest.raises(InferenceError) as caught:
        server.load_model("nope")
    assert caught.value.kind is ErrorKind.NOT_FOUND


def test_metadata_inspect_statistics_and_metrics(server):
    server.infer("two_input", example_inputs("two_input", 1, np.random.default_rng(0)))
    assert server.ready()
    meta = server.model_metadata("two_input")
    assert [(t.name, t.datatype, t.shape) for t in meta.inputs] == [("ids", "INT64", (-1, 4)),
                                                                     ("scale", "FP32", (-1, 4))]
    assert server.model_config("two_input").config.max_batch_size == 8
    doc = server.inspect()
    assert {"mlp", "cnn", "two_input", "slow"} <= {m["name"] for m in doc["models"]}
    assert doc["workers"] and all(w["alive"] for w in doc["workers"])
    stats = server.model_statistics("two_input")[0]
    assert stats.stats.success.count >= 1
    series = 'gpud_model_requests_total{model="two_input",outcome="success",version="1"} '
    values = [float(line[len(series):]) for line in server.metrics_text().splitlines() if line.startswith(series)]
    assert len(values) == 1 and values[0] >= 1
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30) as r:
        scraped = r.read().decode()
    assert "gpud_model_requests_total" in scraped and "gpud_process_cpu_seconds_total" in scraped


# --- settings and life cycle ------------------------------------------------------------------------------------
def test_settings_are_checked_before_anything_starts(repo, tmp_path):
    with pytest.raises(ValueError, match="http_port: not a setting of the in-process server"):
        gpud.Server(repo, http_port=8000)
    with pytest.raises(ValueError, match="trace_file: not a setting of the in-process server"):
        gpud.Server(repo, trace_file="/tmp/trace.json")  # it serves no trace extension
    with pytest.raises(ValueError, match="unknown setting 'nope'"):
        gpud.Server(repo, nope=1)
    with pytest.raises(ValueError, match="setting 'hints_interval_seconds': expected float"):
        gpud.Server(repo, hints_interval_seconds="often")
    with pytest.raises(ValueError, match="placement_control must be one of"):
        gpud.Server(repo, placement_control="sometimes")
    with pytest.raises(ValueError, match="metrics_port must be"):
        gpud.Server(repo, metrics_port=70000)
    with pytest.raises(ValueError, match="is not a directory"):
        gpud.Server(tmp_path / "missing", node=NODE).start()
    config = tmp_path / "gpud.yaml"  # the daemon's file: its front-end settings are not used in-process
    config.write_text("http_port: 9000\nplacement_control: advise\n")
    s = gpud.Server(repo, config=config, default_max_queue_size=7)
    assert (s.settings.placement_control, s.settings.default_max_queue_size, s.settings.allow_http) == \
        ("advise", 7, False)


def test_a_server_not_running_refuses_calls_and_model_control_follows_the_mode(repo, tmp_path):
    small = tmp_path / "repo"
    write_example_repository(small)
    s = gpud.Server(small, node=NODE, placement_control="off")  # model control mode none, as the daemon's default
    x = example_inputs("two_input", 1, np.random.default_rng(0))
    with pytest.raises(InferenceError, match="not started") as caught:
        s.infer("two_input", x)
    assert caught.value.kind is ErrorKind.UNAVAILABLE
    with s:
        assert s.infer("two_input", x)["out"].shape == (1, 4)
        with pytest.raises(InferenceError) as caught:
            s.unload_model("two_input")
        assert caught.value.kind is ErrorKind.UNAVAILABLE
        with pytest.raises(RuntimeError, match="started once"):
            s.start()
    assert not s.running and not s.ready()
    with pytest.raises(InferenceError, match="stopped"):
        s.infer("two_input", x)
    with pytest.raises(InferenceError, match="stopped"):
        asyncio.run(s.infer_async("two_input", x))
    s.stop()  # again: nothing to do
    assert not s._thread.is_alive()  # the server's thread has ended


def test_stop_answers_every_caller(tmp_path):
    # stop() with no time to drain, from two threads at once: the batch already running finishes and is answered,
    # the request queued behind it fails with the reason; no caller is left waiting.
    small = tmp_path / "repo"
    save(slow_model(width=512, layers=3000), small, "slow_alone", ALONE_CONFIG)
    s = gpud.Server(small, node=NODE, placement_control="off").start()
    callers = ThreadPoolExecutor(2)
    running = callers.submit(s.infer, "slow_alone", example_inputs("slow_alone", 64, np.random.default_rng(1)))
    wait_for(lambda: _pending(s, "slow_alone") == 1, 60, "the first request to be in flight")
    queued = callers.submit(s.infer, "slow_alone", example_inputs("slow_alone", 1, np.random.default_rng(2)))
    wait_for(lambda: _pending(s, "slow_alone") == 2, 60, "the second request to be queued")
    stoppers = [threading.Thread(target=s.stop, kwargs={"drain_timeout_s": 0}) for _ in range(2)]  # at once
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join(timeout=120)
        assert not t.is_alive()
    assert not s._thread.is_alive()  # each stop() returned once the server had stopped
    assert running.result(timeout=60)["y"].shape == (64, 512)
    with pytest.raises(InferenceError, match="the server is shutting down") as caught:
        queued.result(timeout=60)
    assert caught.value.kind is ErrorKind.UNAVAILABLE
    callers.shutdown()


def acc_step(server, seq: int, value: int, start: bool = False, end: bool = False) -> int:
    """One request of sequence `seq` to tests.sequence_models' accumulator `acc`: its running sum."""
    out = server.infer("acc", {"INPUT": np.array([[value]], np.int32)},
                       parameters={"sequence_id": seq, "sequence_start": start, "sequence_end": end})
    return int(out["OUTPUT"][0, 0])


def interleaved_sums(server) -> list[int]:
    """Two interleaved sequences, each keeping its own running sum: 1, 1+2; 10, 10+20, 10+20+30."""
    return [acc_step(server, 1, 1, start=True), acc_step(server, 2, 10, start=True), acc_step(server, 1, 2, end=True),
            acc_step(server, 2, 20), acc_step(server, 2, 30, end=True)]


def test_a_sequence_model_in_process(tmp_path):
    """Request parameters reach the core as the front ends pass them: a sequence model's id, start and end."""
    from tests.sequence_models import accumulator_config, accumulator_model

    save(accumulator_model(), tmp_path, "acc", accumulator_config())
    with gpud.Server(tmp_path, node=NODE) as s:
        assert interleaved_sums(s) == [1, 10, 3, 30, 60]
        with pytest.raises(InferenceError) as exc:
            acc_step(s, 1, 5)  # finished: a new request of it must START
        assert exc.value.kind is ErrorKind.INVALID_ARGUMENT
        with pytest.raises(InferenceError):
            s.infer("acc", {"INPUT": np.array([[1]], np.int32)}, parameters=["not", "a", "mapping"])
