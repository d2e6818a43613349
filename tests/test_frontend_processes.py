"""HTTP front ends in processes of their own (--http-processes, issue 25): the same answers, errors, limits, admin
rules and statistics as the in-process front end; tensors handed over in shared memory (binary and JSON bodies, text,
a client's own regions); a front-end process killed under load is restarted while the others serve; SIGTERM drains
every process with no accepted request lost. gRPC front ends in processes: the same answers, errors, streams and
statistics."""
from __future__ import annotations

import concurrent.futures
import os
import signal

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from gpud.examples import write_example_repository
from tests.daemon_harness import SLOW_CONFIG, save, slow_model, start_daemon, wait_for

pytestmark = pytest.mark.slow
PROCESSES = 2


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_example_repository(repo, ["mlp", "two_input"])
    save(slow_model(width=256, layers=60), repo, "slow", SLOW_CONFIG)
    return repo


@pytest.fixture(scope="module")
def daemon(repo, tmp_path_factory):
    d = start_daemon(repo, tmp_path_factory.mktemp("run"), "--http-processes", str(PROCESSES),
                     "--max-request-bytes", str(1 << 20), "--allow-client-shm", "true", node=None)
    yield d
    assert d.stop() == 0, d.log()
    assert "Traceback" not in d.log(), d.log()


def frontends(daemon, kind: str = "http") -> list[psutil.Process]:
    out = []
    for c in psutil.Process(daemon.proc.pid).children():
        try:
            line = " ".join(c.cmdline())
            if c.status() != psutil.STATUS_ZOMBIE and "gpud.frontproc.child" in line and f'"kind": "{kind}"' in line:
                out.append(c)
        except psutil.Error:  # gone meanwhile
            pass
    return out


def mlp_input(value: float = 1.0, binary: bool = True):
    x = httpclient.InferInput("input", [1, 256], "FP32")
    x.set_data_from_numpy(np.full((1, 256), value, np.float32), binary_data=binary)
    return x


def test_it_runs_the_processes_it_was_asked_for(daemon):
    assert len(frontends(daemon)) == PROCESSES
    assert "in 2 front-end process(es)" in daemon.log()


def test_answers_as_the_in_process_front_end(daemon, tmp_path):
    client = httpclient.InferenceServerClient(daemon.http_url)
    binary = client.infer("mlp", [mlp_input(0.5)]).as_numpy("output")
    json_out = client.infer("mlp", [mlp_input(0.5, binary=False)],
                            outputs=[httpclient.InferRequestedOutput("output", binary_data=False)]).as_numpy("output")
    with __import__("gpud").Server(daemon_repo(daemon), models_in_process=True) as server:
        expected = server.infer("mlp", {"input": np.full((1, 256), 0.5, np.float32)})["output"]
    np.testing.assert_allclose(binary, expected, rtol=1e-6)
    np.testing.assert_allclose(json_out, expected, rtol=1e-6)
    assert client.get_model_metadata("two_input")["name"] == "two_input"
    assert client.get_model_config("mlp")["name"] == "mlp"
    assert client.is_model_ready("mlp") and client.is_server_live()


def daemon_repo(daemon) -> str:
    args = psutil.Process(daemon.proc.pid).cmdline()
    return args[args.index("--model-repository") + 1]


def test_errors_and_limits_are_the_same(daemon):
    status, doc = daemon.post_json("/v2/models/nope/infer", {"inputs": []}, 30)
    assert status == 400 and "non-empty 'inputs'" in doc["error"]
    status, doc = daemon.post_json("/v2/models/nope/infer", {"inputs": [
        {"name": "input", "shape": [1, 256], "datatype": "FP32", "data": [0.0] * 256}]}, 30)
    assert status == 404 and "unknown model: 'nope'" in doc["error"]
    status, doc = daemon.post_json("/v2/models/mlp/infer", {"inputs": [
        {"name": "input", "shape": [1, 255], "datatype": "FP32", "data": [0.0] * 255}]}, 30)
    assert status == 400 and "unexpected shape for input 'input'" in doc["error"]
    too_big = {"inputs": [{"name": "input", "shape": [1, 256], "datatype": "FP32", "data": [0.0] * 256}],
               "pad": "x" * (1 << 20)}
    status, doc = daemon.post_json("/v2/models/mlp/infer", too_big, 30)  # --max-request-bytes, in the process
    assert status == 413 and "exceeds the limit" in doc["error"]
    status, doc = daemon.post_json("/v2/repository/models/mlp/unload", None, 30)  # model control none: as Triton
    assert status == 503 and "model control" in doc["error"].lower()


def test_statistics_count_every_processs_requests_once(daemon):
    stats = lambda: daemon.get_json("/v2/models/two_input/stats")["model_stats"][0]["inference_stats"]  # noqa: E731
    before = stats()["success"]["count"]
    def one(i):  # a client (a connection) per request: the connections spread over both processes
        ids = httpclient.InferInput("ids", [1, 4], "INT64")
        ids.set_data_from_numpy(np.arange(4, dtype=np.int64).reshape(1, 4) + i)
        scale = httpclient.InferInput("scale", [1, 4], "FP32")
        scale.set_data_from_numpy(np.ones((1, 4), np.float32))
        return httpclient.InferenceServerClient(daemon.http_url).infer("two_input", [ids, scale])
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(80)))
    assert stats()["success"]["count"] - before == 80


def test_a_clients_shared_memory_goes_through_the_core(daemon):
    import tritonclient.utils.shared_memory as shm

    client = httpclient.InferenceServerClient(daemon.http_url)
    x = np.full((1, 256), 2.0, np.float32)
    key = f"/fe-test-{os.getpid()}"
    handle = shm.create_shared_memory_region("fe_in", key, x.nbytes)
    try:
        shm.set_shared_memory_region(handle, [x])
        client.register_system_shared_memory("fe_in", key, x.nbytes)
        assert [r["name"] for r in client.get_system_shared_memory_status()] == ["fe_in"]
        inp = httpclient.InferInput("input", [1, 256], "FP32")
        inp.set_shared_memory("fe_in", x.nbytes)
        got = client.infer("mlp", [inp]).as_numpy("output")
        np.testing.assert_allclose(got, client.infer("mlp", [mlp_input(2.0)]).as_numpy("output"), rtol=1e-6)
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle)


def test_a_killed_front_end_process_is_restarted_and_the_others_serve_meanwhile(daemon):
    victim, survivor = frontends(daemon)
    client_errors, served = [], []

    def load(n):
        client = httpclient.InferenceServerClient(daemon.http_url)
        for _ in range(n):
            try:
                served.append(client.infer("mlp", [mlp_input()]).as_numpy("output") is not None)
            except (InferenceServerException, ConnectionError, OSError) as exc:
                client_errors.append(exc)  # a connection the killed process held
                client = httpclient.InferenceServerClient(daemon.http_url)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(load, 50) for _ in range(4)]
        wait_for(lambda: len(served) >= 20, 60, "requests served before the kill")
        os.kill(victim.pid, signal.SIGKILL)
        for job in jobs:
            job.result()
    wait_for(lambda: len(frontends(daemon)) == PROCESSES and victim.pid not in {p.pid for p in frontends(daemon)},
             60, "the killed front-end process replaced")
    assert survivor.is_running()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"gpud-{victim.pid}-")]  # its arena: removed
    assert len(served) + len(client_errors) == 200 and len(served) >= 150
    assert "front-end process" in daemon.log() and "restarting it" in daemon.log()
    assert httpclient.InferenceServerClient(daemon.http_url).infer("mlp", [mlp_input()]).as_numpy("output") is not None


def accepted(d) -> int:
    """The slow model's requests that the core holds or has answered."""
    [m] = [m for m in d.inspect()["models"] if m["name"] == "slow"]
    done = d.get_json("/v2/models/slow/stats")["model_stats"][0]["inference_stats"]["success"]["count"]
    return m["pending_requests"] + done


def test_sigterm_drains_every_process_with_no_accepted_request_lost(repo, tmp_path):
    d = start_daemon(repo, tmp_path, "--http-processes", str(PROCESSES), node=None)
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)

    def one(_):
        client = httpclient.InferenceServerClient(d.http_url, network_timeout=120)
        inp = httpclient.InferInput("x", [1, 256], "FP32")
        inp.set_data_from_numpy(x)
        return client.infer("slow", [inp]).as_numpy("y")
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            jobs = [pool.submit(one, i) for i in range(8)]
            wait_for(lambda: accepted(d) == 8, 60, "all 8 requests accepted (queued or running)")
            d.proc.send_signal(signal.SIGTERM)
            results = [j.result() for j in jobs]
        assert all(r is not None and r.shape == (1, 256) for r in results)
        assert d.proc.wait(60) == 0
    finally:
        d.stop()
    assert "Traceback" not in d.log(), d.log()


# --- gRPC in processes of their own (they share the port: SO_REUSEPORT) -------------------------------------------------
@pytest.fixture(scope="module")
def grpc_daemon(repo, tmp_path_factory):
    d = start_daemon(repo, tmp_path_factory.mktemp("run-grpc"), "--grpc-processes", str(PROCESSES), node=None)
    yield d
    assert d.stop() == 0, d.log()
    assert "Traceback" not in d.log(), d.log()


def grpc_input(value: float = 1.0):
    x = grpcclient.InferInput("input", [1, 256], "FP32")
    x.set_data_from_numpy(np.full((1, 256), value, np.float32))
    return x


def test_grpc_processes_answer_as_the_in_process_front_end(grpc_daemon):
    assert len(frontends(grpc_daemon, "grpc")) == PROCESSES
    client = grpcclient.InferenceServerClient(grpc_daemon.grpc_url)
    over_http = httpclient.InferenceServerClient(grpc_daemon.http_url).infer("mlp", [mlp_input(0.25)])
    np.testing.assert_allclose(client.infer("mlp", [grpc_input(0.25)]).as_numpy("output"),
                               over_http.as_numpy("output"), rtol=1e-6)
    assert client.get_model_metadata("mlp").name == "mlp" and client.is_server_ready()
    with pytest.raises(InferenceServerException) as info:
        client.infer("nope", [grpc_input()])
    assert info.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as info:
        client.unload_model("mlp")  # model control none: UNAVAILABLE, as Triton
    assert info.value.status() == "StatusCode.UNAVAILABLE"


def test_grpc_streams_and_statistics_through_the_processes(grpc_daemon):
    stats = lambda: grpc_daemon.get_json("/v2/models/mlp/stats")["model_stats"][0]["inference_stats"]  # noqa: E731
    before = stats()["success"]["count"]
    answers = []
    client = grpcclient.InferenceServerClient(grpc_daemon.grpc_url)
    client.start_stream(callback=lambda result, error: answers.append(error or result))
    for i in range(10):
        client.async_stream_infer("mlp", [grpc_input(float(i))], request_id=str(i))
    client.stop_stream()  # waits for the answers
    assert sorted(int(a.get_response().id) for a in answers) == list(range(10))
    for i in range(10):
        client.infer("mlp", [grpc_input(float(i))])
    assert stats()["success"]["count"] - before == 20


def test_gpudctl_inspect_lists_the_front_end_processes(daemon):
    from gpud.cli.inspect import render_inspect

    view = daemon.inspect()
    processes = view["frontends"]["processes"]
    http = [p for p in processes if p["kind"] == "http"]
    assert len(http) == PROCESSES and all(p["alive"] for p in http)
    assert {p["pid"] for p in http} == {p.pid for p in frontends(daemon)}
    text = render_inspect(view)
    assert "FRONT ENDS (processes of their own)" in text
    assert all(f" {p['pid']} " in text for p in http) and "restarts" in text and "grouped" in text
    # each process's event loop beside the core's (a process reports its loop once as it starts serving)
    loops = {loop["process"] for loop in view["event_loops"]["loops"]}
    assert {"core", *(f"http-{p['index']}" for p in http)} <= loops, loops
    assert "EVENT LOOPS" in text and all(f" http-{p['index']} " in text for p in http)
