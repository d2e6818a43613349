"""The serving harness's verdicts on issue 5's targets (bench/serving/run.py), on made-up results: the harness is
what says PASS or FAIL, so its arithmetic is checked like any other code."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytest.importorskip("psutil")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "serving"))

import run  # noqa: E402

RAW_INFO = {"mlp": {"batch1_p50_ms": 0.07, "best_rows_per_s": 100000.0},
            "heavy": {"best_rows_per_s": 3700.0}}


def result(target: str, req_s: float, p99_ms: float, c: int = 64, model: str = "mlp", errors: int = 0,
           p50_ms: float = 1.0) -> run.Result:
    return run.Result(model, target, c, req_s, p50_ms, p99_ms, 0.1, errors=errors)


def checks(results: list[run.Result]) -> list[str]:
    return run.targets_check(results, run.ratios(results, RAW_INFO), RAW_INFO, 0.05, {"gpud": 0.1})


def line(lines: list[str], *needles: str) -> str:
    found = [x for x in lines if all(n in x for n in needles)]
    assert len(found) == 1, (needles, lines)
    return found[0]


def test_strict_bar_is_the_best_mosec_and_the_issue_bar_is_mosec_json():
    lines = checks([result("raw onnxruntime", 100000, 0), result("mosec json", 5000, 12.0),
                    result("mosec msgpack", 20000, 5.0), result("gpud http-binary", 11000, 9.0),
                    result("gpud http-json", 8000, 11.0)])
    assert line(lines, "http-binary", "best mosec").startswith("[FAIL]")  # 0.55x msgpack
    assert line(lines, "http-binary", "mosec json").startswith("[PASS]")  # 2.2x, p99 9 <= 12
    assert line(lines, "http-json", "best mosec").startswith("[FAIL]")
    assert line(lines, "http-json", "mosec json").startswith("[PASS]")  # 1.6x
    assert "1.60x" in line(lines, "http-json", "mosec json")


def test_issue_bar_fails_below_the_ratio_or_with_a_worse_p99():
    lines = checks([result("mosec json", 5000, 12.0), result("gpud http-binary", 11000, 13.0),
                    result("gpud http-json", 7400, 11.0)])
    assert line(lines, "http-binary", "mosec json").startswith("[FAIL]")  # 2.2x but p99 13 > 12
    assert line(lines, "http-json", "mosec json").startswith("[FAIL]")  # 1.48x < 1.5x


def test_a_peer_with_errors_is_no_bar():
    lines = checks([result("mosec json", 5000, 12.0, errors=3), result("gpud http-binary", 11000, 9.0)])
    assert not [x for x in lines if "mosec json" in x]


def test_grpc_against_http_binary_is_judged_for_each_grpc_client_with_its_cpu_beside():
    http = run.Result("mlp", "gpud http-binary", 64, 10000, 6.0, 9.0, 0.13, client_cpu_ms_per_request=0.02)
    pa = run.Result("mlp", "gpud grpc", 64, 5500, 11.0, 21.0, 0.19, client_cpu_ms_per_request=0.14)
    h2 = run.Result("mlp", "gpud grpc h2load", 64, 11000, 5.0, 8.0, 0.10, client_cpu_ms_per_request=0.01)
    lines = checks([http, pa, h2])
    assert line(lines, "gpud grpc =").startswith("[FAIL]")  # 0.55x
    assert "client CPU 0.140 ms/req against wrk's 0.020" in line(lines, "gpud grpc =")
    assert line(lines, "gpud grpc h2load =").startswith("[PASS]")  # 1.10x
    assert "1.10x gpud http-binary" in line(lines, "gpud grpc h2load =")


def test_grpc_with_errors_is_not_judged():
    lines = checks([run.Result("mlp", "gpud http-binary", 64, 10000, 6.0, 9.0, 0.13),
                    run.Result("mlp", "gpud grpc h2load", 64, 11000, 5.0, 8.0, 0.10, errors=2)])
    assert not [x for x in lines if "grpc h2load =" in x]


H2LOAD_SUMMARY = """
finished in 5.00s, 9321.60 req/s, 1.82MB/s
requests: 46608 total, 46672 started, 46608 done, 46608 succeeded, 0 failed, 0 errored, 0 timeout
status codes: 46608 2xx, 0 3xx, 0 4xx, 0 5xx
traffic: 9.11MB (9554760) total, 2.84MB (2982912) headers (space savings 18.99%), 4.40MB (4614192) data
"""


def test_h2load_summary_is_read_for_done_succeeded_and_data_bytes():
    assert run.h2load_counts(H2LOAD_SUMMARY) == (46608, 46608, 4614192)
    assert run.h2load_counts("h2load: could not connect") is None


def test_a_grpc_error_is_a_200_without_a_message_and_counts_as_an_error():
    assert run.h2load_errors(100, 100, 100 * 99, 99) == 0
    assert run.h2load_errors(100, 100, 97 * 99, 99) == 3  # three trailers-only answers
    assert run.h2load_errors(100, 98, 98 * 99, 99) == 2  # two not 2xx
    assert run.h2load_errors(100, 100, 100 * 99 + 5, 99) == 1  # another answer than the one checked


def test_the_grpc_load_message_is_a_modelinferrequest_the_servers_plan_reads():
    from gpud.api import grpc_infer
    from gpud.proto import grpc_service_pb2 as pb

    row = np.arange(256, dtype=np.float32)
    framed = run.grpc_infer_message("mlp", row)
    assert framed[0] == 0 and int.from_bytes(framed[1:5], "big") == len(framed) - 5
    message = pb.ModelInferRequest.FromString(framed[5:])
    assert (message.model_name, message.inputs[0].name, list(message.inputs[0].shape)) == ("mlp", "input", [1, 256])
    assert np.array_equal(np.frombuffer(message.raw_input_contents[0], "<f4"), row)
    _, _, raws = grpc_infer.scan(framed[5:])
    assert [len(r) for r in raws] == [1024]
