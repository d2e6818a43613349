"""Requests grouped by a front-end process (--http-processes, gpud.frontproc.group), through a real daemon: requests
pipelined on one connection arrive in one turn of the process's loop, and those alike go to the core as one group.
Each client still gets its own answer (the same as alone), its own error, and is counted once in the statistics;
a queue limit counts each member."""
from __future__ import annotations

import json
import socket

import numpy as np
import pytest
import tritonclient.http as httpclient

from gpud.examples import write_example_repository
from tests.daemon_harness import save, slow_model, start_daemon

pytestmark = pytest.mark.slow

LIMITED_CONFIG = """
max_batch_size: 64
dynamic_batching { default_queue_policy { max_queue_size: 2 } }
instance_group [ { count: 1, kind: KIND_CPU } ]
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_example_repository(repo, ["mlp", "two_input"])
    save(slow_model(width=256, layers=60), repo, "limited", LIMITED_CONFIG)
    d = start_daemon(repo, tmp_path_factory.mktemp("run"), "--http-processes", "1", node=None)
    yield d
    assert d.stop() == 0, d.log()
    assert "Traceback" not in d.log(), d.log()


def body(model_inputs: list[tuple[str, str, np.ndarray]], outputs: list[str], request_id: str = "") -> tuple[bytes, int]:
    """A binary infer request body (as tritonclient sends it) and its JSON header's length."""
    header = json.dumps({
        **({"id": request_id} if request_id else {}),
        "inputs": [{"name": n, "shape": list(a.shape), "datatype": d, "parameters": {"binary_data_size": a.nbytes}}
                   for n, d, a in model_inputs],
        "outputs": [{"name": o, "parameters": {"binary_data": True}} for o in outputs]}).encode()
    return header + b"".join(a.tobytes() for _, _, a in model_inputs), len(header)


def mlp(value: float, rows: int = 1, request_id: str = "") -> tuple[str, bytes, int]:
    data = np.full((rows, 256), value, np.float32) * np.linspace(-1, 1, 256, dtype=np.float32)
    return ("mlp", *body([("input", "FP32", data)], ["output"], request_id))


def two_input(value: int) -> tuple[str, bytes, int]:
    ids = np.arange(4, dtype=np.int64).reshape(1, 4) + value
    return ("two_input", *body([("ids", "INT64", ids), ("scale", "FP32", np.ones((1, 4), np.float32))], ["out"]))


def pipelined(daemon, requests: list[tuple[str, bytes, int | None]]) -> list[tuple[int, dict, bytes]]:
    """Every request written at once on one connection (they reach the front-end process in one read, one turn of
    its loop); the answers in order: status, JSON header, binary data."""
    port = daemon.ports["http"]
    wire = b""
    for model, data, header_length in requests:
        extra = f"Inference-Header-Content-Length: {header_length}\r\n" if header_length is not None else ""
        wire += (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n{extra}"
                 f"Content-Type: application/octet-stream\r\n\r\n").encode() + data
    answers = []
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(wire)
        f = sock.makefile("rb")
        for _ in requests:
            status = int(f.readline().split()[1])
            headers = {}
            while (line := f.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            content = f.read(int(headers["content-length"]))
            json_length = int(headers.get("inference-header-content-length", len(content)))
            answers.append((status, json.loads(content[:json_length]), content[json_length:]))
    return answers


def grouped(daemon) -> int:
    return sum(f.get("grouped", 0) for f in daemon.inspect()["frontends"]["processes"])


def stats(daemon, model: str) -> dict:
    return daemon.get_json(f"/v2/models/{model}/stats")["model_stats"][0]


def alone(daemon, model: str, data: np.ndarray) -> np.ndarray:
    x = httpclient.InferInput("input", list(data.shape), "FP32")
    x.set_data_from_numpy(data)
    return httpclient.InferenceServerClient(daemon.http_url).infer(model, [x]).as_numpy("output")


def test_requests_alike_go_as_one_group_and_each_gets_its_own_answer(daemon):
    before = grouped(daemon)
    values = [float(i) for i in range(1, 17)]
    # ids of their own, some none (as perf_analyzer and tritonclient send them): each answer echoes its own
    ids = [f"r{i}" if i % 3 != 1 else "" for i in range(16)]
    answers = pipelined(daemon, [mlp(v, request_id=i) for v, i in zip(values, ids)])
    assert grouped(daemon) > before  # at least some went as groups
    for v, request_id, (status, header, data) in zip(values, ids, answers):
        assert status == 200, header
        assert header.get("id", "") == request_id
        assert header["outputs"][0]["shape"] == [1, 16]
        got = np.frombuffer(data, np.float32).reshape(1, 16)
        expected = alone(daemon, "mlp", np.full((1, 256), v, np.float32) * np.linspace(-1, 1, 256, dtype=np.float32))
        np.testing.assert_array_equal(got, expected)  # exactly what it gets alone


def test_a_mix_of_models_and_shapes_each_answered_as_its_own(daemon):
    requests = [mlp(1.0), two_input(10), mlp(2.0, rows=2), mlp(3.0), two_input(20), mlp(4.0, rows=2), mlp(5.0)]
    before = grouped(daemon)
    answers = pipelined(daemon, requests)
    assert grouped(daemon) > before
    assert [a[0] for a in answers] == [200] * len(requests)
    shapes = [a[1]["outputs"][0]["shape"] for a in answers]
    assert shapes == [[1, 16], [1, 4], [2, 16], [1, 16], [1, 4], [2, 16], [1, 16]]
    # two_input's out is p + rowsum(p), p = ids * scale: each its own ids' back
    for (_, _, data), value in ((answers[1], 10), (answers[4], 20)):
        p = np.arange(4, dtype=np.float32) + value
        np.testing.assert_array_equal(np.frombuffer(data, np.float32), p + p.sum())
    for (_, _, data), (value, rows) in zip([answers[i] for i in (0, 2, 3, 5, 6)],
                                           [(1.0, 1), (2.0, 2), (3.0, 1), (4.0, 2), (5.0, 1)]):
        expected = alone(daemon, "mlp", np.full((rows, 256), value, np.float32) *
                         np.linspace(-1, 1, 256, dtype=np.float32))
        np.testing.assert_array_equal(np.frombuffer(data, np.float32).reshape(rows, 16), expected)


def test_a_bad_request_among_good_ones_fails_alone(daemon):
    bad_shape = ("mlp", *body([("input", "FP32", np.zeros((1, 255), np.float32))], ["output"]))
    malformed = ("mlp", b"{not json", None)
    requests = [mlp(1.0), mlp(2.0), bad_shape, mlp(3.0), malformed, mlp(4.0)]
    before = grouped(daemon)
    answers = pipelined(daemon, requests)
    assert grouped(daemon) > before
    assert [a[0] for a in answers] == [200, 200, 400, 200, 400, 200]
    assert "unexpected shape for input 'input'" in answers[2][1]["error"]
    assert "malformed JSON" in answers[4][1]["error"]


def test_statistics_count_each_request_once(daemon):
    before = stats(daemon, "mlp")
    groups_before = grouped(daemon)
    count = 24
    answers = pipelined(daemon, [mlp(float(i)) for i in range(count)])
    assert all(a[0] == 200 for a in answers)
    assert grouped(daemon) > groups_before
    after = stats(daemon, "mlp")
    s0, s1 = before["inference_stats"], after["inference_stats"]
    for what in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert s1[what]["count"] - s0[what]["count"] == count, what
    assert after["inference_count"] - before["inference_count"] == count  # rows: one each
    assert 1 <= after["execution_count"] - before["execution_count"] <= count


def test_a_queue_limit_counts_each_member(daemon):
    # limited: max_queue_size 2, one instance. 8 alike in one turn, as a group of 8, do not fit a queue of 2: each
    # then goes alone: the first runs at once, 2 wait, the rest are refused (queue full), as they would be alone.
    before = stats(daemon, "limited")
    data = np.ones((1, 256), np.float32)
    requests = [("limited", *body([("x", "FP32", data)], ["y"]))] * 8
    groups_before = grouped(daemon)
    answers = pipelined(daemon, requests)
    assert grouped(daemon) > groups_before
    statuses = [a[0] for a in answers]
    ok = statuses.count(200)
    assert 1 <= ok < 8, statuses
    refused = [a for a in answers if a[0] != 200]
    assert all("Exceeds maximum queue size" in a[1]["error"] for a in refused), refused
    after = stats(daemon, "limited")
    assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == ok
