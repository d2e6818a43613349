"""End to end, the placement controller on a simulated multi-device node with real requests: a load step on one model
scales it up, the end of the load scales it back down, and the clients (HTTP and gRPC) see zero failed requests
throughout; in advise mode the same load changes nothing."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.daemon_harness import save, slow_model, start_daemon, wait_for

pytestmark = pytest.mark.slow
WIDTH = 256
CONFIG = """
max_batch_size: 8
dynamic_batching { }
instance_group [ { count: 1 } ]
parameters { key: "gpud_max_instances" value: { string_value: "3" } }
"""
# Short windows so that a test sees whole cycles: hints every 0.5 s over 2 s, a need for more must last 1 s, a lull
# 4 s (also the controller's no-removal-after-add cooldown); the controller re-plans every second. The queue target is
# 1 ms: a batch of `slow` computes for several ms, so the clients' requests queue longer than that however fast the
# machine is (at 5 ms, a CPU shared with other work gave too little load to ask for more: 3 ms queues, 60% busy).
FAST = ("--hints-interval-seconds", "0.5", "--hints-rate-window-seconds", "2", "--hints-target-queue-seconds", "0.001",
        "--hints-scale-up-stabilization-seconds", "1", "--hints-scale-down-stabilization-seconds", "4",
        "--max-instances", "3", "--control-interval-seconds", "1")


class Load:
    """Client threads sending one-row requests as fast as they are answered, counting answers and failures."""

    def __init__(self, daemon, http_clients: int = 3, grpc_clients: int = 3):
        self.daemon = daemon
        self.stop = threading.Event()
        self.ok = {"http": 0, "grpc": 0}
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._http, daemon=True) for _ in range(http_clients)]
        self.threads += [threading.Thread(target=self._grpc, daemon=True) for _ in range(grpc_clients)]

    def _count(self, protocol: str, error: Exception | None) -> None:
        with self._lock:
            if error is None:
                self.ok[protocol] += 1
            else:
                self.failures.append(f"{protocol}: {error}")

    def _http(self) -> None:
        client = httpclient.InferenceServerClient(self.daemon.http_url, network_timeout=60)
        x = httpclient.InferInput("x", [1, WIDTH], "FP32")
        x.set_data_from_numpy(np.full((1, WIDTH), 0.01, np.float32), binary_data=True)
        while not self.stop.is_set():
            try:
                assert client.infer("slow", [x]).as_numpy("y").shape == (1, WIDTH)
                self._count("http", None)
            except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                self._count("http", exc)

    def _grpc(self) -> None:
        client = grpcclient.InferenceServerClient(self.daemon.grpc_url)
        x = grpcclient.InferInput("x", [1, WIDTH], "FP32")
        x.set_data_from_numpy(np.full((1, WIDTH), 0.01, np.float32))
        while not self.stop.is_set():
            try:
                assert client.infer("slow", [x], client_timeout=60).as_numpy("y").shape == (1, WIDTH)
                self._count("grpc", None)
            except Exception as exc:  # noqa: BLE001
                self._count("grpc", exc)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


def _instances(daemon) -> int:
    return next(len(m["instances"]) for m in daemon.inspect()["models"] if m["name"] == "slow")


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    save(slow_model(width=WIDTH, layers=400), repo, "slow", CONFIG)  # a batch computes for tens of ms
    return repo


def test_a_load_step_scales_up_then_down_with_zero_failed_requests(repo, tmp_path):
    daemon = start_daemon(repo, tmp_path, *FAST)
    try:
        assert _instances(daemon) == 1
        with Load(daemon) as load:
            started = time.monotonic()
            wait_for(lambda: _instances(daemon) >= 2, 60, "the controller to add an instance under load")
            scaled_up_after_s = time.monotonic() - started
            served = dict(load.ok)
            wait_for(lambda: load.ok["http"] > served["http"] + 200 and load.ok["grpc"] > served["grpc"] + 200, 60,
                     "requests served while scaled up")
            peak = _instances(daemon)
        # The load has ended: after the 4 s lull (and the cooldown since the last add) it comes back down, at most
        # half the instances per step, a step per 4 s. A step's decision is recorded once its plan is done, just
        # after its instance is gone: wait for both.
        def steps() -> list[tuple[str, str, bool]]:
            return [(d["action"], d["reason"], d["applied"]) for d in daemon.inspect()["controller"]["decisions"]]

        def back_down() -> bool:
            done = steps()
            return _instances(daemon) == 1 and done.count(("remove", "scale_down", True)) >= \
                done.count(("add", "scale_up", True))

        wait_for(back_down, 90, "the controller to remove the instances the load needed")
        assert load.failures == [], load.failures[:5]
        ctl = daemon.inspect()["controller"]
        reasons = [(d["action"], d["reason"], d["applied"]) for d in ctl["decisions"]]
        adds = reasons.count(("add", "scale_up", True))
        assert adds >= peak - 1 >= 1 and reasons.count(("remove", "scale_down", True)) == adds, reasons
        assert max(t["target"] for t in ctl["targets"]) <= 3  # gpud_max_instances
        # a first rate window (2 s) + the up window (1 s) + at most 2 intervals (1 s each), with room for this machine
        assert scaled_up_after_s < 20, f"took {scaled_up_after_s:.1f} s to scale up"
        # no instance was added and removed within one stabilization window (4 s): no flapping
        adds = [d["time_unix_s"] for d in ctl["decisions"] if d["action"] == "add"]
        removes = [d["time_unix_s"] for d in ctl["decisions"] if d["action"] == "remove"]
        assert min(removes) - max(adds) >= 4
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert "placement control: add model slow" in daemon.log()


def test_advise_mode_changes_nothing(repo, tmp_path):
    daemon = start_daemon(repo, tmp_path, *FAST, "--placement-control", "advise")
    try:
        with Load(daemon, http_clients=3, grpc_clients=0):
            wait_for(lambda: any(d["action"] == "add" for d in daemon.inspect()["controller"]["decisions"]), 60,
                     "the controller to advise an add")
        ctl = daemon.inspect()["controller"]
        assert ctl["mode"] == "advise" and not any(d["applied"] for d in ctl["decisions"])
        assert _instances(daemon) == 1
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert "(advise: not applied)" in daemon.log()


def test_a_crash_looping_worker_has_its_instances_moved_to_another_device(tmp_path):
    import os
    import signal
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from gpud.examples import write_example_repository

    repo = tmp_path / "repo"
    write_example_repository(repo, ["mlp"])
    daemon = start_daemon(repo, tmp_path, "--control-interval-seconds", "3", "--worker-crash-loop-deaths", "3",
                          "--worker-crash-loop-seconds", "60")

    def mlp() -> dict:
        return next(m for m in daemon.inspect()["models"] if m["name"] == "mlp")

    def worker(device: str) -> dict:
        return next(w for w in daemon.inspect()["workers"] if w["device"] == device)

    client = httpclient.InferenceServerClient(daemon.http_url)
    x = httpclient.InferInput("input", [1, 256], "FP32")
    x.set_data_from_numpy(np.ones((1, 256), np.float32))
    try:
        reference = client.infer("mlp", [x]).as_numpy("output")
        first = mlp()["instances"][0]["device"]
        for k in range(3):  # 3 deaths within 60 s: a crash loop
            pid = worker(first)["pid"]
            os.kill(pid, signal.SIGKILL)
            if k < 2:
                # One reading: alive and the new pid (two could see the old worker alive, then the new pid)
                wait_for(lambda pid=pid: (lambda w: w["alive"] and w["pid"] != pid)(worker(first)), 60,
                         f"the worker on {first} to be restarted after death {k + 1}")
        wait_for(lambda: not next(d for d in daemon.inspect()["devices"] if d["id"] == first)["healthy"], 30,
                 f"{first} to read unhealthy")
        # Its only instance is down and not yet placed elsewhere (the controller re-plans every 3 s): a request
        # waits in the queue for the new instance instead of failing.
        np.testing.assert_allclose(client.infer("mlp", [x]).as_numpy("output"), reference, rtol=1e-6)
        wait_for(lambda: any(i["device"] != first and i["ready"] for i in mlp()["instances"]), 60,
                 "the controller to place mlp on another device")
        dev = next(d for d in daemon.inspect()["devices"] if d["id"] == first)
        assert not dev["healthy"] and "crash loop: its worker died 3 times within 60 s" in dev["unhealthy_reason"]
        assert not worker(first)["alive"] and worker(first)["unhealthy_reason"]  # not restarted a 4th time
        assert [i["device"] for i in mlp()["instances"]] != [first]
        np.testing.assert_allclose(client.infer("mlp", [x]).as_numpy("output"), reference, rtol=1e-6)
        steps = [(d["action"], d["reason"], d["applied"]) for d in daemon.inspect()["controller"]["decisions"]]
        assert ("move", "device_lost", True) in steps, steps  # made before broken: the new one serves first
        with urllib.request.urlopen(daemon.metrics_url, timeout=10) as r:
            metrics = r.read().decode()
        healthy = {s.labels["device"]: s.value for fam in text_string_to_metric_families(metrics)
                   if fam.name == "gpud_device_healthy" for s in fam.samples}
        assert healthy[first] == 0.0 and healthy["cpu"] == 1.0
    except AssertionError as exc:  # what the daemon did is the diagnosis
        raise AssertionError(f"{exc}\n--- daemon log (tail) ---\n{daemon.log()[-8000:]}") from None
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert "crash loop" in daemon.log() and "not restarted again" in daemon.log()


def test_a_crash_loop_on_a_device_of_several_models_puts_every_one_back_in_one_interval(tmp_path):
    """Issue 24, item 9: putting back what a lost device held is recovery, not scaling. Three models share a device
    whose worker crash-loops; with one step per interval allowed, the next interval still places all three elsewhere
    (one plan), and requests that arrive meanwhile wait for them instead of failing."""
    import os
    import signal

    from gpud.examples import write_example_repository
    from tritonclient.utils import np_to_triton_dtype

    from tests.daemon_harness import example_inputs

    repo = tmp_path / "repo"
    models = ["mlp", "cnn", "two_input"]
    write_example_repository(repo, models)
    daemon = start_daemon(repo, tmp_path, "--control-interval-seconds", "2", "--control-max-steps-per-interval",
                          "1", "--worker-crash-loop-deaths", "3", "--worker-crash-loop-seconds", "60")

    def placed() -> dict[str, list[tuple[str, bool]]]:
        return {m["name"]: [(i["device"], i["ready"]) for i in m["instances"]] for m in daemon.inspect()["models"]}

    def worker(device: str) -> dict:
        return next(w for w in daemon.inspect()["workers"] if w["device"] == device)

    def infer(model: str, results: dict) -> None:
        client = httpclient.InferenceServerClient(daemon.http_url, network_timeout=120)
        inputs = []
        for name, value in example_inputs(model, 1, np.random.default_rng(0)).items():
            x = httpclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
            x.set_data_from_numpy(value)
            inputs.append(x)
        try:
            client.infer(model, inputs)
            results[model] = "ok"
        except Exception as exc:  # noqa: BLE001 - the failure is the test's report
            results[model] = str(exc)

    try:
        before = placed()
        lost = before["mlp"][0][0]
        assert all(where == [(lost, True)] for where in before.values()), before  # pack: all on one device
        for k in range(3):  # 3 deaths within 60 s: a crash loop
            pid = worker(lost)["pid"]
            os.kill(pid, signal.SIGKILL)
            if k < 2:
                wait_for(lambda pid=pid: (lambda w: w["alive"] and w["pid"] != pid)(worker(lost)), 60,
                         f"the worker on {lost} to be restarted after death {k + 1}")
        wait_for(lambda: not next(d for d in daemon.inspect()["devices"] if d["id"] == lost)["healthy"], 30,
                 f"{lost} to read unhealthy")
        results: dict[str, str] = {}
        clients = [threading.Thread(target=infer, args=(m, results)) for m in models]
        for t in clients:
            t.start()
        wait_for(lambda: all(where and all(d != lost and ready for d, ready in where)
                             for where in placed().values()), 60, "every model to serve on another device")
        for t in clients:
            t.join(120)
        assert results == {m: "ok" for m in models}, results  # they waited for the new instances
        ctl = daemon.inspect()["controller"]
        steps = sorted((d["action"], d["model"], d["reason"], d["applied"], d["from_device"]) for d in ctl["decisions"])
        assert steps == [("move", m, "device_lost", True, lost) for m in sorted(models)], steps
        assert ctl["plans"] == 1  # one interval put all three back, past the one-step cap
    except AssertionError as exc:  # what the daemon did is the diagnosis
        raise AssertionError(f"{exc}\n--- daemon log (tail) ---\n{daemon.log()[-8000:]}") from None
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert "left for the next interval" not in daemon.log()


def test_a_new_version_and_a_new_config_load_under_load_with_zero_failed_requests(repo, tmp_path):
    """No gap on reload (as Triton): the new version loads beside the serving one, requests go to it once it is
    ready, and the old one finishes what it accepted before it unloads."""
    daemon = start_daemon(repo, tmp_path, "--placement-control", "off", "--model-control-mode", "explicit",
                          "--load-model", "*")

    def served() -> list[tuple[str, bool]]:
        return [(m["version"], m["state"] == "READY") for m in daemon.inspect()["models"] if m["name"] == "slow"]

    admin = httpclient.InferenceServerClient(daemon.http_url, network_timeout=120)
    try:
        with Load(daemon, http_clients=2, grpc_clients=2) as load:
            wait_for(lambda: load.ok["http"] > 20 and load.ok["grpc"] > 20, 60, "requests served before the reload")
            save(slow_model(width=WIDTH, layers=400, seed=1), repo, "slow", version=2)
            admin.load_model("slow")  # returns once version 2 serves
            assert served() == [("2", True)]
            before = dict(load.ok)
            wait_for(lambda: load.ok["http"] > before["http"] + 20 and load.ok["grpc"] > before["grpc"] + 20, 60,
                     "requests served by version 2")
            # The same version with a new config: both instances sit on the CPU under the same name meanwhile.
            (repo / "slow" / "config.pbtxt").write_text(CONFIG.replace("max_batch_size: 8", "max_batch_size: 4"))
            admin.load_model("slow")
            assert served() == [("2", True)]
            assert admin.get_model_config("slow")["max_batch_size"] == 4
            before = dict(load.ok)
            wait_for(lambda: load.ok["http"] > before["http"] + 20 and load.ok["grpc"] > before["grpc"] + 20, 60,
                     "requests served with the new config")
        assert load.failures == [], load.failures[:5]
        # A reload that fails (a config that does not parse) leaves what serves as it is, and says so.
        (repo / "slow" / "config.pbtxt").write_text("max_batch_size: [")
        with pytest.raises(Exception, match="keep serving"):
            admin.load_model("slow")
        assert served() == [("2", True)]
    finally:
        assert daemon.stop() == 0, daemon.log()
    log = daemon.log()
    assert "the previous version(s) 1 finish their requests and unload" in log, log[-3000:]


def test_a_model_with_minimum_zero_is_unloaded_when_idle_and_served_again_on_its_next_request(tmp_path):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from gpud.examples import write_example_repository

    repo = tmp_path / "repo"
    write_example_repository(repo, ["mlp"])
    config = repo / "mlp" / "config.pbtxt"
    config.write_text(config.read_text() + '\nparameters { key: "gpud_min_instances" value: { string_value: "0" } }\n')
    daemon = start_daemon(repo, tmp_path, "--idle-unload-seconds", "2", "--control-interval-seconds", "0.5")

    def mlp() -> dict:
        return next(m for m in daemon.inspect()["models"] if m["name"] == "mlp")

    client = httpclient.InferenceServerClient(daemon.http_url)
    x = httpclient.InferInput("input", [1, 256], "FP32")
    x.set_data_from_numpy(np.ones((1, 256), np.float32))
    try:
        reference = client.infer("mlp", [x]).as_numpy("output")
        wait_for(lambda: not mlp()["instances"], 60, "mlp to be unloaded after 2 s without a request")
        assert (mlp()["state"], mlp()["reason"]) == ("READY", "scaled to zero: its next request loads it")
        assert client.is_model_ready("mlp")  # it serves: the next request loads it
        np.testing.assert_allclose(client.infer("mlp", [x]).as_numpy("output"), reference, rtol=1e-6)  # cold start
        assert len(mlp()["instances"]) == 1
        with urllib.request.urlopen(daemon.metrics_url, timeout=10) as r:
            families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        cold = {s.name: s.value for s in families["gpud_model_cold_starts"].samples}
        assert cold["gpud_model_cold_starts_total"] == 1.0
        assert next(s.value for s in families["gpud_model_cold_start_seconds"].samples) > 0
        steps = [(d["action"], d["reason"], d["applied"]) for d in daemon.inspect()["controller"]["decisions"]]
        assert ("remove", "idle", True) in steps, steps
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- daemon log (tail) ---\n{daemon.log()[-6000:]}") from None
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert "cold start in" in daemon.log()
