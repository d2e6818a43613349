"""gpud.api.json_codec: large JSON inference bodies decoded and answers encoded in child processes, behind the HTTP
front end over a FakeCore (127.0.0.1, its own loop thread). The offload threshold is set low (1000 bytes, so 125
JSON elements for an answer) so that small bodies exercise it."""
from __future__ import annotations

import os
import signal

import numpy as np
import orjson
import pytest

from gpud.api.json_codec import JsonCodecPool
from tests.fake_core import FakeCore
from tests.test_http_api import ServerThread

TIMEOUT_S = 60.0


def _doc(values: list[int]) -> dict:
    return {"inputs": [{"name": "INPUT0", "datatype": "INT64", "shape": [1, len(values)], "data": values}]}


@pytest.fixture
def pool():
    p = JsonCodecPool(processes=1, offload_bytes=1000, max_in_flight=2)
    yield p
    p.close()


@pytest.fixture
def make_pool_server():
    def make():
        pool = JsonCodecPool(processes=1, offload_bytes=1000)
        return pool, ServerThread(FakeCore(), json_codec=pool)
    return make


@pytest.fixture
def server(pool):
    s = ServerThread(FakeCore(), json_codec=pool, max_tensor_elements=10**6)
    yield s
    s.stop()


def test_a_large_body_is_decoded_and_its_answer_encoded_in_a_child_as_on_the_loop(server, pool):
    values = list(range(2000))
    status, headers, body = server.post_json("/v2/models/identity_int64/infer", _doc(values))
    assert status == 200, body
    assert headers["Content-Type"] == "application/json"
    assert orjson.loads(body) == {"model_name": "identity_int64", "model_version": "1",
                                  "outputs": [{"name": "OUTPUT0", "datatype": "INT64", "shape": [1, 2000],
                                               "data": values}]}
    assert (pool.decoded, pool.encoded, pool.in_flight) == (1, 1, 0)
    status, _, _ = server.post_json("/v2/models/identity_int64/infer", _doc([1, 2]))  # small: on the loop
    assert status == 200 and (pool.decoded, pool.encoded) == (1, 1)


def test_binary_outputs_are_not_sent_to_a_child(server, pool):
    doc = {**_doc(list(range(2000))), "parameters": {"binary_data_output": True}}
    status, headers, body = server.post_json("/v2/models/identity_int64/infer", doc)
    assert status == 200 and headers["Content-Type"] == "application/octet-stream"
    header_length = int(headers["Inference-Header-Content-Length"])
    assert np.frombuffer(body[header_length:], "<i8").tolist() == list(range(2000))
    assert (pool.decoded, pool.encoded) == (1, 0)


def test_bytes_answers_are_encoded_in_a_child_too(server, pool):
    words = [f"w{i}" for i in range(300)]
    doc = {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 300], "data": words}]}
    status, _, body = server.post_json("/v2/models/identity_bytes/infer", doc)
    assert status == 200 and orjson.loads(body)["outputs"][0]["data"] == words
    assert pool.encoded == 1


@pytest.mark.parametrize("doc, fragment", [
    ({"inputs": [{"name": "INPUT0", "datatype": "INT64", "shape": [1, 10**12], "data": [0] * 600}]},
     "--max-tensor-elements"),
    ({"inputs": [{"name": "INPUT0", "datatype": "INT64", "shape": [1, 600], "data": [0.5] * 600}]},
     "needs integers"),
])
def test_client_errors_found_in_the_child_are_400_with_their_message(server, pool, doc, fragment):
    status, _, body = server.post_json("/v2/models/identity_int64/infer", doc)
    assert status == 400 and fragment in orjson.loads(body)["error"]
    (child,) = pool._idle  # noqa: SLF001 - the child answered a client's mistake: it serves on
    assert server.post_json("/v2/models/identity_int64/infer", _doc(list(range(2000))))[0] == 200
    assert pool._idle == [child] and child.proc.poll() is None
    server.assert_ready()


def test_malformed_json_is_400(server):
    status, _, body = server.request("POST", "/v2/models/identity_int64/infer", b"{" * 5000)
    assert status == 400 and "malformed JSON" in orjson.loads(body)["error"]


def test_binary_requests_with_a_small_json_header_stay_on_the_loop(server, pool):
    header = orjson.dumps({"inputs": [{"name": "INPUT0", "datatype": "INT64", "shape": [1, 1000],
                                       "parameters": {"binary_data_size": 8000}}]})
    body = header + np.arange(1000, dtype="<i8").tobytes()
    status, _, _ = server.request("POST", "/v2/models/identity_int64/infer", body,
                                  {"Inference-Header-Content-Length": str(len(header))})
    assert status == 200 and pool.decoded == 0


def test_over_the_in_flight_bound_a_request_is_503_at_once(server, pool):
    pool.in_flight = pool.max_in_flight  # as if two large bodies were being decoded
    try:
        status, _, body = server.post_json("/v2/models/identity_int64/infer", _doc(list(range(2000))))
    finally:
        server.loop.call_soon_threadsafe(setattr, pool, "in_flight", 0)
    assert status == 503 and "binary tensor data extension" in orjson.loads(body)["error"]


def test_with_the_pool_full_a_large_answer_is_encoded_on_the_loop_not_refused(server, pool):
    server.loop.call_soon_threadsafe(setattr, pool, "in_flight", pool.max_in_flight)
    try:
        doc = {"inputs": [{"name": "INPUT0", "datatype": "INT64", "shape": [1, 200], "data": list(range(200))}]}
        status, _, body = server.post_json("/v2/models/identity_int64/infer", doc)  # a small body, a large answer
    finally:
        server.loop.call_soon_threadsafe(setattr, pool, "in_flight", 0)
    assert status == 200 and orjson.loads(body)["outputs"][0]["data"] == list(range(200))
    assert pool.encoded == 0


def test_a_child_that_dies_gives_503_and_the_next_body_gets_a_new_child(server, pool):
    assert server.post_json("/v2/models/identity_int64/infer", _doc(list(range(2000))))[0] == 200
    (child,) = pool._idle  # noqa: SLF001 - the test plays the kernel's OOM killer
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.wait(TIMEOUT_S)
    # The dead child's next job fails (503, not a hang); the request after it gets a new child.
    statuses = [server.post_json("/v2/models/identity_int64/infer", _doc(list(range(2000))))[0] for _ in range(2)]
    assert statuses == [503, 200], statuses
    assert child not in pool._idle and len(pool._idle) == 1
    server.assert_ready()


def test_close_stops_the_children(make_pool_server):
    pool, server = make_pool_server()
    assert server.post_json("/v2/models/identity_int64/infer", _doc(list(range(2000))))[0] == 200
    (child,) = pool._idle
    server.stop()  # closes the HTTP server, which closes its decoder
    assert child.proc.wait(TIMEOUT_S) == 0  # it read EOF and exited by itself


def test_bad_pool_settings_are_refused():
    with pytest.raises(ValueError, match="processes >= 1"):
        JsonCodecPool(processes=0)
