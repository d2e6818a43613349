"""End to end: sequence models served by the real daemon (subprocess, CPU execution), driven by the official
tritonclient over HTTP and gRPC (unary and streaming) with interleaved sequences, integer and string ids; the
errors Triton gives; the idle release; perf_analyzer --sequence-length when GPUD_PERF_ANALYZER is set."""
from __future__ import annotations

import http.client
import json
import os
import queue
import shutil
import subprocess
import threading
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from gpud.cli.inspect import render_inspect
from tests.daemon_harness import start_daemon, wait_for
from tests.sequence_models import write_sequence_repository

pytestmark = pytest.mark.slow
PERF_ANALYZER = os.environ.get("GPUD_PERF_ANALYZER") or shutil.which("perf_analyzer")
STEPS = 6


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_sequence_repository(repo)
    d = start_daemon(repo, tmp_path_factory.mktemp("run"))
    yield d
    assert d.stop() == 0, d.log()


def _input(module, value: int):
    x = module.InferInput("INPUT", [1, 1], "INT32")
    x.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return [x]


def _values(seq: int) -> list[int]:
    return [seq * 10 + step for step in range(STEPS)]


def _drive(client, module, model: str, ids: list, *, checks_corrid: bool = True) -> dict:
    """One thread per sequence, each sending its requests one after the other (the next once the last is answered),
    so that the sequences interleave on the server. Returns {id: [OUTPUT per step]}."""
    results: dict = {}
    errors: list = []

    def run(k: int, cid) -> None:
        try:
            outs = []
            for step, value in enumerate(_values(k)):
                r = client.infer(model, _input(module, value), sequence_id=cid, sequence_start=step == 0,
                                 sequence_end=step == STEPS - 1)
                outs.append(int(r.as_numpy("OUTPUT")[0, 0]))
                if checks_corrid:
                    got = r.as_numpy("CORRID_OUT")[0, 0]
                    assert (got.decode() if isinstance(got, bytes) else int(got)) == cid
            results[cid] = outs
        except Exception as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k, cid)) for k, cid in enumerate(ids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


def _running_sums(k: int) -> list[int]:
    return list(np.cumsum(_values(k)))


class TestInterleavedSequences:
    def test_http_integer_ids_direct(self, daemon):
        ids = [1001 + k for k in range(8)]  # 8 sequences on 2 instances x 4 slots
        with httpclient.InferenceServerClient(daemon.http_url, concurrency=8, network_timeout=60) as client:
            results = _drive(client, httpclient, "acc_direct", ids)
        assert results == {cid: _running_sums(k) for k, cid in enumerate(ids)}

    def test_grpc_string_ids_oldest(self, daemon):
        ids = [f"user-{k}-e333c95a" for k in range(10)]  # 10 sequences, 8 slots: two wait in the backlog
        with grpcclient.InferenceServerClient(daemon.grpc_url) as client:
            results = _drive(client, grpcclient, "acc_oldest", ids)
        assert results == {cid: _running_sums(k) for k, cid in enumerate(ids)}

    def test_grpc_stream_interleaved_on_one_stream(self, daemon):
        """Every request of four sequences sent at once on one stream, interleaved step by step: the stream's
        order is each sequence's order."""
        answers: queue.Queue = queue.Queue()
        ids = [7, 8, 9, 10]
        with grpcclient.InferenceServerClient(daemon.grpc_url) as client:
            client.start_stream(callback=lambda result, error: answers.put((result, error)))
            for step in range(STEPS):
                for k, cid in enumerate(ids):
                    client.async_stream_infer("acc_direct", _input(grpcclient, _values(k)[step]),
                                              request_id=f"{cid}:{step}", sequence_id=cid,
                                              sequence_start=step == 0, sequence_end=step == STEPS - 1)
            got = {}
            for _ in range(STEPS * len(ids)):
                result, error = answers.get(timeout=60)
                assert error is None, error
                got[result.get_response().id] = int(result.as_numpy("OUTPUT")[0, 0])
            client.stop_stream()
        assert got == {f"{cid}:{step}": _running_sums(k)[step] for k, cid in enumerate(ids) for step in range(STEPS)}

    def test_http_and_grpc_share_a_sequence(self, daemon):
        """The sequence is the server's: a client may continue it over the other protocol."""
        h = httpclient.InferenceServerClient(daemon.http_url)
        g = grpcclient.InferenceServerClient(daemon.grpc_url)
        try:
            assert h.infer("acc_direct", _input(httpclient, 5), sequence_id=555, sequence_start=True) \
                .as_numpy("OUTPUT")[0, 0] == 5
            assert g.infer("acc_direct", _input(grpcclient, 6), sequence_id=555).as_numpy("OUTPUT")[0, 0] == 11
            assert h.infer("acc_direct", _input(httpclient, 7), sequence_id=555, sequence_end=True) \
                .as_numpy("OUTPUT")[0, 0] == 18
        finally:
            h.close()
            g.close()


def test_controls_as_triton_delivers_them(daemon):
    with httpclient.InferenceServerClient(daemon.http_url) as client:
        rows = []
        for step in range(3):
            r = client.infer("controls", _input(httpclient, 3), sequence_id=2**63 + 5, sequence_start=step == 0,
                             sequence_end=step == 2)
            rows.append(tuple(r.as_numpy(n)[0, 0].item() for n in ("START_OUT", "END_OUT", "READY_OUT",
                                                                    "CORRID_OUT", "OUTPUT")))
    # START int32_false_true [10, 11], END bool, READY fp32 [0, 1], CORRID uint64 (above 2^63 too)
    assert rows == [(11, False, 1.0, 2**63 + 5, 3), (10, False, 1.0, 2**63 + 5, 3), (10, True, 1.0, 2**63 + 5, 3)]


def test_config_and_metadata_show_a_sequence_model(daemon):
    with httpclient.InferenceServerClient(daemon.http_url) as client:
        config = client.get_model_config("acc_oldest")
        assert config["sequence_batching"]["oldest"]["max_candidate_sequences"] == 8
        assert [c["name"] for c in config["sequence_batching"]["control_input"]] == ["START", "READY", "CORRID"]
        assert config["sequence_batching"]["state"][0]["input_name"] == "INPUT_STATE"
        assert [i["name"] for i in client.get_model_metadata("acc_oldest")["inputs"]] == ["INPUT"]
        assert "sequence" in client.get_server_metadata()["extensions"]
    inspect = daemon.inspect()
    models = {m["name"]: m for m in inspect["models"]}
    assert models["acc_direct"]["sequences_in_slots"] >= 0 and models["acc_direct"]["sequences_in_backlog"] == 0
    assert "waiting for one" in render_inspect(inspect)  # gpudctl inspect: a sequences line under each such model
    with urllib.request.urlopen(daemon.metrics_url, timeout=30) as r:
        metrics = r.read().decode()
    assert 'gpud_model_sequences{model="acc_direct",version="1",where="slot"}' in metrics
    with grpcclient.InferenceServerClient(daemon.grpc_url) as client:
        config = client.get_model_config("acc_direct").config
        assert config.HasField("sequence_batching") and config.sequence_batching.HasField("direct")
        assert config.sequence_batching.max_sequence_idle_microseconds == 1_000_000  # Triton's default


class TestErrors:
    CASES = [
        (dict(sequence_id=404), "inference request for sequence 404 to model 'acc_direct' must specify the START "
                                "flag on the first request of the sequence"),
        (dict(sequence_id=0, sequence_start=False), "must specify a non-zero or non-empty correlation ID"),
        (dict(sequence_id="text", sequence_start=True), "data-type is 'BYTES', but model 'acc_direct' expects "
                                                        "'UINT64'"),
    ]

    @pytest.mark.parametrize("kwargs, message", CASES)
    def test_http(self, daemon, kwargs, message):
        with httpclient.InferenceServerClient(daemon.http_url) as client:
            with pytest.raises(InferenceServerException) as e:
                client.infer("acc_direct", _input(httpclient, 1), **kwargs)
        assert message in e.value.message() and e.value.status() == "400"

    @pytest.mark.parametrize("kwargs, message", CASES)
    def test_grpc(self, daemon, kwargs, message):
        with grpcclient.InferenceServerClient(daemon.grpc_url) as client:
            with pytest.raises(InferenceServerException) as e:
                client.infer("acc_direct", _input(grpcclient, 1), **kwargs)
        assert message in e.value.message() and e.value.status() == "StatusCode.INVALID_ARGUMENT"

    def test_finished_sequence_and_batch_size(self, daemon):
        with httpclient.InferenceServerClient(daemon.http_url) as client:
            client.infer("acc_direct", _input(httpclient, 1), sequence_id=31, sequence_start=True,
                         sequence_end=True)
            with pytest.raises(InferenceServerException) as e:
                client.infer("acc_direct", _input(httpclient, 1), sequence_id=31)
            assert "sequence 31 ended: its last request set sequence_end" in e.value.message()
            x = httpclient.InferInput("INPUT", [2, 1], "INT32")
            x.set_data_from_numpy(np.array([[1], [2]], dtype=np.int32))
            with pytest.raises(InferenceServerException) as e:
                client.infer("acc_direct", [x], sequence_id=32, sequence_start=True)
            assert "must specify batch-size 1 due to requirements of sequence batcher" in e.value.message()


def test_an_abandoned_sequence_is_released_after_its_idle_time(daemon):
    """acc_idle releases a sequence after 200 ms without a request (measured by the daemon's clock; the state
    machine's timing is tests/test_sequence_batcher.py's, with a fake clock)."""
    with httpclient.InferenceServerClient(daemon.http_url) as client:
        assert client.infer("acc_idle", _input(httpclient, 4), sequence_id=4242, sequence_start=True) \
            .as_numpy("OUTPUT")[0, 0] == 4
        wait_for(lambda: "sequence 4242 was released" in daemon.log(), 30, "the idle release of sequence 4242")
        with pytest.raises(InferenceServerException) as e:
            client.infer("acc_idle", _input(httpclient, 1), sequence_id=4242)
        assert "sequence 4242 was released: it had no request for max_sequence_idle_microseconds (200000 us)" in \
            e.value.message()
        # The id may start again, from a fresh state.
        assert client.infer("acc_idle", _input(httpclient, 9), sequence_id=4242, sequence_start=True) \
            .as_numpy("OUTPUT")[0, 0] == 9


@pytest.mark.skipif(not PERF_ANALYZER, reason="perf_analyzer not installed (set GPUD_PERF_ANALYZER)")
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_sequences(daemon, protocol):
    url = daemon.http_url if protocol == "http" else daemon.grpc_url
    with httpclient.InferenceServerClient(daemon.http_url) as client:
        before = client.get_inference_statistics("acc_direct")["model_stats"][0]["inference_stats"]["fail"]["count"]
    out = subprocess.run([PERF_ANALYZER, "-m", "acc_direct", "-i", protocol, "-u", url, "--sequence-length", "5",
                          "--concurrency-range", "4", "--measurement-mode", "count_windows",
                          "--measurement-request-count", "200", "--stability-percentage", "1000"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Throughput" in out.stdout
    with httpclient.InferenceServerClient(daemon.http_url) as client:
        stats = client.get_inference_statistics("acc_direct")["model_stats"][0]["inference_stats"]
    assert stats["fail"]["count"] == before, out.stdout  # every request of every sequence was served


@pytest.mark.parametrize("parameters, message", [
    ({"sequence_id": -1, "sequence_start": True}, "'sequence_id' must be an unsigned 64-bit integer or a string"),
    ({"sequence_id": 2**64, "sequence_start": True}, "'sequence_id' must be an unsigned"),  # JSON's decoder: a float
    ({"sequence_id": 1.5}, "'sequence_id' must be an unsigned integer or a string"),
    ({"sequence_id": [1]}, "'sequence_id' must be an unsigned integer or a string"),
    ({"sequence_id": None}, "'sequence_id' must be an unsigned integer or a string"),
    ({"sequence_id": True}, "'sequence_id' must be an unsigned integer or a string"),
    ({"sequence_id": 1, "sequence_start": "yes"}, "'sequence_start' must be a boolean"),
    ({"sequence_id": 1, "sequence_end": 1}, "'sequence_end' must be a boolean"),
    ({"sequence_start": True}, "must specify a non-zero or non-empty correlation ID"),
    ({"sequence_id": "\ud800", "sequence_start": True}, ""),  # a lone surrogate: refused, by the JSON decoder or us
])
def test_malformed_sequence_parameters_are_400s(daemon, parameters, message):
    body = json.dumps({"parameters": parameters,
                       "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [1]}]})
    conn = http.client.HTTPConnection(*daemon.http_url.split(":"), timeout=30)
    try:
        conn.request("POST", "/v2/models/acc_direct/infer", body, {"Content-Type": "application/json"})
        answer = conn.getresponse()
        status, doc = answer.status, json.loads(answer.read())
    finally:
        conn.close()
    assert status == 400 and message in doc["error"], doc
    assert "Traceback" not in daemon.log()
