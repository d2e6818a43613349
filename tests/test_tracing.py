"""Triton's trace extension: the settings' rules (gpud.tracing.settings), what the tracer samples and writes
(gpud.tracing.tracer, gpud.tracing.output), the summary, the HTTP and gRPC API against tritonclient, gpudctl trace,
the start-up flags, and a real daemon's trace file."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from gpud.executor.errors import ErrorKind, InferenceError
from gpud.tracing.output import TraceFile
from gpud.tracing.settings import TraceSettings, parse_request, parse_trace_config, settings_of
from gpud.tracing.summary import render, summarize
from gpud.tracing.tracer import Tracer
from tests.daemon_harness import start_daemon, wait_for
from tests.fake_core import FakeCore
from tests.extension_servers import HttpClient, auth, serving

TOKEN = "trace-token"
TIMEOUT_S = 30.0
DEFAULTS = {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1", "log_frequency": "0",
            "trace_file": "", "trace_mode": "triton"}


class Clock:
    def __init__(self) -> None:
        self.ns = 1_000

    def __call__(self) -> int:
        self.ns += 1_000
        return self.ns


def _tracer(tmp_path, **fields) -> Tracer:
    settings = TraceSettings(**{"level": ("TIMESTAMPS",), "rate": 1, "file": str(tmp_path / "trace.json"),
                                **fields})
    return Tracer(settings, clock_ns=Clock())


def _traced(tracer: Tracer, n: int, model: str = "m") -> list[int]:
    """`n` requests of `model` through the tracer, each answered at once: the ids of those traced."""
    ids = []
    for i in range(n):
        trace = tracer.sample(model, "1", f"r{i}")
        if trace is not None:
            trace.computed("1", 10, 20, 1, 2, 3)
            trace.end()
            ids.append(trace.id)
    return ids


def _read(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# --- the settings' rules -----------------------------------------------------------------------------------------
def test_a_request_is_read_as_triton_reads_it():
    assert parse_request({"trace_level": ["TENSORS", "TIMESTAMPS"], "trace_rate": "10", "trace_count": 5,
                          "log_frequency": None}) == {"level": ("TIMESTAMPS", "TENSORS"), "rate": 10, "count": 5,
                                                      "log_frequency": None}
    assert parse_request({"trace_level": ["OFF"]}) == {"level": ()}
    assert parse_request({"trace_level": "timestamps"}) == {"level": ("TIMESTAMPS",)}  # one level alone


@pytest.mark.parametrize("request_, kind, words", [
    ({"trace_level": ["OFF", "TIMESTAMPS"]}, ErrorKind.INVALID_ARGUMENT, "only one trace level 'OFF'"),
    ({"trace_level": ["LOUD"]}, ErrorKind.INVALID_ARGUMENT, "unknown trace level 'LOUD'"),
    ({"trace_level": [1]}, ErrorKind.INVALID_ARGUMENT, "array of strings"),
    ({"trace_rate": "ten"}, ErrorKind.INVALID_ARGUMENT, "Unable to parse 'trace_rate', got: ten"),
    ({"trace_rate": "-1"}, ErrorKind.INVALID_ARGUMENT, "out of range [ 0, 4294967295 ]"),
    ({"trace_count": "-2"}, ErrorKind.INVALID_ARGUMENT, "out of range [ -1, 2147483647 ]"),
    ({"trace_count": True}, ErrorKind.INVALID_ARGUMENT, "expecting a number"),
    ({"log_frequency": 1.5}, ErrorKind.INVALID_ARGUMENT, "expecting a number"),
    ({"trace_file": "/tmp/elsewhere.json"}, ErrorKind.UNSUPPORTED, "can not be updated through network"),
    ({"trace_bogus": "1"}, ErrorKind.INVALID_ARGUMENT, "unknown trace setting 'trace_bogus'"),
])
def test_a_bad_request_is_refused_with_triton_s_words(request_, kind, words):
    with pytest.raises(InferenceError) as refused:
        parse_request(request_)
    assert refused.value.kind is kind and words in refused.value.message


def test_tritonserver_s_trace_config_gives_gpud_s_settings():
    assert parse_trace_config(["triton,file=/tmp/trace.json", "triton,log-frequency=50", "rate=100",
                               "level=TIMESTAMPS", "level=TENSORS", "count=100", "mode=triton"]) == {
        "trace_file": "/tmp/trace.json", "trace_log_frequency": 50, "trace_rate": 100, "trace_count": 100,
        "trace_level": ("TIMESTAMPS", "TENSORS")}


@pytest.mark.parametrize("value, words", [
    ("opentelemetry,url=localhost:4318", "Triton's mode only"), ("mode=opentelemetry", "Triton's mode only"),
    ("file=/tmp/t.json", "a setting of the triton mode"), ("rate=often", "'rate' must be a number"),
    ("triton,rate=1", "unknown setting 'rate'"), ("colour=blue", "unknown setting 'colour'"), ("rate", "expected"),
])
def test_a_trace_config_gpud_cannot_take_is_refused(value, words):
    with pytest.raises(ValueError, match=words):
        parse_trace_config([value])


def test_the_starting_settings_need_a_file_to_trace():
    assert settings_of((), 1000, -1, 0, "") == TraceSettings()
    with pytest.raises(ValueError, match="trace file name is not given"):
        settings_of(("TIMESTAMPS",), 1000, -1, 0, "")
    with pytest.raises(ValueError, match="trace_count must be from -1"):
        settings_of((), 1000, -5, 0, "")
    with pytest.raises(ValueError, match="trace_level: unknown trace level"):
        settings_of(("SOME",), 1000, -1, 0, "/tmp/t.json")


# --- sampling, counting, settings per model ----------------------------------------------------------------------
def test_every_rate_th_request_is_traced_until_the_count_runs_out(tmp_path):
    tracer = _tracer(tmp_path, rate=3, count=2)
    assert tracer.on
    assert _traced(tracer, 10) == [1, 2]  # the 3rd and 6th requests; then the count is done
    assert not tracer.on and tracer.settings().count == 0
    # the count ran out with every trace written: the file has them at once, without waiting for a flush
    written = _read(tmp_path / "trace.json")
    assert [o.get("request_id") for o in written if "model_name" in o] == ["r2", "r5"]


def test_a_group_of_requests_counts_as_its_members(tmp_path):
    tracer = _tracer(tmp_path, rate=4)
    assert tracer.sample("m", "1", "", members=3) is None  # requests 1-3
    assert tracer.sample("m", "1", "", members=3) is not None  # 4-6 hold the 4th
    assert tracer.sample("m", "1", "", members=2) is not None  # 7-8 hold the 8th


def test_a_model_s_own_settings_take_the_rest_from_the_global_ones(tmp_path):
    tracer = _tracer(tmp_path, level=(), rate=1000)
    assert not tracer.on
    with pytest.raises(InferenceError, match="Attempting to set invalid trace setting: sample rate must be non-zero"):
        tracer.update("a", {"trace_level": ["TIMESTAMPS"], "trace_rate": "0"})
    assert tracer.settings("a") == tracer.settings() and not tracer.on  # refused: nothing changed
    own = tracer.update("a", {"trace_level": ["TIMESTAMPS"]})
    assert own.level == ("TIMESTAMPS",) and own.rate == 1000 and tracer.on
    assert tracer.settings("b").level == ()  # other models follow the global settings
    tracer.update("", {"trace_rate": "5"})  # reaches a's rate, which it does not set itself
    assert tracer.settings("a").rate == 5 and tracer.settings("a").level == ("TIMESTAMPS",)
    tracer.update("a", {"trace_rate": "7"})
    tracer.update("", {"trace_rate": "9"})
    assert tracer.settings("a").rate == 7  # now its own
    tracer.update("a", {"trace_rate": None})
    assert tracer.settings("a").rate == 9  # cleared: the global one again
    tracer.update("a", {"trace_level": None})
    assert tracer.settings("a") == tracer.settings() and not tracer.on  # nothing of its own: gone
    tracer.update("", {"trace_rate": None})
    assert tracer.settings().rate == 1000  # the global one cleared: what gpud started with


def test_a_global_change_that_a_model_s_settings_cannot_take_changes_nothing(tmp_path):
    tracer = _tracer(tmp_path, level=(), rate=10)
    tracer.update("a", {"trace_level": ["TIMESTAMPS"]})
    with pytest.raises(InferenceError, match="sample rate must be non-zero"):
        tracer.update("", {"trace_rate": "0"})  # the global setting is OFF, but model a would trace at rate 0
    assert tracer.settings().rate == 10 and tracer.settings("a").rate == 10


def test_an_empty_request_reads_the_settings_and_keeps_the_sampling(tmp_path):
    tracer = _tracer(tmp_path, rate=2)
    assert tracer.sample("m", "1", "") is None
    assert tracer.update("", {}) == tracer.settings()
    assert tracer.sample("m", "1", "") is not None  # the 2nd request: the count went on


# --- what is written ---------------------------------------------------------------------------------------------
def test_a_trace_is_triton_s_objects(tmp_path):
    tracer = _tracer(tmp_path, level=("TIMESTAMPS", "TENSORS"))
    trace = tracer.sample("m", "", "")
    trace.tensor("TENSOR_QUEUE_INPUT", "x", "FP32", (1, 2), np.array([[1.5, 2.0]], dtype=np.float32))
    trace.tensor("TENSOR_QUEUE_INPUT", "s", "BYTES", (2,), np.array([b"a", b"\xff"], dtype=object))
    trace.tensor("TENSOR_QUEUE_INPUT", "in_shm", "FP32", (1, 2), np.empty(0, np.float32))  # bytes elsewhere
    trace.computed("3", arrival_ns=100, dispatch_ns=200, input_ns=10, infer_ns=20, output_ns=30)
    step = trace.child("step", "")
    step.end()
    trace.end()
    tracer.flush()
    step_head, step_stamps, head, stamps, x, s = _read(tmp_path / "trace.json")  # the step ended first
    assert step_head == {"id": 2, "model_name": "step", "model_version": -1, "parent_id": 1}
    assert [t["name"] for t in step_stamps["timestamps"]] == ["REQUEST_START", "REQUEST_END"]
    assert head == {"id": 1, "model_name": "m", "model_version": 3}  # the version that ran; no empty request id
    assert [(t["name"], t["ns"]) for t in stamps["timestamps"]][1:6] == [
        ("QUEUE_START", 100), ("COMPUTE_START", 200), ("COMPUTE_INPUT_END", 210), ("COMPUTE_OUTPUT_START", 230),
        ("COMPUTE_END", 260)]
    assert [t["name"] for t in stamps["timestamps"]][::6] == ["REQUEST_START", "REQUEST_END"]
    assert x == {"id": 1, "activity": "TENSOR_QUEUE_INPUT",
                 "tensor": {"name": "x", "data": "1.5,2.0", "shape": "1,2", "dtype": "FP32"}}
    assert s["tensor"]["data"] == "a,\ufffd"


def test_the_file_is_a_valid_array_after_every_write(tmp_path):
    tracer = _tracer(tmp_path)
    _traced(tracer, 2)
    tracer.flush()
    assert len(_read(tmp_path / "trace.json")) == 4
    _traced(tracer, 1)
    tracer.flush()
    tracer.flush()  # nothing new: nothing written
    assert [o["id"] for o in _read(tmp_path / "trace.json")] == [1, 1, 2, 2, 3, 3]
    (tmp_path / "trace.json").unlink()  # rotated away: a new array
    _traced(tracer, 1)
    tracer.close()
    assert [o["id"] for o in _read(tmp_path / "trace.json")] == [4, 4]


def test_a_log_frequency_writes_indexed_files(tmp_path):
    tracer = _tracer(tmp_path, log_frequency=2)
    _traced(tracer, 5)
    tracer.flush()  # the fifth waits for its file's second trace (or for the end)
    assert [len(_read(tmp_path / f"trace.json.{i}")) for i in range(2)] == [4, 4]
    assert not (tmp_path / "trace.json.2").exists()
    tracer.close()
    assert len(_read(tmp_path / "trace.json.2")) == 2
    assert not (tmp_path / "trace.json").exists()


def test_a_trace_that_ends_after_a_change_is_still_written(tmp_path):
    tracer = _tracer(tmp_path)
    running = tracer.sample("m", "1", "before")
    tracer.update("", {"trace_rate": "2"})
    running.end()  # its setting was replaced meanwhile: written at once
    assert [o.get("request_id") for o in _read(tmp_path / "trace.json") if "model_name" in o] == ["before"]


def test_a_trace_file_that_cannot_be_written_is_logged_once(tmp_path, caplog):
    file = TraceFile(str(tmp_path / "no" / "such" / "dir.json"))
    with caplog.at_level(logging.ERROR, logger="gpud"):
        file.append(['{"id":1}'])
        file.append(['{"id":2}'])
        file.write_indexed(['{"id":3}'])
    assert len([r for r in caplog.records if "cannot write" in r.message]) == 1


def test_the_summary_says_where_the_time_went(tmp_path):
    tracer = _tracer(tmp_path)
    _traced(tracer, 3)
    tracer.close()
    (summary,) = summarize(_read(tmp_path / "trace.json"))
    assert (summary.model_name, summary.model_version, summary.traces) == ("m", 1, 3)
    assert summary.mean_us("compute") == pytest.approx(0.006) and summary.mean_us("queue") == pytest.approx(0.01)
    text = render([summary])
    assert "m (version 1): 3 trace(s)" in text and "infer" in text
    assert render(summarize([{"id": 1, "model_name": "x"}])).startswith("no complete trace")
    with pytest.raises(ValueError, match="not a trace object"):
        summarize([{"name": "x"}])


# --- HTTP and gRPC over a FakeCore -------------------------------------------------------------------------------
@pytest.fixture
def core(tmp_path):
    core = FakeCore()
    core.tracer = Tracer(TraceSettings(file=str(tmp_path / "trace.json")))
    return core


@pytest.fixture(params=[None, TOKEN], ids=["loopback", "token"])
def servers(core, request):
    with serving(core, request.param) as running:
        yield running


def test_http_reads_and_changes_the_settings_as_tritonclient_expects(servers, core, tmp_path):
    started = {**DEFAULTS, "trace_file": str(tmp_path / "trace.json")}
    client = HttpClient(f"127.0.0.1:{servers.http_port}", network_timeout=TIMEOUT_S)
    try:
        assert client.get_trace_settings() == started
        model = next(iter(core.models))
        changed = client.update_trace_settings(model, {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"},
                                               headers=auth(servers))
        assert changed == {**started, "trace_level": ["TIMESTAMPS"], "trace_rate": "1"}
        assert client.get_trace_settings(model) == changed and client.get_trace_settings() == started
        with pytest.raises(InferenceServerException, match="can not be updated through network"):
            client.update_trace_settings(settings={"trace_file": "/tmp/x"}, headers=auth(servers))
        with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
            client.get_trace_settings("nope")
        assert client.update_trace_settings(model, {"trace_level": None, "trace_rate": None},
                                            headers=auth(servers)) == started
    finally:
        client.close()


def test_http_errors_are_triton_shaped_and_a_change_is_an_admin_action(servers, core):
    url = f"http://127.0.0.1:{servers.http_port}/v2/trace/setting"
    bad = requests.post(url, json={"trace_rate": "x"}, headers=auth(servers), timeout=TIMEOUT_S)
    assert bad.status_code == 400 and set(bad.json()) == {"error"}
    assert requests.post(url, json={"trace_file": "x"}, headers=auth(servers), timeout=TIMEOUT_S).status_code == 501
    assert requests.put(url, json={}, timeout=TIMEOUT_S).status_code == 405
    assert requests.post(url, data=b"", timeout=TIMEOUT_S).json()["trace_level"] == ["OFF"]  # a read: no token
    unauthenticated = requests.post(url, json={"trace_rate": "7"}, timeout=TIMEOUT_S)
    if servers.token:
        assert unauthenticated.status_code == 401, unauthenticated.text
        assert core.tracer.settings().rate == 1000
    else:
        assert unauthenticated.status_code == 200 and unauthenticated.json()["trace_rate"] == "7"


def test_grpc_reads_and_changes_the_settings_as_tritonclient_expects(servers, core):
    model = next(iter(core.models))
    with grpcclient.InferenceServerClient(servers.grpc_url) as client:
        read = client.get_trace_settings(as_json=True, client_timeout=TIMEOUT_S)["settings"]
        assert read["trace_level"] == {"value": ["OFF"]} and read["trace_rate"] == {"value": ["1000"]}
        if servers.token:
            with pytest.raises(InferenceServerException) as refused:
                client.update_trace_settings(settings={"trace_rate": "5"}, client_timeout=TIMEOUT_S)
            assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
        changed = client.update_trace_settings(model, {"trace_level": ["TIMESTAMPS", "TENSORS"], "trace_count": "4"},
                                               headers=auth(servers), as_json=True, client_timeout=TIMEOUT_S)
        assert changed["settings"]["trace_level"] == {"value": ["TIMESTAMPS", "TENSORS"]}
        assert core.tracer.settings(model).count == 4 and core.tracer.settings().count == -1
        cleared = client.update_trace_settings(model, {"trace_count": None}, headers=auth(servers), as_json=True,
                                               client_timeout=TIMEOUT_S)
        assert cleared["settings"]["trace_count"] == {"value": ["-1"]}
        with pytest.raises(InferenceServerException, match="Unable to parse 'trace_rate'"):
            client.update_trace_settings(settings={"trace_rate": "fast"}, headers=auth(servers),
                                         client_timeout=TIMEOUT_S)
        with pytest.raises(InferenceServerException, match="expect only 1 value for 'trace_rate'"):
            client.update_trace_settings(settings={"trace_rate": ["1", "2"]}, headers=auth(servers),
                                         client_timeout=TIMEOUT_S)
    assert core.tracer.settings().rate == 1000


def test_gpudctl_trace_shows_and_changes_the_settings(servers, core, tmp_path, capsys):
    from gpud.cli.main import main as gpudctl

    url = ["--url", f"127.0.0.1:{servers.http_port}"]
    token = ["--token-file", str(tmp_path / "token")] if servers.token else []
    (tmp_path / "token").write_text(TOKEN + "\n")
    assert gpudctl(["trace", *url]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == ["trace_level    OFF", "trace_rate     1000"]
    model = next(iter(core.models))
    assert gpudctl(["trace", "--model", model, "--level", "timestamps", "--rate", "2", "--json", *url, *token]) == 0
    assert json.loads(capsys.readouterr().out)["trace_level"] == ["TIMESTAMPS"]
    assert core.tracer.settings(model).rate == 2
    assert gpudctl(["trace", "--model", model, "--clear", "level", "rate", *url, *token]) == 0
    assert core.tracer.settings(model) == core.tracer.settings()
    capsys.readouterr()
    if servers.token:
        assert gpudctl(["trace", "--rate", "3", *url]) == 1
        assert "HTTP 401" in capsys.readouterr().err
    assert gpudctl(["trace", "--rate", "0", "--level", "TIMESTAMPS", *url, *token]) == 1
    assert "sample rate must be non-zero" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpudctl(["trace", "--level", "LOUD", *url])


def test_gpudctl_trace_sums_up_a_file(tmp_path, capsys):
    from gpud.cli.main import main as gpudctl

    tracer = _tracer(tmp_path)
    _traced(tracer, 2, model="mlp")
    tracer.close()
    assert gpudctl(["trace", "--summary", str(tmp_path / "trace.json")]) == 0
    assert "mlp (version 1): 2 trace(s)" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{")
    assert gpudctl(["trace", "--summary", str(tmp_path / "bad.json")]) == 1
    assert "cannot read a trace file" in capsys.readouterr().err


# --- the core and the daemon ---------------------------------------------------------------------------------------
def test_the_core_serves_the_extension_only_with_a_tracer(tmp_path):
    from tests.test_reload import core_on

    core, _ = core_on(tmp_path)
    assert "trace" not in core.server_metadata().extensions
    with pytest.raises(InferenceError) as refused:
        core.trace_settings()
    assert refused.value.kind is ErrorKind.UNSUPPORTED
    core.tracer = Tracer(TraceSettings())
    assert "trace" in core.server_metadata().extensions
    with pytest.raises(InferenceError) as unknown:
        core.update_trace_settings("nope", {"trace_rate": "1"})
    assert unknown.value.kind is ErrorKind.NOT_FOUND


@pytest.mark.parametrize("flags, settings", [
    ([], TraceSettings()),
    (["--trace-config", "triton,file=/tmp/t.json", "--trace-config", "level=TIMESTAMPS", "--trace-config",
      "rate=10", "--trace-config", "count=5", "--trace-config", "triton,log-frequency=2"],
     TraceSettings(("TIMESTAMPS",), 10, 5, 2, "/tmp/t.json")),
    (["--trace-file", "/tmp/t.json", "--trace-level", "TENSORS", "--trace-level", "TIMESTAMPS", "--trace-rate", "3"],
     TraceSettings(("TIMESTAMPS", "TENSORS"), 3, -1, 0, "/tmp/t.json")),
])
def test_tritonserver_s_trace_flags_give_the_settings_gpud_starts_with(flags, settings):
    from gpud.main import build_parser, resolve_settings
    from gpud.settings import trace_settings_of

    assert trace_settings_of(resolve_settings(build_parser().parse_args(flags))) == settings


@pytest.mark.parametrize("flags, words", [(["--trace-config", "level=TIMESTAMPS"], "trace file name is not given"),
                                          (["--trace-config", "mode=opentelemetry"], "Triton's mode only")])
def test_a_trace_flag_gpud_cannot_take_stops_it_with_a_clear_error(flags, words, capsys):
    from gpud.main import main

    assert main(flags) == 2
    assert words in capsys.readouterr().err


def test_a_trace_file_gpud_cannot_write_stops_it_at_start(tmp_path, caplog):
    from gpud.main import main
    from gpud.tracing.output import unwritable

    assert unwritable(str(tmp_path / "trace.json")) == ""
    assert unwritable(str(tmp_path / "missing" / "trace.json")) == f"no directory {tmp_path / 'missing'}"
    assert unwritable(str(tmp_path)) == "it is a directory"
    with caplog.at_level(logging.ERROR, logger="gpud"):
        assert main(["--trace-config", f"triton,file={tmp_path / 'missing' / 'trace.json'}", "--http-port", "0",
                     "--grpc-port", "0", "--metrics-port", "0"]) == 2
    assert "cannot write traces to" in caplog.text and "no directory" in caplog.text


@pytest.mark.slow
def test_a_daemon_traces_requests_into_its_file(tmp_path):
    """The example models, front ends in processes of their own: the requests a change asks for are traced, an
    ensemble's steps as its children; the file is a valid array while gpud runs and has every trace once it
    stops."""
    trace_file = tmp_path / "trace.json"
    d = start_daemon(None, tmp_path, "--http-processes", "1", "--grpc-processes", "1", "--trace-config",
                     f"triton,file={trace_file}", node=None)
    try:
        assert "trace" in d.get_json("/v2")["extensions"]
        with grpcclient.InferenceServerClient(d.grpc_url) as client:  # through a front-end process's gRPC
            client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "2"},
                                         client_timeout=TIMEOUT_S)
        two_input = {"inputs": [{"name": "ids", "datatype": "INT64", "shape": [1, 4], "data": [1, 2, 3, 4]},
                                {"name": "scale", "datatype": "FP32", "shape": [1, 4], "data": [1, 1, 1, 0.5]}]}
        for i in range(4):
            assert d.post_json("/v2/models/two_input/infer", {**two_input, "id": f"r{i}"})[0] == 200
        image = {"inputs": [{"name": "IMAGE", "datatype": "UINT8", "shape": [1, 16], "data": list(range(16))}]}
        status, _ = d.post_json("/v2/models/pipeline/trace/setting", {"trace_rate": "1"})
        assert status == 200
        assert d.post_json("/v2/models/pipeline/infer", image)[0] == 200

        status, _ = d.post_json("/v2/models/two_input/trace/setting", {"trace_rate": "1"})
        assert status == 200
        wrong = {"inputs": [{**two_input["inputs"][0], "datatype": "FP32"}, two_input["inputs"][1]], "id": "wrong"}
        assert d.post_json("/v2/models/two_input/infer", wrong)[0] == 400  # refused once traced: its trace ends

        def traced() -> list[dict]:
            try:
                return [o for o in _read(trace_file) if "model_name" in o]
            except (OSError, ValueError):
                return []
        wait_for(lambda: len(traced()) == 7, 30, "three two_input traces and the pipeline's four in the file")
        heads = traced()
        assert [h.get("request_id") for h in heads if h["model_name"] == "two_input"] == ["r1", "r3", "wrong"]
        (pipeline,) = [h for h in heads if h["model_name"] == "pipeline"]
        assert sorted(h["model_name"] for h in heads if h.get("parent_id") == pipeline["id"]) == [
            "classifier", "postprocess", "preprocess"]
        assert d.stop() == 0, d.log()
        (two_input_summary,) = [s for s in summarize(_read(trace_file)) if s.model_name == "two_input"]
        assert two_input_summary.traces == 3 and two_input_summary.counts["compute"] == 2  # the refused one: none
    finally:
        d.stop()
