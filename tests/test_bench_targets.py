"""The serving harness's verdicts on issue 5's targets (bench/serving/run.py), on made-up results: the harness is
what says PASS or FAIL, so its arithmetic is checked like any other code."""
from __future__ import annotations

import os
import sys

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
