"""End to end: worker crashes, graceful shutdown, and a model that fits nowhere — each on its own daemon."""
from __future__ import annotations

import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from gpud.examples import write_example_repository
from tests.daemon_harness import SLOW_CONFIG, save, slow_model, start_daemon, wait_for

pytestmark = pytest.mark.slow
WIDTH = 1024
SLOW_ROWS = 64  # a batch of this many rows computes for about half a second here: the kill lands mid-batch


def _slow_request(daemon, rows: int = SLOW_ROWS):
    client = httpclient.InferenceServerClient(daemon.http_url, network_timeout=120)
    inp = httpclient.InferInput("x", [rows, WIDTH], "FP32")
    inp.set_data_from_numpy(np.full((rows, WIDTH), 0.01, np.float32))
    return client.infer("slow", [inp]).as_numpy("y")


def _pending(daemon) -> int:
    return next(m["pending_requests"] for m in daemon.inspect()["models"] if m["name"] == "slow")


def _metrics(daemon) -> str:
    with urllib.request.urlopen(daemon.metrics_url, timeout=30) as r:
        return r.read().decode()


def _assert_worker_came_back(daemon, worker: dict, cause: str) -> None:
    """The CPU worker was lost once for `cause`, restarted under a new pid, reloaded, and serves; the metrics agree."""
    wait_for(lambda: httpclient.InferenceServerClient(daemon.http_url).is_model_ready("slow"), 60,
             "the worker to be restarted and the model reloaded")
    assert _slow_request(daemon, rows=1).shape == (1, WIDTH)
    after = next(w for w in daemon.inspect()["workers"] if w["device"] == "cpu")
    assert after["pid"] != worker["pid"] and after["alive"] and after["restarts"] == 1
    assert after["failures"] == {"died": 0, "hung": 0} | {cause: 1}
    metrics = _metrics(daemon)
    assert f'gpud_worker_restarts_total{{cause="{cause}",device="cpu"}} 1.0' in metrics
    assert 'gpud_worker_up{device="cpu"} 1.0' in metrics


@pytest.fixture
def slow_repo(tmp_path):
    repo = tmp_path / "repo"
    save(slow_model(width=WIDTH, layers=600), repo, "slow", SLOW_CONFIG)
    return repo


def test_sigkill_of_a_worker_fails_its_requests_fast_and_the_worker_comes_back(slow_repo, tmp_path):
    daemon = start_daemon(slow_repo, tmp_path)
    try:
        gpud_pid = daemon.ports["pid"]
        worker = next(w for w in daemon.inspect()["workers"] if w["device"] == "cpu")
        with ThreadPoolExecutor(2) as pool:
            fut = pool.submit(_slow_request, daemon)
            wait_for(lambda: _pending(daemon) == 1, 30, "the request to be running on the worker")
            # A full second batch cannot join the running one: it waits in the queue.
            queued = pool.submit(_slow_request, daemon)
            wait_for(lambda: _pending(daemon) == 2, 30, "a second request queued behind it")
            killed_at = time.monotonic()
            os.kill(worker["pid"], signal.SIGKILL)
            with pytest.raises(InferenceServerException) as err:
                fut.result(timeout=30)
            failed_after_s = time.monotonic() - killed_at
            # The queued request was never on the dead worker: it is served once the worker is back.
            assert queued.result(timeout=120).shape == (SLOW_ROWS, WIDTH)
        assert "died" in err.value.message() and "restarting" in err.value.message()
        assert failed_after_s < 5, f"the in-flight request took {failed_after_s:.1f} s to fail"
        _assert_worker_came_back(daemon, worker, cause="died")
        assert daemon.ports["pid"] == gpud_pid and daemon.proc.poll() is None, "gpud itself must not restart"
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_a_hung_worker_is_killed_its_requests_fail_saying_so_and_it_comes_back(slow_repo, tmp_path):
    daemon = start_daemon(slow_repo, tmp_path, "--worker-hang-secs", "2")
    worker = next(w for w in daemon.inspect()["workers"] if w["device"] == "cpu")
    try:
        # Stopped before the request: its batch reaches the worker's pipe and is never answered, as with a kernel
        # that never returns. Without the hang watch this request would wait forever.
        os.kill(worker["pid"], signal.SIGSTOP)
        with pytest.raises(InferenceServerException) as err:
            _slow_request(daemon, rows=1)
        message = err.value.message()
        assert "hung: a batch unanswered for" in message and "so gpud killed it" in message
        assert "restarting" in message
        assert "(--worker-hang-secs 2)" in daemon.log() and "killing it" in daemon.log()
        _assert_worker_came_back(daemon, worker, cause="hung")
    finally:
        try:
            os.kill(worker["pid"], signal.SIGKILL)  # if the watch failed, do not leave a stopped process behind
        except ProcessLookupError:
            pass
        assert daemon.stop() == 0, daemon.log()


def test_sigterm_finishes_accepted_requests_and_exits_0(slow_repo, tmp_path):
    daemon = start_daemon(slow_repo, tmp_path)
    n = 4
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(_slow_request, daemon) for _ in range(n)]
        wait_for(lambda: _pending(daemon) == n, 30, f"{n} requests accepted")
        daemon.proc.send_signal(signal.SIGTERM)
        results = [f.result(timeout=120) for f in futures]
    assert all(r.shape == (SLOW_ROWS, WIDTH) for r in results)
    assert daemon.proc.wait(timeout=60) == 0, daemon.log()
    assert "finishing the accepted ones" in daemon.log()


def test_a_model_that_fits_nowhere_is_unavailable_with_a_reason_and_the_others_serve(tmp_path):
    repo = tmp_path / "repo"
    write_example_repository(repo, ["mlp", "two_input"])
    # two_input on the CPU; mlp on GPUs only, and we leave the GPU no room (40 GiB reserved of 40 GiB).
    cfg = (repo / "two_input" / "config.pbtxt").read_text()
    (repo / "two_input" / "config.pbtxt").write_text(cfg + "\ninstance_group [ { kind: KIND_CPU } ]\n")
    cfg = (repo / "mlp" / "config.pbtxt").read_text()
    (repo / "mlp" / "config.pbtxt").write_text(cfg + "\ninstance_group [ { kind: KIND_GPU, count: 2 } ]\n")
    daemon = start_daemon(repo, tmp_path, "--device-reserve-bytes", str(40 * 2**30),
                          node="config/nodes/a100-40gb-1gpu.yaml")
    try:
        client = httpclient.InferenceServerClient(daemon.http_url)
        assert client.is_server_ready() and client.is_model_ready("two_input")
        assert not client.is_model_ready("mlp")
        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert index["mlp"]["state"] == "UNAVAILABLE"
        assert "not placed" in index["mlp"]["reason"] and "gpu0" in index["mlp"]["reason"]
        inspect = next(m for m in daemon.inspect()["models"] if m["name"] == "mlp")
        assert "larger than any allowed device" in inspect["reason"]
        assert "not placed" in daemon.log()
        inp = httpclient.InferInput("input", [1, 256], "FP32")
        inp.set_data_from_numpy(np.zeros((1, 256), np.float32))
        with pytest.raises(InferenceServerException) as err:
            client.infer("mlp", [inp])
        assert "not placed" in err.value.message()
    finally:
        assert daemon.stop() == 0, daemon.log()
