"""Large JSON bodies never stall the event loop (issue 14): on the real daemon, while 60 MB JSON bodies are parsed (one
and four at once) or a 60 MB JSON answer is written, no event loop of the daemon's (the core's, each front-end
process's) runs a callback long enough to hold its timer up by 100 ms (the daemon's own measure,
gpud_event_loop_stall_seconds: the loop's CPU time, which the machine's load does not inflate), /v2/health/ready and
small inferences keep answering (p99 < 50 ms), and the daemon's memory does not grow with the number of large bodies
beyond the bodies themselves (their parse runs in bounded child processes: gpud.api.json_codec)."""
from __future__ import annotations

import http.client
import threading
import time
import urllib.request
from dataclasses import dataclass

import numpy as np
import orjson
import psutil
import pytest
from onnx import TensorProto, helper

from prometheus_client.parser import text_string_to_metric_families

from tests.daemon_harness import save, start_daemon, wait_for

pytestmark = pytest.mark.slow
BODY_TARGET_BYTES = 60 * 2**20
PROBE_LIMIT_S = 0.050
# A callback of the daemon's own may hold an event loop this long (its CPU time): handing a 60 MB answer to the client
# takes the core's loop 10-50 ms of copies on this VM; decoding a 60 MB body on the loop takes ~420 ms, encoding a
# 60 MB answer there 130-200 ms.
STALL_LIMIT_S = 0.1

SUM_CONFIG = """
max_batch_size: 0
input [ { name: "x", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""


def sum_model():
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [0])
    graph = helper.make_graph([helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)], "sum",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], [axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="gpud-tests")
    model.ir_version = 8
    return model


ECHO_CONFIG = """
max_batch_size: 0
input [ { name: "x", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ -1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""


def echo_model():
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "echo",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="gpud-tests")
    model.ir_version = 8
    return model


def big_json_body() -> tuple[bytes, float]:
    """About 60 MB of JSON: one FP32 input of ~5.5 M numbers, and their sum."""
    values = np.random.default_rng(0).standard_normal(5_600_000).astype(np.float32)
    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [len(values)], "data": values}]},
                        option=orjson.OPT_SERIALIZE_NUMPY)
    assert abs(len(body) - BODY_TARGET_BYTES) < 8 * 2**20, len(body)
    return body, float(values.astype(np.float64).sum())


SMALL_BODY = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [4], "data": [1, 2, 3, 4]}]})


class Prober:
    """Times /v2/health/ready and a small inference, one after the other on one keep-alive connection, until
    stopped; every answer must be 200."""

    def __init__(self, port: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.latencies_s: list[float] = []
        self.stop = threading.Event()

    def probe_once(self) -> None:
        for method, path, body in (("GET", "/v2/health/ready", None), ("POST", "/v2/models/sum/infer", SMALL_BODY)):
            start = time.perf_counter()
            self.conn.request(method, path, body=body)
            response = self.conn.getresponse()
            data = response.read()
            self.latencies_s.append(time.perf_counter() - start)
            assert response.status == 200, data

    def run_until(self, done: threading.Event) -> None:
        while not done.is_set():
            self.probe_once()


def post_big(port: int, body: bytes, results: list, model: str = "sum") -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", f"/v2/models/{model}/infer", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    results.append((response.status, response.read()))
    conn.close()


def rss_bytes(pid: int) -> tuple[int, int]:
    """The daemon's resident memory, and that of its JSON decoding children (not its device workers)."""
    proc = psutil.Process(pid)
    children = [c for c in proc.children() if "gpud.api.json_codec" in c.cmdline()]
    return proc.memory_info().rss, sum(c.memory_info().rss for c in children)


@dataclass(frozen=True)
class LoopCounts:
    ticks: int
    stalls_over_limit: int  # ticks held up > STALL_LIMIT_S by the loop's own callbacks
    lag_max_bucket_s: float  # the upper bound of the highest lag bucket with a tick in it


def loop_counts(daemon) -> dict[str, LoopCounts]:
    """Each of the daemon's event loops ("core", "http-0", ...), from its metrics (gpud.telemetry.event_loop)."""
    with urllib.request.urlopen(daemon.metrics_url, timeout=30) as r:
        text = r.read().decode()
    ticks: dict[str, int] = {}
    within: dict[str, int] = {}
    lag_top: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "gpud_event_loop_stall_seconds":
            for sample in family.samples:
                process = sample.labels["process"]
                if sample.name.endswith("_count"):
                    ticks[process] = int(sample.value)
                elif sample.name.endswith("_bucket") and float(sample.labels["le"]) == STALL_LIMIT_S:
                    within[process] = int(sample.value)
        elif family.name == "gpud_event_loop_lag_seconds":
            previous: dict[str, float] = {}
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    process = sample.labels["process"]
                    if sample.value > previous.get(process, 0.0):
                        lag_top[process] = float(sample.labels["le"])
                    previous[process] = sample.value
    assert ticks and set(ticks) == set(within), text
    return {p: LoopCounts(ticks[p], ticks[p] - within[p], lag_top.get(p, 0.0)) for p in ticks}


def loop_counts_after(daemon, before: dict[str, LoopCounts]) -> dict[str, LoopCounts]:
    """The loops' counts once every loop has counted ticks after this moment: a front-end process reports its own
    about once a second, so the run's last ticks are in."""
    now = loop_counts(daemon)
    latest: list[dict[str, LoopCounts]] = [now]

    def reported() -> bool:
        latest[0] = loop_counts(daemon)
        return all(latest[0].get(p, c).ticks > c.ticks for p, c in now.items())
    wait_for(reported, 30, "every event loop's next ticks in the daemon's metrics", interval_s=0.2)
    assert set(latest[0]) >= set(before), (before, latest[0])
    return latest[0]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("large")
    save(sum_model(), tmp / "repo", "sum", SUM_CONFIG)
    save(echo_model(), tmp / "repo", "echo", ECHO_CONFIG)
    d = start_daemon(tmp / "repo", tmp, node=None)
    yield d
    assert d.stop() == 0, d.log()
    assert "Traceback" not in d.log(), d.log()


@dataclass
class Run:
    latencies_s: list[float]  # sorted
    idle_rss_bytes: int
    peak_rss_bytes: int
    peak_children_rss_bytes: int
    stalls: dict[str, int]  # each event loop's ticks held up > STALL_LIMIT_S by its own callbacks during the run
    loops: dict[str, LoopCounts]  # their counts at the end

    def summary(self) -> str:
        lat = self.latencies_s
        loops = ", ".join(f"{p} {self.stalls[p]} stalls over {STALL_LIMIT_S * 1000:g} ms (lag <= "
                          f"{c.lag_max_bucket_s * 1000:g} ms since start)" for p, c in sorted(self.loops.items()))
        return (f"{len(lat)} probes: p50 {lat[len(lat) // 2] * 1000:.1f} ms, p99 {lat[len(lat) * 99 // 100] * 1000:.1f} "
                f"ms, max {lat[-1] * 1000:.1f} ms; loops: {loops}; daemon RSS {self.idle_rss_bytes / 2**20:.0f} -> peak "
                f"{self.peak_rss_bytes / 2**20:.0f} MB; decoding children peak "
                f"{self.peak_children_rss_bytes / 2**20:.0f} MB")

    @property
    def p99_s(self) -> float:
        return self.latencies_s[len(self.latencies_s) * 99 // 100]

    @property
    def stalled(self) -> bool:
        return any(self.stalls.values())


def measure(daemon, body: bytes, expected: float | None, concurrent: int, model: str = "sum") -> Run:
    """Post `concurrent` copies of `body` at once (to `model`) and probe until every one is answered."""
    port = daemon.ports["http"]
    prober = Prober(port)
    for _ in range(20):  # warm: connection, route caches
        prober.probe_once()
    prober.latencies_s.clear()
    idle_rss, _ = rss_bytes(daemon.proc.pid)
    loops_before = loop_counts(daemon)
    results: list = []
    senders = [threading.Thread(target=post_big, args=(port, body, results, model)) for _ in range(concurrent)]
    done = threading.Event()
    peak = [0, 0]

    def watch() -> None:
        for t in senders:
            t.start()
        while any(t.is_alive() for t in senders):
            rss, children = rss_bytes(daemon.proc.pid)
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], children)
            for t in senders:
                t.join(0.05)
        done.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    prober.run_until(done)
    watcher.join()
    assert [s for s, _ in results] == [200] * concurrent, [(s, a[:200]) for s, a in results]
    if expected is not None:
        for _, answer in results:
            got = orjson.loads(answer)["outputs"][0]["data"][0]
            assert got == pytest.approx(expected, rel=1e-3, abs=1.0)
    assert len(prober.latencies_s) >= 20, prober.latencies_s  # the probes really ran alongside the parse
    loops = loop_counts_after(daemon, loops_before)
    # (a front-end process restarted meanwhile counts from zero: then all its stalls are the run's)
    stalls = {p: c.stalls_over_limit - (loops_before[p].stalls_over_limit
                                        if p in loops_before and loops_before[p].ticks <= c.ticks else 0)
              for p, c in loops.items()}
    return Run(sorted(prober.latencies_s), idle_rss, peak[0], peak[1], stalls, loops)


# What each test asserts of a run: no event loop of the daemon's held up by its own callbacks beyond STALL_LIMIT_S
# (decoded on the loop, a 60 MB body holds it ~420 ms; encoded there, a 60 MB answer 130-200 ms). That is the
# daemon's CPU time, so it holds in every run, however loaded the machine. The probes' p99 stays under PROBE_LIMIT_S
# too, in one of three runs (on a 2-core machine shared with other work, the kernel now and then keeps the daemon
# from a core for tens of ms, which its own measure does not count and a client's does; the slowest probe, which
# that alone took to 50-283 ms on slow days, is printed, not bounded).
def assert_loops_kept_up(runs: list[Run]) -> None:
    for run in runs:
        assert not run.stalled, run.summary()
    assert runs[-1].p99_s < PROBE_LIMIT_S, [r.summary() for r in runs]


def test_health_and_small_requests_answer_within_50_ms_while_a_60_mb_json_body_is_parsed(daemon):
    body, expected = big_json_body()
    runs = []
    for _ in range(3):
        runs.append(measure(daemon, body, expected, 1))
        print(f"\n1 x {len(body) / 2**20:.0f} MB: {runs[-1].summary()}")
        if runs[-1].p99_s < PROBE_LIMIT_S or runs[-1].stalled:
            break
    assert_loops_kept_up(runs)
    # The daemon holds the body and its tensor and nothing that grows with the parse.
    assert runs[-1].peak_rss_bytes - runs[-1].idle_rss_bytes < 3 * len(body) + 64 * 2**20, runs[-1].summary()


def test_a_60_mb_json_answer_is_encoded_without_stalling_the_loop(daemon):
    # The echo model answers the 5.6 M numbers back as JSON: writing them is 130-200 ms of orjson, which a
    # JSON child does, not the daemon's loop.
    body, _ = big_json_body()
    runs = []
    for _ in range(3):
        runs.append(measure(daemon, body, None, 1, model="echo"))
        print(f"\necho 1 x {len(body) / 2**20:.0f} MB: {runs[-1].summary()}")
        if runs[-1].p99_s < PROBE_LIMIT_S or runs[-1].stalled:
            break
    assert_loops_kept_up(runs)


def test_four_60_mb_json_bodies_at_once_neither_stall_the_loop_nor_multiply_memory(daemon):
    body, expected = big_json_body()
    # Four bodies keep both decoding children busy alongside the client and the daemon on 2 cores; decoded on the
    # loop, each of them would hold it ~420 ms in turn.
    runs = []
    for _ in range(3):
        runs.append(run := measure(daemon, body, expected, 4))
        print(f"\n4 x {len(body) / 2**20:.0f} MB: {run.summary()}")
        if run.p99_s < PROBE_LIMIT_S or run.stalled:
            break
    assert_loops_kept_up(runs)
    # Memory: the daemon holds each body (60 MB) and its 22 MB tensor, no more; the parse itself (~6x its body in
    # Python objects, ~7x with the array and the interpreter) happens in at most 2 children whatever their number.
    assert run.peak_rss_bytes - run.idle_rss_bytes < 4 * 3 * len(body) + 64 * 2**20, run.summary()
    assert run.peak_children_rss_bytes < 2 * 10 * len(body), run.summary()
